# usage: bash scripts/gpu_session/bench.sh JOB ...  -> JSON under $R/rep (named as gpu_report reads them), logs in $R/rep/logs
source scripts/gpu_session/env.sh
mkdir -p $R/rep/logs $R/b
DS="--datasets $D/files/extra/mt-bench.jsonl $D/files/extra/humaneval.jsonl --num-prompts 2 --max-new-tokens 64 --repeats 1 --device cuda --no-progress"
for job in "$@"; do
  t0=$(date +%s); echo "[$(date +%T)] $job"
  case $job in
    dec-fp32-graphs) python3 -m dart_core.bench $DS --dtype float32 --methods autoregressive dart-context --cuda-graphs --out $R/b/$job ;;
    dec-bf16-graphs) python3 -m dart_core.bench $DS --dtype bfloat16 --methods autoregressive dart dart-context --cuda-graphs --out $R/b/$job ;;
    dec-fp32)        python3 -m dart_core.bench $DS --dtype float32 --methods autoregressive dart-context --out $R/b/$job ;;
    dec-bf16)        python3 -m dart_core.bench $DS --dtype bfloat16 --methods autoregressive dart dart-context --out $R/b/$job ;;
    prof-bf16-graphs) python3 -m dart_core.bench.step_profile --dataset $D/files/extra/mt-bench.jsonl --num-prompts 1 --max-new-tokens 32 --device cuda --dtype bfloat16 --cuda-graphs --out $R/b/$job --no-progress ;;
    prof-bf16)       python3 -m dart_core.bench.step_profile --dataset $D/files/extra/mt-bench.jsonl --num-prompts 1 --max-new-tokens 32 --device cuda --dtype bfloat16 --out $R/b/$job --no-progress ;;
    batch-bf16-graphs) python3 -m dart_core.bench.batching --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --dataset $D/files/extra/mt-bench.jsonl --device cuda --dtype bfloat16 --cuda-graphs --out $R/b/$job --no-progress ;;
    batch-bf16)      python3 -m dart_core.bench.batching --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --dataset $D/files/extra/mt-bench.jsonl --device cuda --dtype bfloat16 --out $R/b/$job --no-progress ;;
    *) echo "unknown job $job"; continue ;;
  esac > $R/rep/logs/$job.log 2>&1
  rc=$?
  label=${job#*-}; kind=${job%%-*}
  case $kind in dec) f=decoding;; prof) f=step_profile;; batch) f=batching;; esac
  [ -f $R/b/$job/$f.json ] && cp $R/b/$job/$f.json $R/rep/$f-$label.json
  echo "[$(date +%T)] $job rc=$rc $(( $(date +%s) - t0 )) s"; tail -4 $R/rep/logs/$job.log | cut -c1-300
done
