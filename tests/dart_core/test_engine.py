"""Lossless decoding on tiny random Llama and Qwen3 targets: DART greedy output
equals the engine's autoregressive output and transformers' generate, at
batch 1 and batch 4 with different prompt lengths; sampling reproduces the
target's first- and second-token distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dart_core.spec.budget import AdaptiveBudget, SpeculationGate, VerifyCostCurve
from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig
from dart_core.step.engine import DartEngine, NewSequence
from dart_core.step.sampling import SamplingParams, target_probs
from ngram_service.client import InProcessTreeSearch
from ngram_service.build import build_trie
from ngram_service.trie import NgramTrie
from ngram_service.tree_search import SearchParams

from .conftest import VOCAB, OracleTreeSearch, hf_greedy, tiny_target


def random_head(target, seed=0, **kw) -> DartDraftHead:
    head = DartDraftHead(DraftHeadConfig.for_target(target.config, **kw))
    head.reset_parameters(seed)
    return head.eval()


def prompts_of(rng, lengths):
    return [[int(x) for x in rng.integers(0, VOCAB, size=n)] for n in lengths]


@pytest.mark.parametrize("lengths", [[7], [3, 11, 1, 6]])
def test_greedy_dart_equals_autoregressive_and_hf(target, lengths, tmp_path):
    rng = np.random.default_rng(len(lengths))
    docs = [list(rng.integers(0, VOCAB, size=200)) for _ in range(20)]
    build_trie(docs, tmp_path / "t.trie", vocab_size=VOCAB, order=3)
    trie = NgramTrie(tmp_path / "t.trie")
    sp = SamplingParams(max_new_tokens=24)
    for trial in range(5):
        prompts = prompts_of(rng, lengths)
        ar = DartEngine(target).generate(prompts, sp, speculative=False)
        for search in (InProcessTreeSearch(None), InProcessTreeSearch(trie)):
            engine = DartEngine(target, random_head(target, seed=trial), search,
                                SearchParams(top_k=10, beam_width=6, budget=16, context_weight=0.0))
            dart = engine.generate(prompts, sp)
            assert dart.token_ids == ar.token_ids
            assert 1.0 <= dart.tau < 1.5  # a random head is almost never right
        for p, out in zip(prompts, ar.token_ids):
            assert out == hf_greedy(target, p, 24)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_context_chains_keep_output_exact_and_get_accepted(arch):
    """A tiny random target falls into loops; the request's own context drafts them (a random head
    cannot), at a batch of sequences of different lengths, with the output unchanged."""
    target = tiny_target(arch)
    rng = np.random.default_rng(7)
    prompts = prompts_of(rng, [8, 3, 12])
    sp = SamplingParams(max_new_tokens=96)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    taus = {}
    for weight in (0.0, 1.0):
        engine = DartEngine(target, random_head(target), InProcessTreeSearch(None),
                            SearchParams(top_k=10, beam_width=6, budget=16, context_weight=weight), context_order=3)
        assert engine.uses_context == (weight > 0)
        dart = engine.generate(prompts, sp)
        assert dart.token_ids == ar.token_ids
        taus[weight] = dart.tau
    assert taus[0.0] < 1.5 and taus[1.0] > 2.0, taus
    for p, out in zip(prompts, ar.token_ids):
        assert out == hf_greedy(target, p, 96)


def test_only_sequences_that_may_speculate_keep_a_context_index():
    """A call with speculation off, and a sequence that opts out, index nothing (nothing would read
    the index); the others index their prompt and output as before, with the output unchanged."""
    target = tiny_target("llama")
    prompts = prompts_of(np.random.default_rng(2), [6, 9])
    sp = SamplingParams(max_new_tokens=24)
    engine = DartEngine(target, random_head(target), InProcessTreeSearch(None),
                        SearchParams(top_k=10, beam_width=6, budget=8, context_weight=1.0), context_order=3)
    made = []
    new_context = engine._new_context
    engine._new_context = lambda prompt: made.append(len(prompt)) or new_context(prompt)
    ar = engine.generate(prompts, sp, speculative=False)
    assert made == []
    assert engine.generate(prompts, sp).token_ids == ar.token_ids and made == [6, 9]
    made.clear()
    joined = iter([[NewSequence(prompts[1], sp, speculative=False)]])
    out = list(engine.generate_stream([prompts[0]], sp, admit=lambda: next(joined, [])))
    assert made == [6] and out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_oracle_drafts_are_accepted_and_output_stays_exact(arch):
    target = tiny_target(arch, seed=3)
    rng = np.random.default_rng(3)
    prompts = prompts_of(rng, [5, 2, 9, 4])
    sp = SamplingParams(max_new_tokens=40)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    oracle = OracleTreeSearch([p + o for p, o in zip(prompts, ar.token_ids)], depth=6)
    dart = DartEngine(target, random_head(target), oracle).generate(prompts, sp)
    assert dart.token_ids == ar.token_ids
    assert dart.tau > 2.5  # multi-token acceptance and KV compaction really happened


def test_sequences_finish_independently():
    target = tiny_target("llama", seed=5)
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [4, 8, 6])
    free = DartEngine(target).generate(prompts, SamplingParams(max_new_tokens=30), speculative=False)
    stop = free.token_ids[1][10]  # a token sequence 1 emits at step 11
    sp = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))
    engine = DartEngine(target, random_head(target), OracleTreeSearch([p + o for p, o in zip(prompts, free.token_ids)]))
    res = engine.generate(prompts, sp)
    for i, toks in enumerate(free.token_ids):
        cut = toks.index(stop) + 1 if stop in toks else len(toks)
        assert res.token_ids[i] == toks[:cut]
        assert res.finish_reasons[i] == ("stop" if stop in toks else "length")
    short = engine.generate(prompts, SamplingParams(max_new_tokens=3))
    assert [len(t) for t in short.token_ids] == [3, 3, 3] and set(short.finish_reasons) == {"length"}


@pytest.mark.parametrize("speculative", [False, True])
def test_prefill_in_groups_keeps_output_exact(speculative):
    """Joining prompts prefilled in groups of at most max_prefill_tokens padded tokens (each group
    its own prefill step) decode exactly as one prefill of them all."""
    target = tiny_target("llama", seed=9)
    rng = np.random.default_rng(9)
    prompts = prompts_of(rng, [5, 12, 3, 9, 2, 7])
    sp = SamplingParams(max_new_tokens=12)
    whole = DartEngine(target).generate(prompts, sp, speculative=False)
    engine = DartEngine(target, random_head(target), OracleTreeSearch([p + o for p, o in zip(prompts, whole.token_ids)]),
                        max_prefill_tokens=24)
    prefills = [s for s in engine.generate_stream(prompts, sp, speculative=speculative) if not any(s.accepted_lengths)]
    # groups in order: [5, 12] (3 rows would pad to 36 > 24), [3, 9] (3 x 9 > 24), [2, 7]
    assert [s.seq_ids for s in prefills] == [[0, 1], [2, 3], [4, 5]]
    assert engine.generate(prompts, sp, speculative=speculative).token_ids == whole.token_ids
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        DartEngine(target, max_prefill_tokens=0)


def test_context_limit_stops_generation():
    target = tiny_target("llama")
    limit = target.max_context
    prompt = [1] * (limit - 5)
    res = DartEngine(target, random_head(target)).generate([prompt], SamplingParams(max_new_tokens=50))
    assert len(res.token_ids[0]) == 5 and res.finish_reasons == ["length"]
    with pytest.raises(ValueError, match="context"):
        DartEngine(target).generate([[1] * limit])


@pytest.mark.parametrize("bad,match", [([[]], "empty"), ([[1, VOCAB]], "outside the vocabulary"),
                                       ([[-1]], "outside the vocabulary")])
def test_bad_prompts(bad, match):
    with pytest.raises(ValueError, match=match):
        DartEngine(tiny_target("llama")).generate(bad)


def test_streaming_yields_per_step_stats():
    target = tiny_target("qwen3")
    engine = DartEngine(target, random_head(target), search_params=SearchParams(top_k=5, beam_width=4, budget=8))
    steps = list(engine.generate_stream([[1, 2, 3]], SamplingParams(max_new_tokens=6)))
    assert steps[0].accepted_lengths == [0] and len(steps[0].new_tokens[0]) == 1  # prefill
    assert sum(len(s.new_tokens[0]) for s in steps) == 6
    assert all(s.num_nodes >= 1 and s.draft_ms > 0 and s.verify_ms > 0 for s in steps[1:])
    assert steps[-1].finish_reasons == ["length"]


class GreedyChainSearch(OracleTreeSearch):
    """Drafts the target's own greedy continuation (a wrong sibling first at each
    depth), so sampled tokens mostly go through the acceptance test."""

    def __init__(self, target, depth: int) -> None:
        super().__init__([], depth=depth)
        self.target = target
        self.memo: dict[tuple[int, ...], list[int]] = {}

    def _truth(self, context):
        key = tuple(context)
        if key not in self.memo:
            self.memo[key] = hf_greedy(self.target, list(context), self.depth)
        return self.memo[key]


def test_sampling_matches_target_distribution():
    """Distributions of the first and second speculatively decoded tokens (x2, x3:
    x1 comes from the prefill) vs their exact marginals under the target
    (chi-square, fixed seeds)."""
    target = tiny_target("llama", seed=11)
    prompt = [5, 17, 42]
    sp = SamplingParams(temperature=0.6)
    p2, p3 = _marginals_of_tokens_2_and_3(target, prompt, sp)
    engine = DartEngine(target, random_head(target), GreedyChainSearch(target, depth=2))
    n = 4000
    res = engine.generate([prompt] * n, SamplingParams(temperature=0.6, max_new_tokens=4, seed=1))
    draws = np.array(res.token_ids)  # [n, 4]; x2 and x3 are drafted at depths 1 and 2 of the first tree
    assert res.tau > 1.2  # drafts were accepted, not only residual draws
    _assert_columns_follow(draws, p2, p3)


def _marginals_of_tokens_2_and_3(target, prompt, sp):
    """Exact marginals [V] of the second and third sampled tokens after ``prompt`` under the target."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        p1 = target_probs(target.model(ids).logits[0, -1], sp).double()  # [V]
        ext1 = torch.cat([ids.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)  # [V, P + 1]
        p2_given = target_probs(target.model(ext1).logits[:, -1], sp).double()  # [V(x1), V(x2)]
        ext2 = torch.cat([ext1.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], dim=1)
        p3_given = target_probs(target.model(ext2).logits[:, -1], sp).double().view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2_given  # [x1, x2]
    return joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))


