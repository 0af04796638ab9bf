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

A served engine also receives, with each tree search, the n-gram service's live
corpus's continuation of the sequence (:mod:`ngram_service.live`);
:meth:`ContextIndex.hint` keeps it, and :meth:`ContextIndex.continuation` proposes
what remains of it while the accepted tokens follow it, where it matched a longer
suffix than the sequence's own: the lookup steps of the following steps draft from
the shared corpus without another call to the service.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ngram_service import _native
from ngram_service.live import LONG_MATCH
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
        self._hint: ContextChain | None = None
        self._hint_at = 0  # tokens of the hint the sequence has followed since it came

    def __len__(self) -> int:
        return self._native.size

    @property
    def max_context(self) -> int:
        return self._native.max_context

    @property
    def hint_match_cap(self) -> int:
        """The match length a :meth:`hint` of a short match followed past ``max_context`` tokens reports:
        ``max_context + 1``, one value for all of them, longer than any match of the sequence's
        own, so that the adaptive budget (which learns a chain's acceptance per match length,
        :meth:`~dart_core.spec.budget.AdaptiveBudget.chain_acceptance`) learns it from every
        followed hint at once."""
        return self.max_context + 1

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Indexes new tokens (each as the follower of the contexts before it); a :meth:`hint` they
        do not follow is dropped."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self._native.append(tokens)
        if self._hint is not None:
            at, n = self._hint_at, tokens.size
            if at + n <= len(self._hint.tokens) and np.array_equal(self._hint.tokens[at:at + n], tokens):
                self._hint_at += n
            else:
                self._hint = None

    def hint(self, chain: ContextChain) -> None:
        """Keeps an outside continuation of the sequence as it stands now (the live corpus's, from a
        tree search: ``chain.match_length`` tokens of the sequence's suffix matched there).  While
        the tokens appended next follow it, :meth:`continuation` proposes what remains of it where
        it beats the sequence's own chain; the first token that departs from it drops it.  An
        earlier hint that is still followed, has at least as many tokens left and now matches a
        longer suffix is kept instead; an empty chain changes nothing."""
        if not len(chain.tokens):
            return
        h = self._hint
        if h is not None and len(h.tokens) - self._hint_at >= len(chain.tokens) and \
                self._followed(h, self._hint_at) > self._followed(chain, 0):
            return
        self._hint, self._hint_at = chain, 0

    def _followed(self, hint: ContextChain, at: int) -> int:
        """A hint's match length after ``at`` of its tokens were followed: its match, counted at most
        as ``max_context`` tokens (a longer match in the live corpus does not outweigh the
        sequence's own full-length one), plus ``at``, at most :attr:`hint_match_cap`; a match of
        :data:`~ngram_service.live.LONG_MATCH` tokens or more (the request repeats earlier traffic)
        counts in full, plus ``at``, and outweighs any of the sequence's own."""
        if hint.match_length >= LONG_MATCH:
            return int(hint.match_length) + at
        return min(min(hint.match_length, self.max_context) + at, self.hint_match_cap)

    def probability(self, token: int, extra: Sequence[int] = ()) -> float:
        """q(token | the sequence followed by ``extra``) = (|s| / max_context) · count(s·token) / count(s)
        for the longest suffix s (≤ max_context tokens) with count(s·token) > 0; 0 when none predicts it.
        The factor |s| / max_context discounts short matches (docs/engine.md, "Context in the tree")."""
        return float(self._native.probability(np.asarray(extra, dtype=np.int64).reshape(-1), int(token)))

    def continuation(self, max_len: int) -> ContextChain:
        """Up to ``max_len`` tokens that followed the most recent earlier occurrence of the longest
        suffix that occurred before (empty when none did), with their probabilities.  Where a
        :meth:`hint` is still followed and has tokens left, its remainder instead when it matched a
        longer suffix: its match length plus the tokens followed since (:meth:`_followed`), against
        the sequence's own (the sequence's own on a tie)."""
        tokens, probs, match = self._native.continuation(int(max_len))
        h, at = self._hint, self._hint_at
        if h is not None and at < len(h.tokens):
            followed = self._followed(h, at)
            if followed > match or not len(tokens):
                return ContextChain(h.tokens[at:at + max_len], h.probs[at:at + max_len], followed)
        return ContextChain(tokens, probs, int(match))
