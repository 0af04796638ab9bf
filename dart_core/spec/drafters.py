"""Drafters: what proposes each step's draft trees.

A decoding step is four phases (docs/design.md §2): **propose** (a
:class:`Drafter` gives one draft tree per running sequence), **select** (the
adaptive budget keeps the nodes worth verifying, and no tree reaches past a
sequence's token limit), **verify** (one target forward over the
:class:`DraftBatch`), **accept**.

A drafter is built with everything it reads (head, tree search, parameters,
budget) and sees a step only as :class:`DraftInputs`: each sequence's tokens,
its context index, and the drafter's own per-row state.  The engine knows it
through :meth:`Drafter.propose`, :attr:`Drafter.uses_taps`,
:meth:`Drafter.new_state` and :meth:`Drafter.catch_up`, so a new drafter (a
deeper one-pass drafter, an EAGLE-style head) plugs in with
``DartEngine(drafter=...)`` without touching the engine.  A drafter that reads
the target's hidden states keeps them in a :class:`HeadState` (pending
positions, held gated-off steps, its own KV cache), which rides on the batch
and is merged and selected with the other per-row state.

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
from dataclasses import dataclass, field

import numpy as np
import torch

from dart_core.spec.budget import AdaptiveBudget
from dart_core.model.cuda_graphs import StaticDrafter
from dart_core.model.device import sync_device
from dart_core.spec.draft_head import DartDraftHead
from dart_core.model.kv_cache import HeadKVCache, pad_cat, zero_pad
from dart_core.spec.speculative import FOLD_WIDTH
from ngram_service.client import TreeSearchClient
from ngram_service.context import ContextIndex
from ngram_service.tree_search import ContextChain, DraftTree, SearchParams, TreeBatch

__all__ = ["Drafter", "DraftInputs", "HeadState", "Proposal", "ProposalKind", "DraftBatch", "DartDrafter",
           "HeadTreeDrafter", "LookupDrafter", "NoDraft"]


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
            (:meth:`~dart_core.spec.budget.AdaptiveBudget.select_batch`) and learns from what is
            accepted; ``LOOKUP``: each tree is a context chain already sized by the budget
            (:meth:`~dart_core.spec.budget.AdaptiveBudget.select_lookup`); ``NONE``: roots only.
        draft_ms, search_ms: milliseconds spent drafting and searching (reported per step).
        chains: with ``LOOKUP``, each sequence's chain (its match length calibrates the budget).
        catch_up: the draft fed more pending positions than a step normally accepts
            (the step is not typical of its mode; :attr:`~dart_core.step.engine.StepOutput.catch_up`).
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


@dataclass(frozen=True)
class DraftInputs:
    """What a drafter reads for one step, given explicitly (no engine).  Lists are row-aligned.

    Attributes:
        tokens: per running sequence, its prompt and accepted tokens; the last one is the root
            (not yet in the target's KV cache).
        context: per sequence, its :class:`~ngram_service.context.ContextIndex` (prompt and
            accepted tokens indexed) or None where none is kept (docs/design.md §2).
        state: the drafter's own per-row state (:meth:`Drafter.new_state`; the draft head's
            :class:`HeadState`), riding on the batch; None for a drafter that keeps none.
    """

    tokens: list[list[int]]
    context: list[ContextIndex | None]
    state: "HeadState | None" = None

    @property
    def longest(self) -> int:
        """The most tokens any row holds (a host-side bound on every row's positions)."""
        return max(len(t) for t in self.tokens)


class Drafter:
    """Proposes draft trees for the running sequences of a batch.

    Subclasses implement :meth:`propose`; a drafter is built with everything it reads besides the
    per-step :class:`DraftInputs`.  ``uses_taps``: the engine keeps the target's hidden-state taps
    at every accepted position in the drafter's :class:`HeadState` (:meth:`new_state`); a drafter
    that does not read them leaves it False, and the engine skips that bookkeeping.
    """

    uses_taps: bool = False
    #: CUDA graphs the drafter has captured so far (a step that captured one is not typical of its mode)
    captures: int = 0
    #: the method a request names to be drafted so (its ``"method"`` field); None: not a request's choice
    method: str | None = None

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods a request may name with this drafter (a routed drafter holds several)."""
        return (self.method,) if self.method is not None else ()

    def propose(self, inputs: DraftInputs) -> Proposal | None:
        """One tree per running sequence, or None to step autoregressively this time.  Changes
        nothing the engine's other phases read; a drafter may consume its own ``inputs.state``."""
        raise NotImplementedError

    def propose_trees(self, inputs: DraftInputs) -> Proposal | None:
        """As :meth:`propose`, but a proposal of kind ``TREE`` (or None): what a step that verifies
        several drafters' trees together asks for (:class:`~dart_core.spec.routing.RoutedDrafter`)."""
        return self.propose(inputs)

    def new_state(self, rows: int, device: torch.device,
                  methods: "list[str | None] | None" = None) -> "HeadState | None":
        """The per-row state of ``rows`` joining sequences (with ``uses_taps``: an empty
        :class:`HeadState`), None for a drafter that keeps none.  ``methods`` names each row's
        drafting method (None: the default); a drafter of one method drafts every row and ignores it
        (the engine has checked each against :attr:`methods`), a router splits the rows by it."""
        return None

    def catch_up(self, state: "HeadState", max_positions: int, *, prompt: bool = False) -> None:
        """Called once held inputs became pending (speculation resumes) and after a prefill
        (``prompt``): a drafter may do ahead the work its next draft would do.  Nothing by default."""


class NoDraft(Drafter):
    """Trees of only the root: an autoregressive step through the same verify and accept phases."""

    def propose(self, inputs: DraftInputs) -> Proposal:
        return Proposal(TreeBatch.roots([t[-1] for t in inputs.tokens]), kind=ProposalKind.NONE)


class LookupDrafter(Drafter):
    """Each sequence's context chain verified alone (prompt lookup's step), without the draft head
    and the tree search, where the adaptive budget expects it to beat a tree step
    (:meth:`~dart_core.spec.budget.AdaptiveBudget.select_lookup`; docs/design.md §2, "Lookup steps").

    Args:
        budget: the adaptive budget that sizes each lookup (None: never proposes).
        lookup_length: the longest chain verified, in tokens (0: never proposes).
        max_nodes: the most draft nodes a tree may have (``SearchParams.budget``).
        tree_search: where a client keeps a live corpus in process, each chain is the longer-matching
            of the request's own and the corpus's (:meth:`TreeSearchClient.chains`); None: its own.

    Proposes nothing (None) where a row keeps no context index."""

    def __init__(self, budget: AdaptiveBudget | None, lookup_length: int, max_nodes: int,
                 tree_search: TreeSearchClient | None = None) -> None:
        self.budget, self.lookup_length, self.max_nodes = budget, lookup_length, max_nodes
        self.tree_search = tree_search

    def propose(self, inputs: DraftInputs) -> Proposal | None:
        return _lookup(inputs, self.budget, min(self.lookup_length, self.max_nodes), self.tree_search)


def _lookup(inputs: DraftInputs, budget: AdaptiveBudget | None, length: int,
            tree_search: TreeSearchClient | None) -> Proposal | None:
    """:class:`LookupDrafter`'s step with chains of at most ``length`` tokens (0: none)."""
    t0 = time.perf_counter()
    if budget is None or length <= 0 or any(c is None for c in inputs.context):
        return None
    chains = [c.continuation(length) for c in inputs.context]
    if tree_search is not None:
        chains = tree_search.chains(inputs.tokens, chains, length)
    n = budget.select_lookup(chains)
    if n == 0:
        return None
    return Proposal(_chain_batch([t[-1] for t in inputs.tokens], chains, n), kind=ProposalKind.LOOKUP,
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


def _padded_ids(rows: list[list[int]], width: int, device) -> torch.Tensor:
    """[B, width] int64 on ``device``: row b's ids, zero-padded."""
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return torch.from_numpy(ids).to(device)


def _append_in_place(buf: torch.Tensor, counts: torch.Tensor, new: torch.Tensor, longest: int) -> torch.Tensor:
    """Writes new[r, :] at buf[r, counts[r]:] and returns the buffer ([B, capacity, ...]);
    ``longest`` = max(counts), which the caller knows without reading ``counts``.

    Amortised O(new): the buffer grows (doubling, zero-filled, so padding stays finite) only
    when a row would run past its capacity; entries past a row's count are padding.
    """
    rows, t_new = new.shape[0], new.shape[1]
    need = longest + t_new if rows else 0
    if need > buf.shape[1]:
        buf = zero_pad(buf, 1, max(need, 2 * buf.shape[1]))
    idx = counts[:, None] if t_new == 1 else counts[:, None] + torch.arange(t_new, device=counts.device)[None, :]
    # an index write, not scatter_: PyTorch's CPU scatter_ into a bfloat16 buffer took milliseconds
    buf[torch.arange(rows, device=counts.device)[:, None], idx] = new
    return buf


@dataclass
class HeadState:
    """A draft head's inputs per running sequence, row-aligned, riding on the batch: the positions
    accepted since its last draft (pending), the gated-off steps not yet pending (held), and its KV
    cache.  The batcher merges and selects rows through :meth:`merge` and :meth:`select`.

    Attributes:
        taps: [B, P, 3H] the target's hidden-state taps of pending positions, in the head's dtype
            (a buffer: row b's first ``counts[b]`` entries are valid, the rest padding).
        positions: [B, P] int64 their positions.
        counts: [B] int64 valid pending positions per row.
        next: per row, the next token of each pending position (its length is ``counts[b]``, known
            on the host).
        cache: the head's :class:`~dart_core.model.kv_cache.HeadKVCache`.
        held: gated-off steps, oldest first: (taps [B, 1, 3H], positions [B], next tokens per row),
            kept by reference (:meth:`hold`, :meth:`release`).
    """

    taps: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor
    next: list[list[int]]
    cache: HeadKVCache
    held: list = field(default_factory=list)

    @classmethod
    def empty(cls, rows: int, head: DartDraftHead, device: torch.device) -> "HeadState":
        """``rows`` sequences with nothing pending and an empty head KV cache."""
        c = head.config
        return cls(torch.zeros(rows, 0, 3 * c.target_hidden_size, dtype=head.dtype, device=device),
                   torch.zeros(rows, 0, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device), [[] for _ in range(rows)],
                   HeadKVCache(rows, c.num_key_value_heads, c.head_dim, device=device, dtype=head.dtype))

    @property
    def width(self) -> int:
        """The most pending positions of any row (host-side)."""
        return max((len(x) for x in self.next), default=0)

    def merge(self, new: "HeadState") -> None:
        """Appends ``new``'s rows after these (neither may hold gated-off steps: :meth:`release` first).

        Raises:
            ValueError: either side holds steps (they are laid out by the old rows)."""
        if self.held or new.held:
            raise ValueError("release held steps before merging rows")
        self.taps, self.positions = pad_cat(self.taps, new.taps, 1), pad_cat(self.positions, new.positions, 1)
        self.counts = torch.cat([self.counts, new.counts])
        self.next = self.next + new.next
        h, hn = self.cache, new.cache
        h.keys, h.values = pad_cat(h.keys, hn.keys, 2), pad_cat(h.values, hn.values, 2)
        h.lengths = torch.cat([h.lengths, hn.lengths])

    def select(self, rows: list[int]) -> None:
        """Keeps the given rows, in that order (held steps are dropped: :meth:`release` first to keep them)."""
        self.held = []
        sel = torch.tensor(rows, dtype=torch.long, device=self.counts.device)
        self.cache.select(sel)
        self.taps, self.positions, self.counts = self.taps[sel], self.positions[sel], self.counts[sel]
        self.next = [self.next[i] for i in rows]

    def add(self, taps: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor, nexts: list[list[int]]) -> None:
        """Appends each row's newly accepted positions (taps [B, A, 3H], positions [B, A], counts [B],
        each row's next tokens: ``counts[b]`` of them)."""
        taps = taps.to(self.taps.dtype)  # the draft head's dtype
        longest = self.width  # max(counts), known on the host
        self.taps = _append_in_place(self.taps, self.counts, taps, longest)
        self.positions = _append_in_place(self.positions, self.counts, positions, longest)
        self.counts = self.counts + counts
        self.next = [a + b for a, b in zip(self.next, nexts)]

    def clear(self) -> None:
        """Empties every row's pending inputs (the buffers keep their capacity)."""
        self.counts = torch.zeros(len(self.next), dtype=torch.long, device=self.counts.device)
        self.next = [[] for _ in self.next]

    def hold(self, taps: torch.Tensor, positions: torch.Tensor, nexts: list[list[int]]) -> None:
        """Keeps a gated-off step's root taps [B, 1, 3H], positions [B] (the cache lengths before the
        step) and each row's next token, by reference: no device work."""
        self.held.append((taps, positions, nexts))

    def release(self) -> list[list[int]] | None:
        """The held steps, in order, become pending (one concatenation).  Returns each row's tokens
        of those steps (for the context indexes), or None when nothing was held."""
        if not self.held:
            return None
        held, self.held = self.held, []
        taps = held[0][0] if len(held) == 1 else torch.cat([h[0] for h in held], 1)
        positions = torch.stack([h[1] for h in held], 1)
        nexts = [[tok for h in held for tok in h[2][i]] for i in range(len(self.next))]
        self.add(taps, positions, torch.full((len(nexts),), len(held), dtype=torch.long, device=positions.device),
                 nexts)
        return nexts


class HeadTreeDrafter(Drafter):
    """DART's drafter (paper §3): one draft-head forward over each sequence's newly accepted
    positions gives top-k tokens per level, and the tree search (n-gram trie, the request's own
    context chain) turns them into one prefix-closed tree per sequence.

    Args:
        head: the draft head, on the target's device.
        embed: the target's input embedding (token ids [B, W] -> [B, W, H]).
        tree_search: the tree-search client.
        search_params: ``top_k`` drafts per level; ``budget`` the most draft nodes per tree.
        budget: an adaptive budget sizes each search (:meth:`AdaptiveBudget.search_params`) and
            the levels drafted (:meth:`AdaptiveBudget.search_depth`); None: ``search_params`` as given.
        cheap_host_reads: reading a device tensor costs no sync (a CPU target): the top-k is read in place.
        fold_width: a sequence's pending inputs past this many positions (after autoregressive
            steps) are folded into its head KV cache (:meth:`catch_up`), as is a new prompt, so a
            draft reads no more than the static drafter's widest width; None: they wait for the draft.
    """

    uses_taps = True
    method = "dart"

    def __init__(self, head: DartDraftHead, embed: torch.nn.Module, tree_search: TreeSearchClient,
                 search_params: SearchParams, *, budget: AdaptiveBudget | None = None,
                 cheap_host_reads: bool = False, fold_width: int | None = FOLD_WIDTH) -> None:
        self.head, self.embed, self.tree_search, self.search_params = head, embed, tree_search, search_params
        self.budget, self.cheap_host_reads, self.fold_width = budget, cheap_host_reads, fold_width
        self.device = head.norm.weight.device
        # the draft head's static KV cache (eager; enable_static_draft captures it in CUDA graphs)
        self.static_draft: StaticDrafter | None = StaticDrafter(head, embed, top_k=search_params.top_k,
                                                                use_graphs=False)

    @property
    def captures(self) -> int:
        return self.static_draft.captures if self.static_draft is not None else 0

    def enable_static_draft(self, **kwargs) -> StaticDrafter:
        """Replaces the static KV cache by one built with ``kwargs``: by default on a GPU one
        replayed as CUDA graphs (:class:`~dart_core.model.cuda_graphs.StaticDrafter`: padded widths and
        batch sizes, one graph per pair, captured when first needed).  Sequences already running
        keep their cache (it is copied into the new buffers at their next draft).

        Raises:
            ValueError: as :class:`~dart_core.model.cuda_graphs.StaticDrafter`."""
        self.static_draft = StaticDrafter(self.head, self.embed, top_k=self.search_params.top_k, **kwargs)
        return self.static_draft

    def new_state(self, rows: int, device: torch.device, methods: list[str | None] | None = None) -> HeadState:
        return HeadState.empty(rows, self.head, device)

    def draft_levels(self) -> int:
        """Draft levels this step needs: a tree of n nodes is at most n deep, and the
        adaptive budget asks for one level more than it recently kept (its ``search_depth``)."""
        depth = min(self.head.config.depth, self.search_params.max_depth, self.search_params.budget)
        if self.budget is not None:
            depth = self.budget.search_depth(depth)
        return max(1, depth)

    def catch_up(self, state: HeadState, max_positions: int, *, prompt: bool = False) -> None:
        """Folds pending inputs into the head KV cache (:meth:`fold`) past ``fold_width`` (a new
        prompt: always), so the catch-up after autoregressive steps is paid once."""
        if self.fold_width is not None and (prompt or state.width > self.fold_width):
            self.fold(state, max_positions)

    @torch.inference_mode()
    def fold(self, state: HeadState, max_positions: int) -> None:
        """Moves each sequence's pending inputs, all but its last position, into its head KV cache
        (:meth:`DartDraftHead.keys_values`) with no read of a device tensor; ``max_positions``: a
        host-side bound on every row's tokens.

        What the next draft would compute from them anyway, done ahead, so that the draft is
        unchanged (up to rounding) and the inputs held per sequence between steps stay at most
        ``fold_width`` positions while steps are autoregressive: a held position is 3 · H_target
        values, a head KV cache entry 2 · H_kv · D, and both are copied whenever sequences join
        or leave the batch.  The last position stays pending: the next draft queries from it."""
        width = state.width
        if width <= 1:
            return
        head = self.head
        nxt = _padded_ids(state.next, width, self.device)
        keys, values = head.keys_values(state.taps[:, :width], self.embed(nxt).to(head.dtype),
                                        state.positions[:, :width])
        last = (state.counts - 1).clamp(min=0)  # [B]; rows that hold nothing fold nothing
        # a row's head KV cache never holds more entries than the row has tokens
        state.cache.extend(keys, values, last, max_positions)
        state.taps = state.taps.gather(1, last[:, None, None].expand(-1, 1, state.taps.shape[-1]))
        state.positions = state.positions.gather(1, last[:, None])
        state.counts = state.counts.clamp(max=1)
        state.next = [row[-1:] for row in state.next]

    @torch.inference_mode()
    def draft(self, state: HeadState, levels: int | None = None, max_positions: int | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Draft head forward over every row's pending positions, which it consumes (they enter the
        head KV cache) → (topk_ids [B, L, k] int64 target ids, topk_probs [B, L, k] float32), on the
        host; L = ``levels`` (default d): the tree search goes no deeper than L.  With the static
        drafter (the default; :meth:`enable_static_draft`) and ``max_positions`` (a host-side bound
        on every row's tokens) the draft runs over its static cache where it fits; either way the
        top-k comes to the host in one copy."""
        head, device = self.head, self.device
        width = max(state.width, 1)
        taps, positions, last_index = state.taps[:, :width], state.positions[:, :width], state.counts - 1
        nxt = _padded_ids(state.next, width, device)
        levels = head.config.depth if levels is None else levels
        static = None
        if self.static_draft is not None and max_positions is not None:
            static = self.static_draft.forward(taps.to(head.dtype), nxt, positions, last_index, state.cache,
                                               max_positions, levels)
        if static is not None:
            ids, probs = static  # [B, L, k] each
        else:
            dtype = head.dtype
            logits, new_k, new_v = head(taps.to(dtype), self.embed(nxt).to(dtype), positions, last_index,
                                        state.cache.keys, state.cache.values, state.cache.lengths, levels)
            state.cache.append(new_k, new_v, last_index + 1)
            ids, probs = head.top_k(logits, self.search_params.top_k)
        state.clear()
        if ids.device.type == "cpu" and self.cheap_host_reads:  # already on the host: views, no copy
            return ids.long().numpy(), probs.float().contiguous().numpy()
        # one copy to the host: the ids as int32 beside the probabilities' bits
        host = torch.stack([ids.to(torch.int32), probs.contiguous().view(torch.int32)]).cpu().numpy()
        return host[0].astype(np.int64), host[1].view(np.float32)

    def propose(self, inputs: DraftInputs) -> Proposal:
        state = inputs.state
        t0 = time.perf_counter()
        catch_up = state.width > self.head.config.draft_length + 2
        topk_ids, topk_probs = self.draft(state, self.draft_levels(), inputs.longest)
        sync_device(self.device)
        draft_ms = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        levels = topk_ids.shape[1]
        chains = ([c.continuation(levels) if c is not None else None for c in inputs.context]
                  if any(c is not None for c in inputs.context) else None)
        params = self.search_params if self.budget is None else self.budget.search_params(self.search_params)
        trees = self.tree_search.search_batch(topk_ids, topk_probs,
                                              [np.asarray(t, dtype=np.int64) for t in inputs.tokens], params, chains)
        if trees.live is not None:  # the service's live-corpus continuations, for the next lookup steps
            for index, chain in zip(inputs.context, trees.live):
                if index is not None:
                    index.hint(chain)
        return Proposal(trees, kind=ProposalKind.TREE, draft_ms=draft_ms, search_ms=1e3 * (time.perf_counter() - t0),
                        catch_up=catch_up)


class DartDrafter(HeadTreeDrafter):
    """The engine's default with a draft head: a lookup step where the adaptive budget prefers
    one (:class:`LookupDrafter`, ``lookup_length`` tokens at most, 0: never), otherwise the head
    and the tree search (:class:`HeadTreeDrafter`, whose arguments it takes)."""

    def __init__(self, head: DartDraftHead, embed: torch.nn.Module, tree_search: TreeSearchClient,
                 search_params: SearchParams, *, lookup_length: int = 24, **kwargs) -> None:
        super().__init__(head, embed, tree_search, search_params, **kwargs)
        self.lookup_length = lookup_length

    def propose(self, inputs: DraftInputs) -> Proposal:
        # the budget, the node limit and the tree search as they are now (the engine may have swapped them)
        length = min(self.lookup_length, self.search_params.budget)
        return _lookup(inputs, self.budget, length, self.tree_search) or super().propose(inputs)

    def propose_trees(self, inputs: DraftInputs) -> Proposal:
        """The head and the tree search, never a lookup step (a lookup's chain is sized apart)."""
        return super().propose(inputs)


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
            path, as :func:`~dart_core.spec.budget.node_acceptance_estimates` (the root 1, padding 0);
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
