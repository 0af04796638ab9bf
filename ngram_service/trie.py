"""Memory-mapped n-gram trie: open, look up, verify.

The file format (``csrc/trie_format.hpp``) stores the counts of every m-gram
(1 <= m <= order) as level-wise sorted arrays, KenLM-style, so a trie of any
size opens with ``mmap`` and is shared by every process on the host through
the page cache.  A file up to 1 GiB is read into the page cache as it opens
(one sequential read), a larger one is asked in, in the background:
searches touch the file at random, and each page first touched on a cold disk would cost a
read of its own, milliseconds each, inside a decoding step.  This module owns the two CRC-32 checksums of the
format (``zlib.crc32``): the header checksum is checked at every open, the
payload checksum by :meth:`NgramTrie.verify` (O(size); its speed: ``bench/results/billion_trie/``), which also runs a full structural check.

Probabilities follow DART's back-off rule (docs/design.md §2; reference
``ACANgram::get_probability``): for each token, p = count(s·tok) / count(s)
for the longest non-empty suffix s of the last ``order - 1`` context tokens
that has ``tok`` as a child; 0 when no such suffix exists.

Example::

    trie = NgramTrie("smollm2-3gram.trie")
    trie.probability([1, 2], [3, 4])   # -> array([p(3 | 1 2), p(4 | 1 2)])
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ngram_service._native import MappedTrie, TrieFormatError

__all__ = ["NgramTrie", "TrieFormatError", "TokenizerMismatchError", "TrieInfo", "pack_ragged", "write_checksums"]

MAGIC = b"DARTTRIE"
FORMAT_VERSIONS = (1, 2)  # 2: version 1 with header flags (counts imported from a pruned reference trie)
FIXED_HEADER_BYTES = 352
_PAYLOAD_CRC_AT = 48  # byte offsets of the two u32 checksums in the header
_HEADER_CRC_AT = 52
_CRC_CHUNK_BYTES = 64 << 20


class TokenizerMismatchError(ValueError):
    """The trie was built with a different tokenizer than the one in use."""


@dataclass(frozen=True)
class TrieInfo:
    """What a trie file says about itself (header + metadata JSON)."""

    path: str
    order: int
    vocab_size: int
    total_tokens: int  # corpus tokens counted
    num_nodes: int
    nodes_per_level: tuple[int, ...]  # [order]
    file_bytes: int
    tokenizer_name: str
    vocab_hash: str  # sha256 hex of the tokenizer vocabulary
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_per_node(self) -> float:
        return self.file_bytes / max(self.num_nodes, 1)


def pack_ragged(seqs: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged token sequences -> (flat [sum(len)] int64, offsets [len(seqs) + 1] int64);
    sequence i is flat[offsets[i]:offsets[i + 1]] (the layout the C++ entry points take)."""
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return flat, offsets


_LEVELS_AT = 64  # byte offset of the level table in the fixed header; 48 bytes per level


@dataclass(frozen=True)
class LevelEntry:
    """One row of a trie file's level table (``LevelEntry`` in ``csrc/trie_format.hpp``); offsets
    are bytes from the start of the file, widths bytes per value (child_width 0 on the last level)."""

    num_nodes: int
    tokens_offset: int
    counts_offset: int
    children_offset: int
    count_width: int
    child_width: int


