"""Drafters: what proposes each step's draft trees.

A decoding step is four phases (docs/design.md §2): **propose** (a
:class:`Drafter` gives one draft tree per running sequence), **select** (the
adaptive budget keeps the nodes worth verifying, and no tree reaches past a
sequence's token limit), **verify** (one target forward over the
:class:`DraftBatch`), **accept**. The engine knows drafters only through
:meth:`Drafter.propose` and :attr:`Drafter.uses_taps`, so a new drafter (a
deeper one-pass drafter, say) plugs in with ``DartEngine(drafter=...)``
without touching the engine.

Shipped drafters:

- :class:`DartDrafter`, the default with a draft head: a lookup step
  (:class:`LookupDrafter`) where the budget expects it to pay, else the head
  plus the tree search (:class:`HeadTreeDrafter`);
- :class:`NoDraft`: trees of only the root (autoregressive steps).
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dart_core.device import sync_device
from ngram_service.tree_search import ContextChain, DraftTree, TreeBatch

if TYPE_CHECKING:
    from dart_core.engine import DartEngine, _BatchState

__all__ = ["Drafter", "Proposal", "ProposalKind", "DraftBatch", "DartDrafter", "HeadTreeDrafter", "LookupDrafter", "NoDraft"]


class ProposalKind(str, enum.Enum):
    """How a :class:`Proposal`'s trees reach verification (the values are the former strings)."""

    TREE = "tree"  # the adaptive budget selects each tree's nodes and learns from what is accepted
    LOOKUP = "lookup"  # each tree is a context chain the budget already sized: verified as it is
    NONE = "none"  # roots only: an autoregressive step


@dataclass
class Proposal:
    """One step's proposed trees, before selection (host form).

    Attributes:
        trees: one tree per running sequence, in row order, as a padded
            :class:`~ngram_service.tree_search.TreeBatch` (a list of :class:`DraftTree` is packed
            into one on construction); node 0 is the sequence's last token (the root, not yet in
            the KV cache), and ``probs`` are the drafter's acceptance estimates per node (the
            adaptive budget prices nodes by their path products).
        kind: a :class:`ProposalKind` (its string value is accepted and converted):
            ``TREE``: the adaptive budget selects each tree's nodes
            (:meth:`~dart_core.budget.AdaptiveBudget.select_batch`) and learns from what is
            accepted; ``LOOKUP``: each tree is a context chain already sized by the budget
            (:meth:`~dart_core.budget.AdaptiveBudget.select_lookup`); ``NONE``: roots only.
        draft_ms, search_ms: milliseconds spent drafting and searching (reported per step).
        chains: with ``LOOKUP``, each sequence's chain (its match length calibrates the budget).
        catch_up: the draft fed more pending positions than a step normally accepts
            (the step is not typical of its mode; :attr:`~dart_core.engine.StepOutput.catch_up`).
    """

    trees: TreeBatch
    kind: ProposalKind = ProposalKind.TREE
    draft_ms: float = 0.0
    search_ms: float = 0.0
    chains: list[ContextChain] | None = None
    catch_up: bool = False

    def __post_init__(self) -> None:
        """Raises: ValueError: a ``kind`` that is not a :class:`ProposalKind` or one's value."""
        if not isinstance(self.trees, TreeBatch):
            self.trees = TreeBatch.from_trees(self.trees)
        self.kind = ProposalKind(self.kind)


class Drafter:
    """Proposes draft trees for the running sequences of a batch.

    Subclasses implement :meth:`propose`. ``uses_taps``: the engine keeps the target's
    hidden-state taps at every accepted position for the drafter (the DART head reads them);
    a drafter that does not read them leaves it False and the engine skips that bookkeeping.
    """

    uses_taps: bool = False

    def propose(self, engine: "DartEngine", state: "_BatchState") -> Proposal | None:
        """One tree per running sequence (``state.tokens[b]``: its prompt and accepted tokens, the
        last one the root), or None to step autoregressively this time.

        Reads what it needs from ``engine`` (head, tree search, search parameters, budget) and
        ``state`` (tokens, context indexes, pending taps); must not change what the engine's
        other phases read."""
        raise NotImplementedError


