"""The target's KV cache appends in place (no per-step copy of the cache) and its
grouped-query attention skips transformers' head repetition, both with values
identical to the stock ``DynamicLayer`` / ``sdpa`` path."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicLayer

from dart_core.model.kv_cache import BufferedKVLayer, cache_mask, compact_, compaction_plan
from dart_core.model.attention import GROUPED_SDPA, SMALL_QUERY, grouped_sdpa
from dart_core.model.target import TargetCache

from .conftest import VOCAB, tiny_target


def _kv(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g)


def test_appends_match_concatenation_and_reuse_the_buffer():
    buffered, ref = BufferedKVLayer(), DynamicLayer()
    ptrs = set()
    for step, n in enumerate([5, 1, 1, 3, 1, 40, 2, 90, 1]):
        k, v = _kv(3, n, step)
        bk, bv = buffered.update(k, v)
        rk, rv = ref.update(k, v)
        assert torch.equal(bk, rk) and torch.equal(bv, rv)
        ptrs.add(buffered.keys.untyped_storage().data_ptr())
    # 144 positions in 9 appends: capacity doubles, so the buffer moved only a few times
    assert len(ptrs) <= 4
    assert buffered.get_seq_length() == ref.get_seq_length() == 144


def test_compaction_stays_in_the_buffer_and_later_appends_follow_it():
    buffered, ref = BufferedKVLayer(), DynamicLayer()
    lengths = torch.tensor([4, 2])
    k, v = _kv(2, 4, 0)
    buffered.update(k, v)
    ref.update(k, v)
    tree_k, tree_v = _kv(2, 5, 1)  # a 5-node tree per sequence
    buffered.update(tree_k, tree_v)
    ref.update(tree_k, tree_v)
    src = torch.tensor([[4, 6, 7], [4, 8, 0]])
    counts = torch.tensor([3, 2])
    ptr = buffered.keys.untyped_storage().data_ptr()
    buffered.keys, buffered.values = compact_(buffered.keys, buffered.values, lengths, src, counts)
    ref.keys, ref.values = compact_(ref.keys.clone(), ref.values.clone(), lengths, src, counts)
    assert torch.equal(buffered.keys, ref.keys) and torch.equal(buffered.values, ref.values)
    assert buffered.keys.shape[2] == 7  # cropped to max(lengths + counts)
    k, v = _kv(2, 1, 2)
    bk, _ = buffered.update(k, v)
    rk, _ = ref.update(k, v)
    assert torch.equal(bk, rk)
    assert buffered.keys.untyped_storage().data_ptr() == ptr  # no copy after compaction


def test_rows_replaced_by_continuous_batching_are_copied_once():
    layer = BufferedKVLayer()
    k, v = _kv(3, 6, 0)
    layer.update(k, v)
    layer.keys, layer.values = layer.keys[torch.tensor([0, 2])], layer.values[torch.tensor([0, 2])]  # a row left
    k2, v2 = _kv(2, 1, 1)
    keys, values = layer.update(k2, v2)
    assert torch.equal(keys, torch.cat([k[[0, 2]], k2], dim=2))
    assert torch.equal(values, torch.cat([v[[0, 2]], v2], dim=2))
    ptr = layer.keys.untyped_storage().data_ptr()
    layer.update(*_kv(2, 1, 2))
    assert layer.keys.untyped_storage().data_ptr() == ptr


@torch.inference_mode()
def test_grouped_attention_equals_transformers_sdpa_on_a_tree_step():
    """Prefill (more than ``SMALL_QUERY`` query tokens) goes through SDPA with grouped heads: identical
    to transformers' sdpa.  A small tree step takes the two-matmul path: equal to float32 rounding."""
    target = tiny_target("llama", seed=5)  # 4 query heads, 2 key-value heads
    assert target.model.config._attn_implementation == GROUPED_SDPA
    stock = copy.deepcopy(target)
    stock.model.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (SMALL_QUERY + 3, 4)]
    outs = []
    for model in (target, stock):
        cache = TargetCache(2, "cpu")
        pre = model.prefill(prompts, cache)
        # a 4-node tree per sequence: root, two children, one grandchild
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1))
        depths = torch.tensor([0, 1, 1, 2])
        mask = cache_mask(cache.lengths, cache.padded_length, tree.expand(2, 4, 4), model.dtype)
        out = model.forward(ids, cache.lengths[:, None] + depths, mask, cache)
        outs.append((pre.logits, pre.taps, out.logits, out.taps))
    (pre_l, pre_t, tree_l, tree_t), (s_pre_l, s_pre_t, s_tree_l, s_tree_t) = outs
    assert torch.equal(pre_l, s_pre_l) and torch.equal(pre_t, s_pre_t)
    torch.testing.assert_close(tree_l, s_tree_l, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree_t, s_tree_t, atol=1e-5, rtol=1e-5)
    assert torch.equal(tree_l.argmax(-1), s_tree_l.argmax(-1))