def level_table(header) -> list[LevelEntry]:
    """The level table (level 1 first) of a trie file, given its fixed header: the first
    :data:`FIXED_HEADER_BYTES` bytes, or any buffer starting with them.  No checks: open the
    file with :class:`NgramTrie` first to validate it."""
    (order,) = struct.unpack_from("<I", header, 16)
    return [LevelEntry(*struct.unpack_from("<QQQQII", header, _LEVELS_AT + 48 * m)) for m in range(order)]


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Checks magic, version and header CRC; returns (header_bytes, metadata)."""
    with open(path, "rb") as f:
        fixed = f.read(FIXED_HEADER_BYTES)
        if len(fixed) < FIXED_HEADER_BYTES:
            raise TrieFormatError(f"n-gram trie '{path}' is truncated: {len(fixed)} bytes, no full header")
        if fixed[:8] != MAGIC:
            raise TrieFormatError(f"'{path}' is not a dart-serve n-gram trie (bad magic bytes)")
        (version,) = struct.unpack_from("<I", fixed, 8)
        if version not in FORMAT_VERSIONS:
            raise TrieFormatError(f"n-gram trie '{path}' has format version {version}; this build reads "
                                  f"{' and '.join(map(str, FORMAT_VERSIONS))}")
        (header_bytes,) = struct.unpack_from("<I", fixed, 12)
        (metadata_bytes,) = struct.unpack_from("<I", fixed, 56)
        if not FIXED_HEADER_BYTES + metadata_bytes <= header_bytes <= 1 << 24:
            raise TrieFormatError(f"n-gram trie '{path}' is corrupt: inconsistent header size")
        header = bytearray(fixed + f.read(header_bytes - FIXED_HEADER_BYTES))
    if len(header) < header_bytes:
        raise TrieFormatError(f"n-gram trie '{path}' is truncated inside its header")
    (stored_crc,) = struct.unpack_from("<I", header, _HEADER_CRC_AT)
    struct.pack_into("<I", header, _HEADER_CRC_AT, 0)
    if zlib.crc32(header) != stored_crc:
        raise TrieFormatError(f"n-gram trie '{path}' is corrupt: header checksum mismatch")
    raw = bytes(header[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + metadata_bytes])
    try:
        metadata = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrieFormatError(f"n-gram trie '{path}' has unreadable metadata: {e}") from None
    if not isinstance(metadata, dict):
        raise TrieFormatError(f"n-gram trie '{path}' metadata is not a JSON object")
    return header_bytes, metadata


def _payload_crc(path: Path, start: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= start:
            return crc
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for off in range(start, size, _CRC_CHUNK_BYTES):
                    crc = zlib.crc32(view[off : off + _CRC_CHUNK_BYTES], crc)
            finally:
                view.release()
    return crc


def write_checksums(path: str | os.PathLike[str]) -> None:
    """Fills in the payload and header CRC-32 of a freshly written trie file."""
    path = Path(path)
    with open(path, "r+b") as f:
        fixed = f.read(FIXED_HEADER_BYTES)
        (header_bytes,) = struct.unpack_from("<I", fixed, 12)
    payload_crc = _payload_crc(path, header_bytes)
    with open(path, "r+b") as f:
        header = bytearray(f.read(header_bytes))
        struct.pack_into("<I", header, _PAYLOAD_CRC_AT, payload_crc)
        struct.pack_into("<I", header, _HEADER_CRC_AT, 0)
        struct.pack_into("<I", header, _HEADER_CRC_AT, zlib.crc32(header))
        f.seek(0)
        f.write(header)


class NgramTrie:
    """A read-only n-gram trie file, memory-mapped.

    Args:
        path: a file written by ``python -m ngram_service.build``.
        verify: also check the payload checksum and the full structure
            (O(file size)).

    Raises:
        FileNotFoundError / OSError: the file cannot be opened.
        TrieFormatError: the file is truncated, corrupt, of another format
            version, or not a trie at all.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"n-gram trie not found: {self.path}")
        _, metadata = _read_header(self.path)
        self._native = MappedTrie(str(self.path))
        tokenizer = metadata.get("tokenizer", {}) if isinstance(metadata.get("tokenizer"), dict) else {}
        self.info = TrieInfo(
            path=str(self.path),
            order=self._native.order,
            vocab_size=self._native.vocab_size,
            total_tokens=self._native.total_tokens,
            num_nodes=self._native.num_nodes,
            nodes_per_level=tuple(self._native.nodes_per_level),
            file_bytes=self._native.file_bytes,
            tokenizer_name=str(tokenizer.get("name", "")),
            vocab_hash=str(tokenizer.get("vocab_hash", "")),
            metadata=metadata,
        )
        if verify:
            self.verify()

    @property
    def order(self) -> int:
        return self.info.order

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def native(self) -> MappedTrie:
        """The C++ handle, for :mod:`ngram_service.tree_search`."""
        return self._native

    def __repr__(self) -> str:
        i = self.info
        return (f"NgramTrie({i.path!r}, order={i.order}, nodes={i.num_nodes:,}, tokens={i.total_tokens:,}, "
                f"tokenizer={i.tokenizer_name!r})")

    def verify(self) -> None:
        """Checks the payload CRC-32 and the full structure; O(file size).

        Raises:
            TrieFormatError: on the first inconsistency.
        """
        crc = _payload_crc(self.path, self._native.header_bytes)
        if crc != self._native.payload_crc32:
            raise TrieFormatError(f"n-gram trie '{self.path}' is corrupt: payload checksum mismatch")
        self._native.check_structure()

    def check_tokenizer(self, vocab_hash: str) -> None:
        """Raises TokenizerMismatchError unless the trie was built with this vocabulary hash."""
        if vocab_hash != self.info.vocab_hash:
            raise TokenizerMismatchError(
                f"n-gram trie '{self.path}' was built with tokenizer {self.info.tokenizer_name!r} "
                f"(vocab hash {self.info.vocab_hash[:12]}…), not with the one in use (vocab hash {vocab_hash[:12]}…); "
                "rebuild it with `python -m ngram_service.build --tokenizer ...`")

    def count(self, ngram: Sequence[int]) -> int:
        """Occurrences of an m-gram (1 <= m <= order) in the corpus; 0 when absent.

        ``count([])`` is the number of corpus tokens.
        """
        ids = np.asarray(ngram, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError("ngram must be a 1-D sequence of token ids")
        if len(ids) == 0:
            return self.info.total_tokens
        if len(ids) > self.order or ids.min() < 0 or ids.max() >= self.vocab_size:
            return 0
        return int(self._native.count(ids.astype(np.uint32)))

    def probability(self, context: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Back-off n-gram probability of each token after ``context``.

        Args:
            context: token ids; only the last ``order - 1`` matter.
            tokens: [num_tokens] candidate token ids.

        Returns:
            [num_tokens] float64 probabilities (see the module docstring).
        """
        return self.probability_batch([context], np.asarray(tokens, dtype=np.int64)[None, :])[0]

    def probability_batch(self, contexts: Sequence[Sequence[int]], tokens: np.ndarray) -> np.ndarray:
        """Batched :meth:`probability`; releases the GIL.

        Args:
            contexts: ``batch`` token-id sequences of any lengths.
            tokens: [batch, num_tokens] candidate token ids.

        Returns:
            [batch, num_tokens] float64.

        Raises:
            ValueError: shapes disagree or a context token id is negative.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 2 or tokens.shape[0] != len(contexts):
            raise ValueError(f"tokens must be [batch={len(contexts)}, n], got shape {tokens.shape}")
        keep = self.order - 1
        flat, offsets = pack_ragged([np.asarray(c, dtype=np.int64)[-keep:] for c in contexts])
        return self._native.probability(flat, offsets, tokens)
