"""One decoding step, profiled: ``python -m dart_core.bench.step_profile``.

How far a decoding step is from the physical limit of the device.  A batch-1
step of a small target reads every weight once, so its floor is

    floor ms = bytes of the target's weights ÷ memory bandwidth,

with the bandwidth measured in the same run (a device-to-device copy of
``--copy-mib`` MiB, bytes read + written ÷ time, median of 5).  For each mode
(``autoregressive``: one token per target forward; ``dart``: the engine's
speculative step — draft forward, tree search, tree verification;
``gated-off``: the speculative engine with a gate that never speculates, so
every step is autoregressive but keeps the draft head's inputs, as while
the speculation gate keeps speculation off) the
first ``--num-prompts`` prompts are decoded after a warm-up ``--repeats`` times
timed, the modes alternating prompt group by prompt group in an order rotated
every repeat (so a machine whose speed drifts slows every mode alike): the
step is the median over repeats of decoding ms per target forward, prefills
left out (they are reported apart, per prompt: a speculative engine also
folds each prompt's draft-head inputs into the head's KV cache there), and
each mode's ratio to autoregressive decoding is the median of the ratios of
the same repeat.  Then once more under ``torch.profiler`` (device-kernel ms per target forward and kernel launches
per target forward).  Wall ms far above kernel ms means the step waits on the
host (Python, kernel launches); kernel ms far above the floor means the
kernels themselves are slow (small matrices, many launches).  ``--top-ops N``
adds, per mode, the N operators of that profiled pass with the most self
host time and (on CUDA) the N kernels with the most device time, in ms per
target forward: where a step's time goes when one phase is unexpectedly slow
(on a CPU the profiled pass then runs too, host time only).  ``--top-python N``
adds the N Python functions with the most self time, from one more pass under
``cProfile``: the host time that no operator accounts for.  On a CPU there
are no device kernels: kernel figures are reported as absent and the floor
uses the measured memory-copy bandwidth of the host.

A third, instrumented pass gives the host's share of a step, per typical step
(catch-up drafts after a new prompt left out): **host reads** of tensors
(:mod:`dart_core.bench.host_reads`; each one a sync on a GPU), **operators
dispatched**, and **host-only
ms** = the step minus its target forward, draft and tree search (the forward
timed with a sync before and after, so on a GPU this pass is slower than the
timed one); a fourth pass counts the operators dispatched (every ATen call,
through a dispatch mode).  ``--batch-size B`` decodes the prompts B at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["StepProfileConfig", "run_step_profile", "measure_bandwidth", "weight_bytes", "save", "markdown_table", "main"]

MODES = ("autoregressive", "dart", "gated-off")


class _GateOff:
    """A speculation gate that never lets a step speculate: the ``gated-off`` mode's steps are
    autoregressive steps taken by a speculative engine (what a step costs while the gate keeps
    speculation off, draft bookkeeping included)."""

    def speculate(self, batch: int) -> bool:
        return False

    def observe(self, *args, **kwargs) -> None:
        pass


@dataclass
class StepProfileConfig:
    """Settings of one step-profile run (``python -m dart_core.bench.step_profile --help``)."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    head: str | None = None  # None: the head shipped for the model
    trie: str = "auto"  # "auto" (the default trie), a file, or "none"
    dataset: str = "mt-bench"
    num_prompts: int = 4
    max_new_tokens: int = 64
    budget: str = "auto"
    modes: list[str] = field(default_factory=lambda: ["autoregressive", "dart"])  # or any of MODES
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    weights: str = "auto"  # the target's weights: "auto", "dense" or "gguf-native"
    gguf_kernel: str = "auto"  # the GGUF-native layers' kernel: "auto" or one of dart_core.model.quant.KERNELS
    draft_weights: str = "auto"  # the draft head's linear layers: "auto" or one of dart_core.api.DRAFT_WEIGHTS
    device: str | None = None
    threads: int | None = None
    cuda_graphs: bool = False  # CUDA: verification and draft replayed as CUDA graphs over static KV caches
    copy_mib: int = 1024
    top_ops: int = 0  # per mode, the operators (and CUDA kernels) taking the most time: 0 = none
    top_python: int = 0  # per mode, the Python functions taking the most self time (cProfile): 0 = none
    batch_size: int = 1  # prompts decoded together
    repeats: int = 3  # timed passes over the prompts, the modes alternating within each


