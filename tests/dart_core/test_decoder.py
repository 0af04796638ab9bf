"""LlamaDecoder, the target's forward written out for the CPU: bit for bit the stock forward's logits,
taps and KV entries (prefill, ragged batches, draft trees, the 4-bit and the float32 target; close to
them with the qmm-a8 kernel's fused layers), and fused 4-bit layers equal to the layers they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dart_core.model.decoder import LlamaDecoder, decoder_unsupported
from dart_core.model.kv_cache import cache_mask
from dart_core.model.target import TargetCache, TargetModel

from .conftest import VOCAB, tiny_config, tiny_target


def _steps(target: TargetModel, stock: bool) -> tuple[list[torch.Tensor], TargetCache]:
    """Prefill of two ragged prompts, then a 4-node tree per sequence (two branches), then one token:
    every output and the cache, through the decoder or the stock forward."""
    decoder = target.decoder
    if stock:
        target.decoder = None
    try:
        rng = np.random.default_rng(7)
        cache = TargetCache(2, "cpu")
        first = target.prefill([rng.integers(0, VOCAB, 11).tolist(), rng.integers(0, VOCAB, 6).tolist()], cache)
        outs = [first.logits, first.taps]
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
        depth = torch.tensor([0, 1, 2, 1])
        for ids, mask in ((rng.integers(0, VOCAB, (2, 4)), tree), (rng.integers(0, VOCAB, (2, 1)), tree[:1, :1])):
            q = ids.shape[1]
            pos = cache.lengths[:, None] + depth[None, :q]
            out = target.forward(torch.from_numpy(ids), pos,
                                 cache_mask(cache.lengths, cache.padded_length, mask[None].expand(2, q, q), target.dtype),
                                 cache)
            cache.lengths += 1
            outs += [out.logits, out.taps]
        return outs, cache
    finally:
        target.decoder = decoder


def _assert_same_as_stock(target: TargetModel, tol: float = 0.0) -> None:
    """Bit for bit (``tol=0``), or within ``tol`` of the largest magnitude of each output."""
    assert target.decoder is not None
    ours, our_cache = _steps(target, stock=False)
    stock, stock_cache = _steps(target, stock=True)
    layers = list(zip(our_cache.cache.layers, stock_cache.cache.layers))
    pairs = list(zip(ours, stock)) + [(a.keys, b.keys) for a, b in layers] + [(a.values, b.values) for a, b in layers]
    for a, b in pairs:
        if tol == 0:
            assert torch.equal(a, b)
        else:
            assert a.shape == b.shape and (a - b).abs().max() <= tol * b.abs().max()


def test_the_decoder_equals_the_stock_forward_on_the_float32_target():
    target = tiny_target("llama", seed=3)
    assert target.packed  # float32 on a CPU: PackedLinear layers, which the decoder calls one by one
    _assert_same_as_stock(target)


def _tiny_4bit_target(tmp_path, kernel: str, seed: int) -> TargetModel:
    """A tiny Llama written as a GGUF with SmolLM2's head size (64), loaded GGUF-native with ``kernel``."""
    pytest.importorskip("gguf")
    from dart_core.model.quant import can_int4, quantize_from_gguf

    if not can_int4():
        pytest.skip("this PyTorch has no CPU int4 kernel")
    from .test_quant import tiny_gguf_model

    model = tiny_gguf_model(tmp_path / "tiny.gguf", seed=seed, hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64)
    quantize_from_gguf(model, tmp_path / "tiny.gguf", kernel=kernel)
    return TargetModel(model)


@pytest.mark.parametrize("kernel", ["qmm-a8", "qmm", "aten"])
def test_the_decoder_equals_the_stock_forward_on_the_4bit_target(tmp_path, kernel):
    """aten: bit for bit. qmm and qmm-a8: the decoder's layers run as five kernel calls with the RMS norms
    and SiLU inside (summed in another order than PyTorch's): float32 rounding apart with qmm; with
    qmm-a8, 8-bit activations round those slightly different inputs, so further apart."""
    from dart_core.model.quant import Int4Linear

    target = _tiny_4bit_target(tmp_path, kernel, seed=5)
    assert target.row_exact and isinstance(target.decoder.layers[0].qkv, Int4Linear)
    assert target.decoder.fused_layers == (kernel != "aten")
    _assert_same_as_stock(target, tol={"qmm-a8": 0.02, "qmm": 1e-5, "aten": 0.0}[kernel])


