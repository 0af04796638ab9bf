"""Decoding benchmark: DART against its baselines, side by side, in one run.

Methods (all batch 1, same target weights, prompts, max new tokens and temperature):

- ``autoregressive``: the DART engine with ``speculative=False`` (the baseline
  of every speedup);
- ``hf-generate``: Hugging Face ``generate`` (greedy, or sampling at T > 0);
- ``hf-prompt-lookup``: Hugging Face prompt-lookup decoding
  (``prompt_lookup_num_tokens``);
- ``dart-no-ngram``: DART with the logits-only tree search (no trie, no context);
- ``dart``: DART with the n-gram trie searched in this process, without the
  request's own context (κ = 0: the paper's search);
- ``dart-context``: ``dart`` plus the request's own context in the tree
  (context weight κ, docs/engine.md, "Context in the tree"): the engine's default;
- ``dart-grpc``: ``dart-context`` with the tree search served by
  ``ngram_service`` in its own process over gRPC on loopback (the deployment's
  path);
- ``dense-autoregressive``: autoregressive decoding of the same model with
  its weights de-quantised to float32 (when the run's target is GGUF-native;
  its agreement column is how often the 4-bit target's greedy output equals
  the float32 one);
- ``stock-autoregressive``, ``stock-dart-context``: ``autoregressive`` and
  ``dart-context`` with the target's forward run by transformers' modules
  instead of :class:`~dart_core.model.decoder.LlamaDecoder` (the same values bit for
  bit, so the rows differ in speed only); skipped where the target has no decoder;
- ``llama-cpp``, ``llama-cpp-lookup``: llama.cpp (``llama-cpp-python``,
  installed separately) on the same GGUF file and prompt token ids, plain
  decoding and its prompt-lookup decoding; skipped, with the reason printed,
  where the package is missing or the model is not a GGUF.

Protocol: one untimed warm-up generation per method (with ``--cuda-graphs``,
every generation of a pass once, untimed: a graph is captured the first time
its shape is met, once in a server's life, so the timed passes measure
replays), then ``repeats`` passes;
within a pass every prompt is decoded by every method back to back, the
method order rotating from prompt to prompt (so drift in machine speed falls
on all methods alike).  Per (dataset, method): tokens/s = generated tokens ÷
wall seconds of the pass, reported as the median over passes; speedup = the
median over passes of tokens/s ÷ the autoregressive tokens/s of the same pass;
τ = tokens emitted after prefill ÷ target forwards (bonus included); per-phase
milliseconds per target forward (draft, tree search, verify, whole step);
lossless = at T = 0, every prompt's tokens equal the autoregressive tokens;
agreement (T = 0) = how many prompts' outputs equal the autoregressive ones in
the first pass and the share of tokens before the first difference (the
half-precision figure, where bit-exact equality is not expected).
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dart_core.bench import bench_kernel_config, bench_switches
from dart_core.spec.speculative import SpeculativeConfig

__all__ = ["pass_ratios", "METHODS", "DEFAULT_METHODS", "LLAMA_CPP_METHODS", "DART_METHODS", "STOCK_METHODS", "DecodingConfig", "run_decoding", "hardware", "hardware_line", "markdown_table", "plot_speedup",
           "agreement"]

METHODS = ("autoregressive", "hf-generate", "hf-prompt-lookup", "dart-no-ngram", "dart", "dart-context", "dart-grpc",
           "dense-autoregressive", "llama-cpp", "llama-cpp-lookup", "stock-autoregressive", "stock-dart-context",
           "eagle3")
DEFAULT_METHODS = METHODS[:7]  # the comparison methods that need a second model are asked for by name
LLAMA_CPP_METHODS = ("llama-cpp", "llama-cpp-lookup")
DART_METHODS = ("dart-no-ngram", "dart", "dart-context", "dart-grpc")
STOCK_METHODS = ("stock-autoregressive", "stock-dart-context")  # the target's forward through transformers
_CONTEXT_METHODS = ("dart-context", "dart-grpc")  # the others search without the request's context (κ = 0)


@dataclass
class DecodingConfig:
    """Settings of one decoding-benchmark run (``python -m dart_core.bench --help``)."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    head: str | None = None  # None: the head shipped for the model
    trie: str = "auto"  # "auto": the default trie (built when missing), or a file
    datasets: list[str] = field(default_factory=lambda: ["mt-bench", "humaneval", "alpacaeval", "mt-bench-2"])
    num_prompts: int = 8  # per dataset
    max_new_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 3
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    budget: str = "auto"  # "auto" (adaptive, as served) or a fixed number of draft nodes
    prompt_lookup_num_tokens: int = 10
    context_weight: float | None = None  # κ of the context methods (default: SearchParams')
    grpc_timeout_ms: float = 1000.0
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    weights: str = "auto"  # the target's weights: "auto", "dense" or "gguf-native" (DartModel.from_pretrained)
    gguf_kernel: str = "auto"  # the GGUF-native layers' kernel: "auto" or one of dart_core.model.quant.KERNELS
    draft_weights: str = "auto"  # the draft head's linear layers: "auto" or one of dart_core.api.DRAFT_WEIGHTS
    device: str | None = None
    threads: int | None = None  # torch CPU threads (default: torch's)
    cuda_graphs: bool = False  # CUDA: verification and draft replayed as CUDA graphs over static KV caches
    seed: int = 0
    eagle3_head: str | None = None  # method eagle3: an EAGLE-3 head folder (published layout); None: the shipped one
    eagle3_total_tokens: int = 60  # method eagle3: tree nodes, root included (the reference's default)
    eagle3_depth: int = 7  # method eagle3: expansions after the first level (the reference's default)
    eagle3_top_k: int = 10  # method eagle3: children per node and frontier width (the reference's default)


