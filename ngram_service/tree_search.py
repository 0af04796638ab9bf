"""DART draft-tree search over the C++ engine (typed Python API).

The draft head gives, for each of d future positions, a top-k of draft
tokens with probabilities.  The tree search (DART, arXiv 2601.19278,
"N-gram-enforced pruning"; docs/design.md §2) beam-searches paths through these
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

from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np

from ngram_service import _native
from ngram_service.trie import NgramTrie, pack_ragged

__all__ = ["ContextChain", "DraftTree", "SearchParams", "search_tree", "search_trees"]

@dataclass(frozen=True)
class SearchParams:
    """Tree-search parameters: the one place their defaults are written (the
    reference DART defaults).  Frozen and validated on construction; change a
    field with :func:`dataclasses.replace`.  Converted to the C++ struct once,
    at construction (:meth:`native`).

    Raises:
        ValueError: a field out of range (non-positive sizes, λ / μ / ν / ε
            outside their ranges, ``num_threads`` < 1).
    """

    top_k: int = 25  # draft tokens per level
    beam_width: int = 20  # beam survivors per level
    max_depth: int = 8  # levels searched (≤ the draft length d)
    budget: int = 60  # draft nodes in the tree, root excluded
    level_weight_exponent: float = 0.7  # λ_l = (l+1)^-exponent
    logit_weight_base: float = 0.9  # μ_l = base^l
    ngram_weight: float = 0.5  # ν
    epsilon: float = 1e-10  # added before every log
    eos_token_id: int = -1  # candidates ending in it rank last and are not extended; -1: none
    ngram_at_level0: bool = False  # the paper leaves level 0 to the draft head
    use_ngram: bool = True  # False: logits-only search (the fallback)
    num_threads: int = 1  # sequences searched in parallel by one batched call
    context_weight: float = 0.5  # κ: trust in a context continuation (ContextChain; tuned, docs/engine.md); 0: the paper's search
    _native: object = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        object.__setattr__(self, "_native", _native.SearchParams(**values))  # validates (ValueError)

    def native(self):
        """The bound C++ struct (read-only) that the search functions take."""
        return self._native


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
    probs: np.ndarray  # [num_nodes] float32 acceptance estimate: p_draft, or max(p_draft, q) on a context chain (root 1)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def root(cls, token: int) -> "DraftTree":
        """The tree of the root alone (an autoregressive step's): equal to
        ``from_parents([token], [-1], [0], [0.0], [1.0])``, its fields other than ``tokens``
        shared, read-only arrays, so that a step of a large batch builds it cheaply."""
        return cls(tokens=np.array([token], dtype=np.int64), parents=_ROOT_PARENTS, depths=_ROOT_DEPTHS,
                   scores=_ROOT_SCORES, tree_mask=_ROOT_MASK, retrieve_indices=_ROOT_RETRIEVE, probs=_ROOT_PROBS)

    @classmethod
    def from_parents(cls, tokens, parents, depths, scores, probs) -> "DraftTree":
        """Rebuilds tree_mask and retrieve_indices from a depth-ordered tree
        (as the gRPC service sends it); equal to what the C++ search returns.

        Raises:
            ValueError: arrays of different lengths, or nodes that do not follow their parents.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        parents = np.asarray(parents, dtype=np.int32)
        depths = np.asarray(depths, dtype=np.int32)
        probs = np.asarray(probs, dtype=np.float32)
        n = len(tokens)
        if not (len(parents) == len(depths) == len(probs) == n >= 1) or parents[0] != -1:
            raise ValueError("a draft tree needs equal-length arrays and a root with parent -1")
        if n > 1 and (np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, n))
                      or np.any(depths[1:] != depths[parents[1:]] + 1)):
            raise ValueError("draft tree nodes must follow their parents, one level deeper")
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        return cls(tokens=tokens, parents=parents, depths=depths, scores=np.asarray(scores, dtype=np.float64),
                   tree_mask=mask, retrieve_indices=_retrieve_indices(parents, depths, mask), probs=probs)

    def select(self, keep: np.ndarray) -> "DraftTree":
        """The subtree of the nodes where ``keep`` [num_nodes] bool is True, re-indexed in
        the same order, every field consistent (mask, retrieve indices).  Returns ``self``
        when every node is kept.

        Raises:
            ValueError: ``keep`` drops the root or keeps a node without its parent.
        """
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != (self.num_nodes,):
            raise ValueError(f"keep has shape {keep.shape}, the tree {self.num_nodes} nodes")
        if keep.all():
            return self
        if not keep[0] or np.any(keep[1:] & ~keep[np.maximum(self.parents[1:], 0)]):
            raise ValueError("a subtree must keep the root and every kept node's parent (prefix-closed)")
        idx = np.flatnonzero(keep)
        new_of = np.full(self.num_nodes, -1, dtype=np.int32)
        new_of[idx] = np.arange(len(idx), dtype=np.int32)
        parents = self.parents[idx]
        parents = np.where(parents >= 0, new_of[np.maximum(parents, 0)], -1).astype(np.int32)
        depths = self.depths[idx]
        mask = self.tree_mask[np.ix_(idx, idx)]
        return DraftTree(tokens=self.tokens[idx], parents=parents, depths=depths, scores=self.scores[idx],
                         tree_mask=mask, retrieve_indices=_retrieve_indices(parents, depths, mask),
                         probs=self.probs[idx])

    def clip_depth(self, max_depth: int) -> "DraftTree":
        """Without the nodes deeper than ``max_depth`` (the root alone for ``max_depth`` ≤ 0);
        ``self`` when no node is (nodes are in depth order: the last is the deepest)."""
        if int(self.depths[-1]) <= max_depth:
            return self
        return self.select(self.depths <= max(max_depth, 0))

    @classmethod
    def _from_native(cls, d: dict) -> "DraftTree":
        return cls(
            tokens=d["tokens"],
            parents=d["parents"],
            depths=d["depths"],
            scores=d["scores"],
            tree_mask=d["tree_mask"].view(np.bool_),
            retrieve_indices=d["retrieve_indices"],
            probs=d["probs"],
        )


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# the fields of every root-only tree (DraftTree.root), shared
_ROOT_PARENTS = _read_only(np.array([-1], dtype=np.int32))
_ROOT_DEPTHS = _read_only(np.array([0], dtype=np.int32))
_ROOT_SCORES = _read_only(np.array([0.0], dtype=np.float64))
_ROOT_MASK = _read_only(np.array([[True]]))
_ROOT_RETRIEVE = _read_only(np.array([[0]], dtype=np.int32))
_ROOT_PROBS = _read_only(np.array([1.0], dtype=np.float32))