@pytest.mark.parametrize("batch,heads,kv_heads,queries", [(1, 4, 2, 2), (3, 9, 3, 5), (2, 4, 4, 8), (4, 6, 1, 3)])
def test_small_query_attention_equals_sdpa(batch, heads, kv_heads, queries):
    """The two-matmul path for 2..``SMALL_QUERY`` query tokens against PyTorch's SDPA on repeated
    key/value heads, with a mask that hides padding, a tree's off-path nodes and a padded query row."""
    g = torch.Generator().manual_seed(batch * 100 + queries)
    t = 7 + queries
    q = torch.randn(batch, heads, queries, 16, generator=g)
    k, v = (torch.randn(batch, kv_heads, t, 16, generator=g) for _ in range(2))
    allowed = torch.rand(batch, 1, queries, t, generator=g) > 0.4
    allowed[..., -queries:] = torch.eye(queries, dtype=torch.bool)  # every query sees at least itself
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    out, _ = grouped_sdpa(None, q, k, v, mask)
    groups = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                           v.repeat_interleave(groups, 1), attn_mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("batch,heads,kv_heads,queries,mask_rows", [(1, 9, 3, 1, 1), (3, 9, 3, 1, 3), (2, 9, 3, 5, 2),
                                                                   (4, 6, 1, 3, 1), (2, 4, 4, 2, 2)])
def test_grouped_query_sdpa_equals_repeated_heads(batch, heads, kv_heads, queries, mask_rows):
    """The CUDA path's grouped-query attention (query heads stacked per key/value head, the mask
    repeated along the query axis; run here on the CPU) against SDPA on repeated key/value heads
    (what transformers does with a mask), for one-token steps and trees, a per-row mask or one
    broadcast over the batch, and a mask wider than the keys (a static window's padding columns)."""
    from dart_core.model.attention import grouped_query_sdpa as _grouped_query_sdpa

    g = torch.Generator().manual_seed(batch * 100 + queries)
    t = 11 + queries
    q = torch.randn(batch, heads, queries, 16, generator=g)
    k, v = (torch.randn(batch, kv_heads, t, 16, generator=g) for _ in range(2))
    allowed = torch.rand(mask_rows, 1, queries, t + 3, generator=g) > 0.4
    allowed[..., t - queries:t] = torch.eye(queries, dtype=torch.bool)  # every query sees at least itself
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    out = _grouped_query_sdpa(q, k, v, mask, 0.3)
    groups = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                           v.repeat_interleave(groups, 1), attn_mask=mask[..., :t],
                                                           scale=0.3)
    assert out.shape == (batch, queries, heads, 16)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_generate_masks_padding_with_the_grouped_attention():
    """transformers builds its own masks for ``generate`` (left padding): the grouped
    implementation must get sdpa's masks, not none."""
    target = tiny_target("qwen3", seed=2)
    stock = copy.deepcopy(target)
    stock.model.set_attn_implementation("sdpa")
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6]])
    attention = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = [m.model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=8, do_sample=False)
           for m in (target, stock)]
    assert torch.equal(out[0], out[1])
    alone = target.model.generate(input_ids=ids[:1, 3:], max_new_tokens=8, do_sample=False)
    assert torch.equal(out[0][0, 6:], alone[0, 3:])  # the padding is really masked


