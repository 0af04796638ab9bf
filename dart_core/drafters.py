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

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dart_core.target import sync_device
from ngram_service.tree_search import ContextChain, DraftTree

if TYPE_CHECKING:
    from dart_core.engine import DartEngine, _BatchState

__all__ = ["Drafter", "Proposal", "DraftBatch", "DartDrafter", "HeadTreeDrafter", "LookupDrafter", "NoDraft"]


@dataclass
class Proposal:
    """One step's proposed trees, before selection (host form).

    Attributes:
        trees: one per running sequence, in row order; node 0 is the sequence's last token
            (the root, not yet in the KV cache), and ``probs`` are the drafter's acceptance
            estimates per node (the adaptive budget prices nodes by their path products).
        kind: ``"tree"``: the adaptive budget selects each tree's nodes
            (:meth:`~dart_core.budget.AdaptiveBudget.select_batch`) and learns from what is
            accepted; ``"lookup"``: each tree is a context chain already sized by the budget
            (:meth:`~dart_core.budget.AdaptiveBudget.select_lookup`); ``"none"``: roots only.
        draft_ms, search_ms: milliseconds spent drafting and searching (reported per step).
        chains: with ``"lookup"``, each sequence's chain (its match length calibrates the budget).
        catch_up: the draft fed more pending positions than a step normally accepts
            (the step is not typical of its mode; :attr:`~dart_core.engine.StepOutput.catch_up`).
    """

    trees: list[DraftTree]
    kind: str = "tree"
    draft_ms: float = 0.0
    search_ms: float = 0.0
    chains: list[ContextChain] | None = None
    catch_up: bool = False


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
        return Proposal([DraftTree.root(t[-1]) for t in state.tokens], kind="none")


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
        trees = []
        for seq, chain in zip(state.tokens, chains):
            k = min(n, len(chain.tokens))
            trees.append(DraftTree.from_parents(np.concatenate([[seq[-1]], chain.tokens[:k]]),
                                                np.arange(-1, k), np.arange(k + 1), np.zeros(k + 1),
                                                np.concatenate([[1.0], chain.probs[:k]])))
        return Proposal(trees, kind="lookup", search_ms=1e3 * (time.perf_counter() - t0), chains=chains)


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
        trees = engine.tree_search.search(topk_ids, topk_probs, [np.asarray(t, dtype=np.int64) for t in state.tokens],
                                          engine.search_params, chains)
        return Proposal(trees, kind="tree", draft_ms=draft_ms, search_ms=1e3 * (time.perf_counter() - t0),
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
        trees: the selected trees (host form), one per sequence.
        tokens: [B, N] int64 token ids.
        parents: [B, N] int64 parent node indices (the root's given as 0).
        depths: [B, N] int64 node depths (the root 0); a node's position is the sequence's cached
            length plus its depth.
        counts: [B] int64 real nodes per tree.
        tree_mask: [B, N, N] bool, ``[b, i, j]``: node j is node i or one of its ancestors (tree
            attention).
        num_nodes: N.  max_depth: the deepest node of any tree.
        estimates: [B, N] float32 acceptance estimates, the product of ``DraftTree.probs`` along
            each node's path, as :func:`~dart_core.budget.node_acceptance_estimates` (the root 1,
            padding 0); computed from ``trees`` when first read (no phase of the engine's step reads
            it today, so the step does not pay for it).
    """

    trees: list[DraftTree]
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    counts: torch.Tensor
    tree_mask: torch.Tensor
    num_nodes: int
    max_depth: int

    @functools.cached_property
    def estimates(self) -> torch.Tensor:
        b, n = len(self.trees), self.num_nodes
        parents = np.zeros((b, n), dtype=np.int64)
        depths = np.zeros((b, n), dtype=np.int64)
        probs = np.zeros((b, n), dtype=np.float64)
        for i, tr in enumerate(self.trees):
            m = tr.num_nodes
            parents[i, 1:m], depths[i, :m], probs[i, :m] = tr.parents[1:], tr.depths, tr.probs
        # path products level by level (a parent is one level up), as node_acceptance_estimates
        real = np.arange(n)[None, :] < np.array([tr.num_nodes for tr in self.trees])[:, None]
        est = np.where(depths == 0, 1.0, 0.0)
        for level in range(1, int(depths.max()) + 1):
            at = (depths == level) & real
            est = np.where(at, np.take_along_axis(est, parents, axis=1) * probs, est)
        return torch.from_numpy(np.where(real, est, 0.0).astype(np.float32)).to(self.tokens.device)

    @classmethod
    def pack(cls, trees: list[DraftTree], device: torch.device) -> "DraftBatch":
        """One host array per field, filled tree by tree, then one copy each to ``device`` (roots
        alone, an autoregressive step: the root tokens in one copy, the other fields made there)."""
        b = len(trees)
        sizes = [tr.num_nodes for tr in trees]
        n = max(sizes)
        if n == 1:
            tokens = torch.tensor([int(tr.tokens[0]) for tr in trees], device=device)[:, None]
            zeros = torch.zeros_like(tokens)
            return cls(list(trees), tokens, zeros, zeros, torch.ones(b, dtype=torch.long, device=device),
                       torch.ones(b, 1, 1, dtype=torch.bool, device=device), 1, 0)
        ints = np.zeros((4, b, n), dtype=np.int64)  # tokens, parents, depths; counts in [3, :, 0]
        mask = np.broadcast_to(np.eye(n, dtype=bool), (b, n, n)).copy()
        max_depth = 0
        for i, tr in enumerate(trees):
            m = sizes[i]
            ints[0, i, :m] = tr.tokens
            ints[1, i, 1:m] = tr.parents[1:]
            ints[2, i, :m] = tr.depths
            mask[i, :m, :m] = tr.tree_mask
            max_depth = max(max_depth, int(tr.depths[-1]))
        ints[3, :, 0] = sizes
        ints_d = torch.from_numpy(ints).to(device)
        return cls(list(trees), ints_d[0], ints_d[1], ints_d[2], ints_d[3, :, 0].contiguous(),
                   torch.from_numpy(mask).to(device), n, max_depth)
