"""Verification latency against query tokens, per weight format of the target:
``python -m dart_core.bench.verify_curve --weights gguf-native dense``.

For each format the target is loaded and :meth:`~dart_core.budget.VerifyCostCurve.measure`
times one forward of 1, 2, 4, ... 64 query tokens after a 256-token prefix (batch 1; untimed
warm-up, then passes over every size in turn, median per size, made non-decreasing): the curve
the adaptive budget measures at start-up and prices draft trees with. ``--batch-sizes 1 4``
times the same per-sequence sizes at batch 4 as well (each sequence with its own prefix), and
the table adds the batch-1 curve's price of that batch (its B · n tokens), the approximation
the budget uses where only batch 1 is measured (on a CPU). Writes ``verify_curve.json`` and
``verify_curve.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["measure_curves", "markdown_table", "main"]


def measure_curves(model: str | None, weights: list[str], node_counts: tuple[int, ...], repeats: int,
                   threads: int | None, batch_sizes: tuple[int, ...] = (1,)) -> dict:
    """{"config", "hardware", "curves": {weights: {"nodes", "ms", "batches", "batch_ms"}}}.

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
        curve = VerifyCostCurve.measure(target, node_counts=node_counts, repeats=repeats, batch_sizes=batch_sizes)
        curves[w] = {"nodes": list(curve.nodes), "ms": list(curve.ms), "batches": list(curve.batches),
                     "batch_ms": [list(r) for r in curve.batch_ms]}
        del target
    return {"config": {"model": model, "weights": weights, "node_counts": list(node_counts), "repeats": repeats,
                       "batch_sizes": list(batch_sizes)},
            "hardware": hardware("cpu"), "curves": curves, "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    """ms per verification forward by query tokens per sequence, one column per weight format and
    measured batch size; for a batch B > 1 also the batch-1 curve's price of B · n tokens."""
    from dart_core.budget import VerifyCostCurve

    names = list(result["curves"])
    nodes = result["curves"][names[0]]["nodes"]
    head, cols = [], []
    for w in names:
        c = result["curves"][w]
        head.append(f"{w} ms")
        cols.append(c["ms"])
        batch1 = VerifyCostCurve(tuple(c["nodes"]), tuple(c["ms"]))
        for b, row in zip(c.get("batches", []), c.get("batch_ms", [])):
            head += [f"{w} ms, batch {b}", f"{w} ms, batch-1 curve at {b}·n"]
            cols += [row, [float(batch1(b * n)) for n in c["nodes"]]]
    lines = ["| query tokens per sequence | " + " | ".join(head) + " |", "|---:|" + "---:|" * len(head)]
    for i, n in enumerate(nodes):
        lines.append(f"| {n} | " + " | ".join(f"{col[i]:.1f}" for col in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.verify_curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf [embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--weights", nargs="+", default=["gguf-native", "dense"], choices=["gguf-native", "dense"])
    ap.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1], help="batch sizes timed (1 always)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results", help="folder for verify_curve.json/.md")
    args = ap.parse_args(argv)
    try:
        result = measure_curves(args.model, args.weights, tuple(args.nodes), args.repeats, args.threads,
                                tuple(args.batch_sizes))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dart_core.bench.report import save_table

    save_table(args.out, "verify_curve", result, markdown_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