def _naive_compact(keys, values, lengths, src, counts):
    """Reference: copy the kept entries one by one from a snapshot."""
    k0, v0 = keys.clone(), values.clone()
    out_k, out_v = keys.clone(), values.clone()
    for b in range(src.shape[0]):
        for j in range(int(counts[b])):
            out_k[b, :, int(lengths[b]) + j] = k0[b, :, int(src[b, j])]
            out_v[b, :, int(lengths[b]) + j] = v0[b, :, int(src[b, j])]
    t = int((lengths + counts).max())
    return out_k[:, :, :t], out_v[:, :, :t]


def test_compaction_matches_a_naive_copy_including_entries_already_in_place():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        b = int(torch.randint(1, 4, (1,), generator=gen))
        pad = int(torch.randint(1, 6, (1,), generator=gen))  # padded prefix length T
        lengths = torch.randint(0, pad + 1, (b,), generator=gen)
        n = int(torch.randint(1, 6, (1,), generator=gen))  # tree nodes appended at [T, T + n)
        counts = torch.randint(0, n + 1, (b,), generator=gen)
        a = max(1, int(counts.max()))
        src = torch.zeros(b, a, dtype=torch.long)
        for r in range(b):
            if trial % 3 == 0:  # a chain accepted in order: in place where the row is not padded
                src[r] = pad + torch.arange(a)
            else:
                src[r] = pad + torch.sort(torch.randperm(n, generator=gen)[:a] if a <= n else torch.arange(a))[0]
            src[r, int(counts[r]):] = int(torch.randint(0, pad + n, (1,), generator=gen))  # padding: anything
        keys = torch.randn(b, 2, pad + n, 3, generator=gen)
        values = torch.randn(b, 2, pad + n, 3, generator=gen)
        want_k, want_v = _naive_compact(keys, values, lengths, src, counts)
        got_k, got_v = compact_(keys.clone(), values.clone(), lengths, src, counts)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), trial
    # an autoregressive step at batch 1: nothing to move
    moves, new_len = compaction_plan(torch.tensor([5]), torch.tensor([[5]]), torch.tensor([1]))
    assert moves is None and new_len == 6


def test_the_pool_compacts_every_layer_in_one_pass_as_each_layer_would():
    """KVPool.compact (one gather and one scatter over [L, 2, B, H, C, D]) against apply_compaction
    layer by layer, for a plan with moves (a ragged acceptance) and one without; a layer whose
    tensors were replaced since the pool bound them is no longer held."""
    from types import SimpleNamespace

    from dart_core.model.kv_cache import KVPool, apply_compaction, compaction_plan_host

    g = torch.Generator().manual_seed(3)
    pool = KVPool(torch.randn(3, 2, 4, 2, 16, 5, generator=g))
    layers = [SimpleNamespace(keys=None, values=None) for _ in range(3)]
    offset = 6  # 3 real rows of a 4-row bucket; the step's 4 entries at 6 .. 9
    for lengths, paths, new_len, moves in (([3, 5, 2], [[0, 2, 3], [0], [0, 1]], 6, True),
                                           ([6, 6, 6], [[0, 1], [0], [0, 1, 2]], 9, False)):
        pool.bind(layers, 3, offset + 4)
        plan = compaction_plan_host(lengths, offset, paths, "cpu")
        assert (plan[0] is not None) == moves
        expected = [apply_compaction(x.keys.clone(), x.values.clone(), plan) for x in layers]
        assert pool.holds(layers)
        pool.compact(layers, plan)
        for layer, (k, v) in zip(layers, expected):
            assert layer.keys.shape == k.shape == (3, 2, new_len, 5)
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        assert pool.holds(layers)
    layers[1].keys = layers[1].keys.clone()
    assert not pool.holds(layers)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_compaction_of_every_layer_equals_the_per_layer_gather(dtype):
    """compact_layers (the C++ in-order copies, every layer in one call) against apply_compaction
    layer by layer: ragged trees whose accepted paths skip nodes, entries moving over entries that
    are themselves moved, strided views of larger buffers (BufferedKVLayer), float32 and bfloat16
    entries; a plan without moves only crops; a plan whose sources run backwards (not one the
    engine makes) takes the gather path and still equals it."""
    from types import SimpleNamespace

    from dart_core.model.kv_cache import apply_compaction, compact_layers, compaction_plan_host

    g = torch.Generator().manual_seed(5)
    offset = 7
    cases = (([3, 7, 5, 0], [[0, 2, 3, 6], [0, 1, 4], [0], [0, 1, 2]], True),
             ([7, 7], [[0, 1], [0]], False))
    for lengths, paths, moves in cases:
        b = len(lengths)
        buffers = [torch.randn(b, 3, 32, 8, generator=g).to(dtype) for _ in range(4)]
        layers = [SimpleNamespace(keys=buffers[2 * i][:, :, :offset + 7], values=buffers[2 * i + 1][:, :, :offset + 7])
                  for i in range(2)]
        plan = compaction_plan_host(lengths, offset, paths, "cpu")
        assert (plan[0] is not None) == moves
        expected = [apply_compaction(x.keys.clone(), x.values.clone(), plan) for x in layers]
        compact_layers(layers, plan)
        for i, (layer, (k, v)) in enumerate(zip(layers, expected)):
            assert layer.keys.shape == k.shape == (b, 3, max(n + len(p) for n, p in zip(lengths, paths)), 8)
            assert layer.keys.data_ptr() == buffers[2 * i].data_ptr()  # in place: still a view of its buffer
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    # sources that run backwards within a row: in-order copies would read an overwritten entry
    layers = [SimpleNamespace(keys=torch.randn(1, 2, 6, 4, generator=g).to(dtype),
                              values=torch.randn(1, 2, 6, 4, generator=g).to(dtype))]
    plan = ((torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([2, 1])), 3)
    expected = apply_compaction(layers[0].keys.clone(), layers[0].values.clone(), plan)
    compact_layers(layers, plan)
    assert torch.equal(layers[0].keys, expected[0]) and torch.equal(layers[0].values, expected[1])


