"""qmm-a8's AVX2 loop against PyTorch's int4 kernel (``aten``, bfloat16 activations: this CPU's
default before) on SmolLM2-135M's layer shapes: ``python bench/results/avx2_kernel/kernel_avx2.py``.

Random GGUF blocks of each shape (the model's own: q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536 in Q4_1; the tied output layer 49152x576 in Q8_0), 1-32 rows, 2 threads; medians of 7
timings of 20 calls, in ms per call. Prints a Markdown table.
"""

import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from dart_core import _kernels
from dart_core.model.quant import Int4Linear, int4_parts

SHAPES = [("q, o", "Q4_1", 576, 576), ("gate, up", "Q4_1", 1536, 576), ("down", "Q4_1", 576, 1536),
          ("output", "Q8_0", 49152, 576)]
ROWS = (1, 2, 4, 8, 16, 32)


def timed(layer, x) -> float:
    layer(x)
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            layer(x)
        runs.append((time.perf_counter() - start) / 20 * 1e3)
    return float(np.median(runs))


def main() -> None:
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    print(f"qmm-a8 loop: {_kernels.qmm_a8_isa()}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| layer | type | N x K | rows | qmm-a8 ms | aten ms | aten / qmm-a8 |")
    print("|---|---|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, qtype, n, k in SHAPES:
            raw = quantize(rng.normal(size=(n, k)).astype(np.float32), GGMLQuantizationType[qtype])
            parts = int4_parts(raw, qtype, (n, k))
            a8 = Int4Linear(parts, gguf_type=qtype, kernel="qmm-a8")
            aten = Int4Linear(parts, gguf_type=qtype, kernel="aten")
            for m in ROWS:
                x = torch.from_numpy(rng.normal(size=(m, k)).astype(np.float32))
                fast, slow = timed(a8, x), timed(aten, x.bfloat16())
                print(f"| {name} | {qtype} | {n} x {k} | {m} | {fast:.3f} | {slow:.3f} | {slow / fast:.2f}x |")


if __name__ == "__main__":
    main()