@dataclass
class _Run:
    tokens: list[int]
    seconds: float
    emitted_after_prefill: int = 0
    sequence_steps: int = 0
    target_forwards: int = 0
    phase_ms: dict = field(default_factory=dict)


def _timed(engine, ids: list[int], sampling, *, speculative: bool = True) -> _Run:
    """One prompt through ``engine.generate``, timed, with its step counts and phases."""
    t0 = time.perf_counter()
    res = engine.generate([ids], sampling, speculative=speculative)
    return _Run(res.token_ids[0], time.perf_counter() - t0, res.emitted_after_prefill, res.sequence_steps,
                res.target_forwards, dict(res.phase_ms))


_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the ones that decide which kernels are fast


def pass_ratios(result: dict, dataset: str, method: str, baseline: str) -> list[float]:
    """Per timed pass of a decoding result, ``method``'s tokens/s ÷ ``baseline``'s in that pass (each
    pass's speed-ups share its autoregressive tokens/s, so their ratio is the methods' ratio).

    Raises:
        KeyError: ``result`` has no ``method`` or ``baseline`` row for ``dataset``."""
    rows = {r["method"]: r for r in result["rows"] if r["dataset"] == dataset}
    if method not in rows or baseline not in rows:
        raise KeyError(f"no {method} / {baseline} row for {dataset}")
    return [m / b for m, b in zip(rows[method]["speedup_per_pass"], rows[baseline]["speedup_per_pass"])]


def hardware(device: torch.device | str) -> dict:
    """What the figures were measured on, and when: CPU model, cores and the vector flags that
    matter (:data:`_CPU_FLAGS`), GPU name, torch version, threads, the date (UTC)."""
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == (platform.processor() or platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in _CPU_FLAGS if f in have]
                break
    except OSError:
        pass
    out = {"cpu": cpu, "cpu_count": os.cpu_count(), "cpu_flags": flags, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "switches": bench_switches()}
    if str(device).startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency
        pass
    return out


def hardware_line(hw: dict) -> str:
    """One line naming the hardware of :func:`hardware`'s dict (for reports)."""
    gpu = f", GPU {hw['gpu']}" if hw.get("gpu") else ", no GPU"
    flags = f", {' '.join(hw['cpu_flags'])}" if hw.get("cpu_flags") else ""
    return (f"{hw['cpu']} ({hw['cpu_count']} CPUs{flags}){gpu}; Python {hw['python']}, torch {hw['torch']} "
            f"({hw['threads']} threads), transformers {hw.get('transformers', '?')}")