def test_the_compaction_kernel_refuses_moves_outside_the_cache():
    """compact_cache checks every move against every array before copying anything."""
    from dart_core import _kernels

    keys = np.zeros((2, 1, 4, 3), dtype=np.float32)
    keys[1, 0, 3] = 1.0
    with pytest.raises(IndexError, match="outside a cache of 2 rows and 4 positions"):
        _kernels.compact_cache([keys], np.array([1, 1]), np.array([0, 1]), np.array([3, 4]))
    assert keys[1, 0, 0].sum() == 0  # nothing moved
    with pytest.raises(ValueError, match="same length"):
        _kernels.compact_cache([keys], np.array([1]), np.array([0, 1]), np.array([3]))
    with pytest.raises(ValueError, match=r"\[B, H_kv, T, D\]"):
        _kernels.compact_cache([np.zeros((2, 4, 3), dtype=np.float32)], np.array([0]), np.array([0]), np.array([1]))


def test_compaction_keeps_buffered_layers_on_their_own_views():
    """After compact_layers a BufferedKVLayer still holds the views of its last commit (the next
    step's append then needs only the identity test), with or without moves, and its entries equal
    apply_compaction's."""
    from dart_core.model.kv_cache import apply_compaction, compact_layers, compaction_plan_host

    g = torch.Generator().manual_seed(11)
    for lengths, paths in (([4, 2], [[0, 2], [0]]), ([4, 4], [[0], [0]])):
        layer = BufferedKVLayer()
        layer.update(torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 8, generator=g))
        layer.update(torch.randn(2, 3, 3, 8, generator=g), torch.randn(2, 3, 3, 8, generator=g))  # a step's 3 nodes
        plan = compaction_plan_host(lengths, 4, paths, "cpu")
        expected = apply_compaction(layer.keys.clone(), layer.values.clone(), plan)
        compact_layers([layer], plan)
        assert layer.holds_last_commit() and layer.keys.shape[2] == plan[1]
        assert torch.equal(layer.keys, expected[0]) and torch.equal(layer.values, expected[1])


