#!/usr/bin/env bash
# The study's runs on one machine (bench/results/avx2_kernel/README.md), one at a time, nothing else
# running.  before/, first_build/ and verify_aten/ ran at 366747e (the AVX2 loop's first build);
# after/, dense_head/, verify_qmm_a8/ and kernel_avx2.txt at 2681c79 (its loop restructured).
set -euo pipefail
out=${1:-bench/results/avx2_kernel}
common=(--datasets mt-bench humaneval --num-prompts 8 --max-new-tokens 128 --repeats 3 --threads 2
        --methods autoregressive dart-context --no-progress)
# before: what this CPU defaulted to (PyTorch's int4 kernel with bfloat16 activations; a dense head)
python -m dart_core.bench "${common[@]}" --gguf-kernel aten --draft-weights dense --out "$out/before"
python -m dart_core.bench.verify_curve --weights gguf-native --nodes 1 2 4 8 16 32 --gguf-kernel aten \
    --out "$out/verify_aten"
# after: the shipped defaults (qmm-a8's AVX2 loop; the head's Q8_0 layers on it)
python -m dart_core.bench "${common[@]}" --out "$out/after"
# the head's weights alone: a dense float32 head beside the same target
python -m dart_core.bench "${common[@]}" --draft-weights dense --out "$out/dense_head"
python -m dart_core.bench.verify_curve --weights gguf-native --nodes 1 2 4 8 16 32 --out "$out/verify_qmm_a8"
python bench/results/avx2_kernel/kernel_avx2.py > "$out/kernel_avx2.txt"
# against llama.cpp (pip install llama-cpp-python: it compiles llama.cpp for this CPU, about 11 minutes here)
python -m dart_core.bench "${common[@]}" --methods autoregressive dart-context llama-cpp --out "$out/llama"