def _assert_columns_follow(draws, p2, p3):
    """Chi-square of draws[:, 1] and draws[:, 2] against p2 and p3 (rare tokens pooled)."""
    n = len(draws)
    for col, p in ((1, p2), (2, p3)):
        observed = np.bincount(draws[:, col], minlength=VOCAB)
        expected = p.numpy() * n
        keep = expected >= 5  # pool rare tokens
        obs = np.append(observed[keep], observed[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        _, pval = stats.chisquare(obs, exp * obs.sum() / exp.sum())
        assert pval > 1e-3, (col, pval)


def test_sampling_is_reproducible_with_a_seed():
    target = tiny_target("qwen3", seed=2)
    engine = DartEngine(target, random_head(target), search_params=SearchParams(top_k=8, beam_width=4, budget=12))
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=12, seed=7)
    a = engine.generate([[1, 2, 3], [4, 5]], sp).token_ids
    b = engine.generate([[1, 2, 3], [4, 5]], sp).token_ids
    assert a == b


@pytest.mark.parametrize("arch, speculative", [("llama", True), ("qwen3", True), ("llama", False)])
def test_continuous_batching_joins_leaves_and_stays_exact(arch, speculative):
    """Sequences join a running batch at later steps, one is cancelled, steps above
    max_speculative_batch run autoregressively, sampled and greedy rows share the
    batch: every greedy output still equals transformers' generate."""
    target = tiny_target(arch, seed=5)
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [4, 9, 2, 6, 3])
    truth = [hf_greedy(target, p, 30) for p in prompts]
    oracle = OracleTreeSearch([p + t for p, t in zip(prompts, truth)], depth=5, seed=1)
    engine = DartEngine(target, random_head(target), oracle, SearchParams(top_k=10, beam_width=6, budget=16))
    greedy = SamplingParams(max_new_tokens=30)
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=30)
    schedule = {2: [(prompts[1], greedy), (prompts[2], sampled)], 4: [(prompts[3], greedy)], 6: [(prompts[4], greedy)]}
    calls = {"n": 0}

    def admit():
        calls["n"] += 1
        from dart_core.step.engine import NewSequence
        return [NewSequence(p, s) for p, s in schedule.pop(calls["n"], [])]

    cancelled = set()
    out: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    batch_sizes = []
    for step in engine.generate_stream([prompts[0]], greedy, admit=admit, cancelled=cancelled,
                                       max_speculative_batch=3, speculative=speculative):
        if step.accepted_lengths and max(step.accepted_lengths):  # a decoding step, not a prefill
            batch_sizes.append((len(step.seq_ids), max(step.draft_nodes)))
        for sid, toks, reason in zip(step.seq_ids, step.new_tokens, step.finish_reasons):
            out.setdefault(sid, []).extend(toks)
            if reason:
                reasons[sid] = reason
        if len(out.get(3, [])) >= 4:
            cancelled.add(3)  # seq 3 (prompts[3]) is cancelled after a few tokens
    assert reasons == {0: "length", 1: "length", 2: "length", 3: "cancelled", 4: "length"}
    assert out[0] == truth[0] and out[1] == truth[1] and out[4] == truth[4]
    assert out[3] == truth[3][: len(out[3])] and len(out[3]) < 30
    assert len(out[2]) == 30
    assert max(b for b, _ in batch_sizes) >= 4  # sequences joined a running batch
    assert all(nodes == 0 for b, nodes in batch_sizes if b > 3)  # autoregressive above max_speculative_batch
    assert any(nodes > 0 for b, nodes in batch_sizes if b <= 3) == speculative


