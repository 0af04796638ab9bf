"""Every switch is a config field: the kernel switches (KernelConfig) and the engine's former
mutable flags (SpeculativeConfig) are validated once, reach what they switch, and no library module
reads a runtime switch from the environment (benchmark entry points may, as overrides)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dart_core.api import DartModel
from dart_core.bench import SWITCH_VARIABLES, bench_kernel_config, bench_switches
from dart_core.model.cuda_graphs import DEFAULT_DRAFT_WIDTHS
from dart_core.model.kernel_config import KernelConfig
from dart_core.spec.speculative import FOLD_WIDTH, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[2]

# environment reads the library keeps, each for a reason that is not a runtime switch
ALLOWED = {
    "dart_core/model/allocator.py": "MALLOC_MMAP_THRESHOLD_: glibc's own setting, which keep_freed_memory defers to",
    "dart_core/train/gpu_recipe.py": "DART_SERVE_CACHE: the cache path (a command-line entry point)",
    "ngram_service/cache.py": "DART_SERVE_CACHE: the cache path",
    "ngram_service/build_common.py": "TOKENIZERS_PARALLELISM: set for tokenizers' worker processes, not read; "
                                     "SOURCE_DATE_EPOCH: the reproducible-builds date for a trie header",
    "ngram_service/ray_build.py": "TOKENIZERS_PARALLELISM: set for the map tasks' tokenizers, not read",
    "ngram_service/ray_build_bench.py": "SOURCE_DATE_EPOCH: set so that every build's header is equal (a benchmark)",
    "ngram_service/server.py": "the bearer token's variable, named on its command line",
    "deployments/app.py": "the n-gram service's bearer token",
    "deployments/ingress.py": "the API key (api_key_env)",
    "deployments/browser.py": "the compare page test's browser and driver paths",
}


def _environment_readers(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
    return False


def test_no_library_module_reads_a_switch_from_the_environment():
    readers = {str(p.relative_to(ROOT)) for pkg in ("dart_core", "ngram_service", "deployments")
               for p in (ROOT / pkg).rglob("*.py")
               if "bench" not in p.relative_to(ROOT).parts and _environment_readers(p)}
    assert readers <= set(ALLOWED), f"environment read outside the allowed modules: {sorted(readers - set(ALLOWED))}"
    assert _environment_readers(ROOT / "dart_core" / "bench" / "__init__.py")  # the benchmarks' overrides live there


def test_kernel_config_is_validated_once():
    assert KernelConfig().as_dict() == {"sdpa_backends": "auto", "grouped_query": True, "static_windows": True,
                                        "keep_freed_memory": True, "amx": True}
    assert KernelConfig(sdpa_backends=" Math, efficient ").sdpa_backends == "math,efficient"
    for bad in ("fastest", "", ",", 3):
        with pytest.raises(ValueError, match="sdpa_backends"):
            KernelConfig(sdpa_backends=bad)
    with pytest.raises(ValueError, match="grouped_query"):
        KernelConfig(grouped_query="off")
    with pytest.raises(ValueError, match="amx"):
        KernelConfig(amx=1)


def test_the_engine_flags_are_speculative_config_fields():
    cfg = SpeculativeConfig()
    assert (cfg.pooled_budget, cfg.grammar_drafting, cfg.fold_width, cfg.draft_graphs) == (False, True, FOLD_WIDTH, True)
    assert FOLD_WIDTH == DEFAULT_DRAFT_WIDTHS[-1] - 1  # one below the widest graph-captured draft
    assert {"pooled_budget", "grammar_drafting", "fold_width"} <= set(cfg.engine_kwargs())
    for bad in ({"fold_width": -1}, {"fold_width": 2.5}, {"pooled_budget": 1}, {"draft_graphs": "no"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeculativeConfig(**bad)


def test_benchmark_overrides_become_the_configs():
    assert bench_switches({}) == {"sdpa_backends": "auto", "grouped_query": True, "static_windows": True,
                                  "keep_freed_memory": True, "draft_graphs": True, "amx": True}
    env = {"DART_SDPA_BACKENDS": "default", "DART_GROUPED_QUERY": "off", "DART_STATIC_WINDOWS": "0",
           "DART_KEEP_FREED_MEMORY": "no", "DART_DRAFT_GRAPHS": "0", "DART_AMX": "off"}
    assert set(env) == set(SWITCH_VARIABLES)
    assert bench_switches(env) == {"sdpa_backends": "default", "grouped_query": False, "static_windows": False,
                                   "keep_freed_memory": False, "draft_graphs": False, "amx": False}
    assert bench_kernel_config(env) == KernelConfig("default", False, False, False, False)
    with pytest.raises(ValueError, match="sdpa_backends"):
        bench_switches({"DART_SDPA_BACKENDS": "fastest"})


def test_from_pretrained_hands_every_switch_to_what_it_switches(tiny_model_dir, caplog):
    from dart_core import _kernels

    kernels = KernelConfig(sdpa_backends="math", grouped_query=False, amx=False)
    spec = SpeculativeConfig(budget=4, pooled_budget=True, grammar_drafting=False, fold_width=None)
    with caplog.at_level("INFO", logger="dart_core.api"):
        m = DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, speculative_config=spec,
                                      kernel_config=kernels)
    e = m.engine
    assert (e.pooled_budget, e.grammar_drafting, e.drafter.fold_width) == (True, False, None)
    assert e.target.kernels is kernels
    assert _kernels.qmm_a8_amx() is False  # the process-wide AMX switch, off
    attention = [x for x in e.target.model.modules() if hasattr(x, "is_causal") and hasattr(x, "head_dim")]
    assert attention and all(x.dart_grouped_query is False for x in attention)
    assert all(x.kernels is kernels for x in e.head.modules() if hasattr(x, "kernels"))
    assert any("kernel config" in r.getMessage() and "'math'" in r.getMessage() for r in caplog.records)
    ids = m.encode("The capital of France")
    default = DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, budget=4)
    assert _kernels.qmm_a8_amx() == _kernels.set_qmm_a8_amx(True)  # on again where this CPU has it
    params = m.sampling_params(max_new_tokens=12)
    assert e.generate([ids], params).token_ids == default.engine.generate([ids], params).token_ids  # lossless either way
