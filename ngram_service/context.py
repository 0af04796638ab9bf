"""The request's own context as draft evidence: a per-sequence n-gram index (C++).

Prompt-lookup decoding showed that much of what a model writes repeats its
prompt (code edits, quotes, names, summaries); a corpus trie and a draft head
know none of it.  :class:`ContextIndex` indexes one sequence — its prompt and
every token accepted since — as n-gram counts of contexts of 1..``max_context``
tokens, updated in O(``max_context``) per appended token, and proposes a
:class:`~ngram_service.tree_search.ContextChain`: what followed the most recent
earlier occurrence of the longest suffix of the sequence that occurred before,
with each token's evidence q under the index (a back-off estimate discounted
by the length of the matched context).  The tree search
(``SearchParams.context_weight``) puts that chain into the draft tree even where
the draft head's top-k misses it (``csrc/search.hpp``, docs/design.md §2).

The index lives with the engine, one per running sequence, and stays small:
memory is bounded by ``max_tokens`` (past it the newest half is kept and
re-indexed).  Only the chain, a few tokens, travels to a remote tree search.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ngram_service import _native
from ngram_service.tree_search import ContextChain

__all__ = ["ContextIndex"]


class ContextIndex:
    """A growing sequence's n-gram index (see the module docstring).

    Args:
        max_context: longest context looked up, in tokens (1..8).
        max_tokens: tokens kept indexed (memory bound).

    Raises:
        ValueError: settings out of range; a negative token id in :meth:`append`.
    """

    def __init__(self, max_context: int = 4, max_tokens: int = 1 << 16) -> None:
        self._native = _native.ContextIndex(max_context, max_tokens)

    def __len__(self) -> int:
        return self._native.size

    @property
    def max_context(self) -> int:
        return self._native.max_context

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Indexes new tokens (each as the follower of the contexts before it)."""
        self._native.append(np.asarray(tokens, dtype=np.int64).reshape(-1))

    def probability(self, token: int, extra: Sequence[int] = ()) -> float:
        """q(token | the sequence followed by ``extra``) = (|s| / max_context) · count(s·token) / count(s)
        for the longest suffix s (≤ max_context tokens) with count(s·token) > 0; 0 when none predicts it.
        The factor |s| / max_context discounts short matches (docs/engine.md, "Context in the tree")."""
        return float(self._native.probability(np.asarray(extra, dtype=np.int64).reshape(-1), int(token)))

    def continuation(self, max_len: int) -> ContextChain:
        """Up to ``max_len`` tokens that followed the most recent earlier occurrence of the longest
        suffix that occurred before (empty when none did), with their probabilities."""
        tokens, probs, match = self._native.continuation(int(max_len))
        return ContextChain(tokens, probs, int(match))