def test_a_sequence_that_opts_out_of_speculation_makes_its_batch_autoregressive():
    """NewSequence(speculative=False) joins at step 2 and leaves after 6 tokens: steps while it
    runs verify no draft node, speculation resumes after it leaves, every output stays exact."""
    target = tiny_target("llama", seed=4)
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, [5, 3])
    truth = [hf_greedy(target, p, 24) for p in prompts]
    oracle = OracleTreeSearch([p + t for p, t in zip(prompts, truth)], depth=5, seed=2)
    engine = DartEngine(target, random_head(target), oracle, SearchParams(top_k=10, beam_width=6, budget=16))
    from dart_core.step.engine import NewSequence

    joining = {2: [NewSequence(prompts[1], SamplingParams(max_new_tokens=6), speculative=False)]}
    calls = {"n": 0}

    def admit():
        calls["n"] += 1
        return joining.pop(calls["n"], [])

    out: dict[int, list[int]] = {}
    phases = []  # (is the opted-out sequence running, draft nodes of the step)
    running_ar = False
    for step in engine.generate_stream([prompts[0]], SamplingParams(max_new_tokens=24), admit=admit):
        if step.accepted_lengths and max(step.accepted_lengths):
            phases.append((running_ar, max(step.draft_nodes)))
        for sid, toks, reason in zip(step.seq_ids, step.new_tokens, step.finish_reasons):
            out.setdefault(sid, []).extend(toks)
            if sid == 1:
                running_ar = reason is None
    assert out[0] == truth[0] and out[1] == truth[1][:6]
    assert any(r for r, _ in phases)
    assert all(nodes == 0 for r, nodes in phases if r)  # no draft tree while it runs
    last_ar = max(i for i, (r, _) in enumerate(phases) if r)
    assert any(nodes > 0 for _, nodes in phases[last_ar + 1:])  # speculation resumes once it has left


