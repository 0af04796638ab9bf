"""The static-KV-cache verification path (dart_core.cuda_graphs): on a CPU it runs eagerly and must
give the ordinary forward's logits, taps and cache, and leave DART's greedy output exact at
every tree size, with continuous batching; on a GPU the same path is captured and replayed as
CUDA graphs (gpu-marked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_core.cuda_graphs import StaticVerifier
from dart_core.engine import DartEngine, NewSequence
from dart_core.kv_cache import cache_mask
from dart_core.sampling import SamplingParams
from dart_core.target import TargetCache
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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.inference_mode()
def test_the_static_path_equals_the_ordinary_forward_and_cache(arch):
    target = tiny_target(arch)
    rng = np.random.default_rng(0)
    prompts = prompts_of(rng, [9, 4])
    caches = []
    for static in (False, True):
        target.static = StaticVerifier(target, capacity=64, buckets=(1, 2, 4, 8), use_graphs=False) if static else None
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
            cache.compact(t + torch.arange(keep)[None].expand(2, keep), torch.tensor([keep, 1]))
        caches.append((outs, [(layer.keys.clone(), layer.values.clone()) for layer in cache.cache.layers],
                       cache.lengths.clone()))
        if static:
            assert target.static.replays == 3 and target.static.eager == 2  # the prefill and the 11 nodes
            assert (2, 4) in target.static._shapes and (2, 8) in target.static._shapes
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
    oracle = OracleTreeSearch([p + t for p, t in zip(prompts, truth)], depth=3, seed=1)  # trees of 7 nodes
    static = target.enable_static_cache(capacity=44, buckets=(1, 2, 4, 8), use_graphs=False)
    engine = DartEngine(target, random_head(target), oracle, SearchParams(top_k=10, beam_width=6, budget=6))
    schedule = {2: [1], 4: [2, 3]}
    calls = {"n": 0}

    def admit():
        calls["n"] += 1
        return [NewSequence(prompts[i], SamplingParams(max_new_tokens=lengths[i]))
                for i in schedule.pop(calls["n"], [])]

    out: dict[int, list[int]] = {}
    rows = []
    for step in engine.generate_stream([prompts[0]], SamplingParams(max_new_tokens=40), admit=admit):
        rows.append(tuple(step.seq_ids))
        for sid, toks in zip(step.seq_ids, step.new_tokens):
            out.setdefault(sid, []).extend(toks)
    target.static = None
    assert [out[i] for i in range(4)] == truth
    assert static.replays > 10 and static.eager > 0  # both paths ran
    assert (0, 1, 2, 3) in rows and (0, 2, 3) in rows  # the middle row left a batch of 4
    assert {b for b, _ in static._shapes} == {2, 4}  # batch buckets, not batch sizes (3 ran as 4)


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
    v = StaticVerifier(target, use_graphs=False)
    assert v.bucket(3) == 4 and v.bucket(65) is None and v.batch_bucket(5) == 8 and v.batch_bucket(65) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_equal_eager_decoding():
    target = tiny_target("llama", seed=5, device="cuda")
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [4, 9])
    sp = SamplingParams(max_new_tokens=32)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    truth = [p + t for p, t in zip(prompts, ar.token_ids)]
    static = target.enable_static_cache(capacity=128, buckets=(1, 2, 4, 8))
    assert static.use_graphs
    for speculative in (False, True):
        engine = DartEngine(target, random_head(target).to("cuda"), OracleTreeSearch(truth, depth=5, seed=1),
                            SearchParams(top_k=10, beam_width=6, budget=6))
        assert engine.generate(prompts, sp, speculative=speculative).token_ids == ar.token_ids
    assert static.replays > 0 and all(s.graph is not None for s in static._shapes.values())
