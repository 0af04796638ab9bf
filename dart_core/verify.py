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

__all__ = ["Acceptance", "children_lists", "accept_greedy", "accept_sampling"]


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
