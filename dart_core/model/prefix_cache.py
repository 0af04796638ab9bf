"""A prefix cache of prompts' KV entries: a prompt that starts like an earlier one prefills only
the rest (automatic prefix caching, as vLLM's and SGLang's radix cache do, here without paging).

After a prefill the engine stores each prompt's first whole blocks of ``block`` tokens: per
target layer the keys and values [H_kv, n, D] and the taps [n, 3H] the draft head reads.  A later
prompt looks up the longest stored prefix it starts with, in whole blocks, leaving at least its
last token to compute (its logits give the first generated token).  Blocks are found by a chained
hash of their tokens and every hit is checked against the stored tokens, so a hash collision
cannot serve another prompt's entries.

The cache holds at most ``max_tokens`` positions; the least recently used prompt is evicted
first.  An entry's tensors are its own copies: nothing the running batch does touches them.

Greedy outputs are those of a prefill without the cache up to floating-point summation order
(the suffix's queries attend to the stored entries in one kernel call instead of inside one
causal prefill); tests/dart_core/test_prefix_cache.py checks equal tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

__all__ = ["PrefixCache", "PrefixHit"]


@dataclass(frozen=True)
class PrefixHit:
    """A stored prefix of a prompt: its first ``length`` tokens' entries.

    ``keys``/``values``: per target layer [H_kv, length, D] (views of the stored entry: read, never
    written); ``taps``: [length, 3H]."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    taps: torch.Tensor


@dataclass
class _Entry:
    tokens: tuple[int, ...]  # the stored prefix (whole blocks)
    keys: list[torch.Tensor]  # per layer [H_kv, n, D]
    values: list[torch.Tensor]
    taps: torch.Tensor  # [n, 3H]
    hashes: list[int]  # block i's chained hash, i < n / block
    nbytes: int


class PrefixCache:
    """Prompts' KV entries and taps, keyed by their leading blocks, least recently used evicted first.

    Args:
        max_tokens: positions held at most (every stored prompt's whole blocks summed); a prompt
            longer than that is not stored.
        block: tokens per block: prefixes are stored and matched in whole blocks.

    Raises:
        ValueError: ``max_tokens`` < 0 or ``block`` < 1.
    """

    def __init__(self, max_tokens: int, block: int = 16) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block!r}")
        self.max_tokens, self.block = max_tokens, block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_hash: dict[int, dict[int, None]] = {}  # block hash -> ids of the entries holding that prefix
        self._next_id = 0
        self.tokens = 0  # positions held
        self.bytes = 0  # memory of the held tensors
        self.lookups = self.hits = self.hit_tokens = self.evictions = 0

    @staticmethod
    def _chain(h: int, block) -> int:
        """The hash of a prefix: the previous blocks' hash ``h`` and this block's tokens."""
        return hash((h, tuple(block)))

    def _hashes(self, tokens, blocks: int) -> Iterator[int]:
        """The chained hashes of ``tokens``'s first ``blocks`` blocks, one per block, as they are needed."""
        h = 0
        for i in range(blocks):
            h = self._chain(h, tokens[i * self.block:(i + 1) * self.block])
            yield h

    def _find(self, tokens, hashes: Iterable[int]) -> tuple[int, int | None]:
        """(blocks matched, id of the entry holding them) of the longest stored prefix of ``tokens``
        among the blocks whose chained ``hashes`` are given."""
        best, found = 0, None
        for i, h in enumerate(hashes):
            ids = self._by_hash.get(h)
            if not ids:
                break
            eid = next(reversed(ids))  # the newest entry holding this prefix
            if list(self._entries[eid].tokens[:(i + 1) * self.block]) != list(tokens[:(i + 1) * self.block]):
                break  # a hash collision: not this prompt's prefix
            best, found = i + 1, eid
        return best, found

    def lookup(self, prompt: list[int]) -> PrefixHit | None:
        """The longest stored prefix of ``prompt`` in whole blocks, at most ``len(prompt) - 1``
        tokens, or None; a hit makes its entry the most recently used."""
        if not self.max_tokens:
            return None
        self.lookups += 1
        blocks, eid = self._find(prompt, self._hashes(prompt, (len(prompt) - 1) // self.block))
        if eid is None:
            return None
        self._entries.move_to_end(eid)
        entry = self._entries[eid]
        n = blocks * self.block
        self.hits += 1
        self.hit_tokens += n
        return PrefixHit(n, [k[:, :n] for k in entry.keys], [v[:, :n] for v in entry.values], entry.taps[:n])

    def store(self, prompt: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
              taps: torch.Tensor) -> bool:
        """Stores the whole blocks of ``prompt`` (copies of the given entries' first positions).

        Args:
            prompt: the prompt's token ids.
            keys, values: per target layer [H_kv, ≥ n, D], the prompt's entries (n = its whole
                blocks' tokens).
            taps: [≥ n, 3H].

        Returns:
            Whether it was stored: not when it has no whole block, is longer than ``max_tokens``,
            or is already held whole (then that entry becomes the most recently used).

        Raises:
            ValueError: entries shorter than the prompt's whole blocks.
        """
        blocks = len(prompt) // self.block
        n = blocks * self.block
        if not blocks or n > self.max_tokens:
            return False
        if any(t.shape[-2] < n for t in (*keys, *values)) or taps.shape[0] < n:
            raise ValueError(f"entries shorter than the prompt's {n} stored tokens")
        hashes = list(self._hashes(prompt, blocks))
        held, eid = self._find(prompt, hashes)
        if held == blocks:
            self._entries.move_to_end(eid)
            return False
        while self.tokens + n > self.max_tokens:
            self._evict()
        ks = [k[:, :n].clone() for k in keys]
        vs = [v[:, :n].clone() for v in values]
        tp = taps[:n].clone()
        e = _Entry(tuple(prompt[:n]), ks, vs, tp, hashes, sum(t.nbytes for t in (*ks, *vs, tp)))
        eid, self._next_id = self._next_id, self._next_id + 1
        self._entries[eid] = e
        for h in e.hashes:
            self._by_hash.setdefault(h, {})[eid] = None
        self.tokens += n
        self.bytes += e.nbytes
        return True

    def _evict(self) -> None:
        eid, e = self._entries.popitem(last=False)
        for h in e.hashes:
            ids = self._by_hash[h]
            del ids[eid]
            if not ids:
                del self._by_hash[h]
        self.tokens -= len(e.tokens)
        self.bytes -= e.nbytes
        self.evictions += 1

    def clear(self) -> None:
        """Drops every entry (the counters stay)."""
        while self._entries:
            self._evict()

    def stats(self) -> dict:
        """Positions and bytes held, entries, lookups, hits, tokens served from the cache, evictions."""
        return {"tokens": self.tokens, "bytes": self.bytes, "entries": len(self._entries), "lookups": self.lookups,
                "hits": self.hits, "hit_tokens": self.hit_tokens, "evictions": self.evictions}
