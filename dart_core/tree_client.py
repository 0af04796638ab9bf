"""Where the engine gets its draft trees: a small interface and the in-process
implementation over the C++ search of :mod:`ngram_service`.

The gRPC client of the n-gram service implements the same interface, so an
engine swaps one for the other without knowing.  Tests inject fakes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ngram_service.tree_search import DraftTree, SearchParams, search_trees
from ngram_service.trie import NgramTrie

__all__ = ["TreeSearchClient", "InProcessTreeSearch"]


class TreeSearchClient(ABC):
    """Builds one draft tree per sequence from the draft head's top-k."""

    @abstractmethod
    def search(self, topk_ids: np.ndarray, topk_probs: np.ndarray, contexts: Sequence[np.ndarray],
               params: SearchParams) -> list[DraftTree]:
        """Args: topk_ids [B, d, k] int64 target ids; topk_probs [B, d, k] float32;
        contexts: B token arrays ending with each root (bonus) token.
        Returns: B prefix-closed trees (node 0 = root)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases resources (channels, threads)."""


class InProcessTreeSearch(TreeSearchClient):
    """The C++ search in this process, with the trie memory-mapped here
    (``trie=None``: logits-only search, the service's fallback)."""

    def __init__(self, trie: NgramTrie | None = None) -> None:
        self.trie = trie

    def search(self, topk_ids, topk_probs, contexts, params):
        return search_trees(topk_ids, topk_probs, contexts, trie=self.trie, params=params)
