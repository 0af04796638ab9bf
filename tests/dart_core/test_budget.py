"""Adaptive tree budget: exact helpers on hand-written trees, the choice on
flat (GPU-like) and steep (CPU-like) cost curves, and losslessness with it;
the speculation gate's decisions on given step rates, and an engine that
follows a gate's decisions and stays exact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dart_core.spec.budget import (AdaptiveBudget, CalibrationInterrupted, SpeculationGate, VerifyCostCurve,
                                   chain_speedup, curve_shapes, node_acceptance_estimates)
from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams
from ngram_service.tree_search import ContextChain

from .conftest import OracleTreeSearch, make_tree, tiny_target
from .test_engine import prompts_of, random_head

# root 9 -> 1 (p .5) -> 3 (p .8); root -> 2 (p .3) -> 4 (p .1)
TREE = make_tree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [1.0, 0.5, 0.3, 0.8, 0.1])


def with_scores(tree, scores):
    return dataclasses.replace(tree, scores=np.array(scores))


def _trees(selected):
    """select_batch's (TreeBatch, predicted) as (its trees, predicted as a list)."""
    batch, predicted = selected
    return batch.trees(), predicted.tolist()


def hopeless(tree):
    """The same tree, every node drafted with probability 1e-4."""
    return dataclasses.replace(tree, probs=np.r_[1.0, np.full(tree.num_nodes - 1, 1e-4)].astype(np.float32))


def test_node_acceptance_estimates():
    est = node_acceptance_estimates(TREE)
    np.testing.assert_allclose(est, [1.0, 0.5, 0.3, 0.4, 0.03], rtol=1e-6)


def test_subtree_reindexes():
    sub = TREE.select(np.array([True, True, False, True, False]))
    np.testing.assert_array_equal(sub.tokens, [9, 1, 3])
    np.testing.assert_array_equal(sub.parents, [-1, 0, 1])
    np.testing.assert_array_equal(sub.tree_mask, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_flat_cost_keeps_everything_steep_cost_keeps_the_likely_nodes():
    tree = with_scores(TREE, [0.0, -0.7, -1.2, -0.9, -3.0])  # rank: 1, 3, 2, 4
    flat = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)))
    assert flat.select(tree)[0].num_nodes == 5
    # each node costs 10 ms on top of 30: only nodes with P > ~0.3 pay
    steep = AdaptiveBudget(VerifyCostCurve((1, 2, 3, 4, 5), (30.0, 40.0, 50.0, 60.0, 70.0)))
    chosen, predicted = steep.select(tree)
    np.testing.assert_array_equal(chosen.tokens, [9, 1, 3])
    assert abs(predicted - 0.9) < 1e-6
    assert steep.select(hopeless(tree))[0].num_nodes == 2  # min_budget keeps one node to learn from


def test_batch_selection_prices_the_padded_verification():
    tree = with_scores(TREE, [0.0, -0.7, -1.2, -0.9, -3.0])  # rank: 1, 3, 2, 4 with P .5, .4, .3, .03
    policy = AdaptiveBudget(VerifyCostCurve((1, 11), (30.0, 80.0)))  # 5 ms per query token
    # one promising and one hopeless sequence: the trees are padded to one size, so a second node
    # costs both sequences one query token: 2.9 / curve(2 * 3) = 2.9/55 < 2.5 / curve(2 * 2) = 2.5/45.
    # (Pricing nodes one at a time, as if unpadded, would have given the first tree three.)
    (good, bad), predicted = _trees(policy.select_batch([tree, hopeless(tree)]))
    np.testing.assert_array_equal(good.tokens, [9, 1])
    np.testing.assert_array_equal(bad.tokens, [9, 1])  # min_budget: every tree keeps one node
    assert predicted[0] == pytest.approx(0.5) and predicted[1] < 1e-3
    # two promising sequences: 3.8/55 beats 3.0/45 and 4.4/65, so both get two nodes
    both, predicted = _trees(policy.select_batch([tree, tree]))
    for t in both:
        np.testing.assert_array_equal(t.tokens, [9, 1, 3])
    assert predicted == pytest.approx([0.9, 0.9])
    # a tree smaller than the chosen count keeps all it has (2 ms per query token: 3.4/40 is the best rate)
    small = tree.select(np.array([True, True, False, False, False]))
    cheaper = AdaptiveBudget(VerifyCostCurve((1, 11), (30.0, 50.0)))
    (big, little), _ = _trees(cheaper.select_batch([tree, small]))
    assert (big.num_nodes, little.num_nodes) == (3, 2)
    single, p1 = policy.select(tree)
    (alone,), (p2,) = _trees(policy.select_batch([tree]))  # batch 1 is select()
    np.testing.assert_array_equal(alone.tokens, single.tokens)
    assert p1 == p2
    flat = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)))
    assert flat.select_batch([tree, hopeless(tree)])[0].counts.tolist() == [5, 5]


def test_packed_batch_selection_lets_nodes_compete_across_the_batch():
    """Priced by real nodes (a packed target), one budget serves the whole batch: the promising tree
    takes the nodes, the hopeless one verifies its root only; every kept set stays prefix-closed."""
    tree = with_scores(TREE, [0.0, -0.7, -1.2, -0.9, -3.0])  # rank: 1, 3, 2, 4 with P .5, .4, .3, .03
    policy = AdaptiveBudget(VerifyCostCurve((1, 11), (30.0, 80.0)))  # 5 ms per query token
    # T nodes in all cost curve(2 + T): 2.5/40, 2.9/45 (best), 3.2/50, 3.23/55
    (good, bad), predicted = _trees(policy.select_batch([tree, hopeless(tree)], packed=True))
    np.testing.assert_array_equal(good.tokens, [9, 1, 3])
    np.testing.assert_array_equal(bad.tokens, [9])
    assert predicted == pytest.approx([0.9, 0.0])
    (alone,), (p1,) = _trees(policy.select_batch([tree], packed=True))  # batch 1: the per-tree choice
    single, p2 = policy.select(tree)
    np.testing.assert_array_equal(alone.tokens, single.tokens)
    assert p1 == p2
    flat = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)))
    assert flat.select_batch([tree, hopeless(tree)], packed=True)[0].counts.tolist() == [5, 5]
    # a node is never kept without its parent, whatever its own estimate
    odd = make_tree([9, 1, 2, 3], [-1, 0, 1, 2], [1.0, 0.2, 0.99, 0.99])
    steep = AdaptiveBudget(VerifyCostCurve((1, 11), (30.0, 80.0)))
    for t in steep.select_batch([odd, tree, odd], packed=True)[0].trees():
        assert all(0 <= t.parents[i] < i and t.depths[i] == t.depths[t.parents[i]] + 1
                   for i in range(1, t.num_nodes))


