"""The speculation ceiling at the draft head's own acceptance, per prompt set, beside what the
shipped defaults reach: ``python -m dart_core.bench.head_ceiling``.

The speculation-ceiling table (``python -m dart_core.bench.verify_curve``) bounds any drafter at a
chosen per-node acceptance α.  This benchmark measures α for the shipped head on each prompt set and
reads the bound there, in one process, so that the shipped speed-up can be set against what this
machine and this head allow at all:

1. **The head's chain.**  Each prompt is decoded with the head drafting a chain of ``depth`` tokens
   (tree search with beam width 1 and top-k 1, no context chain, no lookup step, no adaptive
   budget, no gate), every node verified.  Per draft level k, α_k = (steps that accepted at least
   k draft tokens) ÷ (steps whose chain reached level k and accepted its first k − 1).
2. **The verification cost** of n = 1 … depth + 1 query tokens at batch 1
   (:meth:`VerifyCostCurve.measure <dart_core.spec.budget.VerifyCostCurve.measure>`, after a
   256-token prefix), measured before the first prompt set and after each, the median of those
   measurements per n (one measurement on a busy moment of a small machine can make every
   extra query token look expensive: the curve is made non-decreasing from its first point).
3. **The ceiling**: max over n of τ(n) · ms(1) ÷ ms(n), τ(n) = 1 + α_1 + α_1·α_2 + … (n − 1 draft
   tokens, the bonus token included): a chain drafted for free and accepted at the measured
   rates.  This is :func:`~dart_core.spec.budget.chain_speedup` with the measured per-level rates
   in place of one α.
4. **The shipped defaults** (``DartModel.from_pretrained()``: adaptive budget, gate, lookup steps)
   against autoregressive decoding with the same engine, on the same prompts, in alternating order
   (``--repeats`` rounds; each round's ratio is total tokens ÷ total seconds of each mode).

The table's last column is the shipped speed-up as a share of the ceiling.  Output is lossless in
every mode (greedy); the benchmark checks that every mode's text equals autoregressive decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dart_core.spec.budget import chain_speedup, chain_taus

__all__ = ["chain_acceptance", "ceiling_at", "run", "markdown_table", "main"]


def chain_acceptance(steps: list[tuple[int, int]], depth: int) -> list[float | None]:
    """Per-level acceptance α_1 … α_depth of drafted chains.

    Args:
        steps: one (draft nodes, accepted draft tokens) pair per sequence-step of chain drafting.
        depth: the chain length drafted.

    Returns:
        α_k for k = 1 … depth; None where no step reached level k.
    """
    out: list[float | None] = []
    for k in range(1, depth + 1):
        reached = sum(1 for nodes, acc in steps if nodes >= k and acc >= k - 1)
        accepted = sum(1 for nodes, acc in steps if nodes >= k and acc >= k)
        out.append(accepted / reached if reached else None)
    return out


def ceiling_at(alphas: list[float | None], nodes: list[int], ms: list[float]) -> tuple[float, int, list[float]]:
    """The best speed-up of free chain drafting at per-level acceptances ``alphas``
    (:func:`~dart_core.spec.budget.chain_speedup` with per-level rates).

    Args:
        alphas: α_1 … α_d (None: that level was never reached; the chain stops there).
        nodes: query tokens per sequence measured (must include 1), ascending.
        ms: verification ms for each of ``nodes``.

    Returns:
        (speed-up, query tokens at the best, τ(n) for each of ``nodes``).

    Raises:
        ValueError: no node count 1.
    """
    best, n = chain_speedup(ms, nodes, alphas)
    return best, n, chain_taus(alphas, nodes)


def _steps(engine, ids: list[int], sampling) -> tuple[list[int], list[tuple[int, int]], float]:
    """One prompt through the engine: its tokens, (draft nodes, accepted draft tokens) per step, seconds."""
    tokens: list[int] = []
    steps: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    for step in engine.generate_stream([ids], sampling, speculative=True):
        tokens.extend(step.new_tokens[0])
        if any(step.accepted_lengths) and step.num_nodes > 1:
            steps.append((int(step.draft_nodes[0]), int(step.accepted_lengths[0]) - 1))
    return tokens, steps, time.perf_counter() - t0


def run(datasets: list[str], num_prompts: int, max_new_tokens: int, depth: int, repeats: int,
        curve_repeats: int, threads: int | None, progress: bool = True) -> dict:
    """Measures everything the module docstring lists; returns ``{"config", "hardware", "curve",
    "rows": [per dataset], "seconds"}``.

    Raises:
        FileNotFoundError: a prompt set is not installed.
        AssertionError: a mode's greedy text differs from autoregressive decoding's (a bug).
    """
    from tqdm import tqdm

    from dart_core.api import DartModel
    from dart_core.bench.datasets import load_prompts
    from dart_core.bench.decoding import _timed, hardware
    from dart_core.spec.budget import VerifyCostCurve

    started = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    model = DartModel.from_pretrained()
    engine = model.engine
    shipped = {"budget": engine.budget, "gate": engine.gate, "search_params": engine.search_params}
    chain = {"budget": None, "gate": None,
             "search_params": replace(engine.search_params, beam_width=1, top_k=1, budget=depth, max_depth=depth,
                                      context_weight=0.0)}

    def use(settings: dict) -> None:
        for k, v in settings.items():
            setattr(engine, k, v)

    nodes = list(range(1, depth + 2))

    def measure_curve() -> list[float]:
        return list(VerifyCostCurve.measure(engine.target, node_counts=tuple(nodes), repeats=curve_repeats).ms)

    curves = [measure_curve()]
    prompts = {d: [model.encode([{"role": "user", "content": t}]) for t in load_prompts(d, num_prompts)]
               for d in datasets}
    sampling = model.sampling_params(max_new_tokens=max_new_tokens, temperature=0.0)
    use(shipped)
    first = next(iter(prompts.values()))[0]
    short = model.sampling_params(max_new_tokens=16, temperature=0.0)
    for spec in (False, True):  # warm-up
        _timed(engine, first, short, speculative=spec)
    rows = []
    bar = tqdm(total=sum(len(p) for p in prompts.values()) * (1 + 2 * repeats), desc="head ceiling", unit="gen",
               disable=not progress)
    for d, plist in prompts.items():
        use(chain)
        steps, reference = [], []
        for ids in plist:
            toks, s, _ = _steps(engine, ids, sampling)
            steps.extend(s)
            reference.append(toks)
            bar.update()
        use(shipped)
        ratios, emitted, steps_n = [], 0, 0
        for rep in range(repeats):
            secs = {False: 0.0, True: 0.0}
            toks_n = {False: 0, True: 0}
            for i, ids in enumerate(plist):
                for spec in ((False, True) if (rep + i) % 2 == 0 else (True, False)):
                    r = _timed(engine, ids, sampling, speculative=spec)
                    if spec:
                        emitted, steps_n = emitted + r.emitted_after_prefill, steps_n + r.sequence_steps
                    if r.tokens != reference[i]:
                        raise AssertionError(f"{d} prompt {i}: {'DART' if spec else 'autoregressive'} output "
                                             "differs from the chain-drafted output (greedy must be lossless)")
                    secs[spec] += r.seconds
                    toks_n[spec] += len(r.tokens)
                    bar.update()
            ratios.append((toks_n[True] / secs[True]) / (toks_n[False] / secs[False]))
        alphas = chain_acceptance(steps, depth)
        rows.append({"dataset": d, "prompts": len(plist), "chain_steps": len(steps),
                     "alpha": [None if a is None else round(a, 4) for a in alphas],
                     "chain_tau": round(float(np.mean([1 + a for _, a in steps])) if steps else 1.0, 3),
                     "shipped_speedup": round(statistics.median(ratios), 3),
                     "shipped_speedup_runs": [round(r, 3) for r in ratios],
                     "shipped_tau": round(emitted / max(steps_n, 1), 3)})
        curves.append(measure_curve())
    bar.close()
    ms = [round(statistics.median(c[j] for c in curves), 3) for j in range(len(nodes))]
    for row in rows:
        best, best_n, chain_taus = ceiling_at(row["alpha"], nodes, ms)
        row.update(ceiling=round(best, 3), ceiling_nodes=best_n, ceiling_tau=round(chain_taus[nodes.index(best_n)], 3),
                   share_of_ceiling=round(row["shipped_speedup"] / best, 3) if best else None)
    return {"config": {"datasets": datasets, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
                       "depth": depth, "repeats": repeats, "curve_repeats": curve_repeats, "threads": threads,
                       "gguf_kernel": getattr(engine.target, "gguf_kernel", None)},
            "hardware": hardware(engine.target.device),
            "curve": {"nodes": nodes, "ms": ms, "measurements": curves}, "rows": rows,
            "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    """The per-set table: α per level, the ceiling at those rates, the shipped speed-up and its share."""
    cfg = result["config"]
    depth = cfg["depth"]
    head = ("| prompt set | " + " | ".join(f"α{k}" for k in range(1, depth + 1))
            + " | chain τ | ceiling (query tokens) | shipped DART ÷ autoregressive (runs) | shipped τ | share of ceiling |")
    lines = [f"Batch 1, T = 0, first {cfg['num_prompts']} prompts, {cfg['max_new_tokens']} tokens; the shipped head's "
             f"chain of {depth} (beam width 1, top-k 1); verification timed at 1–{depth + 1} query tokens "
             f"({', '.join(f'{n}: {m:.2f}' for n, m in zip(result['curve']['nodes'], result['curve']['ms']))} ms, "
             f"the median of {len(result['curve'].get('measurements', [0]))} measurements); "
             f"shipped defaults against autoregressive decoding, median of {cfg['repeats']} alternating runs.", "",
             head, "|---|" + "---:|" * (depth + 5)]
    for r in result["rows"]:
        alphas = " | ".join("–" if a is None else f"{a:.2f}" for a in r["alpha"])
        runs = ", ".join(f"{x:.2f}" for x in r["shipped_speedup_runs"])
        lines.append(f"| {r['dataset']} | {alphas} | {r['chain_tau']:.2f} | {r['ceiling']:.2f}× ({r['ceiling_nodes']}) "
                     f"| {r['shipped_speedup']:.2f}× ({runs}) | {r['shipped_tau']:.2f} | {r['share_of_ceiling']:.0%} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dart_core.bench.head_ceiling",
                                description="The speculation ceiling at the shipped head's measured acceptance, "
                                            "per prompt set, beside the shipped speed-up (module docstring).")
    p.add_argument("--datasets", nargs="+", default=["mt-bench", "humaneval"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=8, help="draft tokens in the head's chain")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of the shipped defaults and autoregressive")
    p.add_argument("--curve-repeats", type=int, default=5, help="passes per verification-cost measurement")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="folder for head_ceiling.json and head_ceiling.md")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "max_tokens", "depth", "repeats", "curve_repeats"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    result = run(args.datasets, args.num_prompts, args.max_tokens, args.depth, args.repeats, args.curve_repeats,
                 args.threads)
    table = markdown_table(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "head_ceiling.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "head_ceiling.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
