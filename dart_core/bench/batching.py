"""Continuous-batching benchmark without Ray: ``python -m dart_core.bench.batching``.

The serving benchmark's sweep (:mod:`dart_core.bench.serving`), run in one
process against :class:`~dart_core.serve.batcher.ContinuousBatcher`: no Ray, no
HTTP, no gRPC hop to the n-gram service (the trie is searched in process).
It measures what the serving core itself does under concurrency, on any
machine torch runs on (a GPU machine without Ray included), and separates it
from what Serve's proxies and the network add.

For each concurrency level C (default 1, 4, 16) and each mode — ``dart`` and
``no-speculation`` (requests sent with ``speculative=False``, so both modes
share one engine and one batcher) — C client threads each submit
``requests_per_client`` chat requests back to back (MT-Bench first turns,
T = 0); the modes alternate which goes first from level to level (and
from pass to pass with ``--repeats``, which reports each (level, mode)'s
median pass and lists every pass's tokens/s).  Reported
per (level, mode), as the serving benchmark does: output tokens/s (all
completion tokens ÷ wall time of the level), requests, TTFT and ITL p50/p99,
and the mean τ of the requests.  ``--no-gate`` turns the speculation gate off,
as the decoding benchmark does, so batch-1 figures compare with its rows.
Before the sweep the largest level runs once, untimed, in each mode: a
server's first large batch pays costs it never pays again (fresh memory
pages for the larger activations and caches, the first prefill of many
prompts at once), and without this pass they fell on whichever mode ran
first at that level.  With ``--cuda-graphs`` every (level, mode) is instead
first run once untimed: a graph is captured the first time its shape
(batch, tree and attention window buckets) is met, once in a server's
life, so the timed pass measures replays, the steady state.

Each row also says where the tokens came from (``steps``, from the engine's
step outputs during the level; prefills left out): decoding steps, the share
that speculated, and per speculative step the verified tokens (draft nodes +
roots of all sequences), the accepted tokens (τ summed over the batch) and the
padding share (positions of the padded layout that hold no node: 1 − verified ÷
B · N).  With ``--pooled-budget`` on a packed CPU target (``packed_verification``
in the result) the nodes of all sequences compete for one budget and padding
positions are not computed by the linear layers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dart_core.bench.serving import MODES, run_sweep  # the same two modes and passes as the serving sweep

__all__ = ["BatchingConfig", "run_batching", "save", "main"]


@dataclass
class BatchingConfig:
    """Settings of one batching-benchmark run (``python -m dart_core.bench.batching --help``)."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    head: str | None = None  # None: the head shipped for the model (method eagle3: an EAGLE-3 head folder or "random")
    method: str = "dart"  # the drafter of the speculative ("dart") rows: "dart" or "eagle3"
    trie: str = "auto"  # "auto": the default trie (built when missing), a file, or "none"
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    requests_per_client: int = 2
    max_tokens: int = 128
    modes: list[str] = field(default_factory=lambda: list(MODES))
    dataset: str = "mt-bench"
    budget: str = "auto"  # "auto" (adaptive, as served) or a fixed number of draft nodes
    gate: bool = True  # the speculation gate, as served; False measures speculation at every step
    max_batch_size: int = 16
    max_speculative_batch: int | None = 8
    dtype: str | None = None
    weights: str = "auto"  # the target's weights: "auto", "dense" or "gguf-native"
    gguf_kernel: str = "auto"  # the GGUF-native layers' kernel: "auto" or one of dart_core.model.quant.KERNELS
    draft_weights: str = "auto"  # the draft head's linear layers: "auto" or one of dart_core.api.DRAFT_WEIGHTS
    device: str | None = None
    threads: int | None = None  # torch CPU threads (default: torch's)
    cuda_graphs: bool = False  # CUDA: verification and draft replayed as CUDA graphs over static KV caches
    pooled_budget: bool = False  # one budget across the batch, padding not computed (DartEngine.pooled_budget)
    repeats: int = 1  # passes per level; each (level, mode) reports its median pass (serving.run_sweep)


