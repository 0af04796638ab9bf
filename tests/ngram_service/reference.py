"""Plain-Python reference of the n-gram counts, back-off lookup and DART tree
search, written for clarity, used only by the tests to check the C++ engine.

It follows docs/design.md §2 and the ordering rules documented in
``ngram_service/csrc/search.hpp`` and performs the same floating-point
operations in the same order, so results must match bit for bit.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np


class ReferenceNgram:
    def __init__(self, docs: list[list[int]], order: int, min_count: int = 1) -> None:
        counts: Counter = Counter()
        for doc in docs:
            for i in range(len(doc)):
                for m in range(1, order + 1):
                    if i + m <= len(doc):
                        counts[tuple(doc[i:i + m])] += 1
        self.order = order
        self.counts = {k: v for k, v in counts.items() if v >= min_count}
        self.total = sum(len(d) for d in docs)

    def count(self, ngram) -> int:
        return self.counts.get(tuple(ngram), 0) if len(ngram) else self.total

    def nodes_per_level(self) -> list[int]:
        return [sum(1 for k in self.counts if len(k) == m) for m in range(1, self.order + 1)]

    def probability(self, context, tok: int) -> float:
        tail = list(context)[-(self.order - 1):]
        for m in range(len(tail), 0, -1):
            s = tuple(tail[-m:])
            if s in self.counts and s + (tok,) in self.counts:
                return self.counts[s + (tok,)] / self.counts[s]
        return 0.0


@dataclass
class _Cand:
    token: int
    parent: int
    depth: int
    score: float
    eff: float
    eos: bool


@dataclass
class RefParams:
    top_k: int = 25
    beam_width: int = 20
    max_depth: int = 8
    budget: int = 60
    level_weight_exponent: float = 0.7
    logit_weight_base: float = 0.9
    ngram_weight: float = 0.5
    epsilon: float = 1e-10
    eos_token_id: int = -1
    ngram_at_level0: bool = False
    use_ngram: bool = True


def reference_search(topk_ids, topk_probs, context, ngram: ReferenceNgram | None, p: RefParams) -> dict:
    ids = np.asarray(topk_ids)
    probs = np.asarray(topk_probs, dtype=np.float32)
    levels = min(p.max_depth, ids.shape[0])
    k = min(p.top_k, ids.shape[1])
    use_ngram = p.use_ngram and ngram is not None and p.ngram_weight > 0
    cands: list[_Cand] = []
    beam = [-1]
    for level in range(levels):
        lam = float(level + 1) ** -p.level_weight_exponent
        mu = p.logit_weight_base ** float(level)
        ngram_here = use_ngram and (level > 0 or p.ngram_at_level0)
        start = len(cands)
        for parent in beam:
            if parent >= 0 and cands[parent].eos:
                continue
            path = []
            q = parent
            while q >= 0:
                path.append(cands[q].token)
                q = cands[q].parent
            ctx = list(context) + path[::-1]
            ps = cands[parent].score if parent >= 0 else 0.0
            pe = cands[parent].eff if parent >= 0 else math.inf
            for j in range(k):
                tok = int(ids[level, j])
                inc = mu * math.log(float(probs[level, j]) + p.epsilon)
                if ngram_here:
                    inc += p.ngram_weight * math.log(ngram.probability(ctx, tok) + p.epsilon)
                score = ps + lam * inc
                cands.append(_Cand(tok, parent, level + 1, score, min(score, pe), tok == p.eos_token_id))
        level_ids = range(start, len(cands))
        beam = sorted(level_ids, key=lambda i: (cands[i].eos, -cands[i].score, i))[:p.beam_width]
        if not beam:
            break
    chosen = sorted(range(len(cands)), key=lambda i: (-cands[i].eff, cands[i].depth, i))[:p.budget]
    rank = {c: r for r, c in enumerate(chosen)}
    ordered = sorted(chosen, key=lambda i: (cands[i].depth, rank[i]))
    node_of = {c: n + 1 for n, c in enumerate(ordered)}
    n = len(ordered) + 1
    tokens = [int(context[-1])] + [cands[c].token for c in ordered]
    parents = [-1] + [0 if cands[c].parent < 0 else node_of[cands[c].parent] for c in ordered]
    depths = [0] + [cands[c].depth for c in ordered]
    scores = [0.0] + [cands[c].score for c in ordered]
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        v = i
        while v >= 0:
            mask[i, v] = True
            v = parents[v]
    max_depth = max(depths)
    has_child = set(parents[1:])
    rows = []
    for i in range(n):
        if i in has_child:
            continue
        row = [-1] * (max_depth + 1)
        v = i
        while v >= 0:
            row[depths[v]] = v
            v = parents[v]
        rows.append(row)
    return {
        "tokens": np.array(tokens, dtype=np.int64),
        "parents": np.array(parents, dtype=np.int32),
        "depths": np.array(depths, dtype=np.int32),
        "scores": np.array(scores, dtype=np.float64),
        "tree_mask": mask,
        "retrieve_indices": np.array(rows, dtype=np.int32).reshape(len(rows), max_depth + 1),
    }
