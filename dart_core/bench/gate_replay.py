"""The speculation gate replayed over measured steps: ``python -m dart_core.bench.gate_replay LOG ...``.

A benchmark run with ``--log-level debug`` logs every gated step of the engine (``gate: batch 1,
speculative step, 3 tokens in 12.60 ms ...``: :data:`dart_core.step.engine.GATE_LOG`).
From such logs this module takes the steps of one batch size as three pools (speculative steps,
autoregressive steps, and the speculative steps the gate did not measure: the draft catching up
after autoregressive steps or on a new prompt) and replays them through
:class:`~dart_core.spec.budget.SpeculationGate`: at each step the gate chooses a mode, a step of that
mode is drawn at random from its pool (a catch-up step where the mode switches to speculation),
and the gate observes it as the engine would.  Over many seeded replays this gives the throughput
each gate setting reaches (tokens per ms, as a multiple of always stepping autoregressively) and
the share of steps it speculates, against the two fixed choices, with no benchmark noise: every
setting sees the same steps.  A second scenario slows every speculative step down by a factor
(``--slowdown``), so that speculation loses, and shows that the gate still turns it off.  A third
slows them only for the first third of the run, then not: speculation loses, then pays (a server's
first seconds, when its other processes still start, or a change of traffic), and shows how fast
a setting follows the change.

The first steps after each change of mode are drawn from their own pools where the logs hold
enough of them (:data:`COLD_STEPS`): served, a speculative step right after an autoregressive
stretch can run cold (the n-gram service's process and the draft head's weights wake up), and a
gate that judged its probes by such steps would rank speculation low.  Otherwise steps are drawn
independently, so those rows have no runs of easy or hard text; one more row takes each mode's
steps in log order instead (:func:`replay`'s ``in_order``), so the gate meets the runs of hard and
easy text the logged requests had.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dart_core.spec.budget import SpeculationGate

__all__ = ["Steps", "read_steps", "replay", "render", "SETTINGS", "COLD_STEPS", "main"]

_LINE = re.compile(r"gate: batch (\d+), (speculative|autoregressive) step, (\d+) tokens in ([\d.]+) ms")

#: (label, SpeculationGate keyword arguments) of the settings the table compares; the first is the default
SETTINGS = (("shipped (ema 0.02, warmup 8, settle 1, probe 4)", {}),
            ("settle 3, probe 7", {"settle_steps": 3, "probe_steps": 7}),
            ("settle 2, probe 6", {"settle_steps": 2, "probe_steps": 6}),
            ("longest period 256", {"max_probe_every": 256}),
            ("ema 0.05", {"ema": 0.05}), ("warmup 2", {"warmup": 2}))

#: steps after a change of mode drawn from their own pools (position 0 is the switch); a pool of
#: fewer than :data:`_MIN_POOL` steps falls back to the mode's whole pool
COLD_STEPS = 4
_MIN_POOL = 5


@dataclass
class Steps:
    """Measured steps of one batch size: (tokens emitted, wall ms) per step."""

    speculative: list[tuple[int, float]]
    autoregressive: list[tuple[int, float]]
    catch_up: list[tuple[int, float]]  # speculative steps the gate left unmeasured
    #: (speculative?, k) -> the steps k = 1 .. COLD_STEPS - 1 steps after their mode began (0 for the
    #: autoregressive switch step itself), in log order
    after_switch: dict[tuple[bool, int], list[tuple[int, float]]] = field(default_factory=dict)

    def pool(self, speculative: bool, k: int) -> list[tuple[int, float]]:
        """What a step ``k`` steps after its mode began is drawn from (the switch to speculation:
        a catch-up step)."""
        if speculative and k == 0:
            return self.catch_up
        cold = self.after_switch.get((speculative, k), []) if k < COLD_STEPS else []
        return cold if len(cold) >= _MIN_POOL else self.speculative if speculative else self.autoregressive

    def rate(self, which: str) -> float:
        """Tokens per ms of a pool, all its steps together."""
        pool = getattr(self, which)
        return sum(t for t, _ in pool) / sum(ms for _, ms in pool)


def read_steps(paths, batch: int = 1) -> Steps:
    """The gated steps of ``batch`` running sequences in the engine's debug logs ``paths``.

    Raises:
        ValueError: a log holds no speculative or no autoregressive step of that batch size.
    """
    steps = Steps([], [], [])
    for path in paths:
        last, k = None, 0
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            m = _LINE.search(line)
            if m is None or int(m.group(1)) != batch:
                continue
            step = (int(m.group(3)), float(m.group(4)))
            spec = m.group(2) == "speculative"
            k, last = (k + 1 if spec == last else 0), spec
            if k < COLD_STEPS and (k or not spec):
                steps.after_switch.setdefault((spec, k), []).append(step)
            if m.group(2) == "autoregressive":
                steps.autoregressive.append(step)
            elif "not measured" in line:
                steps.catch_up.append(step)
            else:
                steps.speculative.append(step)
    if not steps.speculative or not steps.autoregressive:
        raise ValueError(f"no gated speculative and autoregressive steps of batch {batch} in "
                         f"{', '.join(map(str, paths))}")
    if not steps.catch_up:
        steps.catch_up = list(steps.speculative)
    return steps


def replay(steps: Steps, gate_kwargs: dict | bool, *, num_steps: int = 2000, seed: int = 0,
           slowdown: float = 1.0, slow_steps: int | None = None, in_order: bool = False) -> tuple[float, float]:
    """One replay: (tokens per ms, speculative share).  ``gate_kwargs``: a gate's keyword arguments, or a
    bool that fixes the mode (True: always speculate).  Speculative steps take ``slowdown`` times as
    long during the first ``slow_steps`` steps (None: all of them).  ``in_order``: a speculative or
    autoregressive step is not drawn at random but taken in log order, from a random start in each
    mode's pool, both moving on one step per replayed step whichever mode runs (the text goes on),
    so runs of hard or easy text reach the gate as they did in the logs; the cold steps after a
    switch are still drawn from their pools."""
    rnd = random.Random(seed)
    gate = SpeculationGate(**gate_kwargs) if isinstance(gate_kwargs, dict) else None
    start = ({True: rnd.randrange(len(steps.speculative)), False: rnd.randrange(len(steps.autoregressive))}
             if in_order else {})
    tokens = ms = spec_steps = 0
    last, k = None, 0
    for i in range(num_steps):
        spec = gate.speculate(1) if gate is not None else bool(gate_kwargs)
        k = k + 1 if spec == last else (0 if last is not None else 1)  # a replay starts warm: no catch-up
        catch_up = spec and k == 0  # the switch to speculation
        pool = steps.pool(spec, k)
        if in_order and pool is (steps.speculative if spec else steps.autoregressive):
            t, d = pool[(start[spec] + i) % len(pool)]
        else:
            t, d = rnd.choice(pool)
        if spec and (slow_steps is None or i < slow_steps):
            d *= slowdown
        if gate is not None:
            gate.observe(1, spec, t, d, typical=not catch_up)
        tokens, ms, spec_steps, last = tokens + t, ms + d, spec_steps + spec, spec
    return tokens / ms, spec_steps / num_steps


def render(paths, *, seeds: int = 20, num_steps: int = 2000, short_steps: int = 250,
           slowdown: float = 1.5) -> str:
    """The replay table of the logs ``paths`` (Markdown): every setting of :data:`SETTINGS` and the two
    fixed choices, over runs of ``short_steps`` (a fresh engine's first requests: the warm-up weighs) and
    of ``num_steps`` with the measured speculative steps (drawn at random, then in log order: :func:`replay`'s
    ``in_order``), ``num_steps`` with them ``slowdown`` times
    slower, and ``num_steps`` with them slower for the first third only (the change scenario);
    ``seeds`` replays per row (four times as many for the short runs)."""
    steps = read_steps(paths)
    ar = steps.rate("autoregressive")
    cold = sorted(f"{'speculative' if spec else 'autoregressive'} {k}" for (spec, k), pool
                  in steps.after_switch.items() if len(pool) >= _MIN_POOL)
    lines = [f"{len(steps.speculative)} speculative, {len(steps.autoregressive)} autoregressive and "
             f"{len(steps.catch_up)} catch-up steps of batch 1 from {', '.join(f'`{Path(p).name}`' for p in paths)}; "
             f"steps after a change of mode drawn from their own pools: {', '.join(cold) or 'none'} "
             f"(mode, steps after the switch); "
             f"seeded replays ({4 * seeds} of each short run, {seeds} of each long one), means.", "",
             "| speculative steps | steps per run | gate | tokens/ms ÷ autoregressive | speculative share |",
             "|---|---:|---|---:|---:|"]
    third = num_steps // 3
    for label, factor, slow, n, reps, in_order in (("as measured", 1.0, None, short_steps, 4 * seeds, False),
                                                   ("as measured", 1.0, None, num_steps, seeds, False),
                                                   ("as measured, in log order", 1.0, None, num_steps, seeds, True),
                                                   (f"{slowdown:g}× slower", slowdown, None, num_steps, seeds, False),
                                                   (f"{slowdown:g}× slower for {third} steps, then as measured",
                                                    slowdown, third, num_steps, seeds, False)):
        for name, kwargs in (("always speculate", True), ("never speculate", False), *SETTINGS):
            runs = [replay(steps, kwargs, num_steps=n, seed=s, slowdown=factor, slow_steps=slow, in_order=in_order)
                    for s in range(reps)]
            lines.append(f"| {label} | {n} | {name} | {statistics.mean(r[0] for r in runs) / ar:.3f} | "
                         f"{statistics.mean(r[1] for r in runs):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.gate_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="engine debug logs (a benchmark run with --log-level debug)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--slowdown", type=float, default=1.5, help="the second scenario's factor on speculative steps")
    args = ap.parse_args(argv)
    try:
        print(render(args.logs, seeds=args.seeds, num_steps=args.steps, slowdown=args.slowdown))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