def _retrieve_indices(parents: np.ndarray, depths: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[num_leaves, max_depth + 1] int32 root-to-leaf node paths padded -1, from the ancestor mask."""
    n = len(parents)
    is_parent = np.zeros(n, dtype=bool)
    is_parent[parents[1:]] = True
    leaves = np.flatnonzero(~is_parent)
    retrieve = np.full((len(leaves), int(depths.max()) + 1), -1, dtype=np.int32)
    rows, nodes = np.nonzero(mask[leaves])
    retrieve[rows, depths[nodes]] = nodes
    return retrieve


def _native_trie(trie: NgramTrie | None):
    return None if trie is None else trie.native


@dataclass(frozen=True)
class ContextChain:
    """A continuation proposed by the request's own context (see ``csrc/search.hpp``): the tokens
    that followed an earlier occurrence of the sequence's recent suffix, with their context
    probabilities.  Built by :meth:`ngram_service.context.ContextIndex.continuation`."""

    tokens: np.ndarray  # [L] int64
    probs: np.ndarray  # [L] float32 in [0, 1]
    match_length: int = 0  # tokens of the suffix that matched

    @classmethod
    def empty(cls) -> "ContextChain":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.float32), 0)


def _pack_chains(chains: Sequence["ContextChain | None"] | None, batch: int):
    """(flat tokens [sum L], flat probs [sum L], offsets [batch + 1]), laid out as :func:`pack_ragged`."""
    if chains is None:
        chains = [None] * batch
    if len(chains) != batch:
        raise ValueError(f"{len(chains)} chains for a batch of {batch}")
    chains = [ContextChain.empty() if c is None else c for c in chains]
    tokens, offsets = pack_ragged([c.tokens for c in chains])
    probs = [np.asarray(c.probs, np.float32).reshape(-1) for c in chains]
    return tokens, np.concatenate(probs) if probs else np.zeros(0, np.float32), offsets


def search_tree(
    topk_ids: np.ndarray,
    topk_probs: np.ndarray,
    context: Sequence[int],
    *,
    trie: NgramTrie | None = None,
    params: SearchParams | None = None,
    chain: ContextChain | None = None,
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
        chain: the request's context continuation (used when ``params.context_weight`` > 0).

    Returns:
        A prefix-closed :class:`DraftTree` of ``min(budget, candidates) + 1`` nodes.

    Raises:
        ValueError: bad shapes, token ids or probabilities, or invalid parameters.
        TrieFormatError: the trie is found corrupt during the search.
    """
    chain = chain or ContextChain.empty()
    return DraftTree._from_native(
        _native.search_tree((params or SearchParams()).native(), _native_trie(trie), topk_ids, topk_probs,
                            np.asarray(context, dtype=np.int64), np.asarray(chain.tokens, np.int64),
                            np.asarray(chain.probs, np.float32)))


def search_trees(
    topk_ids: np.ndarray,
    topk_probs: np.ndarray,
    contexts: Sequence[Sequence[int]],
    *,
    trie: NgramTrie | None = None,
    params: SearchParams | None = None,
    chains: Sequence[ContextChain | None] | None = None,
) -> list[DraftTree]:
    """Searches a batch of sequences in one call, on ``params.num_threads`` threads.

    Args:
        topk_ids: [batch, depth, k]; topk_probs: [batch, depth, k].
        contexts: ``batch`` sequences of different lengths, each ending with its root token.
        chains: None, or ``batch`` context continuations (None entries: none for that sequence).

    Returns:
        ``batch`` trees (their node counts may differ).

    Raises:
        ValueError / TrieFormatError: as :func:`search_tree`.
    """
    flat, offsets = pack_ragged(contexts)
    chain_tokens, chain_probs, chain_offsets = _pack_chains(chains, len(contexts))
    trees = _native.search_trees((params or SearchParams()).native(), _native_trie(trie), topk_ids, topk_probs, flat,
                                 offsets, chain_tokens, chain_probs, chain_offsets)
    return [DraftTree._from_native(t) for t in trees]
