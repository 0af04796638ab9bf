"""Tree verification: which draft nodes the target accepts, and the bonus token.

Terms (docs/design.md §2): the target runs once over the root (the last
accepted, or *bonus*, token) and every draft node, with tree attention.
Walking down from the root, a child is **accepted** if the target agrees
with it; the walk stops at the first node none of whose children is
accepted, and the target's own token after that node is the **bonus token**.
τ (acceptance length) counts the accepted nodes plus the bonus.

- Greedy (temperature 0): child x of node n is accepted iff
  x == argmax p_target(· | path to n).  The output equals greedy decoding.
- Sampling: at node n with target distribution p (temperature, top-k, top-p
  applied), multi-candidate rejection sampling (SpecInfer) tries the children
  in order, accepts child x with probability p(x), and on rejection sets
  p(x) = 0 and renormalises; with no child accepted the bonus token is drawn
  from the residual.  A tree proposes tokens, not distributions (its drafts
  are point masses), so child x_i is accepted with probability
  p(x_i) overall and the bonus is token y ∉ children with probability p(y):
  the same law as drawing one token y ~ p and accepting the child whose token
  is y, else emitting y.  Every sampling walk below draws that way (inverse
  transform, one uniform per visited node from the row's seeded generator),
  so it is a greedy walk over drawn tokens, and a batch of trees is accepted
  on the device (:func:`accept_sampling_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dart_core import _kernels
from dart_core.spec.drafters import DraftBatch
from dart_core.step.sampling import SamplingParams, batch_target_probs, sample_token, target_probs
from dart_core.model.target import TargetCache, TargetOutput

__all__ = ["accept", "AcceptedBatch", "Acceptance", "children_lists", "accept_greedy", "accept_greedy_batch", "accept_sampling",
           "accept_sampling_batch", "accept_constrained", "uniform_draws"]


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices from the root (0) down
    bonus: int  # token id after the last accepted node


def children_lists(parents: np.ndarray) -> list[list[int]]:
    """parents [N] (-1 for the root) -> children of each node, in node order."""
    kids: list[list[int]] = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        kids[int(parents[i])].append(i)
    return kids


def _walk(tokens: np.ndarray, parents: np.ndarray, choose) -> Acceptance:
    """The acceptance walk from the root: ``choose(node, children)`` returns the accepted child
    (a node index) or ``(None, bonus token)``; every rule below is one ``choose``."""
    kids = children_lists(parents)
    path = [0]
    cur = 0
    while True:
        accepted, bonus = choose(cur, kids[cur])
        if accepted is None:
            return Acceptance(path, int(bonus))
        path.append(accepted)
        cur = accepted


def _child_with(kids: list[int], tokens: np.ndarray, token: int) -> int | None:
    """The child among ``kids`` whose token is ``token`` (None: none)."""
    return next((c for c in kids if tokens[c] == token), None)


def accept_greedy(tokens: np.ndarray, parents: np.ndarray, argmax: np.ndarray) -> Acceptance:
    """tokens/parents/argmax: [N]; argmax[i] is the target's greedy token after node i."""
    def choose(cur, kids):
        nxt = _child_with(kids, tokens, argmax[cur])
        return (nxt, None) if nxt is not None else (None, argmax[cur])

    return _walk(tokens, parents, choose)


