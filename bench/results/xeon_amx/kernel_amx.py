"""qmm-a8 with and without its AMX tiles, per row count: the median of 7 timings of 20 calls each,
on random weights of SmolLM2-135M's shapes (an MLP projection each way, the Q8_0 output layer), the
AMX version taken from one row up (the shipped thresholds are what this table chose).

    python bench/results/xeon_amx/kernel_amx.py > kernel_amx.txt
"""

import time

import gguf
import numpy as np

from dart_core import _kernels
from dart_core.model.quant import Int4Linear, int4_parts

if not _kernels.set_qmm_a8_amx(True):
    raise SystemExit("this CPU offers no AMX-INT8 tiles")
rng = np.random.default_rng(0)
print("| weight | rows | AMX ms | VNNI ms | VNNI ÷ AMX |\n|---|---:|---:|---:|---:|")
for qtype, n, k in (("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)):
    raw = gguf.quants.quantize(rng.normal(size=(n, k)).astype(np.float32), gguf.GGMLQuantizationType[qtype])
    layer = Int4Linear(int4_parts(raw, qtype, (n, k)), kernel="qmm-a8")
    codes, scale, minimum = layer._qmm_args
    for m in (1, 2, 4, 6, 8, 12, 16, 32, 64, 256):
        x = rng.normal(size=(m, k)).astype(np.float32)
        out = np.empty((m, n), np.float32)
        ms = {}
        for amx in (True, False):
            _kernels.set_qmm_a8_amx(amx, 1, 1)
            for _ in range(5):
                _kernels.qmm_a8(x, codes, scale, minimum, n, layer.q8, out)
            runs = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(20):
                    _kernels.qmm_a8(x, codes, scale, minimum, n, layer.q8, out)
                runs.append((time.perf_counter() - t0) / 20 * 1e3)
            ms[amx] = sorted(runs)[3]
        print(f"| {qtype} [{n}, {k}] | {m} | {ms[True]:.3f} | {ms[False]:.3f} | {ms[False] / ms[True]:.2f}× |")
_kernels.set_qmm_a8_amx(True)  # the shipped thresholds
