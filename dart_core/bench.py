"""Decoding benchmark, DART vs autoregressive in one run:
``python -m dart_core.bench --help``.

Same target, same engine, same prompts (MT-Bench first turns or a JSONL
file), T = 0, batch 1: each prompt is decoded autoregressively and with DART,
interleaved, after a warm-up; the figures are medians over ``--repeats``
passes.  Prints JSON: τ, tokens/s of both, speedup, per-phase ms per step,
and whether DART's output equalled the autoregressive output (lossless).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def _prompts(path: str | None, limit: int) -> list[str]:
    if path:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        texts = [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows]
    else:
        from ngram_service.corpus import mt_bench_first_turns

        texts = mt_bench_first_turns()
    return texts[:limit]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf [embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--head", default=None, help='draft head folder, or "random" [the shipped head]')
    ap.add_argument("--trie", default="auto", help='trie file, "auto" (default trie if built) or "none"')
    ap.add_argument("--budget", default="auto", help='"auto" or a fixed number of draft nodes')
    ap.add_argument("--prompts", default=None, help="JSONL with {'prompt': ...} or MT-Bench 'turns' [MT-Bench]")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)

    from dart_core.api import DartModel

    budget = args.budget if args.budget == "auto" else int(args.budget)
    trie = None if args.trie == "none" else args.trie
    model = DartModel.from_pretrained(args.model, head=args.head, trie=trie, budget=budget,
                                      dtype=getattr(torch, args.dtype) if args.dtype else None)
    engine = model.engine
    prompts = [model.encode([{"role": "user", "content": t}]) for t in _prompts(args.prompts, args.num_prompts)]
    sampling = model._sampling(args.max_new_tokens, 0.0, 1.0, 0, 0, None)
    engine.generate(prompts[:1], sampling, speculative=False)  # warm-up
    engine.generate(prompts[:1], sampling)

    runs = {"autoregressive": [], "dart": []}
    phase = {"draft": [], "tree_search": [], "verify": []}
    taus, lossless = [], True
    for _ in range(args.repeats):
        totals = {"autoregressive": [0, 0.0], "dart": [0, 0.0]}
        for p in prompts:
            outs = {}
            for name, spec in (("autoregressive", False), ("dart", True)):
                t0 = time.perf_counter()
                res = engine.generate([p], sampling, speculative=spec)
                totals[name][0] += len(res.token_ids[0])
                totals[name][1] += time.perf_counter() - t0
                outs[name] = res
            lossless &= outs["dart"].token_ids == outs["autoregressive"].token_ids
            taus.append(outs["dart"].tau)
            for k in phase:
                phase[k].append(outs["dart"].phase_ms[k] / max(outs["dart"].target_forwards, 1))
        for name, (tokens, seconds) in totals.items():
            runs[name].append(tokens / seconds)
    ar, dart = statistics.median(runs["autoregressive"]), statistics.median(runs["dart"])
    print(json.dumps({
        "device": str(engine.target.device), "dtype": str(engine.target.dtype).replace("torch.", ""),
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "head": args.head or "shipped", "trie": getattr(engine.tree_search, "trie", None) is not None,
        "budget": args.budget,
        "tau": round(statistics.median(taus), 3),
        "tokens_per_s": {"autoregressive": round(ar, 2), "dart": round(dart, 2)},
        "speedup": round(dart / ar, 3),
        "ms_per_step": {k: round(statistics.median(v), 2) for k, v in phase.items()},
        "lossless": lossless,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
