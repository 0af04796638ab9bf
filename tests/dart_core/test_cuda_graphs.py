"""The static-KV-cache verification and draft paths (dart_core.model.cuda_graphs): on a CPU they run
eagerly and must give the ordinary forwards' logits, taps, drafts and caches, and leave DART's
greedy output exact at every tree size, with continuous batching; on a GPU the same paths are
captured and replayed as CUDA graphs (gpu-marked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_core.model.cuda_graphs import StaticDrafter, StaticVerifier
from dart_core.step.engine import DartEngine, NewSequence
from dart_core.model.kv_cache import cache_mask
from dart_core.step.sampling import SamplingParams
from dart_core.model.target import TargetCache
from ngram_service.tree_search import SearchParams

from .conftest import OracleTreeSearch, hf_greedy, tiny_target
from .test_engine import prompts_of, random_head


def _tree_forward(target, cache, tokens, parents):
    """One verification forward of a tree (parents[i] < i, root -1) after the cache."""
    n = len(tokens)
    depth = [0] * n
    allowed = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            allowed[i] |= allowed[p]
    b = cache.lengths.shape[0]
    ids = torch.tensor([tokens] * b)
    pos = cache.lengths[:, None] + torch.tensor(depth)[None]
    mask = cache_mask(cache.lengths, cache.padded_length, allowed[None].expand(b, n, n), target.dtype)
    return target.forward(ids, pos, mask, cache)


@pytest.mark.parametrize("arch,windows", [("llama", None), ("qwen3", None), ("llama", (12, 16, 32, 64))])
@torch.inference_mode()
def test_the_static_path_equals_the_ordinary_forward_and_cache(arch, windows):
    """With the default windows (one here: the capacity is below the smallest) and with small ones,
    so the forwards move through windows of 12, 16 and 32 positions as the cache grows."""
    target = tiny_target(arch)
    rng = np.random.default_rng(0)
    prompts = prompts_of(rng, [9, 4])
    caches = []
    for static in (False, True):
        target.static = (StaticVerifier(target, capacity=64, buckets=(1, 2, 4, 8), windows=windows, use_graphs=False)
                         if static else None)
        cache = TargetCache(2, target.device)
        target.prefill(prompts, cache)
        outs = []
        # trees of 1, 3 (padded to 4), 5 (padded to 8) and 11 nodes (beyond the buckets: eager)
        for tokens, parents in [([5], [-1]), ([7, 8, 9], [-1, 0, 0]), ([1, 2, 3, 4, 6], [-1, 0, 1, 1, 3]),
                                (list(range(11)), [-1] + list(range(10)))]:
            out = _tree_forward(target, cache, tokens, parents)
            outs.append((out.logits.clone(), out.taps.clone()))
            # keep the root and its first child (a ragged acceptance: row 1 keeps the root only)
            t = cache.padded_length - len(tokens)
            keep = min(2, len(tokens))
            pooled = cache.pool is not None and cache.pool.holds(cache.cache.layers)
            assert pooled == (static and len(tokens) <= 8)  # after a static forward: one pass for all layers
            cache.compact(t + torch.arange(keep)[None].expand(2, keep), torch.tensor([keep, 1]))
        caches.append((outs, [(layer.keys.clone(), layer.values.clone()) for layer in cache.cache.layers],
                       cache.lengths.clone()))
        if static:
            assert target.static.replays == 3 and target.static.eager == 2  # the prefill and the 11 nodes
            if windows is None:
                assert set(target.static._shapes) == {(2, 1, 64), (2, 4, 64), (2, 8, 64)}
            else:  # the cache holds 9, then 10, 11 entries: 9 + 1 ≤ 12, 10 + 4 ≤ 16, 11 + 8 ≤ 32
                assert set(target.static._shapes) == {(2, 1, 12), (2, 4, 16), (2, 8, 32)}
    target.static = None
    (ref_outs, ref_kv, ref_len), (outs, kv, lengths) = caches
    assert torch.equal(ref_len, lengths)
    for (a, b), (c, d) in zip(ref_outs, outs):
        assert a.shape == c.shape and b.shape == d.shape
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d, b, rtol=1e-5, atol=1e-5)
    for (k0, v0), (k1, v1) in zip(ref_kv, kv):
        assert k0.shape == k1.shape
        for row, n in enumerate(lengths.tolist()):  # entries past a row's length are not part of the cache
            torch.testing.assert_close(k1[row, :, :n], k0[row, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v1[row, :, :n], v0[row, :, :n], rtol=1e-5, atol=1e-5)


class _Recording(OracleTreeSearch):
    """The oracle's trees, keeping every draft the search was given (top-k ids and probabilities)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafts = []

    def search(self, topk_ids, topk_probs, contexts, params, chains=None):
        self.drafts.append((np.array(topk_ids), np.array(topk_probs)))
        return super().search(topk_ids, topk_probs, contexts, params, chains)


