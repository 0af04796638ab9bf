"""``python -m dart_core.train.curve``: the draft head's learning curve over training data size.

One head is trained per size (``--sizes``, tokens of prompt + response; ``all`` = every
training sequence) from one shared feature store (``--work-dir``), each a separate run with
the same options and schedule (``--epochs`` passes over its own subset), so the points differ
only in how much data they saw.  Each head is then measured twice:

- held-out top-1 accuracy per draft position (the trainer's final evaluation, on the
  held-out self-distilled sequences);
- τ (acceptance length, bonus token included) of greedy decoding at a fixed tree budget
  (default 60, the reference tree), the default n-gram trie, no context evidence
  (κ = 0: the head and the corpus trie alone), on the first ``--tau-prompts`` MT-Bench and
  HumanEval prompts, ``--tau-tokens`` new tokens each.

The curve is extrapolated with a least-squares fit y = a + b · log10(tokens) per metric to
``--extrapolate-to`` tokens (the size a GPU run would use).  A log-linear fit over one decade
says how fast the metric grows, not where it saturates: read the extrapolated value as an
estimate, not a promise.

Everything is resumable: a finished head (its ``training.json``) or a measured τ
(``tau.json``) is reused; a run stopped by ``--max-minutes`` continues on the next call.
Outputs in ``--out``: ``tokens-<N>/`` (one head each), ``curve.json`` and
``learning_curve.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import replace
from pathlib import Path

__all__ = ["fit_log_linear", "measure_tau", "plot_curve", "main"]

logger = logging.getLogger(__name__)

TAU_SETS = ("mt-bench", "humaneval")


def fit_log_linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b · log10(x).

    Raises:
        ValueError: fewer than two points, or a non-positive x.
    """
    if len(xs) < 2 or len(xs) != len(ys):
        raise ValueError("a fit needs at least two (x, y) points")
    if min(xs) <= 0:
        raise ValueError("log10 needs positive sizes")
    lx = [math.log10(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    var = sum((u - mx) ** 2 for u in lx)
    if var == 0:
        raise ValueError("a fit needs at least two different sizes")
    b = sum((u - mx) * (y - my) for u, y in zip(lx, ys)) / var
    return my - b * mx, b


def measure_tau(head_dir: Path, target, *, prompts: dict[str, list[list[int]]], budget: int,
                max_new_tokens: int) -> dict[str, float]:
    """τ per set of the head in ``head_dir`` (κ = 0, default trie), cached in ``tau.json`` there."""
    from dart_core.spec.draft_head import load_draft_head
    from dart_core.train.trainer import evaluate_tau

    key = {"prompts": {k: len(v) for k, v in prompts.items()}, "budget": budget, "max_new_tokens": max_new_tokens,
           "context_weight": 0.0}
    cache = head_dir / "tau.json"
    if cache.is_file():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["tau"]
    head = load_draft_head(head_dir, target.config, device=target.device)
    tau = {name: evaluate_tau(head, target, p, budget=budget, max_new_tokens=max_new_tokens, context_weight=0.0)
           for name, p in prompts.items()}
    cache.write_text(json.dumps({"key": key, "tau": tau}) + "\n")
    return tau


def plot_curve(curve: dict, path: str | Path) -> None:
    """Two panels: held-out top-1 per position, and τ per set, against training tokens (log scale),
    each fit drawn dashed out to the extrapolation size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = curve["points"]
    xs = [p["train_tokens"] for p in points]
    far = curve["extrapolate_to"]
    grid = [min(xs) * (far / min(xs)) ** (i / 50) for i in range(51)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    depth = len(points[0]["top1"])
    for j in sorted({0, 1, 3, depth - 1}):
        ax1.plot(xs, [p["top1"][j] for p in points], "o-", label=f"position {j + 1}")
    a, b = curve["fits"]["top1_position1"]["a"], curve["fits"]["top1_position1"]["b"]
    ax1.plot(grid, [a + b * math.log10(x) for x in grid], "--", color="C0", alpha=0.6, label="position 1 fit")
    ax1.set(xscale="log", xlabel="training tokens", ylabel="held-out top-1", title="draft accuracy")
    ax1.legend(fontsize=8)
    for i, name in enumerate(TAU_SETS):
        ax2.plot(xs, [p["tau"][name] for p in points], "o-", color=f"C{i}", label=name)
        fit = curve["fits"][f"tau_{name}"]
        ax2.plot(grid, [fit["a"] + fit["b"] * math.log10(x) for x in grid], "--", color=f"C{i}", alpha=0.6)
    ax2.axvline(far, color="grey", lw=0.8, ls=":")
    ax2.set(xscale="log", xlabel="training tokens",
            ylabel=f"τ (budget {curve['tau']['budget']}, κ = 0)", title="acceptance length")
    ax2.legend(fontsize=8)
    fig.suptitle(curve.get("title", "DART draft head learning curve"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sizes(text: str) -> list[int | None]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "all":
            out.append(None)
            continue
        try:
            n = int(float(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"sizes are token counts or 'all', got {part!r}") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"sizes must be positive, got {n}")
        out.append(n)
    if len(out) < 2:
        raise argparse.ArgumentTypeError("a curve needs at least two sizes")
    return out


def main(argv: list[str] | None = None) -> int:
    from dart_core.train.__main__ import add_train_arguments, config_from_args

    ap = argparse.ArgumentParser(prog="python -m dart_core.train.curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="curve folder: one head per size, curve.json, learning_curve.png")
    ap.add_argument("--sizes", type=_sizes, default=_sizes("134000,268000,670000,all"),
                    help="training tokens per point, comma-separated; 'all' = every training sequence")
    ap.add_argument("--tau-prompts", type=int, default=8, help="first prompts of MT-Bench and of HumanEval [8]")
    ap.add_argument("--tau-tokens", type=int, default=256, help="new tokens per prompt [256]")
    ap.add_argument("--tau-budget", type=int, default=60, help="draft tree budget, nodes [60]")
    ap.add_argument("--extrapolate-to", type=float, default=20e6, help="tokens a GPU run would train on [2e7]")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    add_train_arguments(ap, skip=("out", "train_tokens"))
    args = vars(ap.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.pop("out"))
    sizes, quiet = args.pop("sizes"), args.pop("quiet")
    tau_prompts, tau_tokens = args.pop("tau_prompts"), args.pop("tau_tokens")
    budget, far = args.pop("tau_budget"), args.pop("extrapolate_to")
    base = config_from_args({**args, "out": str(out)})

    from dart_core.train.trainer import train

    out.mkdir(parents=True, exist_ok=True)
    summaries = []
    for n in sizes:
        head_dir = out / ("tokens-all" if n is None else f"tokens-{n}")
        done = head_dir / "training.json"
        if done.is_file():
            summaries.append((head_dir, json.loads(done.read_text())))
            continue
        summary = train(replace(base, out=str(head_dir), train_tokens=n), progress=not quiet)
        if not summary["finished"]:
            print(f"stopped by --max-minutes during the {head_dir.name} run: run the same command again to continue",
                  file=sys.stderr)
            return 3
        summaries.append((head_dir, summary))

    from dart_core.bench.datasets import load_prompts
    from dart_core.model.target import TargetModel

    target = TargetModel.from_pretrained(base.model)
    tok = target.tokenizer
    prompts = {name: [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"])
                      for t in load_prompts(name, tau_prompts)] for name in TAU_SETS}
    points = []
    for head_dir, summary in summaries:
        tau = measure_tau(head_dir, target, prompts=prompts, budget=budget, max_new_tokens=tau_tokens)
        final = summary["eval"][-1]
        points.append({"head": head_dir.name, "train_tokens": summary["sequences"]["train_tokens"],
                       "train_sequences": summary["sequences"]["train"], "steps": summary["steps"],
                       "train_wall_s": summary["wall_time_s"]["train"], "top1": final["top1"],
                       "held_out_loss": final["loss"], "tau": tau})
        logger.info("%s: %d tokens, top-1 %s, tau %s", head_dir.name, points[-1]["train_tokens"], final["top1"], tau)
    points.sort(key=lambda p: p["train_tokens"])
    xs = [p["train_tokens"] for p in points]
    fits = {}
    series = {"top1_position1": [p["top1"][0] for p in points]}
    series.update({f"tau_{name}": [p["tau"][name] for p in points] for name in TAU_SETS})
    for key, ys in series.items():
        a, b = fit_log_linear(xs, ys)
        fits[key] = {"a": round(a, 4), "b": round(b, 4), "at_extrapolation": round(a + b * math.log10(far), 3)}
    curve = {"points": points, "fits": fits, "extrapolate_to": far,
             "tau": {"sets": list(TAU_SETS), "prompts": tau_prompts, "max_new_tokens": tau_tokens, "budget": budget,
                     "context_weight": 0.0, "trie": "default"},
             "title": f"DART head, SmolLM2-135M-Instruct target, {base.epochs:g} epoch(s) per point"}
    (out / "curve.json").write_text(json.dumps(curve, indent=2) + "\n")
    from dart_core.bench import save_plot

    png = save_plot(plot_curve, out / "learning_curve.png", curve)
    print(json.dumps({"points": [{k: p[k] for k in ("train_tokens", "top1", "tau")} for p in points],
                      "fits": fits, "png": str(png) if png else None}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