def test_held_draft_inputs_are_folded_into_the_head_cache_while_steps_do_not_draft():
    """Above max_speculative_batch no step drafts.  Each sequence's draft-head inputs are then held
    by reference, and folded into its head KV cache once held and pending positions pass hold_steps
    (a new prompt at once, past fold_width), so they stay bounded; the first draft once speculation
    resumes equals that of an engine that held them all, and the output stays exact either way."""
    target = tiny_target("llama", seed=6)
    prompts = prompts_of(np.random.default_rng(6), [9, 4, 7])
    limits = [40, 12, 14]
    ar = [hf_greedy(target, p, n) for p, n in zip(prompts, limits)]
    runs = {}
    for fold in (None, 3):
        engine = DartEngine(target, random_head(target, seed=2),
                            search_params=SearchParams(top_k=8, beam_width=4, budget=12))
        engine.drafter.fold_width = fold
        engine.hold_steps = 1000 if fold is None else 4
        drafts, held, draft, accept = [], [], engine.drafter.draft, engine._accept_step
        engine.drafter.draft = lambda *a, _draft=draft, _out=drafts, **kw: _out.append(_draft(*a, **kw)) or _out[-1]

        def accept_step(state, *a, _accept=accept, _held=held):
            step = _accept(state, *a)
            _held.append((len(state.seq_ids), len(state.draft.held) + state.draft.width))
            return step

        engine._accept_step = accept_step
        out: dict[int, list[int]] = {}
        for step in engine.generate_stream(prompts, [SamplingParams(max_new_tokens=n) for n in limits],
                                           max_speculative_batch=1):
            for sid, toks in zip(step.seq_ids, step.new_tokens):
                out.setdefault(sid, []).extend(toks)
        assert [out[i] for i in range(3)] == ar
        assert drafts and max(b for b, _ in held) == 3  # autoregressive steps of 3, then drafts alone
        runs[fold] = drafts, held
    (plain, held_all), (folded, held_folded) = runs[None], runs[3]
    # over the autoregressive steps (more than one sequence runs): without folding the inputs pile
    # up over 12 steps, with it they stay within hold_steps
    assert max(w for b, w in held_all if b > 1) > 10
    assert max(w for b, w in held_folded if b > 1) <= 4
    np.testing.assert_array_equal(folded[0][0], plain[0][0])  # the same draft tokens
    np.testing.assert_allclose(folded[0][1], plain[0][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_bf16_head_beside_an_fp32_target_stays_exact(arch):
    """A dense head on a CPU with native bf16 pairs an fp32 target with a bf16 draft head
    (api.default_draft_dtype): the head's inputs and KV cache take its dtype (the taps it has not
    read yet are held in it, half the bytes to copy when sequences join and leave), sequences join
    mid-run, output stays exact."""
    target = tiny_target(arch, seed=4)
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, [6, 3, 8])
    sp = SamplingParams(max_new_tokens=20)
    ar = DartEngine(target).generate(prompts, sp, speculative=False).token_ids
    head = random_head(target, seed=1).to(torch.bfloat16)
    engine = DartEngine(target, head, search_params=SearchParams(top_k=8, beam_width=4, budget=12))
    held, draft = [], engine.drafter.draft
    engine.drafter.draft = lambda state, *a, **kw: held.append(state.taps.dtype) or draft(state, *a, **kw)
    outputs, drafted = run_with_a_late_join(engine, prompts, sp)
    assert outputs == ar
    assert drafted > 0 and held and set(held) == {torch.bfloat16}


def run_with_a_late_join(engine: DartEngine, prompts, sp) -> tuple[list[list[int]], int]:
    """Decodes all prompts but the last, the last joining at the second step: (each prompt's
    output, draft nodes verified in all)."""
    from dart_core.step.engine import NewSequence

    joined = iter([[], [NewSequence(prompts[-1], sp)]])
    out: dict[int, list[int]] = {}
    drafted = 0
    for step in engine.generate_stream(prompts[:-1], sp, admit=lambda: next(joined, [])):
        drafted += sum(step.draft_nodes)
        for sid, toks in zip(step.seq_ids, step.new_tokens):
            out.setdefault(sid, []).extend(toks)
    return [out[i] for i in range(len(prompts))], drafted


class DepthRecordingSearch(InProcessTreeSearch):
    """The logits-only search, recording how many draft levels each call gets."""

    def __init__(self):
        super().__init__(None)
        self.levels = []

    def search_batch(self, topk_ids, topk_probs, contexts, params, chains=None):  # what the engine calls
        self.levels.append(topk_ids.shape[1])
        return super().search_batch(topk_ids, topk_probs, contexts, params)


def test_the_draft_goes_no_deeper_than_the_trees_can():
    """A fixed budget of n nodes drafts min(n, max_depth, d) levels; an adaptive budget drafts one level
    past the trees it keeps.  Output stays exact."""
    target = tiny_target("llama", seed=3)
    prompts = prompts_of(np.random.default_rng(3), [5, 8])
    sp = SamplingParams(max_new_tokens=12)
    ar = DartEngine(target).generate(prompts, sp, speculative=False).token_ids
    head = random_head(target)
    for params, expected in ((SearchParams(budget=1), {1}), (SearchParams(budget=3), {3}),
                             (SearchParams(budget=60, max_depth=5), {5}), (SearchParams(), {head.config.depth})):
        search = DepthRecordingSearch()
        assert DartEngine(target, head, search, params).generate(prompts, sp).token_ids == ar
        assert set(search.levels) == expected
    # steep cost: the budget keeps one node per tree, so after the first step the draft has 2 levels
    search = DepthRecordingSearch()
    steep = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 1000.0)))
    assert DartEngine(target, head, search, budget=steep).generate(prompts, sp).token_ids == ar
    assert search.levels[0] == head.config.depth and set(search.levels[1:]) == {2}


