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

__all__ = ["ContextChain", "DraftTree", "SearchParams", "TreeBatch", "search_tree", "search_trees", "search_tree_batch"]

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


@dataclass(frozen=True)
class TreeBatch:
    """B draft trees padded to one node count N, as host arrays: the batched form that the tree
    search writes (:func:`search_tree_batch`), the adaptive budget selects from and the engine
    packs for the device, with no per-tree Python on the way.  Row b's first ``counts[b]`` nodes
    are its tree, in :class:`DraftTree`'s order (node 0 the root, depth order, every parent before
    its children); the nodes past them are padding: token 0, parent 0, depth 0, score 0, probability 0.

    Attributes:
        tokens: [B, N] int64 token ids.
        parents: [B, N] int32 parent node indices, the root's -1.
        depths: [B, N] int32 depths (position offsets from the root).
        scores: [B, N] float64 search scores (root 0).
        probs: [B, N] float32 acceptance estimates per node (``DraftTree.probs``; root 1).
        counts: [B] int64 nodes per tree, root included (1 to N).
        live: where the search service was asked for them (``TreeSearchRequest.live_chain_length``),
            each sequence's live-corpus continuation of its context (:class:`ContextChain`), for the
            engine's next lookup steps (:meth:`ngram_service.context.ContextIndex.hint`); None
            otherwise.  Not carried by :meth:`select`.

    Raises (on construction): ValueError for arrays of other shapes, or counts outside 1 .. N.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    scores: np.ndarray
    probs: np.ndarray
    counts: np.ndarray
    live: tuple | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        shape = self.tokens.shape
        if len(shape) != 2 or any(a.shape != shape for a in (self.parents, self.depths, self.scores, self.probs)):
            raise ValueError("a tree batch needs [B, N] arrays of one shape")
        if self.counts.shape != shape[:1] or (shape[0] and not (1 <= self.counts.min() and
                                                                self.counts.max() <= shape[1])):
            raise ValueError(f"a tree batch of {shape[1]} nodes per row needs counts in 1 .. {shape[1]}")

    @classmethod
    def checked(cls, tokens, parents, depths, scores, probs, counts) -> "TreeBatch":
        """A batch from arrays that came from elsewhere (the gRPC service's answer), checked as
        :meth:`DraftTree.from_parents` checks a tree: each root has parent -1 and depth 0, every other
        node's parent comes before it and is one level up.  Flat arrays are reshaped to [B, N].

        Raises:
            ValueError: what the constructor refuses, or a row that is not such a tree."""
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        b = len(counts)
        arrays = [np.asarray(a, dtype=t) for a, t in ((tokens, np.int64), (parents, np.int32), (depths, np.int32),
                                                      (scores, np.float64), (probs, np.float32))]
        if any(a.size % max(b, 1) for a in arrays) or len({a.size for a in arrays}) != 1:
            raise ValueError("a tree batch needs equal-length arrays of [batch, num_nodes] values")
        n = arrays[0].size // b if b else 1
        out = cls(*(a.reshape(b, n) for a in arrays), counts)
        if b and (np.any(out.parents[:, 0] != -1) or np.any(out.depths[:, 0] != 0)):
            raise ValueError("every draft tree needs a root with parent -1 at depth 0")
        node = np.arange(n)[None, :]
        inner = out.real & (node > 0)
        parent = np.where(inner, out.parents, 0).astype(np.int64)
        up = np.take_along_axis(out.depths, parent, axis=1)
        if np.any(inner & ((out.parents < 0) | (out.parents >= node) | (out.depths != up + 1))):
            raise ValueError("draft tree nodes must follow their parents, one level deeper")
        return out

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        """N, the padded node count."""
        return int(self.tokens.shape[1])

    @property
    def real(self) -> np.ndarray:
        """[B, N] bool: which entries are nodes of their tree (not padding)."""
        return np.arange(self.num_nodes)[None, :] < self.counts[:, None]

    @property
    def max_depth(self) -> int:
        """The deepest node of any tree (0 for roots alone or an empty batch)."""
        return int(self.depths.max()) if self.depths.size else 0

    @classmethod
    def roots(cls, tokens: Sequence[int]) -> "TreeBatch":
        """Trees of the root alone (an autoregressive step), one per token."""
        t = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        b = len(t)
        return cls(t, np.full((b, 1), -1, np.int32), np.zeros((b, 1), np.int32), np.zeros((b, 1)),
                   np.ones((b, 1), np.float32), np.ones(b, np.int64))

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree]) -> "TreeBatch":
        """The trees padded to the largest (a drafter that builds :class:`DraftTree` objects)."""
        b = len(trees)
        counts = np.fromiter((t.num_nodes for t in trees), dtype=np.int64, count=b)
        n = int(counts.max()) if b else 1
        out = cls._empty(b, n)
        for i, t in enumerate(trees):
            m = t.num_nodes
            out.tokens[i, :m], out.parents[i, :m], out.depths[i, :m] = t.tokens, t.parents, t.depths
            out.scores[i, :m], out.probs[i, :m] = t.scores, t.probs
        return cls(out.tokens, out.parents, out.depths, out.scores, out.probs, counts)

    @classmethod
    def _empty(cls, b: int, n: int) -> "TreeBatch":
        return cls(np.zeros((b, n), np.int64), np.zeros((b, n), np.int32), np.zeros((b, n), np.int32),
                   np.zeros((b, n)), np.zeros((b, n), np.float32), np.ones(b, np.int64))

    def tree(self, i: int) -> DraftTree:
        """Row ``i`` as a :class:`DraftTree` (for a per-sequence consumer: a grammar's drafting)."""
        m = int(self.counts[i])
        return DraftTree.from_parents(self.tokens[i, :m], self.parents[i, :m], self.depths[i, :m],
                                      self.scores[i, :m], self.probs[i, :m])

    def trees(self) -> list[DraftTree]:
        """Every row as a :class:`DraftTree`."""
        return [self.tree(i) for i in range(len(self))]

    def path_values(self) -> tuple[np.ndarray, np.ndarray]:
        """(eff, est), [B, N] float64 each, in one C++ pass: ``eff`` the lowest search score along
        each node's path (root +inf, padding -inf), the search's rank key (``csrc/search.cpp``);
        ``est`` the product of ``probs`` along it (root 1, padding 0), as
        :func:`dart_core.spec.budget.node_acceptance_estimates` per tree.

        Raises:
            ValueError: a node whose parent does not come before it (this and :meth:`ancestor_mask`,
                :meth:`select` check what the constructor does not; :meth:`checked` checks it all)."""
        return _native.path_values(self.parents, self.counts, self.scores, self.probs)

    def path_products(self) -> np.ndarray:
        """[B, N] float64: the ``est`` of :meth:`path_values`."""
        return self.path_values()[1]

    def ancestor_mask(self) -> np.ndarray:
        """[B, N, N] bool, ``[b, i, j]``: node j is node i or one of its ancestors (tree attention;
        a padding node sees only itself), built in one C++ pass."""
        return _native.ancestor_masks(self.parents, self.counts)

    def select(self, keep: np.ndarray) -> "TreeBatch":
        """Each row cut to the nodes where ``keep`` [B, N] bool is True (padding ignored),
        re-indexed in the same order and padded to the largest kept count, in one C++ pass;
        ``self`` when every node is kept.  As :meth:`DraftTree.select` per row.

        Raises:
            ValueError: ``keep`` of another shape, dropping a root, or keeping a node without its parent.
        """
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != self.tokens.shape:
            raise ValueError(f"keep has shape {keep.shape}, the batch {self.tokens.shape}")
        if np.count_nonzero(keep & self.real) == self.counts.sum():
            return self
        return TreeBatch(*_native.select_nodes(keep, self.tokens, self.parents, self.depths, self.scores, self.probs,
                                               self.counts))

    def clip_depth(self, max_depths: np.ndarray) -> "TreeBatch":
        """Each row without its nodes deeper than ``max_depths`` [B] (the root alone where ≤ 0);
        ``self`` when no node is."""
        limit = np.maximum(np.asarray(max_depths, dtype=np.int64), 0)[:, None]
        if not np.any(self.depths > limit):
            return self
        return self.select(self.depths <= limit)


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
    trees = _native.search_trees(*_batch_arguments(topk_ids, topk_probs, contexts, trie, params, chains))
    return [DraftTree._from_native(t) for t in trees]


def _batch_arguments(topk_ids, topk_probs, contexts, trie, params, chains) -> tuple:
    """The native batched searches' arguments: the parameters and trie in their C++ form, the
    contexts and chains packed flat with their offsets."""
    flat, offsets = pack_ragged(contexts)
    chain_tokens, chain_probs, chain_offsets = _pack_chains(chains, len(contexts))
    return ((params or SearchParams()).native(), _native_trie(trie), topk_ids, topk_probs, flat, offsets,
            chain_tokens, chain_probs, chain_offsets)


def search_tree_batch(
    topk_ids: np.ndarray,
    topk_probs: np.ndarray,
    contexts: Sequence[Sequence[int]],
    *,
    trie: NgramTrie | None = None,
    params: SearchParams | None = None,
    chains: Sequence[ContextChain | None] | None = None,
) -> TreeBatch:
    """:func:`search_trees`' trees as one :class:`TreeBatch`, written by the C++ search straight into
    its padded arrays (no per-tree mask, retrieve indices or Python object).  Arguments and errors as
    :func:`search_trees`."""
    d = _native.search_trees_padded(*_batch_arguments(topk_ids, topk_probs, contexts, trie, params, chains))
    return TreeBatch(d["tokens"], d["parents"], d["depths"], d["scores"], d["probs"], d["counts"])
