"""Verification latency against query tokens, per weight format of the target:
``python -m dart_core.bench.verify_curve --weights gguf-native dense``.

For each format the target is loaded and :meth:`~dart_core.spec.budget.VerifyCostCurve.measure`
times one forward of 1, 2, 4, ... 64 query tokens after a 256-token prefix (batch 1; untimed
warm-up, then passes over every size in turn, median per size, made non-decreasing): the curve
the adaptive budget measures at start-up and prices draft trees with. ``--batch-sizes 1 4``
times the same per-sequence sizes at batch 4 as well (each sequence with its own prefix), and
the table adds the batch-1 curve's price of that batch (its B · n tokens), the approximation
the budget uses where only batch 1 is measured (on a CPU). Writes ``verify_curve.json`` and
``verify_curve.md`` under ``--out``.

From the same timings, :func:`ceiling_table` says where speculation *can* pay on this hardware,
whatever the drafter: per batch size B, the acceptance a first draft node needs to pay for itself,
and the best speed-up over plain decoding of drafts accepted at a given rate with no drafting cost
(the formula is in its docstring).
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["measure_curves", "markdown_table", "ceiling_table", "build_parser", "main",
           "ACCEPTANCES"]

#: per-node acceptance rates of :func:`ceiling_table`'s columns
ACCEPTANCES = (1.0, 0.9, 0.8, 0.6)


def measure_curves(model: str | None, weights: list[str], node_counts: tuple[int, ...], repeats: int,
                   threads: int | None, batch_sizes: tuple[int, ...] = (1,), gguf_kernel: str | None = None) -> dict:
    """{"config", "hardware", "curves": {weights: {"nodes", "ms", "batches", "batch_ms", "format"}}}
    (``format``: the layers' weights and kernel, :func:`~dart_core.bench.step_profile.weights_format`).
    ``gguf_kernel`` (one of :data:`dart_core.model.quant.KERNELS`; default the target's own choice) is the
    kernel of gguf-native weights.

    Raises:
        ValueError: as :meth:`~dart_core.model.target.TargetModel.from_pretrained` (e.g. gguf-native for a
            model that is not a GGUF)."""
    import torch

    from dart_core.bench import bench_kernel_config
    from dart_core.bench.decoding import hardware
    from dart_core.bench.step_profile import weights_format
    from dart_core.spec.budget import VerifyCostCurve
    from dart_core.model.target import TargetModel

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    curves = {}
    for w in weights:
        target = TargetModel.from_pretrained(model, weights=w, kernels=bench_kernel_config(),
                                             gguf_kernel=gguf_kernel if w == "gguf-native" else None)
        curve = VerifyCostCurve.measure(target, node_counts=node_counts, repeats=repeats, batch_sizes=batch_sizes)
        curves[w] = {"nodes": list(curve.nodes), "ms": list(curve.ms), "batches": list(curve.batches),
                     "batch_ms": [list(r) for r in curve.batch_ms], "format": weights_format(target.model)}
        del target
    return {"config": {"model": model, "weights": weights, "node_counts": list(node_counts), "repeats": repeats,
                       "batch_sizes": list(batch_sizes), "gguf_kernel": gguf_kernel},
            "hardware": hardware("cpu"), "curves": curves, "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    """ms per verification forward by query tokens per sequence, one column per weight format and
    measured batch size; for a batch B > 1 also the batch-1 curve's price of B · n tokens."""
    from dart_core.spec.budget import VerifyCostCurve

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


def ceiling_table(result: dict, acceptances: tuple[float, ...] = ACCEPTANCES) -> str:
    """Where speculation can pay, per weight format and measured batch size B (rows), from one
    :func:`measure_curves` result whose node counts include 1 and 2:

    - ms per token of plain decoding: ms(B, 1) / B;
    - a draft node's cost: (ms(B, 2) − ms(B, 1)) / B, one more query token for every sequence,
      per sequence;
    - break-even acceptance α* = ms(B, 2) / ms(B, 1) − 1: a first draft node per sequence pays
      only if it is accepted more often than this (B (1 + α) tokens in ms(B, 2) against B tokens
      in ms(B, 1)), before any drafting cost;
    - the best speed-up at each per-node acceptance α of ``acceptances``, with its node count
      (:func:`dart_core.spec.budget.chain_speedup`).

    Raises:
        ValueError: node counts without 1 or 2; a value of ``acceptances`` outside [0, 1]."""
    from dart_core.spec.budget import chain_speedup

    names = list(result["curves"])
    nodes = result["curves"][names[0]]["nodes"]
    if 1 not in nodes or 2 not in nodes:
        raise ValueError("the ceiling needs the timings of 1 and 2 query tokens per sequence")
    i1, i2 = nodes.index(1), nodes.index(2)
    head = ("| weights | batch | plain decoding, ms per token | a draft node, ms per sequence | break-even acceptance | "
            + " | ".join(f"best speed-up at α = {a:g} (nodes)" for a in acceptances) + " |")
    lines = [head, "|---|---:|" + "---:|" * (3 + len(acceptances))]
    for w in names:
        c = result["curves"][w]
        for b, ms in [(1, c["ms"])] + list(zip(c.get("batches", []), c.get("batch_ms", []))):
            cells = [f"{ms[i1] / b:.2f}", f"{(ms[i2] - ms[i1]) / b:.2f}", f"{ms[i2] / ms[i1] - 1:.2f}"]
            for a in acceptances:
                s, n = chain_speedup(ms, nodes, a)
                cells.append(f"{s:.2f}× ({n})")
            lines.append(f"| {c.get('format', w)} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dart_core.bench.verify_curve``."""
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.verify_curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf [embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--weights", nargs="+", default=["gguf-native", "dense"], choices=["gguf-native", "dense"])
    ap.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1], help="batch sizes timed (1 always)")
    ap.add_argument("--gguf-kernel", default="auto", choices=["auto", "qmm-a8", "qmm", "aten"],
                    help="the kernel of gguf-native weights (dart_core.model.quant.KERNELS) [%(default)s: "
                         "dart_core.model.quant.default_kernel()]")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results", help="folder for verify_curve.json/.md")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    kernel = None if args.gguf_kernel == "auto" else args.gguf_kernel
    try:
        result = measure_curves(args.model, args.weights, tuple(args.nodes), args.repeats, args.threads,
                                tuple(args.batch_sizes), kernel)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dart_core.bench.report import save_table

    table = markdown_table(result)
    if 1 in args.nodes and 2 in args.nodes:
        table += "\n" + ceiling_table(result)
    save_table(args.out, "verify_curve", result, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
