"""One engine, several drafters: each request picks its method.

A deployment that loads both a DART head and an EAGLE-3 head serves them behind one verifier
(docs/engine.md, "Two drafters in one deployment"): each running sequence is drafted by the
drafter its request named (the ``"method"`` extension field), and every sequence's tree is
verified in the same target forward with tree attention, so output stays the target's.

:class:`RoutedDrafter` is a :class:`~dart_core.spec.drafters.Drafter` over named drafters.  Its
per-row state, :class:`RoutedState`, keeps one :class:`~dart_core.spec.drafters.HeadState` per
method holding only that method's rows, so each head reads, caches and drafts only the sequences
it serves.  A step whose running sequences all share one method is that drafter's own step
(lookup steps included); a mixed step asks each drafter for trees over its rows
(:meth:`Drafter.propose_trees <dart_core.spec.drafters.Drafter.propose_trees>`) and verifies them
together, the adaptive budget choosing each tree's nodes as in any tree step.
"""

from __future__ import annotations

import numpy as np
import torch

from dart_core.spec.drafters import DraftInputs, Drafter, HeadState, Proposal, ProposalKind
from ngram_service.tree_search import TreeBatch

__all__ = ["RoutedDrafter", "RoutedState"]


class RoutedState:
    """The per-row draft state of a batch whose rows have different drafters: per method, a
    :class:`~dart_core.spec.drafters.HeadState` of that method's rows, in batch order.  It answers
    the engine as a :class:`HeadState` does (:meth:`merge`, :meth:`select`, :meth:`add`,
    :meth:`hold`, :meth:`release`, :attr:`held`, :attr:`width`), splitting each call by method.

    Args:
        methods: per row, its method (a key of ``states``).
        states: per method present, the state of its rows (rows in batch order).

    Raises:
        ValueError: a row whose method has no state, or a state whose row count differs from its
            method's rows.
    """

    def __init__(self, methods: list[str], states: dict[str, HeadState | None]) -> None:
        counts = {m: methods.count(m) for m in set(methods)}
        if set(counts) != set(states):
            raise ValueError(f"rows name methods {sorted(counts)} but states are given for {sorted(states)}")
        for m, s in states.items():
            if s is not None and len(s.next) != counts[m]:
                raise ValueError(f"method {m}: {counts[m]} rows but a state of {len(s.next)}")
        self.methods, self.states = list(methods), dict(states)

    def rows(self, method: str) -> list[int]:
        """The batch rows drafted by ``method``, in order."""
        return [i for i, m in enumerate(self.methods) if m == method]

    def _split(self, method: str) -> torch.Tensor | None:
        """Row indices of ``method`` as a tensor, or None when it has every row (no copy needed)."""
        s = self.states[method]
        if len(s.next) == len(self.methods):
            return None
        return torch.tensor(self.rows(method), dtype=torch.long, device=s.counts.device)

    @property
    def next(self) -> list[list[int]]:
        """Per row, the next tokens of its pending positions (as :attr:`HeadState.next`)."""
        out: list[list[int]] = [[] for _ in self.methods]
        for m, s in self.states.items():
            if s is not None:
                for i, row in zip(self.rows(m), s.next):
                    out[i] = row
        return out

    @property
    def width(self) -> int:
        """The most pending positions of any row (host-side)."""
        return max((s.width for s in self.states.values() if s is not None), default=0)

    @property
    def held(self) -> list:
        """The gated-off steps held (every method's state holds the same steps)."""
        return next((s.held for s in self.states.values() if s is not None), [])

    def merge(self, new: "RoutedState") -> None:
        """Appends ``new``'s rows after these (as :meth:`HeadState.merge`).

        Raises:
            ValueError: either side holds steps."""
        for m, s in new.states.items():
            if m in self.states and self.states[m] is not None and s is not None:
                self.states[m].merge(s)
            elif m not in self.states:
                self.states[m] = s
        self.methods = self.methods + new.methods

    def select(self, rows: list[int]) -> None:
        """Keeps the given rows, in that order (as :meth:`HeadState.select`)."""
        local, seen = [], {}
        for m in self.methods:  # each row's index within its method's state
            local.append(seen.get(m, 0))
            seen[m] = local[-1] + 1
        methods = [self.methods[i] for i in rows]
        for m in list(self.states):
            keep = [local[i] for i in rows if self.methods[i] == m]
            if not keep:
                del self.states[m]
            elif self.states[m] is not None:
                self.states[m].select(keep)
        self.methods = methods

    def add(self, taps: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor, nexts: list[list[int]]) -> None:
        """Appends each row's newly accepted positions to its method's state (as :meth:`HeadState.add`)."""
        for m, s in self.states.items():
            if s is None:
                continue
            idx = self._split(m)
            if idx is None:
                s.add(taps, positions, counts, nexts)
            else:
                s.add(taps[idx], positions[idx], counts[idx], [nexts[i] for i in self.rows(m)])

    def clear(self) -> None:
        """Empties every row's pending inputs."""
        for s in self.states.values():
            if s is not None:
                s.clear()

    def hold(self, taps: torch.Tensor, positions: torch.Tensor, nexts: list[list[int]]) -> None:
        """Keeps a gated-off step (as :meth:`HeadState.hold`; a batch of one method keeps references only)."""
        for m, s in self.states.items():
            if s is None:
                continue
            idx = self._split(m)
            if idx is None:
                s.hold(taps, positions, nexts)
            else:
                s.hold(taps[idx], positions[idx], [nexts[i] for i in self.rows(m)])

    def release(self) -> list[list[int]] | None:
        """The held steps become pending in every method's state; each row's tokens of those steps,
        or None when nothing was held (as :meth:`HeadState.release`)."""
        out: list[list[int]] | None = None
        for m, s in self.states.items():
            got = s.release() if s is not None else None
            if got is not None:
                out = out or [[] for _ in self.methods]
                for i, row in zip(self.rows(m), got):
                    out[i] = row
        return out