class _GrpcServer:
    """``python -m ngram_service.server`` in its own process on a free loopback port."""

    def __init__(self, trie: str | None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "ngram_service.server", "--port", str(port)] + (["--trie", trie] if trie else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        for line in self.proc.stdout:  # the server prints "serving on host:port" once it listens
            if line.startswith("serving on"):
                break
            if time.monotonic() > deadline:
                break
        if self.proc.poll() is not None:
            raise RuntimeError(f"the n-gram server did not start ({' '.join(cmd)})")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def eagle3_engine(engine, head: str | None, *, total_tokens: int, depth: int, top_k: int,
                  draft_weights: str = "auto"):
    """A :class:`~dart_core.step.engine.DartEngine` on ``engine``'s target that drafts with the
    EAGLE-3 head ``head`` (None or ``"auto"``: the shipped one; :func:`dart_core.api.eagle3_drafter`
    with ``total_tokens`` nodes, ``depth`` levels, ``top_k`` children), with its own adaptive budget
    on ``engine``'s verification cost curve and lookup preference when ``engine`` has a budget (the
    budget then sizes each draft: :meth:`~dart_core.spec.eagle3.Eagle3Drafter.tree_size`), else a
    fixed tree of ``total_tokens`` nodes.  Both engines share one target, so one benchmark compares
    the drafters on equal terms.

    Raises:
        ValueError, HeadLoadError: as :func:`dart_core.api.eagle3_drafter`."""
    from dart_core.api import eagle3_drafter
    from dart_core.spec.budget import AdaptiveBudget
    from dart_core.step.engine import DartEngine

    drafter = eagle3_drafter(head, engine.target, draft_weights=draft_weights, total_tokens=total_tokens,
                             depth=depth, top_k=top_k)
    drafter.budget = (AdaptiveBudget(engine.budget.curve, lookup_preference=engine.budget.lookup_preference)
                      if engine.budget is not None else None)
    return DartEngine(engine.target, drafter=drafter, budget=drafter.budget)


class _Bench:
    def __init__(self, cfg: DecodingConfig) -> None:
        from dart_core.api import DartModel
        from dart_core.model.tokenizer import tokenizer_identity
        from ngram_service.client import InProcessTreeSearch

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        unknown = sorted(set(cfg.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
        self.cfg = cfg
        budget = cfg.budget if cfg.budget == "auto" else int(cfg.budget)
        trie = cfg.trie
        if trie == "auto" and any(m in ("dart", "dart-grpc") for m in cfg.methods):
            from ngram_service.build import ensure_default_trie

            trie = str(ensure_default_trie(None if cfg.model is None else cfg.model))
        self.trie_path = None if trie in (None, "none", "auto") else str(trie)
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        switches = bench_switches()
        self.model = DartModel.from_pretrained(
            cfg.model, head=cfg.head, trie=self.trie_path, dtype=dtype, weights=cfg.weights,
            gguf_kernel=cfg.gguf_kernel, draft_weights=cfg.draft_weights, device=cfg.device,
            speculative_config=SpeculativeConfig(budget=budget, cuda_graphs=cfg.cuda_graphs,
                                                 draft_graphs=switches["draft_graphs"]),
            kernel_config=bench_kernel_config())
        self.engine = self.model.engine
        self.skipped: dict[str, str] = {}  # method -> why it did not run
        self.dense = self.llama = self.llama_lookup = None
        if "dense-autoregressive" in cfg.methods:
            self._load_dense(cfg)
        if set(LLAMA_CPP_METHODS) & set(cfg.methods):
            self._load_llama_cpp(cfg)
        if set(STOCK_METHODS) & set(cfg.methods) and self.engine.target.decoder is None:
            for m in STOCK_METHODS:
                self.skipped[m] = "the target has no LlamaDecoder: its forward is transformers' already"
        # each row measures its method: the speculation gate (which would turn a losing
        # method into autoregressive steps, and is shared by the methods) stays off here;
        # the serving benchmark measures the served engine, gate included
        self.engine.gate = None
        self.eagle3 = self._load_eagle3(cfg) if "eagle3" in cfg.methods else None
        if self.engine.head is None and set(cfg.methods) & {*DART_METHODS, "stock-dart-context"}:
            raise ValueError("the DART methods need a draft head: pass --head (none ships for this model)")
        self.tokenizer = self.model.tokenizer
        self.hf = self.engine.target.model
        self.searchers = {"dart-no-ngram": InProcessTreeSearch(None), "dart": self.engine.tree_search,
                          "dart-context": self.engine.tree_search}
        params = self.engine.search_params
        if cfg.context_weight is not None:
            params = replace(params, context_weight=cfg.context_weight)
        self.params = {False: replace(params, context_weight=0.0), True: params}  # by "uses the context"
        self.grpc_server = None
        if "dart-grpc" in cfg.methods:
            from ngram_service.client import GrpcTreeSearch

            self.grpc_server = _GrpcServer(self.trie_path)
            self.searchers["dart-grpc"] = GrpcTreeSearch(
                self.grpc_server.address, timeout_ms=cfg.grpc_timeout_ms,
                vocab_hash=tokenizer_identity(self.tokenizer)[1])

    def _load_eagle3(self, cfg: DecodingConfig):
        """An engine on the same target drafting with the EAGLE-3 head ``cfg.eagle3_head``
        (:func:`eagle3_engine`): ``cfg.eagle3_total_tokens`` nodes when the run's budget is
        adaptive (the budget then sizes each draft), else the run's fixed budget; its linear layers
        as the run's ``draft_weights`` put the DART head's."""
        total = cfg.eagle3_total_tokens if cfg.budget == "auto" else int(cfg.budget) + 1
        return eagle3_engine(self.engine, cfg.eagle3_head, total_tokens=total, depth=cfg.eagle3_depth,
                             top_k=cfg.eagle3_top_k, draft_weights=cfg.draft_weights)

    def _load_dense(self, cfg: DecodingConfig) -> None:
        from dart_core.step.engine import DartEngine
        from dart_core.model.target import TargetModel

        if _weights(self.engine.target) == "dense":
            self.skipped["dense-autoregressive"] = "the run's target is already dense"
            return
        target = TargetModel.from_pretrained(cfg.model, device=self.engine.target.device, weights="dense")
        self.dense = DartEngine(target, None, self.engine.tree_search, search_params=self.engine.search_params)

    def _load_llama_cpp(self, cfg: DecodingConfig) -> None:
        from dart_core.model.tokenizer import resolve_model

        source = resolve_model(cfg.model)
        try:
            import llama_cpp
        except ImportError:
            why = "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)"
        else:
            why = None if source.gguf_file else f"{source.folder} holds no .gguf file"
        if why is not None:
            for m in LLAMA_CPP_METHODS:
                self.skipped[m] = why
            return
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        path = str(source.folder / source.gguf_file)
        threads = cfg.threads or torch.get_num_threads()
        common = dict(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False,
                      seed=cfg.seed)
        self.llama = llama_cpp.Llama(**common) if "llama-cpp" in cfg.methods else None
        if "llama-cpp-lookup" in cfg.methods:
            self.llama_lookup = llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(
                num_pred_tokens=cfg.prompt_lookup_num_tokens))

    def close(self) -> None:
        if self.grpc_server is not None:
            self.searchers["dart-grpc"].close()
            self.grpc_server.close()

    def run(self, method: str, ids: list[int], max_new_tokens: int, seed: int) -> _Run:
        if method in STOCK_METHODS:
            target = self.engine.target
            decoder, target.decoder = target.decoder, None
            try:
                return self.run(method.removeprefix("stock-"), ids, max_new_tokens, seed)
            finally:
                target.decoder = decoder
        cfg = self.cfg
        if method.startswith("hf-"):
            return self._run_hf(method, ids, max_new_tokens, seed)
        if method in LLAMA_CPP_METHODS:
            return self._run_llama_cpp(self.llama if method == "llama-cpp" else self.llama_lookup, ids,
                                       max_new_tokens, seed)
        if method == "dense-autoregressive":
            sampling = self.model.sampling_params(max_new_tokens=max_new_tokens, temperature=cfg.temperature,
                                                  seed=seed)
            return _timed(self.dense, ids, sampling, speculative=False)
        sampling = self.model.sampling_params(max_new_tokens=max_new_tokens, temperature=cfg.temperature, seed=seed)
        if method == "eagle3":
            return _timed(self.eagle3, ids, sampling)
        if method != "autoregressive":
            self.engine.tree_search = self.searchers[method]
            self.engine.search_params = self.params[method in _CONTEXT_METHODS]
        return _timed(self.engine, ids, sampling, speculative=method != "autoregressive")

    def _run_llama_cpp(self, llm, ids: list[int], max_new_tokens: int, seed: int) -> _Run:
        """llama.cpp on the same prompt ids: greedy at T = 0 (else its sampler at the run's
        temperature, top-k and top-p off), stopping after EOS like the engine; a fresh prefill each
        time (its KV cache is reset, so a repeated prompt is not served from the cache)."""
        temperature = self.cfg.temperature
        eos = llm.token_eos()
        llm.reset()
        llm.set_seed(seed)
        out: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, temp=temperature, top_k=0 if temperature > 0 else 1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True):
            out.append(int(tok))  # the end-of-sequence token counts, as in the engine's output
            if tok == eos or len(out) >= max_new_tokens:
                break
        return _Run(out, time.perf_counter() - t0)

    def _run_hf(self, method: str, ids: list[int], max_new_tokens: int, seed: int) -> _Run:
        cfg = self.cfg
        device = self.engine.target.device
        x = torch.tensor([ids], device=device)
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
                      pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                      attention_mask=torch.ones_like(x))
        if cfg.temperature > 0:
            torch.manual_seed(seed)
            kwargs |= dict(do_sample=True, temperature=cfg.temperature, top_p=1.0, top_k=0)
        else:
            kwargs |= dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if method == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = cfg.prompt_lookup_num_tokens
        from dart_core.model.device import sync_device

        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(x, **kwargs)
        sync_device(device)
        seconds = time.perf_counter() - t0
        return _Run(out[0, len(ids):].tolist(), seconds)


