"""Where dart-serve keeps what it builds, converts or downloads once (tries,
converted GGUF models and tokenizers, evaluation prompts): ``$DART_SERVE_CACHE``,
default ``~/.cache/dart-serve``; and how tries in it are named."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Protocol

logger = logging.getLogger(__name__)

__all__ = ["cache_root", "default_trie_path", "converted_cache", "save_converted", "create_once", "ModelFiles"]


class ModelFiles(Protocol):
    """What :func:`converted_cache` reads of a local model (:class:`ngram_service.tokenizer.ModelSource`
    is one): its name, its folder and the GGUF file in it, if any."""

    name: str
    folder: Path
    gguf_file: str | None


def cache_root() -> Path:
    """The cache folder (not created here)."""
    return Path(os.environ.get("DART_SERVE_CACHE", Path.home() / ".cache" / "dart-serve"))


def default_trie_path(model: str, corpus: str, order: int) -> Path:
    """``<cache>/tries/<model>-<corpus>-<order>gram.trie``: where a model's trie of a named corpus goes."""
    return cache_root() / "tries" / f"{model}-{corpus}-{order}gram.trie"


def converted_cache(source: ModelFiles, part: str) -> Path | None:
    """Where the Hugging Face form of a GGUF model's ``part`` ("model" or
    "tokenizer") is cached, keyed by the GGUF file's size and mtime: reading
    a GGUF (de-quantising the weights, parsing the vocabulary) takes seconds,
    loading the converted folder a fraction of that.  None for non-GGUF sources.
    """
    if not source.gguf_file:
        return None
    st = (source.folder / source.gguf_file).stat()
    return cache_root() / "models" / f"{source.name}-{st.st_size}-{st.st_mtime_ns}" / part


def save_converted(write: Callable[[Path], None], folder: Path) -> None:
    """Runs ``write(tmp)`` on a temporary sibling of ``folder`` and renames it into place
    (atomic); a concurrent writer that got there first wins, and any failure only costs
    the cache (logged), never the load that already succeeded."""
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        write(tmp)
        tmp.rename(folder)
    except Exception as e:  # noqa: BLE001 - the cache is an optimisation
        logger.warning("could not cache the converted model at %s: %s", folder, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def create_once(path: Path, create: Callable[[], None]) -> Path:
    """``path``, made by ``create()`` first when it does not exist.  Concurrent callers on one
    machine wait for a single ``create()`` (a file lock beside ``path``); ``create`` must make
    the file appear atomically (written elsewhere, then renamed), so no reader sees half of it."""
    import fcntl

    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            create()
    return path
