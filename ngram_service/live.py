"""The live corpus: the traffic the n-gram service serves, as draft evidence for the next requests.

A static trie pays only where its corpus matches the traffic; the corpus that matches it best is the
traffic itself (agents retrying a step, tool calls of one JSON shape, templated prompts, exact
repeats).  :class:`LiveCorpus` keeps the finished sequences that engine replicas send
(:meth:`LiveCorpus.add`) in one bounded C++ n-gram index (the request context index's structure,
``csrc/context_index.hpp``, with a boundary after each document), and proposes for a request the
continuation of its last tokens in that corpus (:meth:`LiveCorpus.chain`): what followed the most
recent occurrence of the longest matching suffix, up to the end of that document.  The tree search
weighs the chain as it weighs the request's own context chain (``SearchParams.context_weight``;
docs/ngram.md, "Live corpus").

Bounded: the index holds at most ``max_tokens`` tokens; past that it keeps the newest half and
re-indexes them (oldest evicted first).  Thread-safe: one lock around every call, so engine
replicas' inserts and the service's searches may run on different threads.

Nothing learned is lost on a restart: :meth:`LiveCorpus.save` writes the corpus's tokens to a
snapshot file (atomically: a temporary file renamed over the old one) and
:meth:`LiveCorpus.load` re-indexes them; a snapshot that is not one, is truncated or fails its
checksum raises :class:`CorruptSnapshot` (the service then logs it and starts empty).

Privacy: the output of every request is unchanged (verification decides every token), but one
request's text can steer the drafts of another, and so its speed; a request opts out with
``learn = False`` and a deployment with ``ngram.learn: false`` (docs/serving.md).
"""

from __future__ import annotations

import os
import struct
import threading
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ngram_service import _native
from ngram_service.tree_search import ContextChain

__all__ = ["LiveCorpus", "LiveStats", "CorruptSnapshot", "SnapshotMismatch", "Snapshot", "read_snapshot", "BOUNDARY",
           "DEFAULT_MAX_TOKENS", "DEFAULT_MAX_CONTEXT", "REQUEST_MATCH_CAP", "MAX_MATCH", "LONG_MATCH", "with_live_chains",
           "prefer_longer_match"]

#: the id appended after each document (no tokenizer uses it; a chain never crosses it)
BOUNDARY = int(_native.ContextIndex.BOUNDARY)


#: the default cap of a live corpus, in tokens (``ngram.learn_max_tokens``)
DEFAULT_MAX_TOKENS = 1 << 20
#: the suffix length a live corpus matches, in tokens: by default only a match this long proposes a
#: chain (``min_match``).  Tuned on the tuning split (bench/results/live_corpus_steering/): with
#: matches of 1 to 4 tokens, other traffic's text lowered first-seen requests' τ; 4-token matches
#: alone lowered it less; 8-token matches alone left it as without a corpus, and drafted exact
#: repeats best.
DEFAULT_MAX_CONTEXT = 8
#: the longest match a live corpus measures, in tokens: a continuation's match length counts how far back
#: the request's last tokens agree with the corpus at the matched place, past ``max_context`` and up to
#: this many (:meth:`LiveCorpus.chain`); an exact repeat of earlier traffic matches this far
MAX_MATCH = 32
#: a live-corpus match at least this long replaces the request's own chain whatever that matched (a
#: request repeating earlier traffic, which its own context cannot tell; suffix decoding's rule that a
#: longer match drafts further): ``2 * DEFAULT_MAX_CONTEXT``
LONG_MATCH = 16
#: the longest match a request's own context chain has (``SpeculativeConfig.context_order``, 4 by
#: default): a live-corpus chain replaces the request's own only where the request's matched fewer
#: tokens than the corpus's, counted at most as this many, so a request's own full-length match (a
#: loop, a phrase it repeats) is kept over other traffic's text
REQUEST_MATCH_CAP = 4

#: a snapshot: magic, format version, max_context, token count, CRC-32 of the tokens, then (format 2)
#: the tokenizer's vocabulary hash (a 2-byte length and its ASCII bytes, empty when unknown); then int64 tokens
_SNAPSHOT = struct.Struct("<8sIIQI")
_HASH_LENGTH = struct.Struct("<H")
_MAGIC = b"DARTLIVE"
_VERSION = 2
_VERSIONS = (1, 2)


