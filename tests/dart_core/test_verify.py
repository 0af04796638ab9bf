"""Acceptance on the device: the batched sampling walk against the greedy one and against a host
walk over the same uniforms, and the law of its single draw per node (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dart_core.spec.drafters import DraftBatch
from dart_core.step.sampling import SamplingParams, sample_token, target_probs
from dart_core.step.verify import (accept_greedy, accept_greedy_batch, accept_greedy_cpu, accept_sampling_batch,
                              children_lists)

from .conftest import make_tree

VOCAB = 12


def random_trees(rng: np.random.Generator, count: int) -> list:
    """Depth-ordered random trees of 1-9 nodes over a small vocabulary, sibling tokens distinct."""
    trees = []
    for _ in range(count):
        tokens, parents, depths = [int(rng.integers(VOCAB))], [-1], [0]
        for _ in range(int(rng.integers(0, 9))):
            p = int(rng.integers(len(tokens)))
            taken = {tokens[c] for c in range(1, len(tokens)) if parents[c] == p}
            free = [t for t in range(VOCAB) if t not in taken]
            tokens.append(int(rng.choice(free)))
            parents.append(p)
            depths.append(depths[p] + 1)
        order = np.argsort(depths, kind="stable")
        remap = {int(o): i for i, o in enumerate(order)}
        trees.append(make_tree([tokens[o] for o in order], [-1] + [remap[parents[o]] for o in order[1:]]))
    return trees


def host_walk(tree, logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor):
    """The reference: from the root, the token drawn at level L (argmax when greedy) picks the child
    holding it; no such child makes it the bonus token."""
    kids = children_lists(tree.parents)
    path, cur = [0], 0
    for level in range(len(uniforms)):
        row = logits[cur]
        x = int(row.argmax()) if params.greedy else int(sample_token(target_probs(row, params), uniforms[level]))
        nxt = next((c for c in kids[cur] if tree.tokens[c] == x), None)
        if nxt is None:
            return path, x
        path.append(nxt)
        cur = nxt
    raise AssertionError("the walk ran past the deepest node")


def test_greedy_rows_walk_as_the_greedy_batch():
    rng = np.random.default_rng(0)
    trees = random_trees(rng, 16)
    batch = DraftBatch.pack(trees, torch.device("cpu"))
    logits = torch.randn(16, batch.num_nodes, VOCAB, generator=torch.Generator().manual_seed(1))
    # make acceptance likely: the argmax after a node is often one of its children
    for b, tr in enumerate(trees):
        for c in range(1, tr.num_nodes):
            if rng.random() < 0.7:
                logits[b, tr.parents[c], tr.tokens[c]] += 10
    want = accept_greedy_batch(batch.tokens, batch.parents, batch.depths, batch.counts, batch.tree_mask,
                               logits.argmax(-1))
    got = accept_sampling_batch(batch.tokens, batch.parents, batch.counts, logits, [SamplingParams()] * 16,
                                torch.rand(16, batch.max_depth + 1, dtype=torch.float64), batch.max_depth)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert int(want[1].max()) > 2  # paths longer than one draft node were accepted


def test_the_cpu_greedy_walk_equals_the_batched_and_the_reference_one():
    """accept_greedy_cpu (one C++ call) against accept_greedy_batch and accept_greedy per tree, on random
    trees padded to one size, with acceptance likely; bad shapes and node counts are refused."""
    rng = np.random.default_rng(3)
    trees = random_trees(rng, 24)
    batch = DraftBatch.pack(trees, torch.device("cpu"))
    argmax = torch.from_numpy(rng.integers(0, VOCAB, (24, batch.num_nodes)))
    for b, tr in enumerate(trees):  # the argmax after a node is often one of its children
        for c in range(1, tr.num_nodes):
            if rng.random() < 0.7:
                argmax[b, tr.parents[c]] = int(tr.tokens[c])
    path, counts, bonus = accept_greedy_cpu(batch.tokens, batch.parents, batch.counts, argmax)
    want = accept_greedy_batch(batch.tokens, batch.parents, batch.depths, batch.counts, batch.tree_mask, argmax)
    assert np.array_equal(path, want[0].numpy()) and np.array_equal(counts, want[1].numpy())
    assert np.array_equal(bonus, want[2].numpy()) and counts.max() > 2
    for b, tr in enumerate(trees):
        ref = accept_greedy(tr.tokens, tr.parents, argmax[b, : tr.num_nodes].numpy())
        assert path[b, : counts[b]].tolist() == list(ref.path) and bonus[b] == ref.bonus
    with pytest.raises(ValueError, match="has 0 nodes"):
        accept_greedy_cpu(batch.tokens, batch.parents, torch.zeros(24, dtype=torch.long), argmax)
    with pytest.raises(ValueError, match=r"\[B, N\] int64 like tokens"):
        accept_greedy_cpu(batch.tokens, batch.parents, batch.counts, argmax[:, :1])
    from dart_core import _kernels

    with pytest.raises(TypeError):  # an output of another dtype is refused, not written through a copy
        _kernels.accept_greedy(batch.tokens.numpy(), batch.parents.numpy(), batch.counts.numpy(), argmax.numpy(),
                               np.empty(path.shape, np.int32), counts, bonus)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_rows_walk_as_the_host_reference(seed):
    """Greedy rows and rows with temperature, top-k and top-p in one batch: the same paths and bonus
    tokens as the host walk over the same uniforms."""
    rng = np.random.default_rng(seed)
    trees = random_trees(rng, 12)
    batch = DraftBatch.pack(trees, torch.device("cpu"))
    logits = torch.randn(12, batch.num_nodes, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    kinds = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_k=4),
             SamplingParams(temperature=0.9, top_p=0.8, top_k=6)]
    params = [kinds[i % 4] for i in range(12)]
    uniforms = 1 - torch.rand(12, batch.max_depth + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    path, counts, bonus = accept_sampling_batch(batch.tokens, batch.parents, batch.counts, logits, params, uniforms,
                                                batch.max_depth)
    early = accept_sampling_batch(batch.tokens, batch.parents, batch.counts, logits, params, uniforms,
                                  batch.max_depth, stop_when_done=True)
    assert all(torch.equal(a, e) for a, e in zip((path, counts, bonus), early))
    for b, tr in enumerate(trees):
        want_path, want_bonus = host_walk(tr, logits[b], params[b], uniforms[b])
        assert path[b, : int(counts[b])].tolist() == want_path and not path[b, int(counts[b]):].any()
        assert int(bonus[b]) == want_bonus


def test_the_first_emitted_token_follows_the_target():
    """Multi-candidate rejection sampling's law at the root (children 3, 5, 9; temperature and top-k):
    the first emitted token, drafted or bonus, is distributed as the warped target (chi-square over
    6,000 rows of one batch)."""
    n = 6000
    tree = make_tree([0, 3, 5, 9, 4], [-1, 0, 0, 0, 1])
    batch = DraftBatch.pack([tree] * n, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(tree.num_nodes, VOCAB, generator=gen) * 1.5
    logits[0, [3, 5, 9]] += 1.5  # the drafted children are likely, not certain
    logits = logits.expand(n, -1, -1)
    sp = SamplingParams(temperature=0.8, top_k=8)
    path, counts, bonus = accept_sampling_batch(batch.tokens, batch.parents, batch.counts, logits, [sp] * n,
                                                1 - torch.rand(n, batch.max_depth + 1, dtype=torch.float64,
                                                               generator=gen), batch.max_depth)
    first = torch.where(counts > 1, batch.tokens[0, path[:, 1]], bonus).numpy()
    expected = target_probs(logits[0, 0], sp).double().numpy() * n
    observed = np.bincount(first, minlength=VOCAB)
    assert observed[expected == 0].sum() == 0  # top-k's excluded tokens never appear
    keep = expected > 0
    assert stats.chisquare(observed[keep], expected[keep] * n / expected[keep].sum()).pvalue > 1e-3
    assert (counts > 1).float().mean() > 0.2  # drafted children were accepted, not only bonus draws


def test_sample_token_never_draws_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([1.0, 1e-300, 0.5, 0.5000001], dtype=torch.float64)
    assert sample_token(probs, u).tolist() == [3, 1, 1, 3]


def test_accept_keeps_free_rows_batched_beside_a_constrained_one(monkeypatch):
    """accept(): one constrained row (min_tokens masking a stop token) walks on the host while the other
    rows go through the one batched C++ walk; every row's path and bonus equal the per-row reference."""
    from dart_core.step import verify
    from dart_core.step.grammar import MinTokens
    from dart_core.model.target import TargetOutput

    rng = np.random.default_rng(5)
    trees = random_trees(rng, 6)
    batch = DraftBatch.pack(trees, torch.device("cpu"))
    logits = torch.randn(6, batch.num_nodes, VOCAB, generator=torch.Generator().manual_seed(2))
    for b, tr in enumerate(trees):  # acceptance likely
        for c in range(1, tr.num_nodes):
            if rng.random() < 0.7:
                logits[b, tr.parents[c], tr.tokens[c]] += 10
    stop = int(logits[2, 0].argmax())  # the constrained row's root argmax becomes a masked stop token
    constraints = [None, None, MinTokens(None, [stop], 5), None, None, None]
    calls = []
    real = verify.accept_greedy_cpu
    monkeypatch.setattr(verify, "accept_greedy_cpu", lambda tok, *a: calls.append(tok.shape[0]) or real(tok, *a))
    out = TargetOutput(logits, torch.zeros(6, batch.num_nodes, 3))
    got = verify.accept(batch, out, [SamplingParams()] * 6, [torch.Generator()] * 6, constraints, cheap_host_reads=True)
    assert calls == [5]  # the five free rows in one call
    for b, tr in enumerate(trees):
        if b == 2:
            masked = logits[b, : tr.num_nodes].clone()
            masked[:, stop] = float("-inf")
            ref = accept_greedy(tr.tokens, tr.parents, masked.argmax(-1).numpy())
            assert got.bonus[b] != stop
        else:
            ref = accept_greedy(tr.tokens, tr.parents, logits[b, : tr.num_nodes].argmax(-1).numpy())
        assert got.paths[b, : got.counts[b]].tolist() == list(ref.path) and got.bonus[b] == ref.bonus
        assert not got.paths[b, got.counts[b]:].any()
    assert got.longest == got.counts.max() >= 2 and torch.equal(got.device_paths, torch.from_numpy(got.paths))