class RoutedDrafter(Drafter):
    """Drafts each running sequence with the drafter its request named.

    Args:
        drafters: by method name (``"dart"``, ``"eagle3"``), each a drafter on the same target.
        default: the method of a sequence that names none.

    The engine sets ``tree_search``, ``search_params``, ``budget`` and ``cheap_host_reads`` on its
    drafter (a server swaps in its gRPC client); here they reach every drafter that has them.

    Raises:
        ValueError: no drafters, or ``default`` not among them.
    """

    _SHARED = ("tree_search", "search_params", "budget", "cheap_host_reads")

    def __init__(self, drafters: dict[str, Drafter], default: str) -> None:
        if not drafters or default not in drafters:
            raise ValueError(f"the default method {default!r} must be one of the drafters {sorted(drafters)}")
        self.drafters, self.default = dict(drafters), default
        self.uses_taps = any(d.uses_taps for d in drafters.values())

    def __getattr__(self, name: str):
        # the shared attributes read from the first drafter that has one (the default's first)
        if name in RoutedDrafter._SHARED or name in ("lookup_length", "static_draft"):
            drafters = self.__dict__.get("drafters", {})
            order = [self.__dict__.get("default")] + list(drafters)
            for m in order:
                if m in drafters and hasattr(drafters[m], name):
                    return getattr(drafters[m], name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:
        if name in RoutedDrafter._SHARED:
            for d in self.drafters.values():
                if hasattr(d, name):
                    setattr(d, name, value)
            return
        super().__setattr__(name, value)

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods a request may name."""
        return tuple(self.drafters)

    @property
    def captures(self) -> int:
        return sum(d.captures for d in self.drafters.values())

    def enable_static_draft(self, **kwargs) -> None:
        """Each drafter that has a static draft (:meth:`HeadTreeDrafter.enable_static_draft`) enables it."""
        for d in self.drafters.values():
            if hasattr(d, "enable_static_draft"):
                d.enable_static_draft(**kwargs)

    def new_state(self, rows: int, device: torch.device, methods: list[str | None] | None = None) -> RoutedState:
        """The state of ``rows`` joining sequences, each drafted by its entry of ``methods`` (None or
        no list: the default).

        Raises:
            ValueError: a method this drafter does not hold."""
        methods = [m or self.default for m in (methods or [None] * rows)]
        unknown = sorted(set(methods) - set(self.drafters))
        if unknown:
            raise ValueError(f"no drafter for method {', '.join(unknown)} (loaded: {', '.join(self.drafters)})")
        return RoutedState(methods, {m: self.drafters[m].new_state(methods.count(m), device) for m in set(methods)})

    def catch_up(self, state: RoutedState, max_positions: int, *, prompt: bool = False) -> None:
        for m, s in state.states.items():
            if s is not None:
                self.drafters[m].catch_up(s, max_positions, prompt=prompt)

    def propose(self, inputs: DraftInputs) -> Proposal | None:
        state: RoutedState = inputs.state
        if len(state.states) == 1:  # one method: that drafter's own step
            (m, s), = state.states.items()
            return self.drafters[m].propose(DraftInputs(inputs.tokens, inputs.context, s))
        b = len(inputs.tokens)
        parts, draft_ms, search_ms, catch_up = [], 0.0, 0.0, False
        for m, s in state.states.items():
            rows = state.rows(m)
            sub = DraftInputs([inputs.tokens[i] for i in rows], [inputs.context[i] for i in rows], s)
            p = self.drafters[m].propose_trees(sub)
            if p is None or p.kind is ProposalKind.NONE:
                p = Proposal(TreeBatch.roots([t[-1] for t in sub.tokens]))
            parts.append((rows, p.trees))
            draft_ms, search_ms = draft_ms + p.draft_ms, search_ms + p.search_ms
            catch_up = catch_up or p.catch_up
        return Proposal(_interleave(parts, b), kind=ProposalKind.TREE, draft_ms=draft_ms, search_ms=search_ms,
                        catch_up=catch_up)


def _interleave(parts: list[tuple[list[int], TreeBatch]], b: int) -> TreeBatch:
    """One [b, N] :class:`TreeBatch` from per-method batches over their rows (N the widest)."""
    n = max(t.num_nodes for _, t in parts)
    out = TreeBatch._empty(b, n)
    counts = np.ones(b, np.int64)
    for rows, t in parts:
        idx, m = np.asarray(rows, dtype=np.int64), t.num_nodes
        for name in ("tokens", "parents", "depths", "scores", "probs"):
            getattr(out, name)[idx, :m] = getattr(t, name)
        counts[idx] = t.counts
    return TreeBatch(out.tokens, out.parents, out.depths, out.scores, out.probs, counts)