def test_search_depth_follows_the_kept_trees():
    """One level deeper than the deepest node kept over the recent steps, within max_depth."""
    tree = with_scores(TREE, [0.0, -0.7, -1.2, -0.9, -3.0])  # depths 1, 1, 2, 2
    policy = AdaptiveBudget(VerifyCostCurve((1, 2, 3, 4, 5), (30.0, 40.0, 50.0, 60.0, 70.0)), depth_window=2)
    assert policy.search_depth(8) == 8  # nothing kept yet
    policy.select(hopeless(tree))  # keeps one depth-1 node
    assert policy.search_depth(8) == 2
    policy.select(tree)  # keeps 1 -> 3: depth 2
    assert policy.search_depth(8) == 3 and policy.search_depth(2) == 2
    policy.select(hopeless(tree))
    assert policy.search_depth(8) == 3  # the depth-2 step is still in the window of 2
    policy.select(hopeless(tree))
    assert policy.search_depth(8) == 2


def test_the_search_is_sized_to_what_the_budget_keeps():
    """search_params: at most twice the most nodes kept over the recent steps (at least 4), beam no
    wider, top-k no wider than that or 8; the engine's tree search receives it."""
    from ngram_service.tree_search import SearchParams

    tree = with_scores(TREE, [0.0, -0.7, -1.2, -0.9, -3.0])
    policy = AdaptiveBudget(VerifyCostCurve((1, 2, 3, 4, 5), (30.0, 40.0, 50.0, 60.0, 70.0)), depth_window=2)
    params = SearchParams()
    assert policy.search_params(params) is params  # nothing kept yet: the full search
    policy.select(hopeless(tree))  # keeps one node
    small = policy.search_params(params)
    assert (small.budget, small.beam_width, small.top_k) == (4, 4, 8) and small.max_depth == params.max_depth
    assert policy.search_params(params) is small  # made once
    policy._kept_nodes.append(30)
    wide = policy.search_params(params)
    assert (wide.budget, wide.beam_width, wide.top_k) == (60, 20, 25)  # never beyond the configured search

    from ngram_service.client import InProcessTreeSearch

    class Recorder(InProcessTreeSearch):
        def search_batch(self, topk_ids, topk_probs, contexts, params, chains=None):
            seen.append(params)
            return super().search_batch(topk_ids, topk_probs, contexts, params, chains)

    seen = []
    target = tiny_target("llama")
    engine = DartEngine(target, random_head(target), Recorder(None), SearchParams(budget=12),
                        budget=AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0))))
    engine.generate(prompts_of(np.random.default_rng(0), [5]), SamplingParams(max_new_tokens=6))
    assert seen[0].budget == 12 and seen[0].beam_width == 20  # the first step: the configured search
    assert len(seen) > 1 and all(p.budget <= 12 and p.beam_width <= p.budget for p in seen[1:])


def test_cost_curve_extrapolates_its_last_slope():
    curve = VerifyCostCurve((1, 4, 8), (10.0, 16.0, 24.0))
    np.testing.assert_allclose(curve(np.array([1, 6, 8, 12])), [10.0, 20.0, 24.0, 32.0])


def test_cost_by_batch_interpolates_the_measured_batch_sizes():
    flat = VerifyCostCurve((1, 64), (10.0, 10.0))  # batch 1 only: B sequences of n tokens cost as B * n tokens
    np.testing.assert_allclose(flat.cost(16, np.array([1, 44])), [10.0, 10.0])
    curve = VerifyCostCurve((1, 64), (10.0, 10.0), batches=(4, 16), batch_ms=((10.0, 12.0), (11.0, 20.0)))
    np.testing.assert_allclose(curve.cost(1, np.array([1, 64])), [10.0, 10.0])
    np.testing.assert_allclose(curve.cost(4, np.array([1, 64])), [10.0, 12.0])
    np.testing.assert_allclose(curve.cost(10, np.array([1, 64])), [10.5, 16.0])  # halfway between 4 and 16
    np.testing.assert_allclose(curve.cost(28, np.array([64])), [28.0])  # beyond 16: the slope from 4 to 16
    np.testing.assert_allclose(curve.cost(2, np.array([64])), [32 / 3])  # between batch 1 and 4
    with pytest.raises(ValueError, match="one row per batch size"):
        VerifyCostCurve((1, 64), (10.0, 10.0), batches=(4,), batch_ms=((10.0,),))
    with pytest.raises(ValueError, match="ascending"):
        VerifyCostCurve((1, 64), (10.0, 10.0), batches=(1,), batch_ms=((10.0, 10.0),))


def test_a_batch_costlier_than_the_batch1_curve_shrinks_the_trees():
    """A GPU-like flat batch-1 curve lets 16 sequences verify their whole trees; the same budget with
    a measured batch of 16 whose cost grows with the tokens per sequence keeps fewer nodes."""
    chain = make_tree(list(range(9)), [-1] + list(range(8)), [1.0] + [0.7] * 8)  # P(k-th node) = 0.7^k
    trees = [chain] * 16
    flat = AdaptiveBudget(VerifyCostCurve((1, 9), (10.0, 10.0)))
    batched = AdaptiveBudget(VerifyCostCurve((1, 9), (10.0, 10.0), batches=(16,), batch_ms=((10.0, 26.0),)))
    assert set(flat.select_batch(trees)[0].counts.tolist()) == {9}
    # 16 (1 + Σ_{k ≤ n} 0.7^k) / (10 + 2 n) is largest at n = 3
    assert set(batched.select_batch(trees)[0].counts.tolist()) == {4}