class CorruptSnapshot(ValueError):
    """A live-corpus snapshot that is not one, is truncated, or fails its checksum."""


class SnapshotMismatch(CorruptSnapshot):
    """A sound snapshot that does not fit where it is loaded: another tokenizer (vocabulary hash).
    (Its context length does not count: a snapshot holds tokens, indexed afresh when loaded.)"""


@dataclass(frozen=True)
class Snapshot:
    """A snapshot file's contents (:func:`read_snapshot`)."""

    tokens: np.ndarray  # [T] int64, documents each followed by BOUNDARY
    max_context: int
    vocab_hash: str  # "" when the corpus did not know its tokenizer

    def documents(self) -> list[np.ndarray]:
        """The documents, split at :data:`BOUNDARY` (a trailing one without a boundary, cut by an
        eviction at the front or written mid-document, is kept too)."""
        ends = np.flatnonzero(self.tokens == BOUNDARY)
        starts = np.concatenate([[0], ends + 1])
        stops = np.concatenate([ends, [self.tokens.size]])
        return [self.tokens[a:b] for a, b in zip(starts, stops) if b > a]


def read_snapshot(path: str | Path) -> Snapshot:
    """Reads and checks a snapshot :meth:`LiveCorpus.save` wrote (format 1 or 2).

    Raises:
        FileNotFoundError: no file; CorruptSnapshot: not a snapshot, truncated, a failed checksum
            or a negative token id."""
    data = Path(path).read_bytes()
    if len(data) < _SNAPSHOT.size:
        raise CorruptSnapshot(f"{path}: {len(data)} bytes, shorter than a snapshot's header")
    magic, version, max_context, count, crc = _SNAPSHOT.unpack_from(data)
    if magic != _MAGIC or version not in _VERSIONS:
        raise CorruptSnapshot(f"{path}: not a live-corpus snapshot of format {'/'.join(map(str, _VERSIONS))}")
    at, vocab_hash = _SNAPSHOT.size, ""
    if version >= 2:
        if len(data) < at + _HASH_LENGTH.size:
            raise CorruptSnapshot(f"{path}: truncated in its header")
        (n,) = _HASH_LENGTH.unpack_from(data, at)
        at += _HASH_LENGTH.size
        if len(data) < at + n:
            raise CorruptSnapshot(f"{path}: truncated in its header")
        try:
            vocab_hash = data[at:at + n].decode("ascii")
        except UnicodeDecodeError:
            raise CorruptSnapshot(f"{path}: a vocabulary hash that is not ASCII") from None
        at += n
    body = data[at:]
    if len(body) != 8 * count:
        raise CorruptSnapshot(f"{path}: truncated: {len(body)} bytes of tokens, the header says {8 * count}")
    if zlib.crc32(body) != crc:
        raise CorruptSnapshot(f"{path}: the tokens fail their checksum")
    tokens = np.frombuffer(body, dtype="<i8").astype(np.int64)
    if tokens.size and tokens.min() < 0:
        raise CorruptSnapshot(f"{path}: a negative token id")
    return Snapshot(tokens, int(max_context), vocab_hash)


