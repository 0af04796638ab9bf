"""Adaptive tree budget: exact helpers on hand-written trees, the choice on
flat (GPU-like) and steep (CPU-like) cost curves, and losslessness with it."""

from __future__ import annotations

import numpy as np

from dart_core.budget import AdaptiveBudget, VerifyCostCurve, node_acceptance_estimates, subtree
from dart_core.engine import DartEngine
from dart_core.sampling import SamplingParams

from .conftest import OracleTreeSearch, make_tree, tiny_target
from .test_engine import prompts_of, random_head

# root 9 -> 1 (p .5) -> 3 (p .8); root -> 2 (p .3) -> 4 (p .1)
TREE = make_tree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2])
IDS = np.array([[1, 2, 7], [3, 4, 8]])
PROBS = np.array([[0.5, 0.3, 0.2], [0.8, 0.1, 0.1]], dtype=np.float32)


def with_scores(tree, scores):
    return type(tree)(tokens=tree.tokens, parents=tree.parents, depths=tree.depths, scores=np.array(scores),
                      tree_mask=tree.tree_mask, retrieve_indices=tree.retrieve_indices)


def test_node_acceptance_estimates():
    est = node_acceptance_estimates(TREE, IDS, PROBS)
    np.testing.assert_allclose(est, [1.0, 0.5, 0.3, 0.4, 0.03], rtol=1e-6)


def test_subtree_reindexes():
    sub = subtree(TREE, np.array([True, True, False, True, False]))
    np.testing.assert_array_equal(sub.tokens, [9, 1, 3])
    np.testing.assert_array_equal(sub.parents, [-1, 0, 1])
    np.testing.assert_array_equal(sub.tree_mask, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_flat_cost_keeps_everything_steep_cost_keeps_the_likely_nodes():
    tree = with_scores(TREE, [0.0, -0.7, -1.2, -0.9, -3.0])  # rank: 1, 3, 2, 4
    flat = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)))
    assert flat.select(tree, IDS, PROBS)[0].num_nodes == 5
    # each node costs 10 ms on top of 30: only nodes with P > ~0.3 pay
    steep = AdaptiveBudget(VerifyCostCurve((1, 2, 3, 4, 5), (30.0, 40.0, 50.0, 60.0, 70.0)))
    chosen, predicted = steep.select(tree, IDS, PROBS)
    np.testing.assert_array_equal(chosen.tokens, [9, 1, 3])
    assert abs(predicted - 0.9) < 1e-6
    hopeless = np.full_like(PROBS, 1e-4)
    assert steep.select(tree, IDS, hopeless)[0].num_nodes == 2  # min_budget keeps one node to learn from


def test_calibration_follows_observations():
    policy = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)), ema=0.5)
    for _ in range(10):
        policy.observe(predicted=2.0, accepted=1, overhead_ms=3.0)
    assert abs(policy.calibration - 0.5) < 0.01 and abs(policy.overhead_ms - 3.0) < 1e-9


def test_measured_curve_and_lossless_with_adaptive_budget():
    target = tiny_target("llama", seed=4)
    curve = VerifyCostCurve.measure(target, node_counts=(1, 8, 32), context_len=32, repeats=2)
    assert curve.nodes == (1, 8, 32) and all(ms > 0 for ms in curve.ms)
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, [6, 3])
    sp = SamplingParams(max_new_tokens=30)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    engine = DartEngine(target, random_head(target), OracleTreeSearch([p + o for p, o in zip(prompts, ar.token_ids)]),
                        budget=AdaptiveBudget(curve))
    steps = list(engine.generate_stream(prompts, sp))
    out = [[], []]
    for s in steps:
        for sid, toks in zip(s.seq_ids, s.new_tokens):
            out[sid].extend(toks)
    assert out == ar.token_ids
    assert all(1 <= n <= 12 for s in steps[1:] for n in s.draft_nodes if n)