def test_calibration_follows_observations():
    policy = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)), ema=0.5)
    for _ in range(10):
        policy.observe(predicted=2.0, accepted=1, overhead_ms=3.0)
    assert abs(policy.calibration - 0.5) < 0.01 and abs(policy.overhead_ms - 3.0) < 1e-9


def test_calibrated_predictions_settle_on_what_is_accepted():
    """A head whose estimates are twice the acceptance: the budget's calibrated predictions (what
    select_batch returns, made with the calibration of the moment) must settle at what is accepted,
    the calibration at 0.5, not at its square root (the fixed point of averaging accepted ÷ calibrated
    prediction, which left every prediction 1.4× too high)."""
    chain = make_tree([0, 1], [-1, 0], [1.0, 0.8])  # one draft node, estimate 0.8, accepted with rate 0.4
    policy = AdaptiveBudget(VerifyCostCurve((1, 9), (10.0, 10.0)), ema=0.05)
    rng = np.random.default_rng(3)
    predicted_sum = accepted_sum = 0.0
    for step in range(4000):
        _, predicted = policy.select_batch([chain])
        accepted = rng.random(1) < 0.4
        policy.observe_batch(predicted, accepted.astype(np.int64), 1.0)
        if step >= 2000:
            predicted_sum += float(predicted.sum())
            accepted_sum += float(accepted.sum())
    assert policy.calibration == pytest.approx(0.5, abs=0.08)
    assert accepted_sum / predicted_sum == pytest.approx(1.0, abs=0.05)


def test_measured_curve_and_lossless_with_adaptive_budget():
    target = tiny_target("llama", seed=4)
    curve = VerifyCostCurve.measure(target, node_counts=(1, 8, 32), context_len=32, repeats=2)
    assert curve.nodes == (1, 8, 32) and all(ms > 0 for ms in curve.ms) and curve.batches == ()
    both = VerifyCostCurve.measure(target, node_counts=(1, 8), context_len=16, repeats=1, batch_sizes=(3,))
    assert both.batches == (3,) and len(both.batch_ms[0]) == 2
    assert all(b >= a > 0 for a, b in zip(both.ms, both.batch_ms[0]))  # a batch never costs less than one sequence
    assert curve_shapes("cpu", 60) == ((1, 2, 4, 8, 16, 32, 48, 61), (1,))
    assert curve_shapes("cuda", 60)[1] == (1, 4, 16)
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
    # tree steps keep at most the oracle's 12 nodes; lookup steps verify at most lookup_length chain tokens
    assert all(1 <= n <= (engine.drafter.lookup_length if s.lookup else 12) for s in steps[1:] for n in s.draft_nodes if n)


def test_curve_minimum_is_point_wise_and_needs_the_same_shapes():
    a = VerifyCostCurve((1, 2, 4), (1.0, 3.0, 5.0), (4,), ((2.0, 4.0, 9.0),))
    b = VerifyCostCurve((1, 2, 4), (2.0, 2.5, 6.0), (4,), ((1.5, 5.0, 8.0),))
    low = a.minimum(b)
    assert low.ms == (1.0, 2.5, 5.0) and low.batch_ms == ((1.5, 4.0, 8.0),)
    with pytest.raises(ValueError, match="different shapes"):
        a.minimum(VerifyCostCurve((1, 2, 8), (1.0, 2.0, 3.0), (4,), ((1.0, 2.0, 3.0),)))


def test_remeasuring_replaces_a_start_up_curve_that_priced_speculation_out():
    """A start-up curve measured on a busy node (a second query token at 50x the first) says no
    batch size can pay; the idle re-measurement lowers it point-wise and can_pay answers again."""
    target = tiny_target("llama", seed=4)
    nodes = (1, 2, 4, 8)
    busy = VerifyCostCurve(nodes, (1000.0, 50000.0, 50000.0, 50000.0))
    budget = AdaptiveBudget(busy)
    assert not budget.can_pay(1)
    with pytest.raises(CalibrationInterrupted):
        budget.remeasure(target, should_stop=lambda: True)
    assert budget.curve is busy and budget.remeasured == 0 and not budget.can_pay(1)
    asked = []
    curve = budget.remeasure(target, should_stop=lambda: asked.append(1) or False)
    assert budget.curve is curve and curve.nodes == nodes and budget.remeasured == 1
    assert len(asked) == len(nodes) * 6  # asked before every forward: a warm-up pass and 5 timed passes
    assert all(0 < new <= old for new, old in zip(curve.ms, busy.ms)) and curve.ms[1] < 1000.0
    assert budget.can_pay(1)  # the kept no was dropped with the old curve
    assert budget.state()["curve_remeasured"] == 1


def test_engines_on_one_node_measure_their_verification_cost_one_after_another(tmp_path, monkeypatch):
    """measuring_alone: while another engine of the node holds the calibration lock (here a
    thread), a CPU measurement waits for it instead of running beside it; a waiting re-measurement
    still stops when work arrives, a holder that keeps the lock too long is measured beside (with a
    warning), and a GPU measurement never takes the lock."""
    import threading
    import time

    from dart_core.spec import budget as budget_mod

    lock = str(tmp_path / "calibration.lock")
    monkeypatch.setattr(budget_mod, "CALIBRATION_LOCK", lock)
    target = tiny_target("llama", seed=4)
    order, held, release = [], threading.Event(), threading.Event()

    def other_engine():
        with budget_mod.measuring_alone("cpu", path=lock) as got:
            order.append(("other", got))
            held.set()
            release.wait(10)
            order.append(("other done", got))

    t = threading.Thread(target=other_engine)
    t.start()
    assert held.wait(10)
    with pytest.raises(CalibrationInterrupted):  # waiting for the lock, then a request arrives
        VerifyCostCurve.measure(target, node_counts=(1, 2), repeats=1, should_stop=lambda: True, log=False)
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    curve = VerifyCostCurve.measure(target, node_counts=(1, 2), repeats=1, log=False)
    assert time.monotonic() - t0 >= 0.25 and order == [("other", True), ("other done", True)]
    assert curve.nodes == (1, 2)
    t.join()
    with budget_mod.measuring_alone("cpu", path=lock) as got:  # a holder past the wait: measured beside it
        with budget_mod.measuring_alone("cpu", path=lock, wait_s=0.1) as second:
            assert got and not second
    with budget_mod.measuring_alone("cpu", path=lock):
        with budget_mod.measuring_alone("cuda", path=lock) as gpu:
            assert gpu is False