def test_pending_inputs_append_in_place():
    """Row r keeps its first counts[r] entries and gets the new ones right after; the buffer grows
    (zero-filled) only when a row would run past it, so appends are amortised O(new)."""
    from dart_core.spec.drafters import _append_in_place

    g = torch.Generator().manual_seed(0)
    buf = torch.zeros(3, 0, 2)
    counts = torch.zeros(3, dtype=torch.long)
    rows = [[], [], []]
    capacities = []
    for step in range(12):
        new = torch.randn(3, 1 + step % 3, 2, generator=g)
        valid = torch.randint(0, new.shape[1] + 1, (3,), generator=g)
        buf = _append_in_place(buf, counts, new, int(counts.max()))
        for r in range(3):
            rows[r] += new[r, : valid[r]].tolist()
        counts = counts + valid
        capacities.append(buf.shape[1])
        for r in range(3):
            assert buf[r, : counts[r]].tolist() == rows[r]
        assert torch.isfinite(buf).all()
    assert len(set(capacities)) < len(capacities) / 2  # grown a few times, not at every append


class _AlwaysLookup(AdaptiveBudget):
    """A budget that takes a lookup step whenever a chain has a token (up to ``n`` of them)."""

    def __init__(self, n: int) -> None:
        super().__init__(VerifyCostCurve((1, 64), (10.0, 10.0)))
        self.n = n

    def select_lookup(self, chains):
        return self.n if any(len(c.tokens) for c in chains) else 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lookup_steps_keep_output_exact_and_get_accepted(arch):
    """Lookup steps (each sequence's context chain verified alone, no draft head) on a tiny target
    that falls into loops, at a batch of different lengths, mixed with tree steps: greedy output
    unchanged, chains accepted, and the draft head's catch-up after them stays exact."""
    target = tiny_target(arch)
    rng = np.random.default_rng(7)
    prompts = prompts_of(rng, [8, 3, 12])
    sp = SamplingParams(max_new_tokens=96)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    params = SearchParams(top_k=10, beam_width=6, budget=16, context_weight=1.0)
    # the adaptive budget compares a lookup step's rate, priced by its curve plus the lookup overhead it
    # measures, with the tree steps' measured rate: a curve of a few µs makes the first lookup look
    # worth it on any machine (a curve in ms kept a fast CPU from ever trying one), and after it
    # the comparison is between measured times
    for budget in (_AlwaysLookup(12), AdaptiveBudget(VerifyCostCurve((1, 64), (0.010, 0.012)))):
        engine = DartEngine(target, random_head(target), InProcessTreeSearch(None), params, budget=budget,
                            context_order=3)
        steps = list(engine.generate_stream(prompts, sp))
        out = [[], [], []]
        for s in steps:
            for sid, toks in zip(s.seq_ids, s.new_tokens):
                out[sid].extend(toks)
        assert out == ar.token_ids
        lookups = [s for s in steps if s.lookup]
        trees = [s for s in steps[1:] if not s.lookup]
        assert lookups and trees  # both kinds ran (the first steps after the prefill are tree steps)
        assert all(s.draft_ms == 0 for s in lookups)
        accepted = [a for s in lookups for a in s.accepted_lengths]
        assert max(accepted) > 1  # a chain token accepted beyond the bonus token
        if isinstance(budget, _AlwaysLookup):
            # how many lookups the adaptive budget keeps taking after its first depends on the times it
            # measures (a loaded CI machine took three), so the acceptance bar is held where the lookups
            # are fixed by the output alone
            assert sum(accepted) / len(accepted) > 2.0, accepted
    without = DartEngine(target, random_head(target), InProcessTreeSearch(None), params,
                         budget=AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 12.0))), context_order=3,
                         lookup_length=0)
    assert not any(s.lookup for s in without.generate_stream(prompts, sp))