class NoDraft(Drafter):
    """Trees of only the root: an autoregressive step through the same verify and accept phases."""

    def propose(self, engine: "DartEngine", state: "_BatchState") -> Proposal:
        return Proposal(TreeBatch.roots([t[-1] for t in state.tokens]), kind=ProposalKind.NONE)


class LookupDrafter(Drafter):
    """Each sequence's context chain verified alone (prompt lookup's step), without the draft head
    and the tree search, where the adaptive budget expects it to beat a tree step
    (:meth:`~dart_core.budget.AdaptiveBudget.select_lookup`; docs/design.md §2, "Lookup steps").
    Proposes nothing (None) without the context, an adaptive budget or ``engine.lookup_length``."""

    def propose(self, engine: "DartEngine", state: "_BatchState") -> Proposal | None:
        t0 = time.perf_counter()
        if not (engine.uses_context and engine.budget is not None and engine.lookup_length > 0):
            return None
        chains = [c.continuation(min(engine.lookup_length, engine.search_params.budget)) for c in state.context]
        n = engine.budget.select_lookup(chains)
        if n == 0:
            return None
        return Proposal(_chain_batch([t[-1] for t in state.tokens], chains, n), kind=ProposalKind.LOOKUP,
                        search_ms=1e3 * (time.perf_counter() - t0), chains=chains)


def _chain_batch(roots: list[int], chains: list[ContextChain], n: int) -> TreeBatch:
    """Each root followed by the first ``n`` tokens of its chain (fewer where the chain is shorter),
    as one :class:`~ngram_service.tree_search.TreeBatch` of chains (node i's parent is node i - 1)."""
    b = len(roots)
    counts = 1 + np.minimum(n, np.fromiter((len(c.tokens) for c in chains), dtype=np.int64, count=b))
    tokens, probs = np.zeros((b, n + 1), np.int64), np.zeros((b, n + 1), np.float32)
    tokens[:, 0], probs[:, 0] = roots, 1.0
    for i, c in enumerate(chains):  # the chains are per-sequence arrays: one slice copy each
        tokens[i, 1:counts[i]], probs[i, 1:counts[i]] = c.tokens[: counts[i] - 1], c.probs[: counts[i] - 1]
    real = np.arange(n + 1)[None, :] < counts[:, None]
    steps = np.where(real, np.arange(n + 1, dtype=np.int32), 0)
    parents = np.where(real, steps - 1, 0).astype(np.int32)
    parents[:, 0] = -1
    width = int(counts.max()) if b else 1
    return TreeBatch(tokens[:, :width], parents[:, :width], steps[:, :width].astype(np.int32),
                     np.zeros((b, width)), probs[:, :width], counts)


class HeadTreeDrafter(Drafter):
    """DART's drafter (paper §3): one draft-head forward over each sequence's newly accepted
    positions gives top-k tokens per level, and the tree search (n-gram trie, the request's own
    context chain) turns them into one prefix-closed tree per sequence."""

    uses_taps = True

    def propose(self, engine: "DartEngine", state: "_BatchState") -> Proposal:
        device = engine.target.device
        t0 = time.perf_counter()
        width = max(len(x) for x in state.pend_next)  # pending positions per row, known on the host
        catch_up = width > engine.head.config.draft_length + 2
        topk_ids, topk_probs = engine._draft(state.pend_taps[:, :width], state.pend_next, state.pend_pos[:, :width],
                                             state.pend_count - 1, state.head_cache, engine._draft_levels(),
                                             max(len(t) for t in state.tokens))
        state.clear_pending()
        sync_device(device)
        draft_ms = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        levels = topk_ids.shape[1]
        chains = [c.continuation(levels) if c is not None else None for c in state.context] \
            if engine.uses_context else None
        params = engine.search_params if engine.budget is None else engine.budget.search_params(engine.search_params)
        trees = engine.tree_search.search_batch(topk_ids, topk_probs,
                                                [np.asarray(t, dtype=np.int64) for t in state.tokens],
                                                params, chains)
        return Proposal(trees, kind=ProposalKind.TREE, draft_ms=draft_ms, search_ms=1e3 * (time.perf_counter() - t0),
                        catch_up=catch_up)


