"""DART against EAGLE-3 on one target (``python -m dart_core.bench.methods [--eagle3-head DIR]``).

The paper's headline claim (arXiv 2601.19278) is that DART drafts faster than EAGLE-3 for as
much acceptance.  This benchmark loads the target once with its DART head and the n-gram trie
(the engine's defaults: the request's context in the tree, lookup steps), and an EAGLE-3 head
beside it (default the one shipped for the model): a second engine on the same target, with its
own adaptive budget on the same verification cost curve (each draft sized by it:
:meth:`Eagle3Drafter.tree_size <dart_core.spec.eagle3.Eagle3Drafter.tree_size>`).  The
speculation gate is off, so each row measures its method; both verify with the same tree attention.

Protocol: per dataset (default MT-Bench, HumanEval, AlpacaEval; the first ``--num-prompts``
prompts, chat template, T = 0, ``--max-new-tokens``) and per batch size (default 1 and 4:
the prompts decoded ``batch`` at a time, each group until its last sequence ends), every
method decodes every prompt once per pass, the method order rotating from pass to pass; one
untimed warm-up generation per method first.  Per (dataset, batch, method): tokens/s = generated
tokens ÷ wall seconds of the pass (median over passes); speed-up = the median over passes of
tokens/s ÷ the same pass's autoregressive tokens/s; τ = tokens emitted after prefill ÷ the
sequences' steps (per sequence, bonus included); draft, tree-search and verification
milliseconds per target forward (one forward serves the whole batch); lossless = every
output equals the autoregressive one.  DART ÷ EAGLE-3 is the ratio of their speed-ups.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["MethodsConfig", "METHODS", "run_methods", "markdown_table", "save"]

METHODS = ("autoregressive", "dart", "eagle3")


@dataclass
class MethodsConfig:
    eagle3_head: str | None = None  # an EAGLE-3 checkpoint folder; None: the one shipped for the model
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    head: str | None = None  # the DART head; None: the one shipped for the model
    trie: str | None = "auto"  # the n-gram trie; "auto": the default trie (built when absent); "none": none
    datasets: list[str] = field(default_factory=lambda: ["mt-bench", "humaneval", "alpacaeval"])
    num_prompts: int = 8
    max_new_tokens: int = 128
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    repeats: int = 3
    threads: int | None = None


def _engines(cfg: MethodsConfig):
    """(model, {method: engine}): the DART model and an EAGLE-3 engine on its target."""
    import torch

    from dart_core.api import DartModel
    from dart_core.bench import bench_kernel_config
    from dart_core.bench.decoding import eagle3_engine
    from dart_core.spec.speculative import SpeculativeConfig
    from ngram_service.build import ensure_default_trie

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    trie = (str(ensure_default_trie(cfg.model)) if cfg.trie == "auto"
            else None if cfg.trie in (None, "none") else cfg.trie)
    model = DartModel.from_pretrained(cfg.model, head=cfg.head, trie=trie, kernel_config=bench_kernel_config())
    engine = model.engine
    engine.gate = None  # each row measures its method
    spec = SpeculativeConfig()
    eagle3 = eagle3_engine(engine, cfg.eagle3_head, total_tokens=spec.eagle3_total_tokens,
                           depth=spec.eagle3_depth, top_k=spec.eagle3_top_k)
    return model, {"autoregressive": engine, "dart": engine, "eagle3": eagle3}


def _pass(engine, method: str, prompts: list[list[int]], batch: int, sampling) -> dict:
    """One pass of ``method`` over ``prompts``, ``batch`` at a time: tokens, seconds, tokens/s and the
    step figures."""
    out = {"tokens": [], "emitted": 0, "forwards": 0, "sequence_steps": 0,
           "ms": {"draft": 0.0, "tree_search": 0.0, "verify": 0.0}}
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        res = engine.generate(prompts[i:i + batch], sampling, speculative=method != "autoregressive")
        out["tokens"] += res.token_ids
        out["emitted"] += res.emitted_after_prefill
        out["forwards"] += res.target_forwards
        out["sequence_steps"] += res.sequence_steps
        for k in out["ms"]:
            out["ms"][k] += res.phase_ms[k]
    out["seconds"] = time.perf_counter() - t0
    out["tokens_per_s"] = sum(map(len, out["tokens"])) / out["seconds"]
    return out


def run_methods(cfg: MethodsConfig, *, progress: bool = True) -> dict:
    """Runs the comparison; returns ``{"config", "hardware", "rows", "seconds"}``.

    Raises:
        ValueError: no ``eagle3_head`` and none shipped for the model, a batch size or prompt count
            below 1, ``repeats`` below 1.
        HeadLoadError: the EAGLE-3 head does not fit the target."""
    from tqdm import tqdm

    from dart_core.bench.datasets import load_prompts
    from dart_core.bench.decoding import hardware

    if min(cfg.batch_sizes) < 1 or cfg.num_prompts < 1 or cfg.repeats < 1:
        raise ValueError("batch sizes, --num-prompts and --repeats must be >= 1")
    started = time.perf_counter()
    model, engines = _engines(cfg)
    sampling = model.sampling_params(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    sets = {name: [model.encode([{"role": "user", "content": t}]) for t in load_prompts(name, cfg.num_prompts)]
            for name in cfg.datasets}
    warm = model.sampling_params(max_new_tokens=8, temperature=0.0)
    for m in METHODS:  # untimed: the first generation of each engine
        _pass(engines[m], m, next(iter(sets.values()))[:1], 1, warm)
    runs: dict[tuple, list[dict]] = {}
    bar = tqdm(total=len(sets) * len(cfg.batch_sizes) * cfg.repeats * len(METHODS), desc="DART vs EAGLE-3",
               unit="pass", disable=not progress)
    for r in range(cfg.repeats):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for name, prompts in sets.items():
            for b in cfg.batch_sizes:
                for m in order:
                    runs.setdefault((name, b, m), []).append(_pass(engines[m], m, prompts, b, sampling))
                    bar.update()
    bar.close()
    rows = []
    for (name, b, m), passes in runs.items():
        ar = runs[(name, b, "autoregressive")]
        tps = [p["tokens_per_s"] for p in passes]
        fwd = sum(p["forwards"] for p in passes)
        rows.append({"dataset": name, "batch": b, "method": m, "tokens_per_s": round(statistics.median(tps), 2),
                     "tokens_per_s_runs": [round(x, 2) for x in tps],
                     "speedup": round(statistics.median(
                         t / a["tokens_per_s"] for t, a in zip(tps, ar)), 3),
                     "tau": round(sum(p["emitted"] for p in passes)
                                  / max(sum(p["sequence_steps"] for p in passes), 1), 3),
                     "ms_per_step": {k: round(sum(p["ms"][k] for p in passes) / max(fwd, 1), 2)
                                     for k in ("draft", "tree_search", "verify")},
                     "lossless": all(p["tokens"] == a["tokens"] for p, a in zip(passes, ar))})
    rows.sort(key=lambda x: (cfg.datasets.index(x["dataset"]), x["batch"], METHODS.index(x["method"])))
    return {"config": asdict(cfg), "hardware": hardware(engines["dart"].target.device), "rows": rows,
            "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    from dart_core.bench.decoding import hardware_line

    c = result["config"]
    by = {(r["dataset"], r["batch"], r["method"]): r for r in result["rows"]}
    lines = [f"**Hardware**: {hardware_line(result['hardware'])}. T = 0, {c['max_new_tokens']} new tokens, the first "
             f"{c['num_prompts']} prompts of each set, the median of {c['repeats']} passes; the gate off; EAGLE-3 head "
             f"`{c['eagle3_head'] or 'shipped'}`.", "",
             "| dataset | batch | method | τ | draft ms / step | tree-search ms / step | tokens/s | "
             "÷ autoregressive | DART ÷ EAGLE-3 | lossless |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in result["rows"]:
        if r["method"] == "autoregressive":
            continue
        ratio = ""
        if r["method"] == "dart" and (r["dataset"], r["batch"], "eagle3") in by:
            ratio = f"{r['speedup'] / by[(r['dataset'], r['batch'], 'eagle3')]['speedup']:.2f}×"
        ms = r["ms_per_step"]
        lines.append(f"| {r['dataset']} | {r['batch']} | {r['method']} | {r['tau']:.2f} | {ms['draft']:.1f} | "
                     f"{ms['tree_search']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {ratio} | "
                     f"{'yes' if r['lossless'] else 'no'} |")
    return "\n".join(lines) + "\n"


def save(result: dict, out_dir: str | Path, stem: str = "methods") -> dict[str, Path]:
    """Writes ``<stem>.json`` and ``<stem>.md`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["md"].write_text(markdown_table(result))
    return paths


def main(argv=None) -> int:
    import argparse

    from dart_core.bench import run_cli

    d = MethodsConfig()
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.methods", description=__doc__.split("\n\n")[0])
    ap.add_argument("--eagle3-head", default=d.eagle3_head,
                    help="an EAGLE-3 checkpoint folder for the target [the one shipped for the model]")
    ap.add_argument("--model", default=d.model, help="[the embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--head", default=d.head, help="the DART head [the one shipped for the model]")
    ap.add_argument("--trie", default=d.trie, help="[%(default)s: the default trie]")
    ap.add_argument("--datasets", nargs="+", default=d.datasets)
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=d.batch_sizes)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--out", default="bench/results/dart_vs_eagle3", help="folder for methods.json/.md")
    ap.add_argument("--no-progress", action="store_true")
    return run_cli(MethodsConfig, ap.parse_args(argv), run_methods, save, markdown_table)


if __name__ == "__main__":
    raise SystemExit(main())