@pytest.mark.parametrize("source", ["context", "live corpus"])
def test_lookup_steps_sample_the_target_distribution(source):
    """Sampling through lookup steps: the second and third tokens (x1 from the prefill) follow their
    exact marginals under the target (chi-square), whether the chain comes from the prompt, which
    repeats itself, or from the live corpus (in process: whatever x1 the prefill samples, the
    corpus holds the prompt's end and x1 followed by two tokens)."""
    from ngram_service.live import LiveCorpus

    target = tiny_target("llama", seed=11)
    live = None
    if source == "context":
        prompt = [5, 17, 42, 9, 5, 17, 42, 9, 5]
    else:
        prompt = [5, 17, 42, 9, 61, 3, 88]
        rng = np.random.default_rng(3)
        live = LiveCorpus(max_tokens=1 << 12)
        live.add([prompt[-3:] + [t] + rng.integers(0, 96, size=2).tolist() for t in range(96)])
    p2, p3 = _marginals_of_tokens_2_and_3(target, prompt, SamplingParams(temperature=0.6))
    engine = DartEngine(target, random_head(target), InProcessTreeSearch(None, live=live),
                        SearchParams(top_k=4, beam_width=2, budget=8, context_weight=1.0), budget=_AlwaysLookup(2),
                        context_order=3)
    n = 3000
    first_step = None
    draws = np.zeros((n, 3), dtype=np.int64)
    filled = np.zeros(n, dtype=np.int64)
    for s in engine.generate_stream([prompt] * n, SamplingParams(temperature=0.6, max_new_tokens=3, seed=1)):
        if first_step is None and any(s.accepted_lengths):
            first_step = s
        for sid, toks in zip(s.seq_ids, s.new_tokens):
            draws[sid, filled[sid]:filled[sid] + len(toks)] = toks
            filled[sid] += len(toks)
    assert first_step is not None and first_step.lookup  # x2, x3 were drafted by the chains
    _assert_columns_follow(draws, p2, p3)