class StepTally:
    """A batcher observer (the hooks of :class:`dart_core.serve.batcher.BatcherObserver`, duck-typed so this module
    imports no torch) that counts a level's decoding steps (see the module docstring)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = self.speculative = self.verified = self.layout = self.accepted = 0

    def on_admit(self, wait_ms: float, queued: int) -> None:
        pass

    def on_finish(self, chunk) -> None:
        pass

    def on_step(self, step, prefill: bool) -> None:
        if prefill or not step.seq_ids:
            return
        self.steps += 1
        if step.speculated:
            self.speculative += 1
            self.verified += step.verified_tokens
            self.layout += step.padded_tokens
            self.accepted += sum(step.accepted_lengths)

    def summary(self) -> dict:
        spec = self.speculative
        return {"decode_steps": self.steps, "speculative_share": round(spec / self.steps, 3) if self.steps else None,
                "verified_per_step": round(self.verified / spec, 2) if spec else None,
                "accepted_per_step": round(self.accepted / spec, 2) if spec else None,
                "padding_share": round(1 - self.verified / self.layout, 3) if self.layout else None}


def step_table(result: dict) -> str:
    """The rows' ``steps`` as a markdown table (speculative steps only, per step)."""
    lines = [f"Speculative steps{' (verified packed: padding not computed)' if result.get('packed_verification') else ''}:",
             "", "| clients | mode | decode steps | speculative share | verified tokens/step | "
             "accepted tokens/step | padding share |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        st = r.get("steps") or {}

        def f(x):
            return "–" if x is None else str(x)

        lines.append(f"| {r['concurrency']} | {r['mode']} | {f(st.get('decode_steps'))} | "
                     f"{f(st.get('speculative_share'))} | {f(st.get('verified_per_step'))} | "
                     f"{f(st.get('accepted_per_step'))} | {f(st.get('padding_share'))} |")
    return "\n".join(lines) + "\n"


def _level(batcher, prompts: list[str], concurrency: int, speculative: bool, cfg: BatchingConfig) -> dict:
    from dart_core.bench.serving import add_request, level_row, new_record, run_clients
    from dart_core.serve.request import ChatMessage, GenerationRequest

    lock = threading.Lock()
    rec = new_record()

    def worker(cid: int) -> None:
        for k in range(cfg.requests_per_client):
            prompt = prompts[(cid + k * concurrency) % len(prompts)]
            request = GenerationRequest(messages=(ChatMessage("user", prompt),), max_tokens=cfg.max_tokens,
                                        speculative=speculative)
            t0 = time.perf_counter()
            first = last = None
            try:
                for chunk in batcher.generate(request, timeout_s=600):
                    last = time.perf_counter()
                    first = first or last
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    rec["errors"].append(repr(e)[:200])
                continue
            with lock:
                add_request(rec, t0, first, last, chunk.completion_tokens, chunk.tau)

    return level_row(concurrency, speculative, run_clients(concurrency, worker), rec)


def run_batching(cfg: BatchingConfig, *, progress: bool = True) -> dict:
    """Loads the model, runs the sweep, returns ``{"config", "server", "hardware", "rows", "seconds"}``
    (the serving benchmark's shape, so its table and plot apply).

    Raises:
        ValueError: an unknown mode, a concurrency below 1, or a bad budget.
        FileNotFoundError: the model, head or trie cannot be found.
    """
    import torch
    from tqdm import tqdm

    from dart_core.api import DartModel
    from dart_core.serve.batcher import BatcherConfig, ContinuousBatcher, load_in_own_thread
    from dart_core.bench.datasets import load_prompts
    from dart_core.bench.decoding import hardware
    from dart_core.serve.request import GenerationRequest
    from dart_core.bench import bench_kernel_config, bench_switches
    from dart_core.spec.speculative import SpeculativeConfig

    if set(cfg.modes) - set(MODES) or not cfg.modes:
        raise ValueError(f"modes must be among {', '.join(MODES)}")
    if min(cfg.concurrency) < 1:
        raise ValueError("concurrency levels must be ≥ 1")
    if cfg.repeats < 1:
        raise ValueError("repeats must be ≥ 1")
    if cfg.method not in ("dart", "eagle3"):
        raise ValueError(f"method must be dart or eagle3, got {cfg.method!r}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    budget = cfg.budget if cfg.budget == "auto" else int(cfg.budget)
    trie = None if cfg.trie in (None, "none") else cfg.trie
    if trie == "auto":
        from ngram_service.build import ensure_default_trie

        trie = str(ensure_default_trie(cfg.model, progress=progress))
    # as the Serve deployment loads it: on a thread that ends (load_in_own_thread says why)
    model = load_in_own_thread(lambda: DartModel.from_pretrained(
        cfg.model, head=cfg.head, trie=trie, dtype=getattr(torch, cfg.dtype) if cfg.dtype else None,
        weights=cfg.weights, gguf_kernel=cfg.gguf_kernel, draft_weights=cfg.draft_weights, device=cfg.device,
        speculative_config=SpeculativeConfig(method=cfg.method, budget=budget, cuda_graphs=cfg.cuda_graphs,
                                             pooled_budget=cfg.pooled_budget,
                                             draft_graphs=bench_switches()["draft_graphs"]),
        kernel_config=bench_kernel_config()))
    if not cfg.gate:
        model.engine.gate = None
    prompts = load_prompts(cfg.dataset)
    batch = BatcherConfig(max_batch_size=max(cfg.max_batch_size, max(cfg.concurrency)),
                          max_speculative_batch=cfg.max_speculative_batch, max_tokens_limit=max(cfg.max_tokens, 8))
    tally = StepTally()
    with ContinuousBatcher(model.engine, model.tokenizer, batch, observer=tally) as batcher:
        list(batcher.generate(GenerationRequest(prompt=prompts[0], max_tokens=8)))  # warm-up
        if not cfg.cuda_graphs:  # untimed: the largest level once per mode (module docstring)
            for mode in cfg.modes:
                _level(batcher, prompts, max(cfg.concurrency), mode == "dart", cfg)
        bar = tqdm(total=len(cfg.concurrency) * len(cfg.modes) * cfg.repeats, desc="batching benchmark",
                   unit="level", disable=not progress)
        warm = set()

        def level(c: int, mode: str) -> dict:
            if cfg.cuda_graphs and (c, mode) not in warm:  # untimed: the level's new shapes are captured here
                _level(batcher, prompts, c, mode == "dart", cfg)
                warm.add((c, mode))
            tally.reset()
            return {**_level(batcher, prompts, c, mode == "dart", cfg), "steps": tally.summary()}

        rows = run_sweep(cfg.concurrency, list(cfg.modes), cfg.repeats, level, bar)
        bar.close()
    name = getattr(model.tokenizer, "dart_model_name", "model")
    return {"config": asdict(cfg), "server": {"url": "in process (ContinuousBatcher, no Ray)", "model": name},
            "hardware": hardware(model.engine.target.device), "rows": rows,
            "packed_verification": model.engine.packed_verification,
            "seconds": round(time.perf_counter() - started, 1)}


def save(result: dict, out_dir: str | Path, stem: str = "batching") -> dict[str, Path | None]:
    """Writes ``<stem>.json`` and ``<stem>.md``, then ``<stem>.png`` (None without matplotlib)."""
    from dart_core.bench import serving

    hw = result["hardware"].get("gpu") or result["hardware"]["cpu"]
    method = result["config"].get("method", "dart")
    drafter = "" if method == "dart" else f", speculative rows drafted by {method}"
    paths = serving.save(result, out_dir, stem=stem, title=f"Continuous batching without Ray, "
                                                           f"{result['server']['model']} on {hw}{drafter}")
    md = Path(out_dir) / f"{stem}.md"
    text = md.read_text()
    if method != "dart":
        text = f"The rows of mode `dart` speculate with the {method} drafter (`--method {method}`).\n\n" + text
    if any("steps" in r for r in result["rows"]):
        text = text.rstrip("\n") + "\n\n" + step_table(result)
    md.write_text(text)
    return paths


def main(argv=None) -> int:
    import argparse

    from dart_core.bench import add_engine_arguments, run_cli
    from dart_core.bench.serving import add_sweep_arguments, markdown_table

    d = BatchingConfig()
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.batching", description=__doc__.split("\n\n")[0])
    add_engine_arguments(ap, d)
    add_sweep_arguments(ap, d)
    ap.add_argument("--method", default=d.method, choices=["dart", "eagle3"],
                    help='the drafter of the speculative rows (mode "dart"): the DART head and tree search, or '
                         'an EAGLE-3 head (--head: its folder, or "random") [%(default)s]')
    ap.add_argument("--no-gate", dest="gate", action="store_false", help="speculate at every step (no gate)")
    ap.add_argument("--pooled-budget", action="store_true",
                    help="one verification budget for the whole batch, padding not computed (packed CPU targets)")
    ap.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    ap.add_argument("--max-speculative-batch", type=int, default=d.max_speculative_batch)
    ap.add_argument("--out", default="bench/results", help="folder for batching.json/.md/.png")
    ap.add_argument("--no-progress", action="store_true")
    return run_cli(BatchingConfig, ap.parse_args(argv), run_batching, save,
                   lambda r: markdown_table(r) + ("\n" + step_table(r) if any("steps" in x for x in r["rows"]) else ""))


if __name__ == "__main__":
    raise SystemExit(main())
