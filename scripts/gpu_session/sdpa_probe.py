"""Time one masked SDPA call per SDPA backend, at shapes that change every call or stay fixed.

The question (dart_core/model/attention.py): does PyTorch's default backend choice for a bf16 masked
attention on this GPU build a new plan for every new shape, as the engine's draft head and eager
verification present one every step?  For each backend setting: the milliseconds per call when
the key length grows by one every call (a new shape each time), and when it stays fixed.

usage: python3 scripts/gpu_session/sdpa_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SETTINGS = {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
            "math": [SDPBackend.MATH], "auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                 SDPBackend.MATH]}
# (name, batch, heads, queries): the SmolLM2 draft head (8 queries, 9 heads after the grouped heads
# are repeated) and a 16-node verification tree
SHAPES = [("draft b1", 1, 9, 8), ("draft b16", 16, 9, 8), ("verify b1 n16", 1, 9, 16)]


def _calls(backends, b, h, q, lengths, dtype=torch.bfloat16, dim=64) -> list[float]:
    times = []
    for k in lengths:
        qs = torch.randn(b, h, q, dim, device="cuda", dtype=dtype)
        ks = torch.randn(b, h, k, dim, device="cuda", dtype=dtype)
        vs = torch.randn(b, h, k, dim, device="cuda", dtype=dtype)
        mask = torch.zeros(b, 1, q, k, device="cuda", dtype=dtype)
        mask[..., : k // 7] = torch.finfo(dtype).min
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if backends is None:
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        else:
            with sdpa_kernel(backends):
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for name, b, h, q in SHAPES:
        for setting, backends in SETTINGS.items():
            try:
                _calls(backends, b, h, q, [100, 101])  # warm-up: library load, first plans
                growing = _calls(backends, b, h, q, list(range(300, 340)))
                fixed = _calls(backends, b, h, q, [340] * 40)
                row = {"shape": name, "backend": setting, "new_shape_ms": statistics.median(growing),
                       "same_shape_ms": statistics.median(fixed[5:])}
            except RuntimeError as e:  # a backend that refuses the inputs
                row = {"shape": name, "backend": setting, "error": str(e).splitlines()[0][:200]}
            results.append(row)
            print(json.dumps(row), flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    print(f"{'shape':14} {'backend':10} {'new shape ms':>12} {'same shape ms':>13}")
    for r in results:
        if "error" in r:
            print(f"{r['shape']:14} {r['backend']:10} refused: {r['error'][:60]}")
        else:
            print(f"{r['shape']:14} {r['backend']:10} {r['new_shape_ms']:12.3f} {r['same_shape_ms']:13.3f}")


if __name__ == "__main__":
    main()