def run_decoding(cfg: DecodingConfig, *, progress: bool = True) -> dict:
    """Runs the benchmark; returns the results (see :func:`markdown_table` for the table).

    Returns:
        ``{"config", "hardware", "device", "dtype", "rows": [per (dataset, method)],
        "prompts": {dataset: n}, "seconds"}``.

    Raises:
        ValueError: unknown method, or DART methods without a draft head.
        FileNotFoundError: a dataset is not installed / a file is missing.
    """
    from tqdm import tqdm

    started = time.perf_counter()
    bench = _Bench(cfg)
    try:
        prompts = {name: _encoded_prompts(bench, name, cfg.num_prompts) for name in cfg.datasets}
        for m, why in bench.skipped.items():
            print(f"skipping {m}: {why}", file=sys.stderr)
        methods = [m for m in cfg.methods if m not in bench.skipped]
        if "autoregressive" not in methods:
            methods.insert(0, "autoregressive")  # every speedup needs it
        first = next(iter(prompts.values()))[0]
        for m in methods:  # warm-up: kernels, allocator, the gRPC channel
            bench.run(m, first, min(16, cfg.max_new_tokens), cfg.seed)
        if cfg.cuda_graphs:  # and every generation once, untimed: its graphs captured (module docstring)
            for plist in prompts.values():
                for i, ids in enumerate(plist):
                    for m in methods:
                        bench.run(m, ids, cfg.max_new_tokens, cfg.seed + i)
        runs: dict[tuple[str, str], list[list[_Run]]] = {(d, m): [] for d in prompts for m in methods}
        total = cfg.repeats * sum(len(p) for p in prompts.values()) * len(methods)
        bar = tqdm(total=total, desc="decoding benchmark", unit="gen", disable=not progress)
        for rep in range(cfg.repeats):
            for dname, plist in prompts.items():
                per = {m: [] for m in methods}
                for i, ids in enumerate(plist):
                    shift = (rep + i) % len(methods)
                    for m in methods[shift:] + methods[:shift]:
                        per[m].append(bench.run(m, ids, cfg.max_new_tokens, cfg.seed + i))
                        bar.update()
                for m in methods:
                    runs[(dname, m)].append(per[m])
        bar.close()
        fallbacks = bench.searchers["dart-grpc"].fallbacks if "dart-grpc" in bench.searchers else 0
        rows = _aggregate(runs, prompts, methods, cfg, fallbacks)
    finally:
        bench.close()
    target = bench.engine.target
    return {"config": asdict(cfg), "hardware": hardware(target.device), "device": str(target.device),
            "dtype": str(target.dtype).replace("torch.", ""), "trie": bench.trie_path,
            "weights": _weights(target), "skipped": bench.skipped,
            "prompts": {d: len(p) for d, p in prompts.items()}, "rows": rows,
            "seconds": round(time.perf_counter() - started, 1)}