class DartDrafter(Drafter):
    """The engine's default with a draft head: a lookup step where the budget prefers one
    (:class:`LookupDrafter`), otherwise the head and the tree search (:class:`HeadTreeDrafter`)."""

    uses_taps = True

    def __init__(self) -> None:
        self.lookup, self.tree = LookupDrafter(), HeadTreeDrafter()

    def propose(self, engine: "DartEngine", state: "_BatchState") -> Proposal:
        return self.lookup.propose(engine, state) or self.tree.propose(engine, state)


@dataclass(frozen=True)
class DraftBatch:
    """A step's selected draft trees, padded to one node count N and moved to the device together:
    what verification and acceptance read.  Padding nodes are token 0 at depth 0 with the root as
    parent, see only themselves, and have acceptance estimate 0.

    Attributes:
        trees: the selected trees (host form, :class:`~ngram_service.tree_search.TreeBatch`: the same
            [B, N] layout on the host, the root's parent -1).
        tokens: [B, N] int64 token ids.
        parents: [B, N] int64 parent node indices (the root's given as 0).
        depths: [B, N] int64 node depths (the root 0); a node's position is the sequence's cached
            length plus its depth.
        counts: [B] int64 real nodes per tree.
        tree_mask: [B, N, N] bool, ``[b, i, j]``: node j is node i or one of its ancestors (tree
            attention).
        num_nodes: N.  max_depth: the deepest node of any tree.
        estimates: [B, N] float32 acceptance estimates, the product of ``probs`` along each node's
            path, as :func:`~dart_core.budget.node_acceptance_estimates` (the root 1, padding 0);
            computed from ``trees`` when first read (no phase of the engine's step reads it today,
            so the step does not pay for it).
    """

    trees: TreeBatch
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    counts: torch.Tensor
    tree_mask: torch.Tensor
    num_nodes: int
    max_depth: int

    @functools.cached_property
    def estimates(self) -> torch.Tensor:
        return torch.from_numpy(self.trees.path_products().astype(np.float32)).to(self.tokens.device)

    @classmethod
    def pack(cls, trees: TreeBatch | list[DraftTree], device: torch.device) -> "DraftBatch":
        """The host arrays in one copy per field to ``device``, the ancestor mask built from the
        parents for the whole batch at once (roots alone, an autoregressive step: the root tokens
        in one copy, the other fields made there).  On CUDA the copies go from pinned host memory
        without blocking the host (PyTorch's caching host allocator keeps a staging buffer until
        its copy has run).  A list of trees is packed first."""
        if not isinstance(trees, TreeBatch):
            trees = TreeBatch.from_trees(trees)
        b, n = trees.tokens.shape
        if n == 1:
            tokens = torch.from_numpy(trees.tokens).to(device)
            zeros = torch.zeros_like(tokens)
            return cls(trees, tokens, zeros, zeros, torch.ones(b, dtype=torch.long, device=device),
                       torch.ones(b, 1, 1, dtype=torch.bool, device=device), 1, 0)
        cuda = torch.device(device).type == "cuda"
        # tokens, parents, depths; counts in [3, :, 0]; on CUDA in pinned memory, copied without a sync
        ints_h = torch.zeros((4, b, n), dtype=torch.int64, pin_memory=cuda)
        ints = ints_h.numpy()
        ints[0], ints[1], ints[2] = trees.tokens, trees.parents, trees.depths
        ints[1, :, 0] = 0
        ints[3, :, 0] = trees.counts
        mask = torch.from_numpy(trees.ancestor_mask())
        if cuda:
            mask = mask.pin_memory()
        ints_d = ints_h.to(device, non_blocking=cuda)
        return cls(trees, ints_d[0], ints_d[1], ints_d[2], ints_d[3, :, 0].contiguous(),
                   mask.to(device, non_blocking=cuda), n, trees.max_depth)