def _dart_with_joins(target, prompts, lengths, truth, static_draft: dict | str | None = None, head_seed: int = 0):
    """Greedy DART (oracle trees of 7 nodes) with sequences 1 and 2, 3 joining at the 2nd and 4th
    step: (outputs per sequence, the recording search, the engine, each step's seq_ids).
    ``static_draft``: None for the engine's default drafter, "eager" for none, or the settings of
    a static drafter run without graphs."""
    oracle = _Recording([p + t for p, t in zip(prompts, truth)], depth=3, seed=1)
    engine = DartEngine(target, random_head(target, seed=head_seed), oracle,
                        SearchParams(top_k=10, beam_width=6, budget=6))
    if static_draft == "eager":
        engine.drafter.static_draft = None
    elif static_draft is not None:
        engine.drafter.enable_static_draft(use_graphs=False, **static_draft)
    schedule = {2: [1], 4: [2, 3]}
    calls = {"n": 0}

    def admit():
        calls["n"] += 1
        return [NewSequence(prompts[i], SamplingParams(max_new_tokens=lengths[i]))
                for i in schedule.pop(calls["n"], [])]

    out: dict[int, list[int]] = {}
    rows = []
    for step in engine.generate_stream([prompts[0]], SamplingParams(max_new_tokens=lengths[0]), admit=admit):
        rows.append(tuple(step.seq_ids))
        for sid, toks in zip(step.seq_ids, step.new_tokens):
            out.setdefault(sid, []).extend(toks)
    return [out[i] for i in range(len(prompts))], oracle, engine, rows


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_dart_stays_exact_over_the_static_cache_with_continuous_batching(arch):
    """Oracle drafts (long acceptances, KV compaction), sequences joining and leaving (the static
    buffers re-bound per batch bucket; a sequence in the middle of a batch of 4 finishing first,
    so the remaining 3 move rows inside the same 4-row bucket) and a cache that outgrows the
    capacity (the last steps run eagerly on the same cache): every output equals transformers'
    generate."""
    target = tiny_target(arch, seed=5)
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [4, 9, 2, 6])
    lengths = [40, 20, 40, 40]  # the second sequence (row 1 of the full batch) finishes first
    truth = [hf_greedy(target, p, n) for p, n in zip(prompts, lengths)]
    static = target.enable_static_cache(capacity=44, buckets=(1, 2, 4, 8), windows=(24, 32, 44), use_graphs=False)
    out, _, _, rows = _dart_with_joins(target, prompts, lengths, truth)
    target.static = None
    assert out == truth
    assert static.replays > 10 and static.eager > 0  # both paths ran
    assert (0, 1, 2, 3) in rows and (0, 2, 3) in rows  # the middle row left a batch of 4
    assert {b for b, _, _ in static._shapes} == {2, 4}  # batch buckets, not batch sizes (3 ran as 4)
    assert {w for _, _, w in static._shapes} == {24, 32, 44}  # the window grew with the cache


def test_bad_settings_are_refused():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="CUDA device"):
        StaticVerifier(target, use_graphs=True)
    with pytest.raises(ValueError, match="ascending"):
        StaticVerifier(target, buckets=(4, 2))
    with pytest.raises(ValueError, match="batch_buckets"):
        StaticVerifier(target, batch_buckets=(0, 1))
    with pytest.raises(ValueError, match="largest bucket"):
        StaticVerifier(target, capacity=8, buckets=(1, 16))
    with pytest.raises(ValueError, match="last window"):
        StaticVerifier(target, capacity=64, windows=(16, 32))
    with pytest.raises(ValueError, match="windows"):
        StaticVerifier(target, capacity=64, windows=(32, 16, 64))
    v = StaticVerifier(target, use_graphs=False)
    assert v.bucket(3) == 4 and v.bucket(65) is None and v.batch_bucket(5) == 8 and v.batch_bucket(65) is None
    assert v.windows == (256, 512, 1024, 2048) and v.window(257) == 512 and v.window(2048) == 2048


