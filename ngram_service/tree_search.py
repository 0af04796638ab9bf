"""DART draft-tree search over the C++ engine (typed Python API).

The draft head gives, for each of d future positions, a top-k of draft
tokens with probabilities.  The tree search (DART, arXiv 2601.19278,
"N-gram-enforced pruning"; DESIGN.md §2) beam-searches paths through these
levels, scoring each path by the draft probabilities and an n-gram trie:

    score(child) = score(parent) + λ_l · (μ_l · log(p_draft + ε) + ν · log(p_ngram + ε))

with λ_l = (l+1)^-0.7, μ_l = 0.9^l, ν = 0.5, ε = 1e-10 and no n-gram term at
level 0 (reference defaults, all fields of :class:`SearchParams`).  The best
``budget`` candidates over all levels form the draft tree, rooted at the last
accepted (bonus) token, which the target then verifies in one forward with
tree attention.  See ``csrc/search.hpp`` for tie-breaking and the
prefix-closure guarantee.  Without a trie (or with ``use_ngram=False``) the
search is logits-only: the fallback when the n-gram service is unreachable.

Worked example (k=2, w=1, depth 2, budget 2, logits-only)::

    ids   = [[5, 6], [7, 8]]; probs = [[0.6, 0.4], [0.9, 0.1]]
    tree  = search_tree(ids, probs, context=[1, 2, 3], params=SearchParams(top_k=2, beam_width=1,
                        max_depth=2, budget=2, use_ngram=False))
    tree.tokens   -> [3, 5, 7]      (root = last context token)
    tree.parents  -> [-1, 0, 1]
    tree.retrieve_indices -> [[0, 1, 2]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ngram_service import _native
from ngram_service.trie import NgramTrie, pack_ragged

__all__ = ["DraftTree", "SearchParams", "search_tree", "search_trees"]

#: Bound C++ parameter struct; every field is a runtime setting (keyword-only
#: constructor, validated): top_k=25, beam_width=20, max_depth=8, budget=60
#: (draft nodes, root excluded), level_weight_exponent=0.7 (λ_l),
#: logit_weight_base=0.9 (μ_l), ngram_weight=0.5 (ν), epsilon=1e-10,
#: eos_token_id=-1 (none), ngram_at_level0=False, use_ngram=True,
#: num_threads=1 (sequences searched in parallel by :func:`search_trees`).
SearchParams = _native.SearchParams


@dataclass(frozen=True)
class DraftTree:
    """One draft tree.  Node 0 is the root (the last accepted / bonus token);
    nodes are ordered by depth, so every parent precedes its children."""

    tokens: np.ndarray  # [num_nodes] int64 token ids
    parents: np.ndarray  # [num_nodes] int32 parent node index, -1 for the root
    depths: np.ndarray  # [num_nodes] int32 depth = position offset from the root
    scores: np.ndarray  # [num_nodes] float64 search scores (root 0)
    tree_mask: np.ndarray  # [num_nodes, num_nodes] bool, [i, j] = j is i or an ancestor of i
    retrieve_indices: np.ndarray  # [num_leaves, max_depth + 1] int32 root-to-leaf node paths, padded -1

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def from_parents(cls, tokens, parents, depths, scores) -> "DraftTree":
        """Rebuilds tree_mask and retrieve_indices from a depth-ordered tree
        (as the gRPC service sends it); equal to what the C++ search returns."""
        tokens = np.asarray(tokens, dtype=np.int64)
        parents = np.asarray(parents, dtype=np.int32)
        depths = np.asarray(depths, dtype=np.int32)
        n = len(tokens)
        if not (len(parents) == len(depths) == n >= 1) or parents[0] != -1:
            raise ValueError("a draft tree needs equal-length arrays and a root with parent -1")
        if n > 1 and (np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, n))
                      or np.any(depths[1:] != depths[parents[1:]] + 1)):
            raise ValueError("draft tree nodes must follow their parents, one level deeper")
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        leaves = np.setdiff1d(np.arange(n), parents[1:])
        width = int(depths.max()) + 1
        retrieve = np.full((len(leaves), width), -1, dtype=np.int32)
        for row, leaf in enumerate(leaves):
            v = int(leaf)
            while v >= 0:
                retrieve[row, depths[v]] = v
                v = int(parents[v])
        return cls(tokens=tokens, parents=parents, depths=depths, scores=np.asarray(scores, dtype=np.float64),
                   tree_mask=mask, retrieve_indices=retrieve)

    @classmethod
    def _from_native(cls, d: dict) -> "DraftTree":
        return cls(
            tokens=d["tokens"],
            parents=d["parents"],
            depths=d["depths"],
            scores=d["scores"],
            tree_mask=d["tree_mask"].view(np.bool_),
            retrieve_indices=d["retrieve_indices"],
        )


def _native_trie(trie: NgramTrie | None):
    return None if trie is None else trie.native


def search_tree(
    topk_ids: np.ndarray,
    topk_probs: np.ndarray,
    context: Sequence[int],
    *,
    trie: NgramTrie | None = None,
    params: SearchParams | None = None,
) -> DraftTree:
    """Searches one draft tree.

    Args:
        topk_ids: [depth, k] draft token ids per level, columns by descending
            probability (as ``torch.topk`` returns them).
        topk_probs: [depth, k] their probabilities (softmax over the top-k logits).
        context: [context_len >= 1] prompt + accepted tokens, ending with the
            root (bonus) token.
        trie: n-gram trie; None for the logits-only search.
        params: search parameters (reference defaults when None).

    Returns:
        A prefix-closed :class:`DraftTree` of ``min(budget, candidates) + 1`` nodes.

    Raises:
        ValueError: bad shapes, token ids or probabilities, or invalid parameters.
        TrieFormatError: the trie is found corrupt during the search.
    """
    return DraftTree._from_native(
        _native.search_tree(params or SearchParams(), _native_trie(trie), topk_ids, topk_probs,
                            np.asarray(context, dtype=np.int64)))


def search_trees(
    topk_ids: np.ndarray,
    topk_probs: np.ndarray,
    contexts: Sequence[Sequence[int]],
    *,
    trie: NgramTrie | None = None,
    params: SearchParams | None = None,
) -> list[DraftTree]:
    """Searches a batch of sequences in one call, on ``params.num_threads`` threads.

    Args:
        topk_ids: [batch, depth, k]; topk_probs: [batch, depth, k].
        contexts: ``batch`` sequences of different lengths, each ending with its root token.

    Returns:
        ``batch`` trees (their node counts may differ).

    Raises:
        ValueError / TrieFormatError: as :func:`search_tree`.
    """
    flat, offsets = pack_ragged(contexts)
    trees = _native.search_trees(params or SearchParams(), _native_trie(trie), topk_ids, topk_probs, flat, offsets)
    return [DraftTree._from_native(t) for t in trees]