def _drive(gate, batch, steps, spec_rate, ar_rate):
    """Runs the gate for ``steps`` steps where speculative / autoregressive steps emit the given tokens per ms."""
    modes = []
    for _ in range(steps):
        spec = gate.speculate(batch)
        modes.append(spec)
        gate.observe(batch, spec, 10, 10 / (spec_rate if spec else ar_rate))
    return modes


def test_gate_measures_both_modes_then_keeps_the_faster_and_probes_the_other():
    gate = SpeculationGate(probe_every=8, probe_steps=2, settle_steps=1, warmup=2, max_probe_every=8)  # a fixed probe period
    modes = _drive(gate, 1, 6 + 32, spec_rate=0.5, ar_rate=1.0)  # speculation loses
    # 3 speculative steps, then 3 autoregressive (the first step of each mode is not measured)
    assert modes[:6] == [True, True, True, False, False, False]
    assert modes[6:].count(True) == 32 // 8 * 2  # only the probes speculate, two steps at a time
    assert [i for i, m in enumerate(modes[6:]) if m][:4] == [6, 7, 14, 15]
    assert gate.speedup(1) == pytest.approx(0.5)
    modes = _drive(gate, 4, 6 + 32, spec_rate=2.0, ar_rate=1.0)  # speculation wins at batch 4: its own statistics
    assert modes[:6] == [True, True, True, False, False, False] and modes[6:].count(False) == 32 // 8 * 2
    assert gate.speedup(4) == pytest.approx(2.0) and gate.speedup(16) is None


def test_gate_ranks_modes_by_tokens_per_ms_of_wall_time():
    """A mode's rate is its average tokens per step over its average wall ms per step (tokens per ms of
    wall time), not an average of each step's own tokens / ms, which weighs a 10-ms step like a 40-ms
    one and overstates a mode whose step times vary: here that average would rank autoregressive steps
    (1 token in 10 or 40 ms: 0.0625) above speculative ones (2 tokens in 40 ms: 0.05), at 0.04 they are not."""
    gate = SpeculationGate(warmup=4, settle_steps=1)
    ar_ms = iter([10.0, 40.0] * 200)
    modes = []
    for _ in range(300):
        spec = gate.speculate(1)
        modes.append(spec)
        gate.observe(1, spec, 2 if spec else 1, 40.0 if spec else next(ar_ms))
    assert 0.03 <= gate.state()["1"]["tokens_per_ms"]["autoregressive"] < 0.05  # the probes' steps: 10, 40, 10 ms or 40, 10, 40
    assert gate.speedup(1) > 1 and modes[20:].count(True) > 0.9 * len(modes[20:])


def test_gate_buckets_batch_sizes_by_powers_of_two():
    assert [SpeculationGate.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]
    gate = SpeculationGate(warmup=1, settle_steps=1)
    _drive(gate, 5, 4, spec_rate=2.0, ar_rate=1.0)  # batch 5 measures bucket 8
    assert gate.speedup(8) == pytest.approx(2.0) and gate.speedup(4) is None
    assert gate.speculate(7)


def test_gate_does_not_measure_the_settling_steps_after_a_switch():
    """The first ``settle_steps`` steps of each mode (a bucket's first steps too) are not measured: the
    switch's catch-up and the cold steps after it."""
    gate = SpeculationGate(warmup=1, settle_steps=3, probe_steps=7)
    for _ in range(3):
        gate.observe(1, True, 1, 100.0)  # a fresh engine's cold first steps, ignored
    gate.observe(1, True, 10, 10.0)
    assert gate.state()["1"]["measured_steps"] == {"autoregressive": 0, "speculative": 1}
    gate.observe(1, False, 1, 1000.0)  # the switch: a slow catch-up, ignored
    gate.observe(1, False, 1, 100.0)  # still settling, ignored
    gate.observe(1, False, 1, 100.0)
    gate.observe(1, False, 10, 20.0)
    assert gate.speedup(1) == pytest.approx(2.0)
    gate.observe(1, True, 1, 100.0)  # speculation resumes: three settling steps, 90 ms each beyond its average
    gate.observe(1, True, 1, 100.0)
    assert gate.speedup(1) == pytest.approx(2.0)
    gate.observe(1, True, 1, 100.0)
    assert gate._buckets[1].switch_ms == pytest.approx(3 * 90.0)  # priced into the probe period


def test_gate_ignores_atypical_steps():
    gate = SpeculationGate(warmup=1, settle_steps=1)
    gate.observe(1, True, 1, 10.0)  # the bucket's first step: settling
    gate.observe(1, True, 2, 1000.0, typical=False)  # the draft over a whole new prompt
    gate.observe(1, True, 10, 10.0)
    gate.observe(1, False, 1, 1000.0)  # switch
    gate.observe(1, False, 10, 20.0)
    assert gate.speedup(1) == pytest.approx(2.0)


def test_gate_leaves_hiccups_out_of_its_averages():
    """A step far slower than its mode's average (a CUDA graph capture, a GC pause) is skipped; when the
    first steps were the hiccup, a step far faster restarts the average."""
    gate = SpeculationGate(warmup=2, settle_steps=1)
    gate.observe(1, True, 1, 10.0)  # the bucket's first step: settling
    gate.observe(1, True, 2, 500.0)  # the first measured step captured graphs: 0.004 tokens/ms
    gate.observe(1, True, 3, 10.0)  # 0.3 tokens/ms: the average restarts here
    gate.observe(1, True, 3, 600.0)  # a later hiccup: skipped
    gate.observe(1, True, 3, 10.0)
    gate.observe(1, False, 1, 1000.0)  # the switch (not measured)
    gate.observe(1, False, 1, 5.0)
    gate.observe(1, False, 1, 5.0)
    assert gate.speedup(1) == pytest.approx(0.3 / 0.2) and gate.hiccups == 2
    assert gate.speculate(1)  # the hiccups do not turn speculation off
    plain = SpeculationGate(warmup=1, ema=0.1, settle_steps=1)  # the first steps average plainly, not 1 : 0.1
    plain.observe(1, True, 1, 1.0)  # settling
    plain.observe(1, True, 1, 10.0)
    plain.observe(1, True, 3, 10.0)
    plain.observe(1, False, 1, 10.0)  # switch
    plain.observe(1, False, 1, 10.0)
    assert plain.speedup(1) == pytest.approx(2.0)