def measure_bandwidth(device, mib: int = 1024, repeats: int = 5) -> float:
    """Memory bandwidth of ``device`` in GB/s: a copy of ``mib`` MiB, (read + written bytes) ÷ time,
    median of ``repeats`` after one warm-up."""
    import torch

    from dart_core.step.engine import _sync

    n = (mib << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / statistics.median(times) / 1e9


def weights_format(module) -> str:
    """What the linear layers' weights are, for the report: the GGUF block types and kernel of 4-bit
    layers (:class:`~dart_core.model.quant.Int4Linear`, e.g. ``"4-bit GGUF Q4_1+Q8_0, qmm kernel"``), else the
    parameters' dtype."""
    from dart_core.model.quant import Int4Linear

    layers = [m for m in module.modules() if isinstance(m, Int4Linear)]
    if layers:
        types = sorted({t for m in layers if m.gguf_type for t in m.gguf_type.split("+")})
        kernels = "+".join(sorted({m.kernel for m in layers}))
        return " ".join(["4-bit"] + (["GGUF", "+".join(types)] if types else [])) + f", {kernels} kernel"
    return str(next(module.parameters()).dtype).replace("torch.", "")


def weight_bytes(module) -> int:
    """Bytes of weights one forward of ``module`` (a Hugging Face causal LM) reads: its parameters,
    shared ones once, plus the weights of packed CPU linears (:class:`~dart_core.model.rows.PackedLinear`
    and :class:`~dart_core.model.quant.Int4Linear`, which are not parameters), less the input embedding, which a forward only gathers rows of,
    unless that same tensor is the output projection (tied and not packed)."""
    import torch

    from dart_core.model.quant import Int4Linear
    from dart_core.model.rows import PackedLinear

    seen, total = set(), 0
    for t in module.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    total += sum(m.in_features * m.out_features * 4 for m in module.modules() if isinstance(m, PackedLinear))
    total += sum(b.numel() * b.element_size() for m in module.modules() if isinstance(m, Int4Linear)
                 for b in m.buffers(recurse=False))  # 4-bit codes, scales and zeros
    if hasattr(module, "get_input_embeddings"):
        emb = module.get_input_embeddings().weight
        out = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if not (type(out) is torch.nn.Linear and out.weight is emb):
            total -= emb.numel() * emb.element_size()
    return total


def _kernel_stats(prof) -> tuple[float, int]:
    """(device-kernel ms, kernel count) of a finished ``torch.profiler`` run."""
    import torch

    ms, count = 0.0, 0
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        self_us = getattr(evt, "self_device_time_total", None)
        if self_us is None:
            self_us = getattr(evt, "self_cuda_time_total", 0.0)
        ms += self_us / 1000.0
        count += evt.count
    return ms, count


def _op_times(prof, forwards: int) -> dict[str, list[dict]]:
    """Every host operator's self CPU time and every CUDA kernel's device time of a finished
    ``torch.profiler`` run, in ms and calls per target forward:
    ``{"host": [{"op", "self_ms", "calls"}, ...], "device": [...]}`` (``device`` empty on a CPU)."""
    import torch

    per = max(forwards, 1)
    rows = {"host": [], "device": []}
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            us = getattr(evt, "self_device_time_total", None)
            kind, us = "device", us if us is not None else getattr(evt, "self_cuda_time_total", 0.0)
        else:
            kind, us = "host", evt.self_cpu_time_total
        rows[kind].append({"op": evt.key, "self_ms": round(us / 1000.0 / per, 4), "calls": round(evt.count / per, 2)})
    return rows


def _python_times(run, n: int) -> list[dict]:
    """The ``n`` Python functions (and C builtins) with the most self time over ``run()`` (a list
    of generation results) under ``cProfile``, in ms and calls per target forward, largest first:
    ``[{"function", "self_ms", "cum_ms", "calls"}, ...]``.  cProfile slows every Python call, so
    compare the figures across modes of one run, not with the timed pass."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        outs = run()
    finally:
        profiler.disable()
    per = max(sum(o.result.target_forwards for o in outs), 1)
    rows = []
    for (file, line, name), (_, calls, self_s, cum_s, _) in pstats.Stats(profiler).stats.items():
        where = name if file == "~" else f"{name} ({Path(file).name}:{line})"
        rows.append({"function": where, "self_ms": round(self_s * 1e3 / per, 4), "cum_ms": round(cum_s * 1e3 / per, 4),
                     "calls": round(calls / per, 2)})
    return sorted(rows, key=lambda r: -r["self_ms"])[:n]


def _merge_top_ops(per_prompt: list[dict], n: int) -> dict[str, list[dict]]:
    """The prompts' operator lists (:func:`_op_times`, each per target forward of its prompt)
    averaged over the prompts, the ``n`` largest of each kind kept, largest first."""
    merged, prompts = {}, max(len(per_prompt), 1)
    for kind in ("host", "device"):
        acc: dict[str, list[float]] = {}
        for lists in per_prompt:
            for r in lists[kind]:
                a = acc.setdefault(r["op"], [0.0, 0.0])
                a[0] += r["self_ms"]
                a[1] += r["calls"]
        rows = [{"op": op, "self_ms": round(ms / prompts, 4), "calls": round(c / prompts, 2)}
                for op, (ms, c) in acc.items()]
        merged[kind] = sorted(rows, key=lambda r: -r["self_ms"])[:n]
    return merged


def _instrumented(engine, run) -> dict:
    """Per typical step (not a catch-up) of ``run()``: the mean host reads and host-only ms (the
    engine's steps counted and its target forwards timed), then, in a second ``run()``, the mean
    operators dispatched (counted apart, so that counting them costs the first figures nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dart_core.bench.host_reads import count_host_reads
    from dart_core.step.engine import _sync

    device = engine.target.device
    target_forward, step = engine.target.forward, engine._step
    reads, host_ms, ops = [], [], []
    forward_ms = [0.0]

    class _CountOps(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _CountOps.n += 1
            return func(*args, **(kwargs or {}))

    def timed_forward(*args, **kwargs):
        _sync(device)
        t0 = time.perf_counter()
        out = target_forward(*args, **kwargs)
        _sync(device)
        forward_ms[0] += 1e3 * (time.perf_counter() - t0)
        return out

    def counted_step(state, speculative):
        forward_ms[0] = 0.0
        with count_host_reads() as counts:
            out = step(state, speculative)
        if not out.catch_up:
            reads.append(sum(counts.values()))
            host_ms.append(out.step_ms - forward_ms[0] - out.draft_ms - out.tree_search_ms)
        return out

    def ops_step(state, speculative):
        _CountOps.n = 0
        with _CountOps():
            out = step(state, speculative)
        if not out.catch_up:
            ops.append(_CountOps.n)
        return out

    try:
        engine.target.forward, engine._step = timed_forward, counted_step
        run()
        engine.target.forward, engine._step = target_forward, ops_step
        run()
    finally:
        engine.target.forward, engine._step = target_forward, step

    def mean(xs, nd):
        return round(sum(xs) / len(xs), nd) if xs else None

    return {"host_reads_per_step": mean(reads, 2), "host_only_ms_per_step": mean(host_ms, 3),
            "ops_per_step": mean(ops, 1)}


def run_step_profile(cfg: StepProfileConfig, *, progress: bool = True) -> dict:
    """Loads the model, measures the bandwidth and each mode's step; returns
    ``{"config", "hardware", "weights_bytes", "bandwidth_gbs", "floor_ms", "rows", "seconds"}``.

    Raises:
        ValueError: an unknown mode or a bad budget.
        FileNotFoundError: the model, head, trie or prompt file cannot be found.
    """
    import torch
    from tqdm import tqdm

    from dart_core.api import DartModel
    from dart_core.bench import bench_kernel_config, bench_switches
    from dart_core.spec.speculative import SpeculativeConfig
    from dart_core.bench.datasets import load_prompts
    from dart_core.bench.decoding import hardware
    from dart_core.step.engine import _sync

    if not cfg.modes or set(cfg.modes) - set(MODES):
        raise ValueError(f"modes must be among {', '.join(MODES)}")
    if cfg.top_ops < 0 or cfg.top_python < 0:
        raise ValueError(f"top_ops and top_python must be 0 or more, got {cfg.top_ops}, {cfg.top_python}")
    if cfg.batch_size < 1 or cfg.repeats < 1:
        raise ValueError(f"batch_size and repeats must be 1 or more, got {cfg.batch_size}, {cfg.repeats}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    trie = None if cfg.trie in (None, "none") else cfg.trie
    if trie == "auto":
        from ngram_service.build import ensure_default_trie

        trie = str(ensure_default_trie(cfg.model, progress=progress))
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    budget = cfg.budget if cfg.budget == "auto" else int(cfg.budget)
    model = DartModel.from_pretrained(
        cfg.model, head=cfg.head, trie=trie, dtype=dtype, weights=cfg.weights, gguf_kernel=cfg.gguf_kernel,
        draft_weights=cfg.draft_weights, device=cfg.device,
        speculative_config=SpeculativeConfig(budget=budget, cuda_graphs=cfg.cuda_graphs,
                                             draft_graphs=bench_switches()["draft_graphs"]),
        kernel_config=bench_kernel_config())
    device = model.engine.target.device
    weights = weight_bytes(model.engine.target.model)
    bandwidth = measure_bandwidth(device, cfg.copy_mib)
    floor_ms = weights / (bandwidth * 1e9) * 1e3
    prompts = load_prompts(cfg.dataset, cfg.num_prompts)
    profile_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if profile_cuda else [])
    rows = []
    groups = [prompts[i: i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    bar = tqdm(total=len(cfg.modes) * len(groups) * cfg.repeats, desc="step profile", disable=not progress)
    gate = model.engine.gate

    def decode(mode, group):
        model.engine.gate = _GateOff() if mode == "gated-off" else gate
        return model.generate([[{"role": "user", "content": p}] for p in group],
                              max_new_tokens=cfg.max_new_tokens, speculative=mode != "autoregressive")

    for mode in cfg.modes:
        decode(mode, groups[0])  # warm-up: allocator, kernels' first launches
    # the timed passes: the modes alternate, prompt group by prompt group, in an order rotated every
    # repeat, so that a machine whose speed drifts slows every mode alike
    timed = {m: [] for m in cfg.modes}  # per mode: (prompt group, repeat) -> the decode's figures
    for rep in range(cfg.repeats):
        order = cfg.modes[rep % len(cfg.modes):] + cfg.modes[:rep % len(cfg.modes)]
        for group in groups:
            for mode in order:
                _sync(device)
                t0 = time.perf_counter()
                stats = decode(mode, group).result
                _sync(device)
                timed[mode].append((rep, time.perf_counter() - t0, stats))
                bar.update(1)
    for mode in cfg.modes:
        wall_s, forwards, emitted, seq_steps, phases = 0.0, 0, 0, 0, {}
        per_repeat = {}  # repeat -> [decode ms without the prefills, target forwards]
        for rep, wall, stats in timed[mode]:
            wall_s += wall
            forwards += stats.target_forwards
            emitted += stats.emitted_after_prefill
            seq_steps += stats.sequence_steps
            for k, v in stats.phase_ms.items():
                phases[k] = phases.get(k, 0.0) + v
            acc = per_repeat.setdefault(rep, [0.0, 0])
            acc[0] += stats.phase_ms["total"] - stats.phase_ms["prefill"]
            acc[1] += stats.target_forwards
        kernel_ms, kernels, prof_forwards = 0.0, 0, 0
        ops = []  # (profiler run, its target forwards) for --top-ops
        if profile_cuda or cfg.top_ops:
            for group in groups:
                with torch.profiler.profile(activities=activities) as prof:
                    again = decode(mode, group)
                    _sync(device)
                ms, n = _kernel_stats(prof)
                kernel_ms += ms
                kernels += n
                prof_forwards += again.result.target_forwards
                if cfg.top_ops:
                    ops.append((prof, again.result.target_forwards))
        host = _instrumented(model.engine, lambda: [decode(mode, g) for g in groups])
        python = (_python_times(lambda: [decode(mode, g) for g in groups], cfg.top_python)
                  if cfg.top_python else None)
        fwd = max(forwards, 1)
        # a step: the median over repeats of decoding ms per target forward, the prefills left out
        step_ms = statistics.median(ms / max(n, 1) for ms, n in per_repeat.values())
        row = {"mode": mode, "target_forwards": forwards, "tokens": emitted,
               "tau": round(emitted / max(seq_steps, 1), 3),  # per sequence and step, bonus included
               "tokens_per_s": round(emitted / max(wall_s, 1e-9), 1),
               "step_ms": round(step_ms, 3),
               "step_ms_per_repeat": [round(ms / max(n, 1), 3) for ms, n in per_repeat.values()],
               "prefill_ms_per_prompt": round(phases.get("prefill", 0.0) / (len(prompts) * cfg.repeats), 2),
               # per decoding step: a prefill's ms count in the engine's "verify" and "total", not here
               "phase_ms_per_step": {k: round((v - (phases.get("prefill", 0.0) if k in ("verify", "total") else 0.0))
                                              / fwd, 3) for k, v in phases.items() if k != "prefill"},
               "kernel_ms_per_step": round(kernel_ms / max(prof_forwards, 1), 3) if profile_cuda else None,
               "kernels_per_step": round(kernels / max(prof_forwards, 1), 1) if profile_cuda else None,
               "step_over_floor": round(step_ms / floor_ms, 1), **host}
        if cfg.top_ops:
            row["top_ops"] = _merge_top_ops([_op_times(p, f) for p, f in ops], cfg.top_ops)
        if python is not None:
            row["top_python"] = python
        if profile_cuda:
            row["kernel_over_floor"] = round(row["kernel_ms_per_step"] / floor_ms, 1)
            row["host_share"] = round(1 - min(row["kernel_ms_per_step"] / max(step_ms, 1e-9), 1.0), 3)
        rows.append(row)
    model.engine.gate = gate
    bar.close()
    return {"config": asdict(cfg), "hardware": hardware(device), "weights_bytes": weights,
            "weights_dtype": weights_format(model.engine.target.model),
            "bandwidth_gbs": round(bandwidth, 1), "floor_ms": round(floor_ms, 4), "rows": rows,
            "seconds": round(time.perf_counter() - started, 1)}


def step_ratio(row: dict, plain: dict | None) -> float | None:
    """A mode's step ÷ the autoregressive step: the median of the ratios of the same repeat (the
    modes alternate within a repeat), or of the medians where a row has no per-repeat figures."""
    if plain is None:
        return None
    mine, theirs = row.get("step_ms_per_repeat"), plain.get("step_ms_per_repeat")
    if mine and theirs and len(mine) == len(theirs):
        return statistics.median(a / b for a, b in zip(mine, theirs))
    return row["step_ms"] / plain["step_ms"]


def markdown_table(result: dict) -> str:
    """The rows as a Markdown table, with the floor above it: per mode the step's wall ms (and its
    ratio to the autoregressive row's, when that mode ran: a gated-off step should cost what an
    autoregressive one does) and the engine's phases per target forward (draft, tree search,
    verify: the target forward, acceptance and KV compaction)."""
    from dart_core.bench.decoding import hardware_line

    head = (f"{hardware_line(result['hardware'])}. Target weights {result['weights_bytes'] / 1e6:.1f} MB "
            f"({result['weights_dtype']}), measured bandwidth {result['bandwidth_gbs']:.0f} GB/s: "
            f"floor {result['floor_ms']:.3f} ms per target forward.\n\n")
    lines = ["| mode | τ | tokens/s | step ms | step ÷ autoregressive | prefill ms/prompt | draft ms | tree ms | "
             "verify ms | kernel ms | kernels/step | host share | step ÷ floor | host reads/step | ops/step | "
             "host-only ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = next((r for r in result["rows"] if r["mode"] == "autoregressive"), None)
    for r in result["rows"]:
        def f(v, spec):
            return "—" if v is None else format(v, spec)
        phase = r.get("phase_ms_per_step", {})
        lines.append(f"| {r['mode']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
                     f"{f(step_ratio(r, plain), '.3f')} | {f(r.get('prefill_ms_per_prompt'), '.1f')} | "
                     f"{f(phase.get('draft'), '.2f')} | "
                     f"{f(phase.get('tree_search'), '.2f')} | {f(phase.get('verify'), '.2f')} | "
                     f"{f(r['kernel_ms_per_step'], '.2f')} | {f(r['kernels_per_step'], '.0f')} | "
                     f"{f(r.get('host_share'), '.0%')} | {r['step_over_floor']:.0f}× | "
                     f"{f(r.get('host_reads_per_step'), '.1f')} | {f(r.get('ops_per_step'), '.0f')} | "
                     f"{f(r.get('host_only_ms_per_step'), '.2f')} |")
    text = head + "\n".join(lines) + "\n"
    for r in result["rows"]:
        for kind, what in (("host", "operators by self host ms"), ("device", "CUDA kernels by device ms")):
            top = r.get("top_ops", {}).get(kind)
            if top:
                text += (f"\n{r['mode']}: {what} per target forward\n\n| op | ms | calls |\n|---|---|---|\n"
                         + "".join(f"| `{o['op'][:80]}` | {o['self_ms']:.3f} | {o['calls']:g} |\n" for o in top))
        if r.get("top_python"):
            text += (f"\n{r['mode']}: Python functions by self ms per target forward (under cProfile)\n\n"
                     "| function | self ms | cumulative ms | calls |\n|---|---|---|---|\n"
                     + "".join(f"| `{o['function'][:80]}` | {o['self_ms']:.3f} | {o['cum_ms']:.3f} | {o['calls']:g} |\n"
                               for o in r["top_python"]))
    return text


def save(result: dict, out: str | Path) -> dict:
    """Writes ``step_profile.json`` and ``step_profile.md`` under ``out``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "step_profile.json", "md": out / "step_profile.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["md"].write_text(markdown_table(result))
    return paths


def main(argv=None) -> int:
    from dart_core.bench import add_engine_arguments, run_cli

    d = StepProfileConfig()
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.step_profile", description=__doc__.split("\n\n")[0])
    add_engine_arguments(ap, d)
    ap.add_argument("--dataset", default=d.dataset, help="mt-bench, humaneval, alpacaeval or a JSONL file")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--modes", nargs="+", default=d.modes, choices=MODES)
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts decoded together [1]")
    ap.add_argument("--repeats", type=int, default=d.repeats,
                    help="timed passes, the modes alternating prompt group by prompt group [3]")
    ap.add_argument("--copy-mib", type=int, default=d.copy_mib, help="size of the bandwidth copy [1024]")
    ap.add_argument("--top-ops", type=int, default=d.top_ops,
                    help="per mode, the N operators (and CUDA kernels) with the most time per target forward [0]")
    ap.add_argument("--top-python", type=int, default=d.top_python,
                    help="per mode, the N Python functions with the most self time per target forward, from one "
                         "more pass under cProfile [0]")
    ap.add_argument("--out", default="bench/results", help="folder for step_profile.json/.md")
    ap.add_argument("--no-progress", action="store_true")
    return run_cli(StepProfileConfig, ap.parse_args(argv), run_step_profile, save, markdown_table)


if __name__ == "__main__":
    raise SystemExit(main())