def test_static_windows_can_be_switched_off():
    """KernelConfig.static_windows False: one window, the whole capacity (the measurements'
    comparison), for default_windows and for a StaticVerifier of a target loaded with it."""
    from dart_core.model.cuda_graphs import StaticVerifier, default_windows
    from dart_core.model.kernel_config import KernelConfig

    assert default_windows(3000) == (256, 512, 1024, 2048, 3000) and default_windows(100) == (100,)
    assert default_windows(2048, windowed=False) == (2048,)
    target = tiny_target("llama", seed=3)
    assert StaticVerifier(target, capacity=1024, use_graphs=False).windows == (256, 512, 1024)
    target.kernels = KernelConfig(static_windows=False)
    assert StaticVerifier(target, capacity=1024, use_graphs=False).windows == (1024,)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_static_draft_equals_the_ordinary_draft(arch):
    """Every draft of the static path (its head KV cache written in place, never compacted; rows
    joining and leaving) gives the eager draft's top-k, and output stays exact: the engine's
    default drafter (no graphs, a capacity that grows, so every draft takes it) and one with a
    fixed capacity and widths, where catch-up drafts wider than the widths and drafts past the
    capacity run eagerly on the same cache."""
    target = tiny_target(arch, seed=7)
    rng = np.random.default_rng(7)
    prompts = prompts_of(rng, [4, 9, 2, 6])
    lengths = [40, 20, 40, 40]
    truth = [hf_greedy(target, p, n) for p, n in zip(prompts, lengths)]
    ref, ref_search, _, _ = _dart_with_joins(target, prompts, lengths, truth, "eager", head_seed=3)
    assert ref == truth
    for settings in (None, dict(capacity=48, widths=(1, 2, 4, 8), batch_buckets=(1, 2, 4))):
        out, search, engine, _ = _dart_with_joins(target, prompts, lengths, truth, settings, head_seed=3)
        assert out == truth
        static = engine.drafter.static_draft
        if settings is None:
            assert static.replays == len(search.drafts) and static.eager == 0
        else:  # prompts wider than 8 and sequences past 48 positions draft eagerly
            assert static.replays > 10 and static.eager > 0
        assert len(search.drafts) == len(ref_search.drafts)
        for (ids0, p0), (ids1, p1) in zip(ref_search.drafts, search.drafts):
            assert ids0.shape == ids1.shape
            np.testing.assert_allclose(p1, p0, rtol=1e-4, atol=1e-5)
            assert (ids0 == ids1).mean() > 0.99  # near-ties may swap order


def test_greedy_dart_stays_exact_with_grouped_query_attention(monkeypatch):
    """The CUDA path's masked grouped-query attention (dart_core.model.attention.grouped_query_sdpa),
    forced on here on the CPU for the target's and the draft head's attention over static caches
    with windows: greedy DART still equals transformers' generate, and both models took it."""
    import dart_core.spec.draft_head
    from dart_core.model import attention

    calls = {"target": 0, "head": 0}
    original = attention.grouped_query_sdpa

    def on_any_device(query, key, mask, enabled=True):
        return enabled and mask is not None and mask.is_floating_point() and mask.dim() == 4 and mask.shape[1] == 1 \
            and key.shape[1] != query.shape[1]

    # the target's attention plug-in lives in dart_core.model.attention; the head imports the functions by name
    for name, module in (("target", attention), ("head", dart_core.spec.draft_head)):
        def counting(*args, _name=name, **kwargs):
            calls[_name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, "use_grouped_query", on_any_device)
        monkeypatch.setattr(module, "grouped_query_sdpa", counting)
    target = tiny_target("llama", seed=5)
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [4, 9, 2, 6])
    lengths = [40, 20, 40, 40]
    truth = [hf_greedy(target, p, n) for p, n in zip(prompts, lengths)]
    target.enable_static_cache(capacity=64, buckets=(1, 2, 4, 8), windows=(24, 32, 64), use_graphs=False)
    out, _, _, _ = _dart_with_joins(target, prompts, lengths, truth, dict(capacity=64, widths=(1, 2, 4, 8)))
    target.static = None
    assert out == truth
    assert calls["target"] > 0 and calls["head"] > 0


