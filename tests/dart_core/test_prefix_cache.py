"""The engine's prefix cache (dart_core/model/prefix_cache.py): prompts that start like earlier ones
prefill only the rest, with the same greedy output, the same draft-head inputs, the cap held and
opted-out prompts never stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_core.model.prefix_cache import PrefixCache
from dart_core.model.target import TargetCache
from dart_core.step import engine as engine_module
from dart_core.step.engine import DartEngine, NewSequence
from dart_core.step.sampling import SamplingParams
from ngram_service.client import InProcessTreeSearch
from ngram_service.tree_search import SearchParams

from .conftest import VOCAB, tiny_target
from .test_engine import random_head


def entries(n: int, layers: int = 2, fill: float = 0.0):
    """Per-layer keys and values [1, n, 2] and taps [n, 3] whose position i holds fill + i."""
    pos = fill + torch.arange(n, dtype=torch.float32)
    kv = [pos[None, :, None].expand(1, n, 2).clone() for _ in range(layers)]
    return kv, [t.clone() for t in kv], pos[:, None].expand(n, 3).clone()


def test_lookup_matches_whole_blocks_and_leaves_the_last_token():
    pc = PrefixCache(1000, block=4)
    prompt = list(range(10))
    assert pc.store(prompt, *entries(10))  # whole blocks: 8 tokens
    assert pc.tokens == 8 and pc.stats()["entries"] == 1
    hit = pc.lookup(prompt)
    assert hit.length == 8 and hit.keys[0].shape == (1, 8, 2) and hit.taps.shape == (8, 3)
    assert torch.equal(hit.taps[:, 0], torch.arange(8, dtype=torch.float32))
    assert pc.lookup(list(range(9))).length == 8  # 8 cached, the 9th computed
    assert pc.lookup(list(range(8))).length == 4  # at least the last token is left to compute
    assert pc.lookup(list(range(6)) + [99, 98, 97]).length == 4  # diverges inside the second block
    assert pc.lookup([5] + list(range(1, 10))) is None
    assert pc.lookup([1, 2, 3]) is None  # shorter than a block plus one
    assert not pc.store(prompt, *entries(10))  # already held whole: not stored twice
    assert pc.stats()["hits"] == 4 and pc.stats()["hit_tokens"] == 24


def test_cap_evicts_least_recently_used_and_bytes_are_counted():
    pc = PrefixCache(16, block=4)
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    pc.store(a, *entries(8))
    pc.store(b, *entries(8))
    assert pc.lookup(a + [0]).length == 8  # a is now the most recently used
    pc.store(c, *entries(8))
    assert pc.lookup(b + [0]) is None and pc.lookup(a + [0]) is not None and pc.lookup(c + [0]) is not None
    assert pc.tokens == 16 and pc.evictions == 1
    assert pc.bytes == 2 * (4 * 8 * 2 * 4 + 8 * 3 * 4)  # two prompts: 4 tensors [1, 8, 2] + taps [8, 3], fp32
    assert not pc.store([4] * 20, *entries(20))  # longer than the cap: not stored, nothing evicted
    for i in range(50):
        pc.store([10 + i] * (4 * (1 + i % 4)), *entries(16))
        assert pc.tokens <= 16 and pc.tokens == sum(len(e.tokens) for e in pc._entries.values())
    pc.clear()
    assert pc.tokens == pc.bytes == 0 and pc.lookup(c + [0]) is None


def test_a_hash_collision_serves_nothing(monkeypatch):
    monkeypatch.setattr(PrefixCache, "_chain", staticmethod(lambda h, block: 0))  # every prefix collides
    pc = PrefixCache(100, block=4)
    pc.store([1, 2, 3, 4, 5], *entries(5))
    assert pc.lookup([1, 2, 3, 4, 5]).length == 4
    assert pc.lookup([9, 9, 9, 9, 9]) is None


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="block"):
        PrefixCache(10, block=0)
    with pytest.raises(ValueError, match="shorter"):
        PrefixCache(100, block=4).store(list(range(8)), *entries(4))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_after_stored_prefixes_equals_a_whole_prefill(arch):
    """Rows with prefixes of different lengths (and one without) continue from them: the last
    token's logits, the taps and every cached entry equal a prefill of the whole prompts."""
    target = tiny_target(arch)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, VOCAB, size=n)] for n in (40, 21, 9, 33)]
    whole = TargetCache(len(prompts), "cpu")
    ref = target.prefill(prompts, whole, last_logits=True)
    pc = PrefixCache(1000, block=8)
    for p, b in zip(prompts, range(len(prompts))):
        pc.store(p, [layer.keys[b] for layer in whole.cache.layers], [layer.values[b] for layer in whole.cache.layers],
                 ref.taps[b])
    hits = [pc.lookup(p) for p in prompts[:2]] + [None, pc.lookup(prompts[3][:20])]
    assert [h.length if h else 0 for h in hits] == [32, 16, 0, 16]
    cache = TargetCache.with_prefixes(hits, "cpu")
    out = target.prefill([p[h.length if h else 0:] for p, h in zip(prompts, hits)], cache, last_logits=True)
    assert cache.lengths.tolist() == [len(p) for p in prompts]
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for b, (p, h) in enumerate(zip(prompts, hits)):
        s = h.length if h else 0
        torch.testing.assert_close(out.taps[b, :len(p) - s], ref.taps[b, s:len(p)], atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(cache.cache.layers, whole.cache.layers):
            torch.testing.assert_close(mine.keys[b, :, :len(p)], theirs.keys[b, :, :len(p)], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values[b, :, :len(p)], theirs.values[b, :, :len(p)],
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_a_prefix_cache_is_lossless_and_feeds_the_head_the_same_taps(arch, monkeypatch):
    target = tiny_target(arch)
    rng = np.random.default_rng(1)
    shared = [int(x) for x in rng.integers(0, VOCAB, size=40)]
    first = [shared + [int(x) for x in rng.integers(0, VOCAB, size=n)] for n in (5, 12)]
    later = [first[0], shared + [1, 2, 3], [int(x) for x in rng.integers(0, VOCAB, size=20)], first[1][:30]]
    sp = SamplingParams(max_new_tokens=16)
    ar = DartEngine(target).generate(first + later, sp, speculative=False).token_ids
    taps_seen = []
    original = engine_module._BatchState.add_pending

    def record(self, taps, positions, counts, nexts):
        taps_seen.append([taps[b, :int(c)].clone() for b, c in enumerate(counts)])
        return original(self, taps, positions, counts, nexts)

    monkeypatch.setattr(engine_module._BatchState, "add_pending", record)
    runs = {}
    for tokens in (0, 4096):
        engine = DartEngine(target, random_head(target), InProcessTreeSearch(None),
                            SearchParams(top_k=8, beam_width=4, budget=8, context_weight=0.0),
                            prefix_cache_tokens=tokens)
        out = engine.generate(first, sp).token_ids + engine.generate(later, sp).token_ids
        out_ar = engine.generate(later, sp, speculative=False).token_ids
        assert out == ar and out_ar == ar[2:]
        runs[tokens] = taps_seen[:2]
        taps_seen.clear()
        if tokens:
            s = engine.prefix_cache.stats()
            # later: first[0] (40 + 5 tokens: 32 cached), shared + 3 (32), a new prompt (none), first[1][:30]
            # (16); then again, the new prompt's first block now stored too
            assert s["hits"] == 7 and s["hit_tokens"] == 32 + 32 + 16 + 32 + 32 + 16 + 16, s
    for a, b in zip(runs[0][1], runs[4096][1]):  # the second call's prefill: draft-head inputs alike
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_prompts_that_opt_out_are_not_stored():
    target = tiny_target("llama")
    engine = DartEngine(target, prefix_cache_tokens=1024)
    prompt = list(range(1, 40))
    sp = SamplingParams(max_new_tokens=4)
    joining = iter([[NewSequence(prompt, sp, cache_prefix=False)]])
    list(engine.generate_stream([], sp, speculative=False, admit=lambda: next(joining, [])))
    assert engine.prefix_cache.tokens == 0
    engine.generate([prompt], sp, speculative=False)
    assert engine.prefix_cache.tokens == 32
    with pytest.raises(ValueError, match="max_tokens"):
        DartEngine(target, prefix_cache_tokens=-1)