@dataclass(frozen=True)
class LiveStats:
    """A snapshot of a :class:`LiveCorpus`'s counters."""

    tokens: int  # tokens held, boundaries included
    max_tokens: int  # the cap
    bytes: int  # memory of the index (estimate from its containers' sizes)
    inserts: int  # documents added since start
    evicted: int  # tokens dropped to stay under the cap
    lookups: int  # chains asked for
    hits: int  # chains that matched something

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class LiveCorpus:
    """A bounded, thread-safe index of served sequences (module docstring).

    Args:
        max_tokens: the cap, in tokens (boundaries included), at least 64.
        max_context: the longest suffix matched, in tokens (1..8).
        min_match: the shortest suffix match that proposes a chain, in tokens (1..``max_context``;
            None: ``max_context``): a shorter match in other traffic's text says little about
            this request.  The index keeps only the lengths ``min_match..max_context`` (its memory
            and inserts grow with how many).
        vocab_hash: the tokenizer's vocabulary hash (:func:`~ngram_service.tokenizer.tokenizer_identity`),
            written into snapshots and checked against theirs; "" while unknown (the service sets it
            from its trie, or from the first ``Learn`` call that names one).

    Raises:
        ValueError: settings out of range.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_context: int = DEFAULT_MAX_CONTEXT,
                 vocab_hash: str = "", min_match: int | None = None) -> None:
        if max_tokens < 64:
            raise ValueError(f"max_tokens must be >= 64, got {max_tokens}")
        min_match = max_context if min_match is None else min_match
        if not 1 <= min_match <= max_context:
            raise ValueError(f"min_match must be in 1..max_context ({max_context}), got {min_match}")
        self._index = _native.ContextIndex(max_context, max_tokens, min_match)
        self.max_tokens, self.max_context, self.vocab_hash = max_tokens, max_context, vocab_hash
        self._lock = threading.Lock()
        self._inserts = self._evicted = self._lookups = self._hits = 0
        self._position = 0  # tokens ever appended, boundaries included: the end of the stream held
        self.stream_id = uuid.uuid4().hex  # which stream positions refer to (another corpus, another stream)

    def __len__(self) -> int:
        return self._index.size

    @property
    def min_match(self) -> int:
        """The shortest suffix match that proposes a chain (the index keeps no shorter one: fixed
        when the corpus is made)."""
        return self._index.min_context

    @property
    def position(self) -> int:
        """Tokens ever appended (boundaries included): where the stream this corpus holds the end
        of stands; :meth:`tokens_since` answers from it."""
        return self._position

    def _append(self, tokens: np.ndarray) -> None:  # call with the lock held
        before = self._index.size
        self._index.append(tokens)
        self._evicted += max(0, before + tokens.size - self._index.size)
        self._position += int(tokens.size)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Appends a stream of tokens as :meth:`tokens_since` and :meth:`save` give them (documents
        each followed by :data:`BOUNDARY`), as they are; returns how many.  A mirror of another
        corpus feeds itself with this.

        Raises:
            ValueError: a negative token id (nothing is added)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size and tokens.min() < 0:
            raise ValueError("token ids must be >= 0")
        tokens = tokens[-self.max_tokens:]
        with self._lock:
            self._append(tokens)
        return int(tokens.size)

    def tokens_since(self, position: int) -> tuple[int, bool, np.ndarray]:
        """What was appended after stream position ``position`` (an earlier :attr:`position` of this
        corpus, whose :attr:`stream_id` a mirror keeps to tell a restarted corpus from it):
        ``(position now, reset, tokens)``.  ``reset`` is True where some of it was evicted since (or
        ``position`` is not one of this corpus's, e.g. after a restart): ``tokens`` is then every
        token held, and a mirror starts over from them.  [T] int64, boundaries included."""
        with self._lock:
            end, size = self._position, self._index.size
            if 0 <= position <= end and position >= end - size:
                if position == end:
                    return end, False, np.zeros(0, dtype=np.int64)
                return end, False, self._index.tokens(size - (end - position))
            return end, True, self._index.tokens()

    def add(self, documents: Sequence[Sequence[int]]) -> int:
        """Indexes each document (token ids ≥ 0) followed by :data:`BOUNDARY`; returns the tokens
        added.  A document longer than half the cap keeps only its last half-cap tokens (a longer
        one would evict itself).

        Raises:
            ValueError: a negative token id (nothing of the call is added)."""
        arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in documents]
        if any(a.size and a.min() < 0 for a in arrays):
            raise ValueError("token ids must be >= 0")
        keep = self.max_tokens // 2 - 1
        added = 0
        for a in arrays:  # the lock per document: searches wait for one document at most
            if not a.size:
                continue
            a = np.append(a[-keep:], BOUNDARY)
            with self._lock:
                self._append(a)
                self._inserts += 1
            added += a.size
        return added

    def chain(self, context: Sequence[int] | np.ndarray, max_len: int) -> ContextChain:
        """Up to ``max_len`` tokens that followed the most recent occurrence of the longest suffix
        of ``context`` in the corpus, at least ``min_match`` tokens long (empty without one), with
        their probabilities under the corpus (as :meth:`ContextIndex.probability
        <ngram_service.context.ContextIndex.probability>`).  Its ``match_length`` is how many of
        ``context``'s last tokens agree with the corpus there: at least ``min_match``, past
        ``max_context`` where the context repeats earlier text, at most :data:`MAX_MATCH`.
        Only the last :data:`MAX_MATCH` tokens of ``context`` are read (and converted)."""
        query = np.asarray(context[-max(MAX_MATCH, self.max_context):], dtype=np.int64).reshape(-1)
        with self._lock:
            tokens, probs, match = self._index.continuation_after(query, int(max_len))
            self._lookups += 1
            self._hits += bool(len(tokens))
        return ContextChain(tokens, probs, int(match))

    def save(self, path: str | Path) -> int:
        """Writes the corpus's tokens (boundaries included) and its tokenizer's vocabulary hash to
        ``path`` atomically (a temporary file beside it, flushed, then renamed over it); returns the
        tokens written."""
        path = Path(path)
        with self._lock:
            tokens = np.ascontiguousarray(self._index.tokens(), dtype="<i8")
        name = self.vocab_hash.encode("ascii")
        header = _SNAPSHOT.pack(_MAGIC, _VERSION, self.max_context, tokens.size, zlib.crc32(tokens.tobytes())) + \
            _HASH_LENGTH.pack(len(name)) + name
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(tokens.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return int(tokens.size)

    def load(self, path: str | Path) -> int:
        """Appends a snapshot's tokens (as :meth:`save` wrote them) to the corpus; returns how many.
        A snapshot larger than the cap keeps its newest tokens, as inserts would.  A corpus that did
        not know its tokenizer takes the snapshot's.

        Raises:
            FileNotFoundError: no file; CorruptSnapshot: not a snapshot, truncated, or a failed
                checksum; SnapshotMismatch: another tokenizer where both name one (nothing is added)."""
        snap = read_snapshot(path)  # its tokens are indexed afresh: the lengths it was written with do not count
        if snap.vocab_hash and self.vocab_hash and snap.vocab_hash != self.vocab_hash:
            raise SnapshotMismatch(f"{path}: written for another tokenizer (vocabulary hash {snap.vocab_hash[:12]}…, "
                                   f"this corpus's {self.vocab_hash[:12]}…)")
        tokens = snap.tokens[-self.max_tokens:]
        with self._lock:
            self._append(tokens)
            self.vocab_hash = self.vocab_hash or snap.vocab_hash
        return int(tokens.size)

    def stats(self) -> LiveStats:
        with self._lock:
            return LiveStats(self._index.size, self.max_tokens, int(self._index.memory_bytes), self._inserts,
                             self._evicted, self._lookups, self._hits)


def with_live_chains(live: LiveCorpus, contexts: Sequence[np.ndarray], chains: Sequence[ContextChain | None] | None,
                     max_len: int) -> list[ContextChain | None]:
    """Each sequence's chain for the tree search: its own context chain (``chains[b]``, the engine's)
    or the live corpus's continuation of ``contexts[b]``, whichever matched the longer suffix (the
    corpus's counted at most as :data:`REQUEST_MATCH_CAP` tokens; the request's own on a tie).
    ``contexts``: B token sequences ending with each root (the last ``max_context`` tokens are
    read); ``max_len``: the longest chain."""
    return prefer_longer_match(chains, [live.chain(ctx, max_len) for ctx in contexts], max_len)


def prefer_longer_match(chains: Sequence[ContextChain | None] | None, live: Sequence[ContextChain],
                        max_len: int) -> list[ContextChain | None]:
    """Per sequence, ``live[b]`` (its first ``max_len`` tokens) where it has tokens and matched a
    longer suffix than ``chains[b]``, its match counted at most as :data:`REQUEST_MATCH_CAP` tokens
    unless it is :data:`LONG_MATCH` or longer (or where ``chains[b]`` is absent or empty), otherwise
    ``chains[b]``."""
    own = list(chains) if chains is not None else [None] * len(live)
    out = []
    for c, lv in zip(own, live):
        mine = c is not None and len(c.tokens) > 0
        if len(lv.tokens) and (not mine or lv.match_length >= LONG_MATCH or
                               min(lv.match_length, REQUEST_MATCH_CAP) > c.match_length):
            c = lv if len(lv.tokens) <= max_len else ContextChain(lv.tokens[:max_len], lv.probs[:max_len],
                                                                  lv.match_length)
        out.append(c)
    return out
