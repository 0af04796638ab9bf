"""``python -m dart_core.train.mix``: which training source gives the best draft head per CPU-hour.

The trainer has two sources (:mod:`dart_core.train.data`): **self-distilled** responses (the
target writes them, one decode step per token, then one teacher forward) and **teacher-forced**
ShareGPT assistant turns (one teacher forward per token, no generation).  A self-distilled
token is what the head will be asked to predict; a teacher-forced one is several times
cheaper.  This tool reads learning curves of each source made by :mod:`dart_core.train.curve`
(``--train-source self``, ``sharegpt`` and ``all`` on one feature store, same sizes and
schedule), prices every point in core-hours and compares the sources twice:

- at equal training tokens (what a token of each source is worth);
- at equal core-hours: y = a + b · log10(core-hours) fitted per source and metric, read at
  the largest budget every source's curve reaches (what a CPU-hour of each source is worth).

Price of a point = data + training.  Data: ``train_tokens_self_distilled`` × the
self-distilled cost per token + the rest × the teacher-forced cost per token (core-seconds,
``--core-seconds-per-token``; measured when the feature store was built: generation and
teacher-forward throughput, see the model card).  Training: the run's training wall time ×
its ``threads``.  Metrics: held-out position-1 top-1 and τ per set, as in the curve.

Outputs in ``--out``: ``mix.json`` and ``mix.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dart_core.train.curve import TAU_SETS, fit_log_linear

__all__ = ["price_points", "compare_sources", "plot_mix", "main"]

SOURCES = ("self", "sharegpt", "all")


def price_points(curve_dir: Path, core_s_per_token: dict[str, float]) -> list[dict]:
    """The points of one curve folder with their cost in core-hours.

    Args:
        curve_dir: a :mod:`dart_core.train.curve` output (``curve.json`` and one
            ``<head>/training.json`` per point).
        core_s_per_token: data cost per training token, core-seconds, keys ``self`` and ``sharegpt``.

    Returns: one dict per point, sorted by tokens: ``source``, ``train_tokens``,
    ``self_tokens``, ``data_core_h``, ``train_core_h``, ``core_h``, ``top1`` (position 1),
    ``tau`` ({set: τ}).

    Raises:
        ValueError: a missing file or field (a point of the ``all`` source trained before the
            trainer recorded ``train_tokens_self_distilled``), or points of different sources.
    """
    path = Path(curve_dir) / "curve.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: run python -m dart_core.train.curve first")
    curve = json.loads(path.read_text())
    out, sources = [], set()
    for p in curve["points"]:
        run_file = Path(curve_dir) / p["head"] / "training.json"
        if not run_file.is_file():
            raise ValueError(f"{run_file} not found: the curve folder is incomplete")
        run = json.loads(run_file.read_text())
        source = run["config"].get("train_source", "all")
        sources.add(source)
        seqs = run["sequences"]
        tokens = int(seqs["train_tokens"])
        if source == "self":
            self_tokens = tokens
        elif source == "sharegpt":
            self_tokens = 0
        elif "train_tokens_self_distilled" in seqs:
            self_tokens = int(seqs["train_tokens_self_distilled"])
        else:
            raise ValueError(f"{run_file}: a mixed-source run without train_tokens_self_distilled "
                             "(trained by an older trainer): train that point again to price it")
        data_s = self_tokens * core_s_per_token["self"] + (tokens - self_tokens) * core_s_per_token["sharegpt"]
        train_s = float(run["wall_time_s"]["train"]) * int(run["config"].get("threads") or 1)
        out.append({"source": source, "head": p["head"], "train_tokens": tokens, "self_tokens": self_tokens,
                    "data_core_h": round(data_s / 3600, 4), "train_core_h": round(train_s / 3600, 4),
                    "core_h": round((data_s + train_s) / 3600, 4), "top1": p["top1"][0], "tau": p["tau"]})
    if len(sources) > 1:
        raise ValueError(f"{curve_dir} mixes runs of sources {sorted(sources)}")
    return sorted(out, key=lambda q: q["train_tokens"])


def compare_sources(points: dict[str, list[dict]]) -> dict:
    """Fits per source and metric against tokens and against core-hours, read at a common size.

    Args:
        points: {source: :func:`price_points` output}, at least two sources of ≥ 2 points.

    Returns: {"metrics": [...], "at_tokens": T, "at_core_h": C, "sources": {source: {metric:
    {"by_tokens": value at T, "by_core_h": value at C, "per_decade_tokens": b, "per_decade_core_h": b}}},
    "best_by_tokens": {metric: source}, "best_by_core_h": {metric: source}} where T and C are the
    largest token count and core-hours that every source's curve reaches.

    Raises:
        ValueError: fewer than two sources, or a source with fewer than two points.
    """
    if len(points) < 2:
        raise ValueError("a comparison needs at least two sources")
    for name, pts in points.items():
        if len(pts) < 2:
            raise ValueError(f"source {name!r} has {len(pts)} point(s): a fit needs two")
    metrics = {"top1_position1": lambda q: q["top1"]}
    metrics.update({f"tau_{s}": (lambda q, s=s: q["tau"][s]) for s in TAU_SETS})
    at_tokens = min(max(q["train_tokens"] for q in pts) for pts in points.values())
    at_core_h = min(max(q["core_h"] for q in pts) for pts in points.values())
    table: dict = {}
    for name, pts in points.items():
        table[name] = {}
        for metric, get in metrics.items():
            ys = [get(q) for q in pts]
            a_t, b_t = fit_log_linear([q["train_tokens"] for q in pts], ys)
            a_c, b_c = fit_log_linear([q["core_h"] for q in pts], ys)
            table[name][metric] = {"by_tokens": round(a_t + b_t * math.log10(at_tokens), 4),
                                   "by_core_h": round(a_c + b_c * math.log10(at_core_h), 4),
                                   "per_decade_tokens": round(b_t, 4), "per_decade_core_h": round(b_c, 4)}
    best = {kind: {m: max(table, key=lambda s: table[s][m][kind]) for m in metrics}
            for kind in ("by_tokens", "by_core_h")}
    return {"metrics": list(metrics), "at_tokens": at_tokens, "at_core_h": at_core_h, "sources": table,
            "best_by_tokens": best["by_tokens"], "best_by_core_h": best["by_core_h"]}


def plot_mix(points: dict[str, list[dict]], path: str | Path) -> None:
    """Two panels against core-hours (log scale): held-out position-1 top-1, and τ per set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, pts) in enumerate(points.items()):
        xs = [q["core_h"] for q in pts]
        ax1.plot(xs, [q["top1"] for q in pts], "o-", color=f"C{i}", label=name)
        for style, s in zip(("o-", "s--"), TAU_SETS):
            ax2.plot(xs, [q["tau"][s] for q in pts], style, color=f"C{i}", label=f"{name}, {s}")
    ax1.set(xscale="log", xlabel="core-hours (data + training)", ylabel="held-out top-1, position 1",
            title="draft accuracy per CPU cost")
    ax2.set(xscale="log", xlabel="core-hours (data + training)", ylabel="τ (budget 60, κ = 0)",
            title="acceptance length per CPU cost")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _named(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.train.mix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", type=_named, action="append", required=True, metavar="SOURCE=DIR",
                    help="a learning-curve folder per source (self, sharegpt, all); repeat")
    ap.add_argument("--core-seconds-per-token", type=_named, action="append", required=True, metavar="SOURCE=S",
                    help="data cost of one training token of each source, core-seconds (self=..., sharegpt=...)")
    ap.add_argument("--out", required=True, help="folder for mix.json and mix.png")
    args = ap.parse_args(argv)
    try:
        costs = {k: float(v) for k, v in args.core_seconds_per_token}
        missing = {"self", "sharegpt"} - set(costs)
        if missing or min(costs.values()) < 0:
            raise ValueError("--core-seconds-per-token needs non-negative self=... and sharegpt=...")
        points = {name: price_points(Path(d), costs) for name, d in args.curve}
        result = {"core_seconds_per_token": costs, "points": points, **compare_sources(points)}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mix.json").write_text(json.dumps(result, indent=2) + "\n")
    from dart_core.bench import save_plot

    png = save_plot(plot_mix, out / "mix.png", points)
    print(json.dumps({k: result[k] for k in ("at_tokens", "at_core_h", "sources", "best_by_tokens",
                                             "best_by_core_h")} | {"png": str(png) if png else None}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