class _RecordingGate(SpeculationGate):
    """A speculation gate that records whether each step it was shown was measured (typical)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def observe(self, batch, speculative, tokens, step_ms, typical=True):
        self.seen.append(typical)
        super().observe(batch, speculative, tokens, step_ms, typical)


def test_the_gate_measures_lookup_steps_whatever_is_pending():
    """Lookup steps leave the draft head's inputs pending (it catches up at the next tree step); the
    speculation gate still measures them, and only the catch-up draft is left unmeasured."""
    target = tiny_target("llama")
    prompt = prompts_of(np.random.default_rng(7), [8])
    gate = _RecordingGate()
    engine = DartEngine(target, random_head(target), InProcessTreeSearch(None),
                        SearchParams(top_k=4, beam_width=2, budget=16, context_weight=1.0), budget=_AlwaysLookup(12),
                        gate=gate, context_order=3)
    steps = [s for s in engine.generate_stream(prompt, SamplingParams(max_new_tokens=96)) if any(s.accepted_lengths)]
    assert len(steps) == len(gate.seen)
    lookups = [typical for s, typical in zip(steps, gate.seen) if s.lookup]
    assert len(lookups) >= 2 and all(lookups)
    pending, piled = len(prompt[0]), False  # positions the head has not seen, before each step
    for s in steps:
        piled = piled or (s.lookup and pending > engine.head.config.draft_length + 2)
        pending = pending + s.accepted_lengths[0] if s.lookup or not s.draft_ms else s.accepted_lengths[0]
    assert piled  # some measured lookup step started with a catch-up's worth of pending positions


class _OffThenOn(SpeculationGate):
    """Keeps speculation off for ``off`` steps, then on."""

    def __init__(self, off):
        super().__init__()
        self.off, self.asked = off, 0

    def speculate(self, batch):
        self.asked += 1
        return self.asked > self.off


@pytest.mark.parametrize("batch", [1, 3])
def test_a_gated_off_step_dispatches_the_autoregressive_steps_operators(batch):
    """A step the gate keeps autoregressive in a speculative batch dispatches the operators of an
    autoregressive step, plus one view (its root taps, held by reference); the held taps and tokens
    reach the draft head and the context indexes when speculation resumes, and output stays exact."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    target = tiny_target("llama", seed=3)
    prompts = prompts_of(np.random.default_rng(3), [5, 9, 7][:batch])
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ops = {}
    for mode in ("autoregressive", "gated-off"):
        engine = DartEngine(target, random_head(target, seed=1), InProcessTreeSearch(None),
                            SearchParams(top_k=4, beam_width=2, budget=8), gate=_OffThenOn(off=12))
        counts, step, resumed = [], engine._step, []

        def counted(state, speculative, _step=step, _counts=counts, _resumed=resumed):
            held = len(state.draft.held) if state.draft is not None else 0
            with Count() as c:
                out = _step(state, speculative)
            _counts.append(c.n)
            if speculative and held:  # the first draft after the gated-off stretch: nothing left held
                _resumed.append((held, len(state.draft.held),  # each context index holds all its row's tokens
                                 [len(x) for x in state.context] == [len(t) for t in state.tokens]))
            return out

        engine._step = counted
        out = engine.generate(prompts, sp, speculative=mode == "gated-off")
        assert out.token_ids == DartEngine(target).generate(prompts, sp, speculative=False).token_ids
        ops[mode] = counts[2:10]  # steps 3..10: the gate keeps the gated-off engine autoregressive
        if mode == "gated-off":
            assert resumed and resumed[0][0] >= 10 and resumed[0][1] == 0 and resumed[0][2]
    assert [g - a for g, a in zip(ops["gated-off"], ops["autoregressive"])] == [1] * 8


@pytest.mark.parametrize("batch, temperature", [(1, 0.0), (16, 0.0), (1, 0.8), (16, 0.8)])
def test_a_step_reads_device_tensors_at_most_twice(batch, temperature):
    """A speculative step reads device tensors twice (the draft's top-k out, the accepted paths
    out) and an autoregressive step once (the accepted token out), whatever the batch size and
    tree size, greedy or sampling (with top-k and top-p): on a GPU each read is a sync.  Counted
    over typical steps (after the first, catch-up draft; no sequence joins or leaves)."""
    from dart_core.bench.host_reads import count_host_reads

    target = tiny_target("llama")
    prompts = prompts_of(np.random.default_rng(batch), [3 + i % 7 for i in range(batch)])
    for speculative, budget, most in ((False, 8, 1), (True, 4, 2), (True, 12, 2)):
        engine = DartEngine(target, random_head(target), InProcessTreeSearch(None),
                            SearchParams(top_k=8, beam_width=4, budget=budget))
        # count what a GPU would (a CPU's sampling walk may read per level; its greedy walk reads nothing)
        engine.cheap_host_reads = False
        sampling = SamplingParams(max_new_tokens=40, temperature=temperature, top_k=20 * (temperature > 0),
                                  top_p=0.9 if temperature else 1.0, seed=1)
        steps = engine.generate_stream(prompts, sampling, speculative=speculative)
        next(steps), next(steps)  # the prefill and the first draft (a catch-up over the prompt)
        with count_host_reads() as reads:
            for _ in range(4):
                step = next(steps)
                assert step.num_nodes > 1 or not speculative
        assert sum(reads.values()) == 4 * most, dict(reads)