def test_the_static_draft_forward_equals_forward_per_row():
    """forward_static with ragged widths and cache lengths: each row's d distributions equal
    forward's, and the buffers hold that row's real keys after its prefix."""
    target = tiny_target("llama", seed=2)
    head = random_head(target, seed=4)
    c = head.config
    b, t, cap = 3, 5, 32
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(b, t, 3 * c.target_hidden_size, generator=g)
    emb = torch.randn(b, t, c.hidden_size, generator=g)
    past_len = torch.tensor([0, 7, 3])
    last = torch.tensor([4, 0, 2])
    pos = past_len[:, None] + torch.arange(t)[None]
    keys = torch.randn(b, c.num_key_value_heads, cap, c.head_dim, generator=g)
    values = torch.randn(b, c.num_key_value_heads, cap, c.head_dim, generator=g)
    k0, v0 = keys.clone(), values.clone()
    with torch.inference_mode():
        static = head.forward_static(taps, emb, pos, last, keys, values, past_len)
        for r in range(b):
            n = int(past_len[r])
            ref, new_k, _ = head(taps[r:r + 1], emb[r:r + 1], pos[r:r + 1], last[r:r + 1], k0[r:r + 1, :, :n],
                                 v0[r:r + 1, :, :n], past_len[r:r + 1])
            torch.testing.assert_close(static[r:r + 1], ref, rtol=1e-5, atol=1e-5)
            m = int(last[r]) + 1
            torch.testing.assert_close(keys[r, :, n:n + m], new_k[0, :, :m], rtol=1e-6, atol=1e-6)
            assert torch.equal(keys[r, :, :n], k0[r, :, :n])  # the prefix is untouched