def test_gate_follows_a_change_seen_by_its_probes():
    gate = SpeculationGate(ema=0.5, probe_every=4, probe_steps=2, settle_steps=1, warmup=1, max_probe_every=4)
    _drive(gate, 2, 20, spec_rate=0.5, ar_rate=1.0)
    modes = _drive(gate, 2, 40, spec_rate=3.0, ar_rate=1.0)  # the draft head got good (e.g. code prompts)
    assert modes[-20:].count(False) == 20 // 4 * 2  # speculation wins again; autoregressive steps are the probes


def test_gate_probes_less_often_while_the_same_mode_keeps_winning():
    # probes priced loosely (a probe may cost 90 % of its period), so the period only doubles
    gate = SpeculationGate(ema=0.5, probe_every=4, probe_steps=2, settle_steps=1, warmup=1, max_probe_every=16, max_probe_share=0.9)
    warm = 4  # two speculative steps, then two autoregressive (the first step of each mode is not measured)
    modes = _drive(gate, 1, warm + 48, spec_rate=0.5, ar_rate=1.0)
    # probe periods 4, 4 (the first end only records the winner), 8, 16, 16: one 2-step probe each
    assert [i for i, m in enumerate(modes[warm:]) if m] == [2, 3, 6, 7, 14, 15, 30, 31, 46, 47]
    modes = _drive(gate, 1, 64, spec_rate=3.0, ar_rate=1.0)  # speculation starts winning: the probes see it
    first = modes.index(True)
    assert first < 16  # the first probe of the 16-step period
    # that probe measures one step, and its ratio of averages still carries the old average's slow step
    # (a stale average weighs one step): the next probe turns the gate
    turned = first + 16
    assert all(modes[turned:turned + 10])
    assert modes[turned:].count(True) > 3 * modes[turned:].count(False)  # then autoregressive steps are only probes