def test_a_lazy_commit_makes_its_views_when_they_are_first_read_or_replaced():
    """commit(lazy=True), as the C++ layer stack's steps and compact_buffered commit: nothing is made
    until keys or values is read or set; the views then are the eager commit's (same entries, same
    length, kept across reads); the next reserve starts from the pending length without making them;
    a tensor set after a lazy commit replaces only what it sets; reset drops a pending commit."""
    g = torch.Generator().manual_seed(17)
    eager, lazy = BufferedKVLayer(), BufferedKVLayer()
    prefix = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    for layer in (eager, lazy):
        layer.update(*prefix)
    for step, n in enumerate((3, 1, 4)):
        k, v = torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 8, generator=g)
        for layer in (eager, lazy):
            kb, vb, t = layer.reserve(2, 3, n, 8, 8, torch.float32, "cpu")
            kb[:, :, t:t + n], vb[:, :, t:t + n] = k, v
        assert eager.commit(t + n) is not None and lazy.commit(t + n, lazy=True) is None
        assert lazy._pending == t + n and lazy.holds_last_commit() and lazy.cached_length() == t + n
        if step == 1:
            continue  # the next reserve starts from the pending length: no views made in between
        keys = lazy.keys
        assert lazy._pending is None and lazy.keys is keys and lazy.holds_last_commit()
        assert torch.equal(keys, eager.keys) and torch.equal(lazy.values, eager.values)
        assert keys.data_ptr() == lazy._key_buffer.data_ptr()  # a view of the buffer, not a copy
    assert lazy.get_seq_length() == eager.get_seq_length() == 13
    lazy.commit(10, lazy=True)
    replaced = torch.zeros(2, 3, 10, 8)
    lazy.keys = replaced  # the pending views are made first, then keys replaced
    assert lazy.keys is replaced and torch.equal(lazy.values, eager.values[:, :, :10])
    assert not lazy.holds_last_commit()
    lazy.commit(4, lazy=True)
    lazy.reset()
    assert lazy._pending is None and lazy.keys is None and lazy.cached_length() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_from_the_paths_in_one_call_equals_the_plan(dtype):
    """compact_buffered (the moves made and applied by one C++ call on the layers' whole buffers) against
    apply_compaction of compaction_plan_host's plan: ragged paths that skip nodes, a row already in
    place, float32 and bfloat16; layers that are not buffered are left to the plan (False, untouched);
    a path that does not increase is refused before anything moves."""
    from types import SimpleNamespace

    from dart_core.model.kv_cache import apply_compaction, compact_buffered, compaction_plan_host

    g = torch.Generator().manual_seed(13)
    lengths, offset, paths = [3, 7, 5, 0, 7], 7, [[0, 2, 3, 6], [0, 1, 4], [0], [0, 1, 2], [0, 1]]
    layers = []
    for _ in range(3):
        layer = BufferedKVLayer()
        for n in (offset, 7):  # the prefix, then a step's 7 nodes
            layer.update(*(torch.randn(5, 2, n, 8, generator=g).to(dtype) for _ in range(2)))
        layers.append(layer)
    plan = compaction_plan_host(lengths, offset, paths, "cpu")
    expected = [apply_compaction(x.keys.clone(), x.values.clone(), plan) for x in layers]
    assert compact_buffered(layers, lengths, offset, paths)
    for layer, (k, v) in zip(layers, expected):
        assert layer.holds_last_commit() and layer.keys.shape[2] == plan[1] == 10
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    plain = [SimpleNamespace(keys=torch.zeros(1, 1, 4, 2), values=torch.zeros(1, 1, 4, 2))]
    assert not compact_buffered(plain, [1], 2, [[0, 1]])
    before = layers[0].keys.clone()
    with pytest.raises(ValueError, match="does not increase"):
        compact_buffered(layers, [1, 1, 1, 0, 1], 2, [[0, 2], [0], [0, 3, 1], [0], [0]])
    assert torch.equal(layers[0].keys, before)


def test_the_additive_mask_in_every_dtype():
    """cache_mask: 0 where a new token may attend (its sequence's valid prefix, its tree's ancestors and
    itself), the dtype's lowest value elsewhere (not -inf: float64 included)."""
    g = torch.Generator().manual_seed(2)
    lengths, tree = torch.tensor([3, 0, 5]), torch.rand(3, 4, 4, generator=g) > 0.5
    allowed = torch.cat([(torch.arange(6)[None, :] < lengths[:, None])[:, None, :].expand(3, 4, 6), tree], dim=2)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        mask = cache_mask(lengths, 6, tree, dtype)
        assert mask.shape == (3, 1, 4, 10) and mask.dtype == dtype
        assert torch.equal(mask[:, 0] == 0, allowed) and (mask[:, 0][~allowed] == torch.finfo(dtype).min).all()