@pytest.mark.parametrize("levels, q8", [(None, False), (3, False), (None, True), (2, True)])
def test_the_one_sequence_static_draft_on_the_cpu_equals_the_batched_one(levels, q8):
    """One sequence on the CPU takes the row kernel (rotation, cache writes and attention in one
    call; with a Q8_0 head the norms, SiLU and residual adds inside the qmm calls, q/k/v and
    gate/up fused): its distributions equal forward's, and the buffers hold the real keys and values
    after the prefix, as the batched path writes them; a bfloat16 head keeps the batched path."""
    from dart_core.model.quant import quantize_linears

    import dataclasses

    from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig

    target = tiny_target("llama", seed=2)
    head = random_head(target, seed=4)
    if q8:  # products in whole 64-row blocks, so that q/k/v and gate/up fuse
        config = dataclasses.replace(DraftHeadConfig.for_target(target.config), hidden_size=64, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=64, intermediate_size=128)
        head = DartDraftHead(config)
        head.reset_parameters(4)
        quantize_linears(head.eval(), "qmm")  # the portable loop where the CPU lacks AVX-512
    c = head.config
    t, cap, n = 4, 32, 9
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(1, t, 3 * c.target_hidden_size, generator=g)
    emb = torch.randn(1, t, c.hidden_size, generator=g)
    past_len, last = torch.tensor([n]), torch.tensor([t - 1])
    pos = past_len[:, None] + torch.arange(t)[None]
    keys = torch.randn(1, c.num_key_value_heads, cap, c.head_dim, generator=g)
    values = torch.randn(1, c.num_key_value_heads, cap, c.head_dim, generator=g)
    k0, v0 = keys.clone(), values.clone()
    assert head._row_kernel_fits(taps, keys, values)
    assert not head._row_kernel_fits(taps.expand(2, -1, -1), keys, values)
    with torch.inference_mode():
        static = head.forward_static(taps, emb, pos, last, keys, values, past_len, levels)
        ref, new_k, new_v = head(taps, emb, pos, last, k0[:, :, :n], v0[:, :, :n], past_len, levels)
        batched_k, batched_v = k0.clone(), v0.clone()
        batched = head.forward_static(taps.expand(2, -1, -1), emb.expand(2, -1, -1), pos.expand(2, -1),
                                      last.expand(2), batched_k.expand(2, -1, -1, -1).clone(),
                                      batched_v.expand(2, -1, -1, -1).clone(), past_len.expand(2), levels)
    assert static.shape == ref.shape == (1, levels or c.depth, c.draft_vocab_size)
    torch.testing.assert_close(static, ref, rtol=1e-4, atol=1e-4)  # the kernel's norms: float32 rounding
    torch.testing.assert_close(static, batched[:1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(keys[:, :, n:n + t], new_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values[:, :, n:n + t], new_v, rtol=1e-6, atol=1e-6)
    assert torch.equal(keys[:, :, :n], k0[:, :, :n]) and torch.equal(values[:, :, :n], v0[:, :, :n])
    assert (head._row_products() is not None) == q8
    if not q8:
        assert not head.to(torch.bfloat16)._row_kernel_fits(taps.bfloat16(), keys.bfloat16(), values.bfloat16())


@pytest.mark.parametrize("levels, final_norm_twice", [(None, False), (1, False), (3, True)])
def test_the_one_call_draft_of_a_q8_head_equals_its_top_k_of_forward(levels, final_norm_twice):
    """topk_static for one sequence with a Q8_0 head runs the layer, the logits and their top-k in one
    C++ call (_kernels.DraftRow): the same top-k ids and probabilities as top_k(forward(...)), the same
    cache writes, the prefix untouched; a batch of two takes the operator path and agrees too."""
    import dataclasses

    from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig
    from dart_core.model.quant import quantize_linears

    target = tiny_target("llama", seed=2)
    config = dataclasses.replace(DraftHeadConfig.for_target(target.config), hidden_size=64, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=64, intermediate_size=128,
                                 final_norm_twice=final_norm_twice)
    head = DartDraftHead(config)
    head.reset_parameters(7)
    with torch.no_grad():
        head.d2t.copy_(torch.arange(config.draft_vocab_size) % 3)  # a draft vocabulary that is not the first ids
    quantize_linears(head.eval(), "qmm")
    c, k = head.config, 5
    t, cap, n = 3, 32, 6
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(1, t, 3 * c.target_hidden_size, generator=g)
    emb = torch.randn(1, t, c.hidden_size, generator=g)
    past_len, last = torch.tensor([n]), torch.tensor([1])  # the third position is padding
    pos = past_len[:, None] + torch.arange(t)[None]
    keys = torch.randn(1, c.num_key_value_heads, cap, c.head_dim, generator=g)
    values = torch.randn(1, c.num_key_value_heads, cap, c.head_dim, generator=g)
    k0, v0 = keys.clone(), values.clone()
    with torch.inference_mode():
        ids, probs = head.topk_static(taps, emb, pos, last, keys, values, past_len, k, levels)
        logits, new_k, new_v = head(taps, emb, pos, last, k0[:, :, :n], v0[:, :, :n], past_len, levels)
        ref_ids, ref_probs = head.top_k(logits, k)
        bk, bv = k0.expand(2, -1, -1, -1).clone(), v0.expand(2, -1, -1, -1).clone()
        b_ids, b_probs = head.topk_static(taps.expand(2, -1, -1), emb.expand(2, -1, -1), pos.expand(2, -1),
                                          last.expand(2), bk, bv, past_len.expand(2), k, levels)
    assert head._draft_row() is not None
    assert ids.shape == probs.shape == (1, levels or c.depth, k)
    assert torch.equal(ids, ref_ids) and torch.equal(b_ids[:1], ids)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b_probs[:1], probs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(keys[:, :, n:n + 2], new_k[:, :, :2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values[:, :, n:n + 2], new_v[:, :, :2], rtol=1e-6, atol=1e-6)
    assert torch.equal(keys[:, :, :n], k0[:, :, :n]) and torch.equal(values[:, :, :n], v0[:, :, :n])


def test_the_one_call_draft_refuses_bad_shapes():
    """_kernels.DraftRow checks its arguments: a wrong k or a taps width is a ValueError, not a crash."""
    import dataclasses

    from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig
    from dart_core.model.quant import quantize_linears

    target = tiny_target("llama", seed=2)
    config = dataclasses.replace(DraftHeadConfig.for_target(target.config), hidden_size=64, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=64, intermediate_size=128)
    head = DartDraftHead(config)
    quantize_linears(head.eval(), "qmm")
    row, c = head._draft_row(), head.config
    keys = np.zeros((1, 1, 16, 64), np.float32)
    cos = np.ones((2, 64), np.float32)
    ids, probs = np.zeros((2, 3), np.int64), np.zeros((2, 3), np.float32)
    taps = np.zeros((1, 3 * c.target_hidden_size), np.float32)
    emb = np.zeros((1, 64), np.float32)
    row.forward(taps, emb, cos, cos, keys, keys.copy(), 0, 1, ids, probs, 1 << 20)  # accepted
    with pytest.raises(ValueError, match="taps"):
        row.forward(taps[:, :-32], emb, cos, cos, keys, keys.copy(), 0, 1, ids, probs, 1 << 20)
    with pytest.raises(ValueError, match="ids and probs"):
        row.forward(taps, emb, cos, cos, keys, keys.copy(), 0, 2, ids, probs, 1 << 20)
    with pytest.raises(ValueError, match="cache buffers"):
        row.forward(taps, emb, cos, cos, keys[:, :, :1], keys.copy(), 0, 1, ids, probs, 1 << 20)


def test_bad_static_draft_settings_are_refused():
    target = tiny_target("llama")
    head = random_head(target)
    with pytest.raises(ValueError, match="CUDA device"):
        StaticDrafter(head, target.embed_tokens, top_k=4, use_graphs=True)
    with pytest.raises(ValueError, match="ascending"):
        StaticDrafter(head, target.embed_tokens, top_k=4, widths=(4, 2))
    with pytest.raises(ValueError, match="no room"):
        StaticDrafter(head, target.embed_tokens, top_k=4, capacity=16, widths=(1, 16))
    assert DartEngine(target).drafter is None  # no draft head: nothing drafts, so no static draft either


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_equal_eager_decoding():
    target = tiny_target("llama", seed=5, device="cuda")
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [4, 9])
    sp = SamplingParams(max_new_tokens=32)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    truth = [p + t for p, t in zip(prompts, ar.token_ids)]
    static = target.enable_static_cache(capacity=128, buckets=(1, 2, 4, 8), windows=(16, 32, 128))
    assert static.use_graphs
    for speculative in (False, True):
        engine = DartEngine(target, random_head(target).to("cuda"), OracleTreeSearch(truth, depth=5, seed=1),
                            SearchParams(top_k=10, beam_width=6, budget=6))
        drafter = engine.drafter.enable_static_draft(capacity=128)
        assert drafter.use_graphs
        assert engine.generate(prompts, sp, speculative=speculative).token_ids == ar.token_ids
    assert static.replays > 0 and all(s.graph is not None for s in static._shapes.values())
    assert {w for _, _, w in static._shapes} == {16, 32, 128}  # graphs of every window replayed
    assert drafter.replays > 0 and all(s.graph is not None for s in drafter._shapes.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_draft_batch_packed_for_cuda_through_pinned_memory_equals_the_cpu_one():
    """DraftBatch.pack on CUDA stages the host arrays in pinned memory and copies them without
    blocking; the fields equal the CPU packing's, also when batches of other shapes follow at once."""
    from dart_core.spec.drafters import DraftBatch
    from ngram_service.tree_search import search_tree_batch

    rng = np.random.default_rng(2)
    packed = []
    for b in (1, 5, 16, 3):  # packed one after another, compared after the last
        ids = rng.integers(0, 40, size=(b, 4, 6))
        probs = rng.dirichlet(np.ones(6), size=(b, 4)).astype(np.float32)
        trees = search_tree_batch(ids, probs, [[1, 2]] * b,
                                  params=SearchParams(top_k=6, beam_width=3, budget=int(rng.integers(1, 20)),
                                                      use_ngram=False))
        packed.append((DraftBatch.pack(trees, torch.device("cuda")), DraftBatch.pack(trees, torch.device("cpu"))))
    for on_gpu, on_cpu in packed:
        for name in ("tokens", "parents", "depths", "counts", "tree_mask"):
            assert getattr(on_gpu, name).cpu().equal(getattr(on_cpu, name)), name