def test_gate_judges_a_probe_by_its_own_steps_not_by_old_averages():
    """At the default settings, once speculation has lost for a long time (its average settled over many
    probes), the first probe after it starts winning turns the gate, instead of being blended into the old
    average at weight ``ema`` and confirming the old winner (which doubled the probe period each time)."""
    gate = SpeculationGate()
    _drive(gate, 1, 2000, spec_rate=0.5, ar_rate=1.0)  # periods grow to 1024 steps
    modes = _drive(gate, 1, 1100, spec_rate=2.0, ar_rate=1.0)  # the draft head got good
    first = modes.index(True)
    assert first < 1024  # the next probe: within one period
    assert modes[first + 8:].count(False) <= 4 * (len(modes) // 64 + 1)  # afterwards autoregressive steps are probes


def test_gate_spaces_its_probes_by_their_measured_cost():
    """Once a probe confirms the winner, the next period is long enough that what a probe loses
    (probe_steps of the loser, each losing its step time x (1 - its rate / the winner's)) stays within
    max_probe_share of the period.  Here both modes emit 10 tokens a step, so a probe step loses 30 - 10 ms."""
    gate = SpeculationGate(ema=0.5, probe_every=8, probe_steps=2, settle_steps=1, warmup=1, max_probe_every=1024,
                           max_probe_share=0.05)
    modes = _drive(gate, 1, 3 + 2000, spec_rate=1 / 3, ar_rate=1.0)  # a speculative step takes 3x as long
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    gaps = np.diff(starts)
    priced = int(np.ceil(2 * (3 - 1) / 0.05))  # 80 steps
    assert gaps[0] == 8 and all(g >= priced for g in gaps[1:])  # the first period only records the winner
    probe_ms = modes[starts[1]:].count(True) * (30 - 10)  # what the probes cost beyond autoregressive steps
    assert probe_ms <= 0.05 * 10 * len(modes[starts[1]:]) + 2 * 20  # within the share (the last probe aside)


def test_gate_never_speculates_where_speculation_cannot_pay():
    """A batch size where can_pay says no never speculates: no warm-up, no probe, nothing measured."""
    gate = SpeculationGate(warmup=1, probe_every=8, probe_steps=2, settle_steps=1, max_probe_every=8, can_pay=lambda b: b < 8)
    assert not any(_drive(gate, 16, 50, spec_rate=2.0, ar_rate=1.0))
    assert gate.speedup(16) is None
    assert _drive(gate, 4, 1, spec_rate=2.0, ar_rate=1.0) == [True]  # elsewhere the gate warms up as before


def test_the_gates_measurements_outrank_a_can_pay_no():
    """A bucket that measured both modes, speculation ahead, keeps deciding by its measurements when
    can_pay turns to no (a model of the step, here misled); one that measured speculation behind,
    or has not measured both, obeys the no."""
    says = {"pay": True}
    gate = SpeculationGate(warmup=2, probe_every=8, probe_steps=2, settle_steps=1, max_probe_every=8,
                           can_pay=lambda b: says["pay"])
    _drive(gate, 1, 30, spec_rate=2.0, ar_rate=1.0)  # both modes measured at batch 1, speculation ahead
    _drive(gate, 2, 30, spec_rate=0.5, ar_rate=1.0)  # both measured at batch 2, speculation behind
    says["pay"] = False
    ahead = _drive(gate, 1, 40, spec_rate=2.0, ar_rate=1.0)
    assert ahead.count(True) >= 30  # still speculating, probing autoregressive steps now and then
    assert not any(_drive(gate, 2, 20, spec_rate=0.5, ar_rate=1.0))
    assert not any(_drive(gate, 4, 20, spec_rate=2.0, ar_rate=1.0))  # nothing measured there: the no holds
    # the measurements then turn: speculation falls behind, and the gate stops on its own evidence
    late = _drive(gate, 1, 200, spec_rate=0.5, ar_rate=1.0)
    assert not any(late[-20:])


def test_can_pay_prices_the_measured_first_level_acceptance():
    """can_pay's α is the measured share of sequence-steps that accepted a draft token (trees and
    lookups) plus CAN_PAY_MARGIN: a batch size that pays only with nearly every node accepted stops
    speculating once drafts are measured to be accepted less, and comes back when they are."""
    from dart_core.spec.budget import CAN_PAY_MARGIN

    # batch 4 prices 4n tokens on the batch-1 curve: a second query token per sequence costs 50 %
    curve = VerifyCostCurve((1, 4, 8, 16, 32), (10.0, 10.0, 15.0, 22.0, 38.0))
    budget = AdaptiveBudget(curve)
    assert budget.first_level_acceptance == 1.0 and budget.can_pay(4)
    for _ in range(300):  # tree rows: one in four accepts its first node
        budget.observe_batch(np.array([0.5, 0.5, 0.5, 0.5]), np.array([1, 0, 0, 0]), 0.0)
    assert budget.first_level_acceptance == pytest.approx(0.25, abs=0.02)
    alpha = budget.first_level_acceptance + CAN_PAY_MARGIN
    assert curve.ceiling(4, alpha)[1] == 1 and not budget.can_pay(4)
    assert budget.can_pay(1)  # batch 1: a second token is free, any acceptance pays
    for _ in range(400):  # lookup rows count too: now every chain's first token is accepted
        budget.observe_lookup(match_length=3, offered=4, accepted=2)
    assert budget.first_level_acceptance > 0.9 and budget.can_pay(4)
    budget.observe_lookup(match_length=3, offered=0, accepted=0)  # nothing offered: no evidence
    assert budget.first_level_acceptance > 0.9


def test_step_time_average_leaves_out_one_off_stalls():
    """StepTimeAverage: a stall before the steady steps (the first served step's gRPC connect) is
    replaced by the next step; a stall among them is left out; ``confirm`` in a row are a new level."""
    from dart_core.spec.budget import StepTimeAverage

    avg = StepTimeAverage(0.05)
    avg.add(35.0)  # the first step: one-off costs
    for _ in range(28):
        avg.add(3.0)
    assert avg.value == pytest.approx(3.0)  # a plain EMA of weight 0.05 would still be at 3 + 32 * 0.95**28 = 10.6
    avg.add(40.0)  # one spike among steady steps
    assert avg.value == pytest.approx(3.0) and avg.stalls == 1
    avg.add(3.4)
    assert 3.0 < avg.value < 3.4
    for x in (20.0, 24.0, 22.0):  # three in a row: the level moved
        avg.add(x)
    assert avg.value == pytest.approx(22.0)
    avg.add(21.0, steps=2)  # two observations at once: weight 1 - 0.95**2
    assert avg.value == pytest.approx(0.95 ** 2 * 22.0 + (1 - 0.95 ** 2) * 21.0)
    avg.reset()
    assert avg.value == 0.0
    with pytest.raises(ValueError):
        StepTimeAverage(0.0)


def test_budget_overhead_survives_the_first_step_and_a_stale_no_is_revisited():
    """AdaptiveBudget.overhead_ms: a first step that paid one-off costs does not make can_pay say no
    (the trap found serving on a 2-core Xeon: no speculative step, so the estimate never came down),
    nor do the first _OVERHEAD_MIN_STEPS steps before they are all measured where the ceiling with
    drafting free is high (on a steep curve the first step is priced at once);
    and a no resting on an overhead measured _OVERHEAD_STALE_STEPS calls ago is asked again."""
    from dart_core.spec.budget import _OVERHEAD_MIN_STEPS, _OVERHEAD_STALE_STEPS

    curve = VerifyCostCurve((1, 2, 4, 8), (10.0, 10.6, 11.8, 16.0))
    budget = AdaptiveBudget(curve)
    for i in range(300):  # lookup rows (no drafting time): 30 % accept their first token
        budget.observe_lookup(match_length=2, offered=1, accepted=int(i % 10 < 3))
    budget.observe_batch(np.array([0.5]), np.array([1]), 35.0)  # the first tree step, cold
    assert budget.overhead_ms == 35.0 and budget.can_pay(1)  # too few steps to price it: drafting free
    for _ in range(_OVERHEAD_MIN_STEPS - 1):  # the cold steps go on
        assert budget.can_pay(1)
        budget.observe_batch(np.array([0.5]), np.array([1]), 35.0)
    assert not budget.can_pay(1)  # now measured: 35 ms of drafting cannot pay
    for _ in range(5):
        budget.observe_batch(np.array([0.5]), np.array([1]), 2.0)
    assert budget.overhead_ms == pytest.approx(2.0, rel=0.05) and budget.can_pay(1)
    budget.observe_batch(np.array([0.5]), np.array([0]), None)  # a catch-up step: acceptance only
    assert budget.overhead_ms == pytest.approx(2.0, rel=0.05)
    budget.overhead_ms = 40.0  # a slow service at the last speculative step
    assert not budget.can_pay(1)
    for _ in range(_OVERHEAD_STALE_STEPS - 1):
        assert not budget.can_pay(1)
    assert budget.can_pay(1) and budget.overhead_ms == 0.0  # forgotten: the next speculative step measures it
    # where even free drafting pays little (a steep curve), the first step's time is priced at once
    steep = AdaptiveBudget(VerifyCostCurve((1, 2, 4, 8), (10.0, 14.0, 20.0, 34.0)))
    for i in range(300):
        steep.observe_lookup(match_length=2, offered=1, accepted=int(i % 10 < 3))
    assert steep.curve.ceiling(1, 0.5)[0] < 1.5 and steep.can_pay(1)
    steep.observe_batch(np.array([0.5]), np.array([1]), 35.0)
    assert not steep.can_pay(1)


def test_budget_and_gate_state_for_operators():
    """AdaptiveBudget.state and SpeculationGate.state: what a served engine's stats report."""
    curve = VerifyCostCurve((1, 2, 4), (10.0, 11.0, 13.0))
    budget = AdaptiveBudget(curve)
    budget.observe_batch(np.array([0.5, 0.5]), np.array([1, 0]), 2.5)
    state = budget.state()
    assert state["overhead_ms"] == 2.5 and state["verify_ms"] == {1: 10.0, 2: 11.0, 4: 13.0}
    assert 0 < state["first_level_acceptance"] < 1 and state["calibration"] > 0 and state["overhead_stalls"] == 0
    gate = SpeculationGate(warmup=1, settle_steps=1)
    assert gate.state() == {}
    gate.speculate(3)
    gate.observe(3, True, tokens=6, step_ms=1000.0)  # the bucket's first step settles: not measured
    gate.observe(3, True, tokens=6, step_ms=12.0)
    bucket = gate.state()["4"]  # batch 3 is in the bucket of 4
    assert bucket["measured_steps"] == {"autoregressive": 0, "speculative": 1}
    assert bucket["tokens_per_ms"]["speculative"] == pytest.approx(0.5) and bucket["step_ms"]["speculative"] == 12.0


def test_the_ceiling_and_whether_speculation_can_pay():
    """VerifyCostCurve.ceiling is chain_speedup over the curve's cost at the batch size plus the step's
    overhead; AdaptiveBudget.can_pay is its value at the measured overhead, at least 1, with α = 1
    before any acceptance was measured."""
    linear = VerifyCostCurve((1, 2, 4, 8), (10.0, 20.0, 40.0, 80.0))  # every query token costs a whole step
    assert linear.ceiling(1, 1.0) == (pytest.approx(1.0), 1)
    flat = VerifyCostCurve((1, 2, 4, 8), (10.0, 10.0, 10.0, 12.0))
    assert flat.ceiling(1, 1.0) == (pytest.approx(8 * 10 / 12), 8)
    assert flat.ceiling(1, 0.5, overhead_ms=2.0) == chain_speedup([10.0, 12.0, 12.0, 14.0], [1, 2, 4, 8], 0.5)
    # the batch-1 curve prices batch 4 as 4n tokens: 8 tokens at batch 4 cost 4 x 8 tokens (extrapolated)
    assert flat.ceiling(4, 1.0)[0] == pytest.approx(max(n * float(flat(4)) / float(flat(4 * n)) for n in (1, 2, 4, 8)))
    budget = AdaptiveBudget(linear)
    assert not budget.can_pay(1)  # exactly break-even with drafting free: nothing to gain
    cheap = AdaptiveBudget(VerifyCostCurve((1, 2, 4, 8), (10.0, 19.0, 39.0, 79.0)))
    assert cheap.can_pay(1)  # the first node costs 9 ms of a 10 ms step, each further one 10
    cheap.overhead_ms = 1.5
    assert not cheap.can_pay(1) and not cheap.can_pay(16)
    fast = AdaptiveBudget(VerifyCostCurve((1, 2, 4, 8), (10.0, 10.0, 10.0, 40.0)))  # flat, then 7.5 ms a token
    fast.overhead_ms = 0.5
    assert fast.can_pay(1) and not fast.can_pay(16)  # 16 sequences: 16 tokens per node, on the steep part
    lines = flat.calibration_lines(batches=(1, 4), alphas=(1.0, 0.6))
    assert len(lines) == 2 and lines[0].startswith("batch 1: plain 10.00 ms/token, a draft node 0.00 ms/sequence, "
                                                   "break-even acceptance 0.00; ceiling with drafting free α 1: 6.67x")


@pytest.mark.parametrize("kw", [{"ema": 0}, {"ema": 1.5}, {"probe_steps": 1}, {"probe_every": 4, "probe_steps": 4},
                                {"probe_every": 64, "max_probe_every": 32}, {"warmup": 0}, {"outlier": 1.0},
                                {"max_probe_share": 0.0}, {"max_probe_share": 1.0}])
def test_gate_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        SpeculationGate(**kw)


class ScriptedGate:
    """Speculates on even calls; records what the engine feeds back."""

    def __init__(self):
        self.calls = 0
        self.seen = []

    def speculate(self, batch):
        self.calls += 1
        return self.calls % 2 == 0

    def observe(self, batch, speculative, tokens, step_ms, typical=True):
        self.seen.append((batch, speculative, tokens, step_ms, typical))


@pytest.mark.parametrize("fold", [True, False])
def test_engine_follows_the_gate_and_stays_exact(fold):
    target = tiny_target("llama", seed=4)
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, [12, 3])
    sp = SamplingParams(max_new_tokens=30)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    gate = ScriptedGate()
    engine = DartEngine(target, random_head(target), OracleTreeSearch([p + o for p, o in zip(prompts, ar.token_ids)]),
                        gate=gate)
    if not fold:
        engine.drafter.fold_width = None  # the prompts' taps wait for the first draft
    out = [[], []]
    decode_steps = []
    for s in engine.generate_stream(prompts, sp):
        for sid, toks in zip(s.seq_ids, s.new_tokens):
            out[sid].extend(toks)
        if any(s.accepted_lengths):
            decode_steps.append(s)
    assert out == ar.token_ids
    assert len(gate.seen) == len(decode_steps) == gate.calls
    for (batch, spec, tokens, ms, _), s in zip(gate.seen, decode_steps):
        assert batch == len(s.seq_ids) and tokens == sum(s.accepted_lengths) and ms >= s.step_ms
        assert (max(s.draft_nodes) > 0) == spec  # the oracle drafts the truth: a speculative step drafts nodes
    assert any(spec and tokens > batch for _, spec, tokens, _, _ in gate.seen)  # accepted drafts count as tokens
    # every draft after an autoregressive step covers two steps' tokens, a typical step; without
    # folding the head's first draft covers the prompts, more than one step can accept (a catch-up)
    typical = [t for _, spec, _, _, t in gate.seen if spec]
    assert all(typical) if fold else typical[0] is False and all(typical[1:])


