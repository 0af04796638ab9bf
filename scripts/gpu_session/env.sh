# sourced at the start of every device call (run from the repository root there)
D=/tmp/dart-gpu; R=/tmp/dart-res  # staged parts and training work; results kept on the machine
RET=${RET:-${OUT:-/tmp/dart-return}}  # the folder whose files travel back (at most 16 MiB each)
export DART_SERVE_CACHE=/tmp/dart-cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site:$D/site:$PWD
mkdir -p $R $RET /tmp/site $DART_SERVE_CACHE/tries
# gRPC stubs made here with a grpcio-tools no newer than the machine's grpcio (carried in .gpu/stubs)
[ -d ngram_service/_proto ] || cp -r .gpu/stubs/ngram_service/_proto ngram_service/
[ -d deployments/_proto ] || cp -r .gpu/stubs/deployments/_proto deployments/
