"""Benchmarks: decoding (``python -m dart_core.bench``), serving over HTTP
(``python -m dart_core.bench.serving``), continuous batching without Ray
(``python -m dart_core.bench.batching``) and the results page that the first
two feed (``python -m dart_core.bench.report``).  See BENCHMARKS.md."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Mapping

from dart_core.model.kernel_config import KernelConfig

logger = logging.getLogger(__name__)

# The measurement switches, as benchmark command lines may set them (the GPU session scripts do):
# variable -> (field, value when the variable is unset).  The library reads no environment variable:
# these become a KernelConfig and SpeculativeConfig.draft_graphs here, at the benchmarks' entry
# points, and hardware() writes the result into every result file.
SWITCH_VARIABLES = {"DART_SDPA_BACKENDS": ("sdpa_backends", "auto"), "DART_GROUPED_QUERY": ("grouped_query", True),
                    "DART_STATIC_WINDOWS": ("static_windows", True),
                    "DART_KEEP_FREED_MEMORY": ("keep_freed_memory", True), "DART_DRAFT_GRAPHS": ("draft_graphs", True),
                    "DART_AMX": ("amx", True)}
_OFF = ("0", "off", "false", "no", "none")


def bench_switches(environ: Mapping[str, str] | None = None) -> dict:
    """The measurement switches a benchmark runs with: :data:`SWITCH_VARIABLES` read from ``environ``
    (default ``os.environ``): the fields of :class:`~dart_core.model.kernel_config.KernelConfig` plus
    ``draft_graphs`` (:class:`~dart_core.spec.speculative.SpeculativeConfig`).

    Raises:
        ValueError: an unknown ``DART_SDPA_BACKENDS`` value (as KernelConfig)."""
    environ = os.environ if environ is None else environ
    out = {}
    for var, (name, default) in SWITCH_VARIABLES.items():
        raw = environ.get(var, "").strip().lower()
        out[name] = (raw or default) if isinstance(default, str) else (default if not raw else raw not in _OFF)
    KernelConfig(**{k: v for k, v in out.items() if k != "draft_graphs"})  # validated before anything loads
    return out


def bench_kernel_config(environ: Mapping[str, str] | None = None) -> KernelConfig:
    """:func:`bench_switches` as the :class:`~dart_core.model.kernel_config.KernelConfig` to load with."""
    return KernelConfig(**{k: v for k, v in bench_switches(environ).items() if k != "draft_graphs"})

INSTALL_HINT = "pip install 'dart-serve[bench]'"


def missing_modules(*names: str) -> list[str]:
    """The modules among ``names`` that cannot be imported here."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def save_plot(plot: Callable[..., None], path: Path, *args) -> Path | None:
    """Draws ``plot(*args, path)`` when matplotlib is installed; returns the path, or None (logged)
    without it, so the JSON and Markdown written before it are never lost to a missing plot library."""
    if missing_modules("matplotlib"):
        logger.warning("matplotlib is not installed: no plot at %s (%s)", path, INSTALL_HINT)
        return None
    plot(*args, path)
    return path


def add_engine_arguments(ap, defaults) -> None:
    """The options that load the engine in process (model, head, trie, budget, dtype, weights, device,
    threads, CUDA graphs), shared by the batching benchmark and the step profile."""
    ap.add_argument("--model", default=defaults.model, help="local model folder or .gguf [embedded SmolLM2-135M-Instruct]")
    ap.add_argument("--head", default=defaults.head, help='draft head folder, or "random" [the shipped head]')
    ap.add_argument("--trie", default=defaults.trie, help='trie file, "auto" (default trie) or "none" (logits-only)')
    ap.add_argument("--budget", default=defaults.budget, help='"auto" or a fixed number of draft nodes')
    ap.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    add_weights_argument(ap, defaults)
    ap.add_argument("--device", default=defaults.device)
    ap.add_argument("--threads", type=int, default=defaults.threads)
    add_cuda_graphs_argument(ap)
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="level of dart-serve's own log records (dart_core, ngram_service) on stderr; debug "
                         "shows the speculation gate's choice and measurement at every step [%(default)s]")


def add_weights_argument(ap, defaults) -> None:
    """``--weights``, ``--gguf-kernel`` and ``--draft-weights``: the target's weight format and GGUF
    kernel, and the draft head's weights (``DartModel.from_pretrained(weights=..., gguf_kernel=...,
    draft_weights=...)``)."""
    ap.add_argument("--weights", default=defaults.weights, choices=["auto", "dense", "gguf-native"],
                    help="the target's weights: a GGUF's own 4-bit blocks (gguf-native, CPU), de-quantised to "
                         "--dtype (dense), or auto [%(default)s: gguf-native for a GGUF on the CPU]")
    ap.add_argument("--gguf-kernel", default="auto", choices=["auto", "qmm-a8", "qmm", "aten"],
                    help="the kernel of GGUF-native layers (dart_core.model.quant.KERNELS) [%(default)s: "
                         "dart_core.model.quant.default_kernel()]")
    ap.add_argument("--draft-weights", default="auto", choices=["auto", "dense", "q8_0"],
                    help="the draft head's linear layers: Q8_0 blocks run by a qmm kernel (CPU with AVX-512 or AVX2), "
                         "dense, or auto [%(default)s: dart_core.api.default_draft_weights()]")


def add_cuda_graphs_argument(ap) -> None:
    """``--cuda-graphs``: the engine's verification and draft replayed as CUDA graphs (every benchmark CLI)."""
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA only: verify and draft over static KV caches "
                    "replayed as CUDA graphs (dart_core.model.cuda_graphs; DART_DRAFT_GRAPHS=0 in the command's environment "
                    "keeps the draft eager: SpeculativeConfig.draft_graphs)")


def run_cli(config_cls, args, run, save, table, requires: tuple[str, ...] = ()) -> int:
    """The shared tail of the benchmark CLIs: checks the optional modules the run needs
    (``requires``; matplotlib only warns) before anything long starts, builds ``config_cls``
    from the parsed ``args`` fields, runs, saves under ``args.out`` (JSON and Markdown first,
    then the plot), prints the table and the paths.  Returns 2 with a one-line error for a
    missing module, bad input, a missing dataset or an absent server."""
    absent = missing_modules(*requires)
    if absent:
        print(f"error: this benchmark needs {', '.join(absent)}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if missing_modules("matplotlib"):
        print(f"warning: matplotlib is not installed: the results get no plot ({INSTALL_HINT})", file=sys.stderr)
    level = getattr(args, "log_level", None)
    if level:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        for name in ("dart_core", "ngram_service"):
            logging.getLogger(name).setLevel(level.upper())
    fields = {f.name for f in dataclasses.fields(config_cls)}
    cfg = config_cls(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        result = run(cfg, progress=not args.no_progress)
    except (ValueError, RuntimeError, OSError) as e:  # OSError: FileNotFoundError, ConnectionError
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = save(result, args.out)
    print(table(result))
    print(json.dumps({k: str(v) for k, v in paths.items() if v is not None}))
    return 0