def _chain(n, match):
    return ContextChain(np.arange(1, n + 1, dtype=np.int64), np.ones(n, dtype=np.float32), match)


def test_lookup_waits_for_a_measured_tree_step_and_for_a_chain():
    policy = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)))
    assert policy.select_lookup([_chain(8, 4)]) == 0  # no tree rate to compare with yet
    policy.observe_step(1, False, tokens=2, step_ms=20.0, verified_nodes=5)  # tree steps: 0.1 tokens/ms
    assert policy.select_lookup([ContextChain.empty()]) == 0
    assert policy.select_lookup([_chain(8, 4)]) == 8  # flat cost: the whole chain


def test_long_matches_are_learnt_in_buckets():
    """A live corpus's match lengths past 8 (up to its MAX_MATCH) are learnt together from 9, 16 and
    32 on, so that each bucket gathers evidence; lengths up to 8 stay apart."""
    policy = AdaptiveBudget(VerifyCostCurve((1, 2, 32), (10.0, 12.0, 70.0)))
    for _ in range(40):
        policy.observe_lookup(20, offered=24, accepted=24)
    assert policy.chain_acceptance(16) == policy.chain_acceptance(31) > 0.95
    assert policy.chain_acceptance(8) == policy.chain_acceptance(9) == policy.chain_acceptance(32) == \
        pytest.approx(2 / 3)  # no evidence there: the prior
    policy.observe_lookup(12, offered=24, accepted=0)
    assert policy.chain_acceptance(15) == policy.chain_acceptance(9) < 2 / 3 and \
        policy.chain_acceptance(8) == pytest.approx(2 / 3)