def accept_greedy_batch(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, num_nodes: torch.Tensor,
                        tree_mask: torch.Tensor, argmax: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`accept_greedy` for a padded batch of trees, on the device, with no host read.

    A node is accepted when its token is the target's argmax at its parent and every ancestor is
    accepted (``tree_mask`` gives the ancestors); the path ends at the deepest accepted node (the
    first in node order among equally deep ones: where sibling tokens differ, as the tree search
    makes them, only one node per depth can be accepted, so this is :func:`accept_greedy`'s path).

    Args:
        tokens, parents, depths, argmax: [B, N] int64 (parents of padding nodes: any valid index;
            argmax[b, i] = the target's greedy token after node i); num_nodes: [B] real nodes per
            tree; tree_mask: [B, N, N] bool, [b, i, j] = j is i or an ancestor of i.

    Returns:
        path [B, N] int64 (the accepted node indices from the root, entries past ``counts`` are 0),
        counts [B] int64 (accepted nodes, root included: τ of the step), bonus [B] int64.
    """
    b, n = tokens.shape
    idx = torch.arange(n, device=tokens.device)
    valid = idx[None, :] < num_nodes[:, None]  # [B, N]
    ok = (tokens == argmax.gather(1, parents.clamp(min=0))) & valid
    ok[:, 0] = True  # the root is accepted
    reach = ~(tree_mask & ~ok[:, None, :]).any(-1) & valid  # every ancestor (and itself) accepted
    leaf = torch.where(reach, depths * n + (n - 1 - idx)[None, :], -1).argmax(-1)  # [B]
    counts = depths.gather(1, leaf[:, None])[:, 0] + 1
    on_path = tree_mask[torch.arange(b, device=tokens.device), leaf]  # [B, N] the leaf and its ancestors
    path = torch.zeros(b, n + 1, dtype=torch.long, device=tokens.device)  # column n collects the rest
    path.scatter_(1, torch.where(on_path, depths, n), idx.expand(b, n))
    return path[:, :n], counts, argmax.gather(1, leaf[:, None])[:, 0]


def accept_greedy_cpu(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, argmax: torch.Tensor
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`accept_greedy` for a padded batch of trees on the CPU, in one C++ call
    (``_kernels.accept_greedy``): on a CPU the walk over a few nodes per tree costs less than
    :func:`accept_greedy_batch`'s dozen tensor operators, and its results are host arrays already.

    Args:
        tokens, parents, argmax: [B, N] int64 CPU tensors (nodes in depth order; padding nodes past
            ``num_nodes`` are not visited); num_nodes: [B] int64, 1 to N.

    Returns:
        (path [B, N] int64 accepted node indices from the root, 0 past each count; counts [B]
        accepted nodes, root included; bonus [B] the target's argmax at each path's last node),
        numpy arrays.

    Raises:
        ValueError: shapes that do not match, or a row's node count outside 1 .. N."""
    b, n = tokens.shape
    path, counts, bonus = np.empty((b, n), np.int64), np.empty(b, np.int64), np.empty(b, np.int64)
    _kernels.accept_greedy(tokens.numpy(), parents.numpy(), num_nodes.numpy(), argmax.numpy(), path, counts, bonus)
    return path, counts, bonus


def uniform_draws(generator: torch.Generator, n: int) -> torch.Tensor:
    """[n] float64 uniforms in (0, 1] from ``generator`` (CPU), for :func:`~dart_core.step.sampling.sample_token`."""
    return 1.0 - torch.rand(n, generator=generator, dtype=torch.float64)


def accept_sampling_batch(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                          logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor,
                          max_depth: int, stop_when_done: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Acceptance of a padded batch of trees on the device, rows sampling with their own parameters
    (greedy rows take the argmax), with no host read (module docstring: one draw per visited node).

    The walk runs one level per iteration for every row at once: the target's distribution at
    each row's current node (:func:`~dart_core.step.sampling.batch_target_probs`), one token drawn from
    it with the row's uniform for that level, and the child holding that token (the first in node
    order) becomes the current node; a row without one ends with the drawn token as its bonus.
    ``max_depth + 1`` iterations, so a row computes the distributions of at most that many nodes;
    ``stop_when_done`` ends the loop once every row has ended instead, at one host read per level
    (for a CPU, where a read costs no device sync and warping a distribution with top-p costs a
    sort of the vocabulary).

    Args:
        tokens, parents: [B, N] int64 (parents of padding nodes: any valid index); num_nodes: [B]
            real nodes per tree; logits: [B, N, V] the target's logits after every node;
            params: B sampling parameter sets; uniforms: [B, max_depth + 1] float64 in (0, 1]
            (:func:`uniform_draws` from each row's generator; any value for greedy rows);
            max_depth: the deepest node of any tree.

    Returns:
        path [B, N] int64 (accepted node indices from the root; entries past ``counts`` are 0),
        counts [B] int64 (accepted nodes, root included), bonus [B] int64 — as
        :func:`accept_greedy_batch`.
    """
    b, n = tokens.shape
    dev = tokens.device
    rows, idx = torch.arange(b, device=dev), torch.arange(n, device=dev)
    child_ok = (idx[None, :] > 0) & (idx[None, :] < num_nodes[:, None])  # [B, N] real non-root nodes
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    sampled = not all(p.greedy for p in params)
    uniforms = uniforms.to(dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    bonus = torch.zeros(b, dtype=torch.long, device=dev)
    path = torch.zeros(b, n + 1, dtype=torch.long, device=dev)
    for level in range(max_depth + 1):
        at = logits[rows, cur]  # [B, V] the target after each row's current node
        drawn = at.argmax(-1)
        if sampled:
            drawn = torch.where(greedy, drawn, sample_token(batch_target_probs(at, params), uniforms[:, level]))
        match = child_ok & (parents == cur[:, None]) & (tokens == drawn[:, None])  # [B, N]
        found = match.any(-1) & alive
        child = match.long().argmax(-1)
        bonus = torch.where(alive & ~found, drawn, bonus)
        cur = torch.where(found, child, cur)
        path[:, level + 1] = torch.where(found, child, 0)
        alive = found
        if stop_when_done and not bool(alive.any()):
            break
    counts = 1 + (path[:, 1:] > 0).sum(-1)
    return path[:, :n], counts, bonus


def accept_constrained(tokens: np.ndarray, parents: np.ndarray, logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator, grammar) -> Acceptance:
    """Acceptance under a grammar (structured output): at every node the walk visits, the target's
    logits are masked by the grammar state after that node's path before the rule of
    ``params`` applies — greedy argmax, or rejection sampling (one draw, module docstring) on the
    masked, renormalised distribution (the grammar masks before temperature, top-k and top-p, as a logits processor
    does in Hugging Face's ``generate``).  The output is then that of constrained plain decoding:
    equal at temperature 0, equally distributed otherwise.

    ``grammar`` (a :class:`~dart_core.step.grammar.GrammarState`) advances over every accepted token
    and the bonus token.  An accepted node whose token ends the grammar (its EOS) ends the walk:
    that token becomes the bonus token, since nothing may follow it.

    Args:
        tokens, parents: [N] the tree; logits: [N, V] target logits at every node (any device).

    Returns:
        the :class:`Acceptance`; only the nodes visited are masked (at most the path's length + 1
        masks per step, not one per node).
    """
    return _draw_walk(tokens, parents, logits, params, generator, grammar)


def accept_sampling(tokens: np.ndarray, parents: np.ndarray, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator) -> Acceptance:
    """One tree's acceptance on the host (the engine's path for an unconstrained row in a batch that
    also holds a constrained one): the walk of :func:`accept_sampling_batch`, one uniform drawn from
    ``generator`` per visited node.  tokens, parents: [N]; logits: [N, V] (any device)."""
    return _draw_walk(tokens, parents, logits, params, generator, None)


def _draw_walk(tokens: np.ndarray, parents: np.ndarray, logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator, grammar) -> Acceptance:
    """The walk with one token drawn (or the argmax taken) at every visited node, its logits masked
    by ``grammar`` first when there is one, which then consumes the drawn token."""
    def choose(cur, kids):
        row = logits[cur] if grammar is None else grammar.mask_logits(logits[cur])
        x = int(row.argmax()) if params.greedy else \
            int(sample_token(target_probs(row, params), uniform_draws(generator, 1)[0].to(row.device)))
        nxt = _child_with(kids, tokens, x)
        if grammar is not None:
            grammar.consume(x)
            if grammar.stopped:  # the grammar's end (the node's token is the last one): x is the bonus token
                return None, x
        return (None, x) if nxt is None else (nxt, None)

    return _walk(tokens, parents, choose)


@dataclass(frozen=True)
class AcceptedBatch:
    """What a step accepted, per sequence (:func:`accept`).

    Attributes:
        paths: [B, A] int64 host array: each row's accepted node indices from the root, 0 past its
            count; A = the longest count.
        counts: [B] int64 host array: accepted nodes, root included (τ of the step).
        bonus: [B] int64 host array: each row's bonus token.
        device_paths: [B, A] int64, ``paths`` on the target's device.
        device_counts: [B] int64, ``counts`` on the target's device.
    """

    paths: np.ndarray
    counts: np.ndarray
    bonus: np.ndarray
    device_paths: torch.Tensor
    device_counts: torch.Tensor

    @property
    def longest(self) -> int:
        """A: the most nodes any row accepted, root included."""
        return self.paths.shape[1]


def accept(batch: DraftBatch, out: TargetOutput, samplings: list[SamplingParams],
           generators: list[torch.Generator], constraints: list, *, cheap_host_reads: bool,
           cache: TargetCache | None = None, cached_lengths: list[int] | None = None,
           padded_length: int = 0) -> AcceptedBatch:
    """The accept phase of a step (docs/design.md §2): each sequence's accepted path and bonus token
    from the verification forward's output, then (given ``cache``) the KV cache compacted to the
    accepted entries.

    The path is chosen here, per batch:

    - a greedy unconstrained batch of roots alone (an autoregressive step): each root's argmax
      (the fused one where the forward computed it: :meth:`TargetOutput.greedy_tokens`), one read;
    - greedy unconstrained trees with ``cheap_host_reads`` on a CPU: one C++ walk over the host
      tensors (:func:`accept_greedy_cpu`, no read);
    - otherwise unconstrained rows on the device, greedy and sampling alike
      (:func:`accept_greedy_batch`, or :func:`accept_sampling_batch` with each sampling row's
      uniforms from its own generator), read back in one copy;
    - a constrained row (a grammar, min_tokens: ``constraints[b]`` not None) walks on the host,
      masking the nodes it visits (:func:`accept_constrained`); the batch's unconstrained rows stay
      batched beside it.

    Args:
        batch: the step's :class:`~dart_core.spec.drafters.DraftBatch` ([B, N] trees).
        out: the verification forward's :class:`~dart_core.model.target.TargetOutput` (logits [B, N, V],
            or for a greedy batch possibly its fused argmax alone).
        samplings, generators, constraints: per row (B each).
        cheap_host_reads: reading a device tensor costs no sync (a CPU target).
        cache: the target's KV cache, holding the verified trees after ``padded_length`` entries;
            compacted so each row keeps its accepted nodes' entries after its ``cached_lengths[b]``.

    Returns:
        an :class:`AcceptedBatch`.
    """
    device = out.taps.device
    free = [i for i, g in enumerate(constraints) if g is None]
    if len(free) == len(constraints):
        paths, counts, bonus, device_paths = _accept_unconstrained(batch, out, samplings, generators,
                                                                   cheap_host_reads)
    else:
        b = len(constraints)
        paths, counts, bonus = np.zeros((b, batch.num_nodes), np.int64), np.ones(b, np.int64), np.zeros(b, np.int64)
        if free:
            sel = torch.tensor(free, dtype=torch.long, device=batch.tokens.device)
            sub = _rows(batch, free, sel)
            sub_out = TargetOutput(None if out.logits is None else out.logits[sel], out.taps[sel],
                                   None if out.argmax is None else out.argmax[sel])
            p, c, bn, _ = _accept_unconstrained(sub, sub_out, [samplings[i] for i in free],
                                                [generators[i] for i in free], cheap_host_reads)
            paths[free, : p.shape[1]], counts[free], bonus[free] = p, c, bn
        trees, logits = batch.trees, out.logits
        for i, g in enumerate(constraints):  # a constrained row's walk asks its grammar node by node
            if g is not None:
                m = int(trees.counts[i])
                acc = accept_constrained(trees.tokens[i, :m], trees.parents[i, :m], logits[i, :m], samplings[i],
                                         generators[i], g)
                paths[i, : len(acc.path)], counts[i], bonus[i] = acc.path, len(acc.path), acc.bonus
        device_paths = None
    longest = int(counts.max())
    paths = paths[:, :longest]
    device_paths = torch.from_numpy(np.ascontiguousarray(paths)).to(device) if device_paths is None \
        else device_paths[:, :longest]
    device_counts = torch.from_numpy(counts).to(device)
    if cache is not None:
        cache.compact_paths(cached_lengths, padded_length, paths, device_counts, counts)
    return AcceptedBatch(paths, counts, bonus, device_paths, device_counts)


def _rows(batch: DraftBatch, rows: list[int], sel: torch.Tensor) -> DraftBatch:
    """The given rows of ``batch`` (``sel``: the same indices on its device), trees kept at N nodes."""
    t = batch.trees
    trees = type(t)(t.tokens[rows], t.parents[rows], t.depths[rows], t.scores[rows], t.probs[rows], t.counts[rows])
    return DraftBatch(trees, batch.tokens[sel], batch.parents[sel], batch.depths[sel], batch.counts[sel],
                      batch.tree_mask[sel], batch.num_nodes, batch.max_depth)


def _accept_unconstrained(batch: DraftBatch, out: TargetOutput, samplings: list[SamplingParams],
                          generators: list[torch.Generator], cheap_host_reads: bool
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
    """:func:`accept`'s unconstrained paths → (paths [B, W] int64, W ≥ the longest count; counts [B];
    bonus [B]) on the host, and the paths [B, W'] on the device."""
    logits, device = out.logits, out.taps.device
    b = len(samplings)
    greedy = all(s.greedy for s in samplings)
    if batch.num_nodes == 1 and greedy:  # roots alone: the bonus is the argmax
        bonus = out.greedy_tokens()[:, 0].cpu().numpy()
        zeros = np.zeros((b, 1), dtype=np.int64)  # one read above
        return zeros, np.ones(b, dtype=np.int64), bonus, torch.from_numpy(zeros).to(device)
    if greedy and cheap_host_reads and device.type == "cpu":  # no read
        path, counts, bonus = accept_greedy_cpu(batch.tokens, batch.parents, batch.counts, out.greedy_tokens())
        return path, counts, bonus, torch.from_numpy(path)
    if greedy:
        path, counts, bonus = accept_greedy_batch(batch.tokens, batch.parents, batch.depths, batch.counts,
                                                  batch.tree_mask, out.greedy_tokens())
    else:
        levels = batch.max_depth + 1
        uniforms = torch.stack([torch.ones(levels, dtype=torch.float64) if s.greedy else
                                uniform_draws(g, levels) for s, g in zip(samplings, generators)])
        path, counts, bonus = accept_sampling_batch(batch.tokens, batch.parents, batch.counts, logits,
                                                    samplings, uniforms, batch.max_depth,
                                                    stop_when_done=cheap_host_reads)
    width = batch.max_depth + 1
    host = torch.cat([counts[:, None], bonus[:, None], path[:, :width]], dim=1).cpu().numpy()  # one read
    return host[:, 2:], host[:, 0], host[:, 1], path
