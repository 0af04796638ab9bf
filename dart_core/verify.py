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
  applied), try the children in order; accept child x with probability p(x);
  on rejection set p(x) = 0 and renormalise; if no child is accepted, draw the
  bonus from the residual p.  For drafts that are point masses (a tree
  proposes tokens, not distributions) this is exact: the emitted token is
  distributed as p (SpecInfer-style multi-candidate rejection sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dart_core.sampling import SamplingParams, target_probs

__all__ = ["Acceptance", "children_lists", "accept_greedy", "accept_greedy_batch", "accept_sampling",
           "accept_constrained"]


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


def _sample_children(p: torch.Tensor, kids: list[int], tokens: np.ndarray, generator: torch.Generator):
    """Multi-candidate rejection sampling at one node (module docstring): ``p`` [V] float64 on the
    CPU, the target's distribution there (modified in place).  Returns (accepted child, None) or
    (None, the bonus token drawn from the residual)."""
    for c in kids:
        x = int(tokens[c])
        if torch.rand((), generator=generator, dtype=torch.float64).item() < p[x].item():
            return c, None
        p[x] = 0.0
        total = p.sum()
        if total <= 0:  # x held all the mass but rounding rejected it: it is the target's token
            return c, None
        p /= total
    return None, int(torch.multinomial(p, 1, generator=generator).item())


def accept_sampling(tokens: np.ndarray, parents: np.ndarray, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator) -> Acceptance:
    """logits: [N, V] target logits at every node (any device); draws use ``generator`` (CPU)."""
    return _walk(tokens, parents, lambda cur, kids: _sample_children(
        target_probs(logits[cur], params).double().cpu(), kids, tokens, generator))


def accept_constrained(tokens: np.ndarray, parents: np.ndarray, logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator, grammar) -> Acceptance:
    """Acceptance under a grammar (structured output): at every node the walk visits, the target's
    logits are masked by the grammar state after that node's path before the rule of
    ``params`` applies — greedy argmax, or rejection sampling on the masked, renormalised
    distribution (the grammar masks before temperature, top-k and top-p, as a logits processor
    does in Hugging Face's ``generate``).  The output is then that of constrained plain decoding:
    equal at temperature 0, equally distributed otherwise.

    ``grammar`` (a :class:`~dart_core.grammar.GrammarState`) advances over every accepted token
    and the bonus token.  An accepted node whose token ends the grammar (its EOS) ends the walk:
    that token becomes the bonus token, since nothing may follow it.

    Args:
        tokens, parents: [N] the tree; logits: [N, V] target logits at every node (any device).

    Returns:
        the :class:`Acceptance`; only the nodes visited are masked (at most the path's length + 1
        masks per step, not one per node).
    """
    def choose(cur, kids):
        row = grammar.mask_logits(logits[cur])
        if params.greedy:
            x = int(row.argmax())
            nxt = _child_with(kids, tokens, x)
        else:
            nxt, x = _sample_children(target_probs(row, params).double().cpu(), kids, tokens, generator)
            x = int(tokens[nxt]) if nxt is not None else x
        grammar.consume(x)
        # no child taken, or the grammar's end (the node's token is the last one): x is the bonus token
        return (None, x) if nxt is None or grammar.stopped else (nxt, None)

    return _walk(tokens, parents, choose)