@pytest.mark.parametrize("kernel", ["qmm-a8", "qmm", "aten"])
def test_a_greedy_forward_returns_the_argmax_of_the_logits(tmp_path, kernel):
    """``greedy=True`` on a 4-bit output layer of dart-serve's kernels: the argmax alone, equal to the
    argmax of the logits an ordinary forward of the same cache computes (prefill, a tree step, inside
    real_rows); the aten kernel and a float32 target return their logits as usual."""
    target = _tiny_4bit_target(tmp_path, kernel, seed=6)
    assert target.fused_argmax == (kernel != "aten")
    assert not tiny_target("llama", seed=3).fused_argmax
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 4).tolist()]
    ids = torch.from_numpy(rng.integers(0, VOCAB, (2, 3)))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None].expand(2, 3, 3)
    for rows in (None, torch.tensor([0, 1, 2, 3])):
        outs = []
        for greedy in (False, True):
            cache = TargetCache(2, "cpu")
            target.prefill(prompts, cache)
            pos = cache.lengths[:, None] + torch.tensor([0, 1, 1])[None]
            mask = cache_mask(cache.lengths, cache.padded_length, tree, target.dtype)
            outs.append(target.forward(ids, pos, mask, cache, rows=rows, greedy=greedy))
        plain, greedy = outs
        assert plain.argmax is None and torch.equal(plain.greedy_tokens(), plain.logits.argmax(-1))
        if kernel == "aten":
            assert greedy.argmax is None and torch.equal(greedy.logits, plain.logits)
            continue
        assert greedy.logits is None and greedy.argmax.shape == (2, 3) and greedy.argmax.dtype == torch.int64
        real = slice(None) if rows is None else [0, 1, 2, 3]
        assert torch.equal(greedy.greedy_tokens().view(-1)[real], plain.logits.argmax(-1).view(-1)[real])
        assert torch.equal(greedy.taps.view(6, -1)[real], plain.taps.view(6, -1)[real])


@pytest.mark.parametrize("kernel", ["qmm-a8", "qmm"])
def test_the_fused_decoder_computes_only_the_real_rows_and_each_alike(tmp_path, kernel):
    """Inside real_rows the fused layers (from Python) compute the real rows only, each equal to its value
    in a forward of every row (one C++ call): the padded batch of draft trees of the batched engine."""
    from dart_core.model.rows import real_rows

    target = _tiny_4bit_target(tmp_path, kernel, seed=4)
    assert target.decoder.fused_layers
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, VOCAB, 7).tolist(), rng.integers(0, VOCAB, 5).tolist()]
    ids = torch.from_numpy(rng.integers(0, VOCAB, (2, 3)))
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))[None].expand(2, 3, 3)
    outs = []
    for rows in (None, torch.tensor([0, 1, 2, 3])):  # sequence 1 has one real node of three
        cache = TargetCache(2, "cpu")
        target.prefill(prompts, cache)
        pos = cache.lengths[:, None] + torch.arange(3)[None]
        with real_rows(rows, 6):
            outs.append(target.forward(ids, pos, cache_mask(cache.lengths, cache.padded_length, chain, target.dtype),
                                       cache))
    full, part = outs
    real = [(0, 0), (0, 1), (0, 2), (1, 0)]
    for b, i in real:
        assert torch.equal(part.logits[b, i], full.logits[b, i]) and torch.equal(part.taps[b, i], full.taps[b, i])


@pytest.mark.parametrize("kernel", ["qmm-a8", "qmm", "aten"])
def test_fused_4bit_layers_equal_their_parts_and_share_their_weights(tmp_path, kernel):
    pytest.importorskip("gguf")
    from dart_core.model.quant import PACK_BLOCK_ROWS, Int4Linear, can_int4, quantize_from_gguf

    if not can_int4():
        pytest.skip("this PyTorch has no CPU int4 kernel")
    from .test_quant import tiny_gguf_model

    model = tiny_gguf_model(tmp_path / "tiny.gguf", seed=1)
    quantize_from_gguf(model, tmp_path / "tiny.gguf", kernel=kernel)
    weight = "packed_0" if kernel == "aten" else "qmm_codes"
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features % PACK_BLOCK_ROWS  # k and v (32 rows each) cannot both go first:
    assert not Int4Linear.can_fuse([attn.k_proj, attn.v_proj])  # AVX512 packs 64 rows per block
    with pytest.raises(ValueError, match="multiple of 64"):
        Int4Linear.fuse([attn.k_proj, attn.v_proj])
    parts = [attn.q_proj, attn.k_proj]  # 64 rows, then 32 (the last part may end inside a block)
    x = torch.randn(5, attn.q_proj.in_features)
    before = [p(x) for p in parts]
    fused = Int4Linear.fuse(parts)
    assert fused.out_features == sum(p.out_features for p in parts)
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    for p, y in zip(parts, before):
        assert torch.equal(p(x), y)  # the parts now read views of the fused weight
        assert getattr(p, weight).untyped_storage().data_ptr() == getattr(fused, weight).untyped_storage().data_ptr()
    assert not Int4Linear.can_fuse([attn.q_proj, model.model.layers[0].mlp.down_proj])  # other in_features
    with pytest.raises(ValueError, match="one in_features"):
        Int4Linear.fuse([attn.q_proj, model.model.layers[0].mlp.down_proj])


def test_models_the_decoder_does_not_cover_keep_the_stock_forward():
    qwen = tiny_target("qwen3")
    assert qwen.decoder is None and "qwen3" in decoder_unsupported(qwen.model)
    with pytest.raises(ValueError, match="decoder=True: model type 'qwen3'"):
        TargetModel(qwen.model, decoder=True)
    plain = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    reason = decoder_unsupported(plain)
    assert "Linear" in reason  # nn.Linear layers do not honour real_rows
    assert TargetModel(plain, pack=False).decoder is None
    assert TargetModel(tiny_target("llama").model, decoder=False).decoder is None
    with pytest.raises(ValueError, match="cannot run this model: model type"):
        LlamaDecoder(qwen.model, (2, 3, 3))
