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
    chain: bool = False
    prob: float = 0.0


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
    context_weight: float = 0.0


class ReferenceContext:
    """The per-request context index, written plainly: n-gram counts of one sequence."""

    def __init__(self, max_context: int, max_tokens: int) -> None:
        self.max_context, self.max_tokens = max_context, max_tokens
        self.tokens: list[int] = []

    def append(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            if len(self.tokens) > self.max_tokens:
                self.tokens = self.tokens[-(self.max_tokens // 2):]

    def _occurrences(self, s: tuple, seq: list[int]) -> list[int]:
        """Positions of the token after each occurrence of s in seq that has a following token."""
        m = len(s)
        return [i + m for i in range(len(seq) - m) if tuple(seq[i:i + m]) == s]

    def probability(self, extra, tok: int) -> float:
        seq = self.tokens
        tail = (seq + [int(x) for x in extra])[-self.max_context:]
        for m in range(len(tail), 0, -1):
            s = tuple(tail[-m:])
            after = [seq[j] for j in self._occurrences(s, seq)]
            if after and tok in after:
                return (m / self.max_context) * (after.count(tok) / len(after))
        return 0.0

    def continuation(self, max_len: int):
        seq = self.tokens
        for m in range(min(self.max_context, len(seq)), 0, -1):
            after = self._occurrences(tuple(seq[-m:]), seq)
            if not after:
                continue
            pos, out, probs = after[-1], [], []
            for _ in range(max_len):
                tok = seq[pos] if pos < len(seq) else out[pos - len(seq)]
                probs.append(np.float32(self.probability(out, tok)))
                out.append(tok)
                pos += 1
            return out, probs, m
        return [], [], 0


def reference_search(topk_ids, topk_probs, context, ngram: ReferenceNgram | None, p: RefParams,
                     chain=(), chain_probs=()) -> dict:
    ids = np.asarray(topk_ids)
    probs = np.asarray(topk_probs, dtype=np.float32)
    levels = min(p.max_depth, ids.shape[0])
    k = min(p.top_k, ids.shape[1])
    use_ngram = p.use_ngram and ngram is not None and p.ngram_weight > 0
    chain_used = len(chain) if p.context_weight > 0 else 0
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
            on_chain = level < chain_used and (parent < 0 or cands[parent].chain)
            chain_tok = int(chain[level]) if on_chain else -1
            chain_p = p.context_weight * float(np.float32(chain_probs[level])) if on_chain else 0.0
            seen = False
            for j in range(k + 1):
                if j < k:
                    tok, p_draft = int(ids[level, j]), np.float32(probs[level, j])
                elif on_chain and not seen:  # the head's top-k missed the chain's token
                    tok, p_draft = chain_tok, np.float32(0.0)
                else:
                    break
                is_chain = tok == chain_tok
                scored = np.float32(max(float(p_draft), chain_p)) if is_chain else p_draft
                prob = max(p_draft, np.float32(chain_probs[level])) if is_chain else p_draft  # the budget's estimate
                inc = mu * math.log(float(scored) + p.epsilon)
                if ngram_here:
                    p_ng = ngram.probability(ctx, tok)
                    inc += p.ngram_weight * math.log((max(p_ng, chain_p) if is_chain else p_ng) + p.epsilon)
                score = ps + lam * inc
                cands.append(_Cand(tok, parent, level + 1, score, min(score, pe), tok == p.eos_token_id, is_chain,
                                   float(prob)))
                seen = seen or is_chain
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
        "probs": np.array([1.0] + [cands[c].prob for c in ordered], dtype=np.float32),
    }