def _weights(target) -> str:
    """The target's weight format, for the report: "gguf-native (210× Q4_1, 1× Q8_0; qmm kernel)" (the
    GGUF block types and :attr:`~dart_core.model.quant.Int4Linear.kernel`) or "dense"."""
    from dart_core.model.quant import Int4Linear

    layers = [m for m in target.model.modules() if isinstance(m, Int4Linear)]
    if not layers:
        return "dense"
    kinds = [m.gguf_type for m in layers]
    kernels = "+".join(sorted({m.kernel for m in layers}))
    return "gguf-native (" + ", ".join(f"{kinds.count(k)}× {k}" for k in sorted(set(kinds))) + f"; {kernels} kernel)"


def _encoded_prompts(bench: _Bench, name: str, limit: int) -> list[list[int]]:
    """A set's prompts as token ids; a second-turn set's after the target's own first answers
    (greedy, autoregressive, at most ``FIRST_ANSWER_TOKENS``)."""
    from dart_core.bench.datasets import (FIRST_ANSWER_TOKENS, SECOND_TURN_SETS, load_prompts, load_second_turns,
                                          second_turn_messages)

    if name not in SECOND_TURN_SETS:
        return [bench.model.encode([{"role": "user", "content": t}]) for t in load_prompts(name, limit)]
    out = []
    sampling = bench.model.sampling_params(max_new_tokens=FIRST_ANSWER_TOKENS, temperature=0.0)
    for first, second in load_second_turns(name, limit):
        res = bench.engine.generate([bench.model.encode([{"role": "user", "content": first}])], sampling,
                                    speculative=False)
        answer = bench.tokenizer.decode(res.token_ids[0], skip_special_tokens=True).strip()
        out.append(bench.model.encode(second_turn_messages(first, answer, second)))
    return out


