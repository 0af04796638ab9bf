"""Verification latency against query tokens, per weight format of the target:
``python -m dart_core.bench.verify_curve --weights gguf-native dense``.

For each format the target is loaded and :meth:`~dart_core.budget.VerifyCostCurve.measure`
times one forward of 1, 2, 4, ... 64 query tokens after a 256-token prefix (batch 1; untimed
warm-up, then passes over every size in turn, median per size, made non-decreasing): the curve
the adaptive budget measures at start-up and prices draft trees with. Writes
``verify_curve.json`` and ``verify_curve.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["measure_curves", "markdown_table", "main"]


def measure_curves(model: str | None, weights: list[str], node_counts: tuple[int, ...], repeats: int,
                   threads: int | None) -> dict:
    """{"config", "hardware", "curves": {weights: {"nodes", "ms"}}}.

    Raises:
        ValueError: as :meth:`~dart_core.target.TargetModel.from_pretrained` (e.g. gguf-native for a
            model that is not a GGUF)."""
    import torch

    from dart_core.bench.decoding import hardware
    from dart_core.budget import VerifyCostCurve
    from dart_core.target import TargetModel

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    curves = {}
    for w in weights:
        target = TargetModel.from_pretrained(model, weights=w)
        curve = VerifyCostCurve.measure(target, node_counts=node_counts, repeats=repeats)
        curves[w] = {"nodes": list(curve.nodes), "ms": list(curve.ms)}
        del target
    return {"config": {"model": model, "weights": weights, "node_counts": list(node_counts), "repeats": repeats},
            "hardware": hardware("cpu"), "curves": curves, "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    """ms per verification forward by query tokens, one column per weight format."""
    names = list(result["curves"])
    nodes = result["curves"][names[0]]["nodes"]
    lines = ["| query tokens | " + " | ".join(f"{w} ms" for w in names) + " |",
             "|---:|" + "---:|" * len(names)]
    for i, n in enumerate(nodes):
        lines.append(f"| {n} | " + " | ".join(f"{result['curves'][w]['ms'][i]:.1f}" for w in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.verify_curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf [embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--weights", nargs="+", default=["gguf-native", "dense"], choices=["gguf-native", "dense"])
    ap.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results", help="folder for verify_curve.json/.md")
    args = ap.parse_args(argv)
    try:
        result = measure_curves(args.model, args.weights, tuple(args.nodes), args.repeats, args.threads)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_curve.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "verify_curve.md").write_text(markdown_table(result))
    print(markdown_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