def test_lookup_follows_the_chains_measured_acceptance():
    curve = VerifyCostCurve((1, 2, 32), (10.0, 12.0, 70.0))
    policy = AdaptiveBudget(curve)
    policy.observe_step(1, False, tokens=3, step_ms=25.0, verified_nodes=9)  # 0.12 tokens/ms
    for _ in range(40):  # chains of match 4 are always right ...
        policy.observe_lookup(4, offered=6, accepted=6)
    for _ in range(40):  # ... chains of match 1 never
        policy.observe_lookup(1, offered=6, accepted=0)
    assert policy.chain_acceptance(4) > 0.95 and policy.chain_acceptance(1) < 0.15  # the prior keeps a little
    assert policy.chain_acceptance(3) == pytest.approx(2 / 3)  # no evidence: the prior
    assert policy.select_lookup([_chain(16, 4)]) >= 8
    assert policy.select_lookup([_chain(16, 1)]) == 0  # a tree step pays more
    # the comparison is per batch bucket: a batch of 4 has no measured tree rate yet
    assert policy.select_lookup([_chain(16, 4)] * 4) == 0


def test_lookup_overhead_is_learnt_from_lookup_steps():
    policy = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 73.0)))
    policy.observe_step(1, True, tokens=4, step_ms=25.0, verified_nodes=4)  # t_verify(4) = 13 ms
    assert policy.lookup_overhead_ms == pytest.approx(12.0)


def test_lookup_preference_must_be_positive():
    with pytest.raises(ValueError, match="lookup_preference"):
        AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)), lookup_preference=0)


def _rank_reference(tree) -> np.ndarray:
    """A tree's draft nodes in the search's rank order, one node at a time: the lowest score on the
    path high to low, then depth, then index (csrc/search.cpp)."""
    eff = np.full(tree.num_nodes, np.inf)
    for i in range(1, tree.num_nodes):
        eff[i] = min(tree.scores[i], eff[tree.parents[i]])
    return sorted(range(1, tree.num_nodes), key=lambda i: (-eff[i], tree.depths[i], i))


def test_the_batched_selection_keeps_each_trees_best_nodes_in_rank_order():
    """select_batch ranks and cuts the whole batch in array operations; against a per-tree reference
    on random searched trees (rounded scores, so ties occur): padded, every tree keeps its first
    min(n, size) nodes in rank order for one n; packed, each tree keeps a prefix of its rank order;
    the predicted accepted nodes are the calibrated path products of what is kept."""
    from ngram_service.tree_search import SearchParams, search_trees

    rng = np.random.default_rng(7)
    for trial in range(60):
        b = int(rng.integers(1, 7))
        ids = rng.integers(0, 50, size=(b, 5, 6))
        probs = np.sort(rng.random((b, 5, 6)).astype(np.float32) ** 2, axis=-1)[..., ::-1].copy()
        params = SearchParams(top_k=6, beam_width=3, max_depth=5, budget=int(rng.integers(0, 20)), use_ngram=False)
        trees = [with_scores(t, np.round(t.scores, 1)) for t in search_trees(ids, probs, [[1, 2]] * b, params=params)]
        policy = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0 + 60 * rng.random())), min_budget=0)
        policy.calibration, policy.overhead_ms = float(rng.uniform(0.5, 2.0)), float(rng.uniform(0.0, 10.0))
        for packed in (False, True):
            chosen, predicted = policy.select_batch(trees, packed=packed)
            kept = []
            for i, tree in enumerate(trees):
                order = _rank_reference(tree)
                k = int(chosen.counts[i]) - 1
                keep = np.zeros(tree.num_nodes, dtype=bool)
                keep[0] = True
                keep[order[:k]] = True
                want = tree.select(keep)
                np.testing.assert_array_equal(chosen.tree(i).tokens, want.tokens)
                np.testing.assert_array_equal(chosen.tree(i).parents, want.parents)
                est = np.minimum(node_acceptance_estimates(tree)[order[:k]] * policy.calibration, 1.0)
                assert predicted[i] == pytest.approx(est.sum())
                kept.append(k)
            if not packed:  # one node count n for the batch
                sizes = [t.num_nodes - 1 for t in trees]
                n = max(kept)
                assert kept == [min(n, s) for s in sizes], trial


def test_observing_a_batch_equals_observing_its_rows_in_order():
    rng = np.random.default_rng(8)
    one, many = (AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.0)), ema=0.1) for _ in range(2))
    for _ in range(20):
        b = int(rng.integers(0, 9))
        predicted = rng.random(b) * rng.integers(0, 3, size=b) * 3  # some rows predict nothing
        accepted, ms = rng.integers(0, 5, size=b), rng.random()
        for p, a in zip(predicted, accepted):
            one.observe(float(p), int(a), ms)
        many.observe_batch(predicted, accepted, ms)
        assert many.calibration == pytest.approx(one.calibration, rel=1e-12)
        assert many.overhead_ms == pytest.approx(one.overhead_ms, rel=1e-12)