def _aggregate(runs, prompts, methods, cfg: DecodingConfig, grpc_fallbacks: int) -> list[dict]:
    rows = []
    for dname in prompts:
        ar_passes = runs[(dname, "autoregressive")]
        ar_tps = [sum(len(r.tokens) for r in p) / sum(r.seconds for r in p) for p in ar_passes]
        for m in methods:
            passes = runs[(dname, m)]
            tps = [sum(len(r.tokens) for r in p) / sum(r.seconds for r in p) for p in passes]
            flat = [r for p in passes for r in p]
            row = {"dataset": dname, "method": m, "prompts": len(prompts[dname]),
                   "tokens": sum(len(r.tokens) for r in passes[0]),
                   "tokens_per_s": round(statistics.median(tps), 2),
                   "speedup": round(statistics.median(t / a for t, a in zip(tps, ar_tps)), 3),
                   "speedup_per_pass": [round(t / a, 3) for t, a in zip(tps, ar_tps)],
                   "tau": None, "ms_per_step": None, "lossless": None}
            if not m.startswith(("hf-", "llama-cpp")):
                steps = sum(r.sequence_steps for r in flat)
                fwd = sum(r.target_forwards for r in flat)
                row["tau"] = round(sum(r.emitted_after_prefill for r in flat) / max(steps, 1), 3)
                row["ms_per_step"] = {k: round(sum(r.phase_ms.get(k, 0.0) for r in flat) / max(fwd, 1), 2)
                                      for k in ("draft", "tree_search", "verify", "total")}
            if cfg.temperature == 0:
                row["lossless"] = all(r.tokens == a.tokens for p, ap in zip(passes, ar_passes) for r, a in zip(p, ap))
                row["agreement"] = agreement([r.tokens for r in passes[0]], [a.tokens for a in ar_passes[0]])
            if m == "dart-grpc":
                row["grpc_fallbacks"] = grpc_fallbacks
            rows.append(row)
    return rows


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How far greedy outputs agree with the reference (autoregressive) ones, prompt by prompt.

    Args:
        outputs, reference: one token list per prompt, in the same order.

    Returns:
        ``{"prompts_equal": k, "prompts": n, "prefix": f}``: k of the n outputs equal their
        reference token for token; f is the fraction of reference tokens (all prompts together)
        that come before each output's first difference, 1.0 when every output is equal.  In
        float32 DART is lossless (k = n); in half precision a near-tie can resolve the other way
        and the continuations part (docs/engine.md, "Lossless").
    """
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} references")
    same = total = 0
    for out, ref in zip(outputs, reference):
        k = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        same += len(ref) if out == ref else k
        total += len(ref)
    return {"prompts_equal": sum(o == r for o, r in zip(outputs, reference)), "prompts": len(reference),
            "prefix": round(same / total, 4) if total else 1.0}


def _fmt(x, spec: str = "") -> str:
    return "–" if x is None else format(x, spec)


def markdown_table(result: dict) -> str:
    """The results as a Markdown table (one row per dataset and method)."""
    cfg = result["config"]
    weights = result.get("weights", "dense")
    lines = [f"T = {cfg['temperature']}, {cfg['max_new_tokens']} new tokens, batch 1, budget {cfg['budget']}, "
             f"{result['device']} {result['dtype']}" + ("" if weights == "dense" else f", weights {weights}")
             + f", median of {cfg['repeats']} passes", ""]
    skipped = [f"Skipped {m}: {why}." for m, why in result.get("skipped", {}).items()]
    lines += skipped + ([""] if skipped else [])
    lines += ["| dataset | method | τ | tokens/s | speedup | draft ms | tree ms | verify ms | step ms | lossless |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in result["rows"]:
        ms = r["ms_per_step"] or {}
        lossless = "n/a (T > 0)" if r["lossless"] is None else ("yes" if r["lossless"] else "**NO**")
        agree = r.get("agreement")
        if r["lossless"] is False and agree:
            lossless += f" ({agree['prompts_equal']}/{agree['prompts']} equal, {100 * agree['prefix']:.0f} % before a difference)"
        name = r["method"] + (f" ({r['grpc_fallbacks']} fallbacks)" if r.get("grpc_fallbacks") else "")
        lines.append(f"| {r['dataset']} ({r['prompts']}) | {name} | {_fmt(r['tau'], '.2f')} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {_fmt(ms.get('draft'), '.1f')} | "
                     f"{_fmt(ms.get('tree_search'), '.1f')} | {_fmt(ms.get('verify'), '.1f')} | "
                     f"{_fmt(ms.get('total'), '.1f')} | {lossless} |")
    return "\n".join(lines) + "\n"


def plot_speedup(result: dict, path: str | Path) -> None:
    """Bar chart of speedup vs autoregressive, grouped by dataset, one bar per method (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(datasets) * len(methods) / 3, 4))
    for j, m in enumerate(methods):
        ys = [next((r["speedup"] for r in rows if r["dataset"] == d and r["method"] == m), 0.0) for d in datasets]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        bars = ax.bar(xs, ys, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("speedup vs autoregressive (×)")
    hw = result["hardware"].get("gpu") or re.sub(r"\s+", " ", result["hardware"]["cpu"])
    cfg = result["config"]
    ax.set_title(f"Decoding speedup, batch 1, T = {cfg['temperature']}, {cfg['max_new_tokens']} tokens\n{hw}",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: dict, out_dir: str | Path, stem: str = "decoding") -> dict[str, Path | None]:
    """Writes ``<stem>.json`` and ``<stem>.md``, then ``<stem>.png`` (None without matplotlib) into ``out_dir``."""
    from dart_core.bench import save_plot

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["md"].write_text(markdown_table(result))
    paths["png"] = save_plot(plot_speedup, out / f"{stem}.png", result)
    return paths
