"""The speculation gate's rate estimator, before and after: replays the tuning logs of
``bench/results/gate/`` through the gate of a given commit and through the working tree's.

    python bench/results/gate_estimator/compare.py [--before 8db825e] > bench/results/gate_estimator/results.md

The gate of ``--before`` is read with ``git show`` and loaded as a module, so both gates see the
same replayed steps (:func:`dart_core.bench.gate_replay.replay`, drawn at random and in log order).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from dart_core.bench import gate_replay
from dart_core.spec import budget

ROOT = Path(__file__).resolve().parents[3]
LOGS = {"2-core AMD EPYC, in process (AlpacaEval)": ["cpu-alpacaeval-1client-a.log", "cpu-alpacaeval-1client-b.log"],
        "2-core Xeon, served (AlpacaEval)": ["served-xeon-alpacaeval-1.log", "served-xeon-alpacaeval-2.log",
                                             "served-xeon-alpacaeval-3.log"]}


def gate_at(commit: str):
    """SpeculationGate of dart_core/spec/budget.py at ``commit``."""
    text = subprocess.run(["git", "show", f"{commit}:dart_core/spec/budget.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "budget_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("budget_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["budget_before"] = mod
    spec.loader.exec_module(mod)
    return mod.SpeculationGate


def run(steps, gate_class, n, reps, slowdown, in_order):
    gate_replay.SpeculationGate = gate_class
    out = [gate_replay.replay(steps, {} if gate_class else True, num_steps=n, seed=s, slowdown=slowdown,
                              in_order=in_order) for s in range(reps)]
    return statistics.mean(r[0] for r in out), statistics.mean(r[1] for r in out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="8db825e")
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args()
    before, after = gate_at(args.before), budget.SpeculationGate
    print(f"Gate at {args.before} (each step's tokens ÷ ms averaged) against the working tree's (averages of tokens "
          f"and of ms, rated by their ratio); default settings; {args.seeds} seeded replays per row "
          f"({4 * args.seeds} of 250 steps), means; tokens/ms as a multiple of autoregressive decoding.\n")
    for name, files in LOGS.items():
        steps = gate_replay.read_steps([ROOT / "bench/results/gate" / f for f in files])
        ar = steps.rate("autoregressive")
        print(f"**{name}**: {len(steps.speculative)} speculative, {len(steps.autoregressive)} autoregressive steps.\n")
        print("| pool | tokens/ms: all steps' tokens ÷ all their ms | mean of each step's tokens ÷ ms | overstated by |")
        print("|---|---:|---:|---:|")
        for pool in ("speculative", "autoregressive"):
            p = getattr(steps, pool)
            ratio, mean = steps.rate(pool), float(np.mean([t / d for t, d in p]))
            print(f"| {pool} | {ratio:.4f} | {mean:.4f} | {100 * (mean / ratio - 1):+.0f} % |")
        print("\n| speculative steps | drawn | steps | always speculate | before | after | after ÷ before | "
              "speculative share before → after |")
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for slowdown in (1.0, 1.15, 1.3):
            for in_order in (False, True):
                for n in (250, 2000):
                    reps = 4 * args.seeds if n == 250 else args.seeds
                    always = run(steps, None, n, reps, slowdown, in_order)[0] / ar
                    b, bs = run(steps, before, n, reps, slowdown, in_order)
                    a, as_ = run(steps, after, n, reps, slowdown, in_order)
                    label = "as measured" if slowdown == 1.0 else f"{slowdown:g}× slower"
                    print(f"| {label} | {'in log order' if in_order else 'at random'} | {n} | {always:.3f} | "
                          f"{b / ar:.3f} | {a / ar:.3f} | {a / b:.3f} | {bs:.2f} → {as_:.2f} |")
        print()
    gate_replay.SpeculationGate = after


if __name__ == "__main__":
    main()