@pytest.mark.parametrize("temperature, packed", [(0.0, False), (0.0, True), (0.8, False)])
def test_a_speculative_step_builds_no_per_tree_objects(monkeypatch, temperature, packed):
    """From the search to the acceptance, a step of a batch of 8 handles its trees as padded arrays
    (TreeBatch, DraftBatch): no DraftTree and no Acceptance is built, with the adaptive budget choosing
    (padded or packed) and the request's context in the search, greedy or sampling; the output is
    unchanged by the guard (greedy equals the target's own)."""
    from ngram_service.tree_search import DraftTree
    from dart_core.step import verify

    target = tiny_target("llama")
    prompts = prompts_of(np.random.default_rng(11), [3 + i % 5 for i in range(8)])
    engine = DartEngine(target, random_head(target), InProcessTreeSearch(None),
                        SearchParams(top_k=8, beam_width=4, budget=12, context_weight=0.5),
                        budget=AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.5))), context_order=3)
    engine.pooled_budget = packed
    sampling = SamplingParams(max_new_tokens=24, temperature=temperature, seed=3)
    steps = engine.generate_stream(prompts, sampling)
    out = [[] for _ in prompts]
    for step in (next(steps), next(steps)):  # the prefill and the first draft
        for sid, toks in zip(step.seq_ids, step.new_tokens):
            out[sid] += toks
    built = []

    def refuse(name):
        def init(self, *args, **kwargs):
            built.append(name)
            raise AssertionError(f"a {name} was built on the step's path")
        return init

    with monkeypatch.context() as guard:
        guard.setattr(DraftTree, "__init__", refuse("DraftTree"))
        guard.setattr(verify.Acceptance, "__init__", refuse("Acceptance"))
        for _ in range(4):
            step = next(steps)
            assert step.speculated
            for sid, toks in zip(step.seq_ids, step.new_tokens):
                out[sid] += toks
    assert not built
    for step in steps:
        for sid, toks in zip(step.seq_ids, step.new_tokens):
            out[sid] += toks
    if temperature == 0:
        assert out == engine.generate(prompts, sampling, speculative=False).token_ids


def test_a_step_that_captures_a_cuda_graph_is_not_measured_by_the_gate():
    """A graph capture (tens of ms) is no measure of its mode: the engine marks the step atypical."""
    class Speculating(_RecordingGate):  # every step speculates: no mode switch, no timing in the test
        def speculate(self, batch):
            return True

    target = tiny_target("llama")
    prompt = prompts_of(np.random.default_rng(3), [8])
    gate = Speculating()
    engine = DartEngine(target, random_head(target), InProcessTreeSearch(None),
                        SearchParams(top_k=4, beam_width=2, budget=8), gate=gate)
    real_step, calls = engine._step, []

    def capturing_step(state, speculative):  # the 4th step captures a graph, as a new shape would on CUDA
        calls.append(speculative)
        if len(calls) == 4:
            engine.drafter.static_draft.captures += 1
        return real_step(state, speculative)

    engine._step = capturing_step
    list(engine.generate_stream(prompt, SamplingParams(max_new_tokens=24)))
    assert len(gate.seen) == len(calls) >= 5 and all(calls)
    assert gate.seen[3] is False and all(gate.seen[1:3]) and all(gate.seen[4:])  # step 0: the prompt's catch-up


def test_packed_verification_is_lossless_and_skips_padding():
    """With the adaptive budget on a packed CPU target, nodes compete across the batch, trees of
    different sizes are verified with only their real rows computed, and greedy output stays exact."""
    target = tiny_target("llama", seed=4)
    if not target.packed:
        pytest.skip("this PyTorch cannot pack linear layers (no oneDNN)")
    rng = np.random.default_rng(11)
    prompts = prompts_of(rng, [6, 3, 9, 4])
    sp = SamplingParams(max_new_tokens=24)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    truth = [p + o for p, o in zip(prompts, ar.token_ids)]
    engine = DartEngine(target, random_head(target), OracleTreeSearch(truth, depth=5, seed=2),
                        budget=AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 74.0))))
    assert not engine.packed_verification  # opt-in
    engine.pooled_budget = True
    assert engine.packed_verification
    real, rows_seen = target.forward, []

    def spy(*args, rows=None, **kw):
        rows_seen.append(None if rows is None else len(rows))
        return real(*args, rows=rows, **kw)

    target.forward = spy
    try:
        assert engine.generate(prompts, sp).token_ids == ar.token_ids
    finally:
        del target.forward
    assert all(r is None or r > 0 for r in rows_seen)
    # the rows of trees of 3 and 1 nodes padded to 3 (which trees the budget makes depends on timing)
    rows = engine._real_rows(np.array([3, 1]), 3)
    assert rows.tolist() == [0, 1, 2, 3]
