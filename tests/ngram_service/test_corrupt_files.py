"""Truncated, corrupt and foreign trie files raise TrieFormatError, never crash.

Header damage is caught at open (CRC-32 plus structural checks); payload
damage is caught by verify(), and lookups or searches on a damaged payload
either answer or raise TrieFormatError, because every child range they
follow is bounds-checked."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from ngram_service.build import build_trie
from ngram_service.trie import NgramTrie, TrieFormatError
from ngram_service.tree_search import SearchParams, search_tree

from .conftest import random_docs


@pytest.fixture(scope="module")
def good_trie(tmp_path_factory):
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("fuzz") / "good.trie"
    build_trie(random_docs(rng, 16, 120, 60), path, vocab_size=16, order=3, tokenizer_name="t", vocab_hash="0" * 64)
    return path.read_bytes()


def _write(tmp_path, data: bytes, name="bad.trie"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _exercise(trie: NgramTrie, rng: np.random.Generator):
    """Lookups and searches that touch many nodes; may raise TrieFormatError only."""
    for _ in range(20):
        ctx = list(rng.integers(0, 16, size=rng.integers(0, 4)))
        trie.probability(ctx, list(range(16)))
        trie.count(list(rng.integers(0, 16, size=rng.integers(1, 4))))
    ids = rng.integers(0, 16, size=(8, 16))
    probs = rng.dirichlet(np.ones(16), size=8).astype(np.float32)
    search_tree(ids, probs, [1, 2], trie=trie, params=SearchParams(top_k=16, beam_width=8))


def _exercise_corrupt(trie: NgramTrie, rng: np.random.Generator):
    """As _exercise, on a damaged file: an answer or TrieFormatError, never a crash."""
    try:
        _exercise(trie, rng)
    except TrieFormatError:
        pass


def test_good_file_is_clean(tmp_path, good_trie):
    trie = NgramTrie(_write(tmp_path, good_trie), verify=True)
    _exercise(trie, np.random.default_rng(0))


@pytest.mark.parametrize("data,match", [
    (b"", "truncated"),
    (b"DARTTRIE", "truncated"),
    (b"\x89PNG\r\n\x1a\n" + bytes(400), "not a dart-serve n-gram trie"),
    (bytes(range(256)) * 4, "not a dart-serve n-gram trie"),
])
def test_foreign_files(tmp_path, data, match):
    with pytest.raises(TrieFormatError, match=match):
        NgramTrie(_write(tmp_path, data))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        NgramTrie(tmp_path / "nope.trie")


def test_every_truncation_raises(tmp_path, good_trie):
    for cut in sorted({0, 1, 7, 8, 100, 351, 352, 400, *range(512, len(good_trie), 97), len(good_trie) - 1}):
        with pytest.raises(TrieFormatError):
            NgramTrie(_write(tmp_path, good_trie[:cut]))


def test_wrong_version(tmp_path, good_trie):
    data = bytearray(good_trie)
    struct.pack_into("<I", data, 8, 99)
    with pytest.raises(TrieFormatError, match="format version 99"):
        NgramTrie(_write(tmp_path, bytes(data)))


def test_header_byte_flips_raise(tmp_path, good_trie):
    rng = np.random.default_rng(1)
    header_bytes = struct.unpack_from("<I", good_trie, 12)[0]
    for _ in range(300):
        data = bytearray(good_trie)
        pos = int(rng.integers(0, header_bytes))
        data[pos] ^= int(rng.integers(1, 256))
        with pytest.raises(TrieFormatError):
            NgramTrie(_write(tmp_path, bytes(data)))


def _with_valid_header_crc(data: bytearray) -> bytes:
    header_bytes = struct.unpack_from("<I", data, 12)[0]
    header = bytearray(data[:header_bytes])
    struct.pack_into("<I", header, 52, 0)
    struct.pack_into("<I", data, 52, zlib.crc32(header))
    return bytes(data)


# u32 fields whose forged value cannot be told from a real one without the
# header CRC: total_tokens, vocab_size (only a smaller one shows).
_UNCHECKABLE = {20, 24, 28, 52, 56}  # 52: the header CRC, recomputed below; 56: metadata length (0 is legal)


def test_flags_must_fit_the_format_version(tmp_path, good_trie):
    """Version 1 has no flags; version 2 has known ones (kFlagReferenceCounts = 1)."""
    for version, flags, ok in [(1, 1, False), (2, 0, False), (2, 2, False), (2, 1, True)]:
        data = bytearray(good_trie)
        struct.pack_into("<I", data, 8, version)
        struct.pack_into("<I", data, 60, flags)
        path = _write(tmp_path, _with_valid_header_crc(data))
        if ok:  # the flag only relaxes checks: a consistent file reads the same
            assert NgramTrie(path).probability([1, 2], list(range(16))).tolist() == \
                NgramTrie(_write(tmp_path, good_trie, "good.trie")).probability([1, 2], list(range(16))).tolist()
        else:
            with pytest.raises(TrieFormatError, match="do not fit format version"):
                NgramTrie(path)


def test_forged_header_fields_fail_structural_checks(tmp_path, good_trie):
    """A header whose CRC is valid but whose fields lie is caught at open or by
    verify(), and never crashes a lookup in between."""
    rng = np.random.default_rng(2)
    order = struct.unpack_from("<I", good_trie, 16)[0]
    used_end = 64 + 48 * order
    for field in range(16, used_end, 4):
        if field in _UNCHECKABLE or (field >= 64 and (field - 64) % 48 >= 40):  # per-level reserved
            continue
        for value in {0, 1, 2**32 - 1, int(rng.integers(0, 2**32)), struct.unpack_from("<I", good_trie, field)[0] ^ 8}:
            data = bytearray(good_trie)
            if struct.unpack_from("<I", data, field)[0] == value:
                continue
            struct.pack_into("<I", data, field, value)
            try:
                trie = NgramTrie(_write(tmp_path, _with_valid_header_crc(data)))
            except TrieFormatError:
                continue
            _exercise_corrupt(trie, rng)
            with pytest.raises(TrieFormatError):
                trie.verify()


def test_payload_flips_are_detected_and_never_crash(tmp_path, good_trie):
    rng = np.random.default_rng(3)
    header_bytes = struct.unpack_from("<I", good_trie, 12)[0]
    for trial in range(300):
        data = bytearray(good_trie)
        for _ in range(int(rng.integers(1, 8))):
            pos = int(rng.integers(header_bytes, len(data)))
            data[pos] ^= int(rng.integers(1, 256))
        if bytes(data) == good_trie:
            continue
        path = _write(tmp_path, bytes(data), f"p{trial}.trie")
        try:
            trie = NgramTrie(path)  # O(1) checks only: offsets at the ends of each level
        except TrieFormatError:
            continue
        _exercise_corrupt(trie, rng)
        with pytest.raises(TrieFormatError):
            trie.verify()
