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

__all__ = ["Acceptance", "children_lists", "accept_greedy", "accept_greedy_batch", "accept_sampling"]


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


def accept_greedy(tokens: np.ndarray, parents: np.ndarray, argmax: np.ndarray) -> Acceptance:
    """tokens/parents/argmax: [N]; argmax[i] is the target's greedy token after node i."""
    kids = children_lists(parents)
    path = [0]
    cur = 0
    while True:
        nxt = next((c for c in kids[cur] if tokens[c] == argmax[cur]), None)
        if nxt is None:
            return Acceptance(path, int(argmax[cur]))
        path.append(nxt)
        cur = nxt


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


def accept_sampling(tokens: np.ndarray, parents: np.ndarray, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator) -> Acceptance:
    """logits: [N, V] target logits at every node (any device); draws use ``generator`` (CPU)."""
    kids = children_lists(parents)
    path = [0]
    cur = 0
    while True:
        p = target_probs(logits[cur], params).double().cpu()  # [V]
        accepted = None
        for c in kids[cur]:
            x = int(tokens[c])
            if torch.rand((), generator=generator, dtype=torch.float64).item() < p[x].item():
                accepted = c
                break
            p[x] = 0.0
            total = p.sum()
            if total <= 0:  # x held all the mass but rounding rejected it: it is the target's token
                accepted = c
                break
            p /= total
        if accepted is None:
            return Acceptance(path, int(torch.multinomial(p, 1, generator=generator).item()))
        path.append(accepted)
        cur = accepted
