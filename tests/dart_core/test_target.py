"""The target adapter's oneDNN-packed linear layers (dart_core.model.rows.PackedLinear)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams
from dart_core.model.rows import PackedLinear, can_pack, pack_linears
from dart_core.model.target import TargetModel

from .conftest import VOCAB, OracleTreeSearch, hf_greedy, tiny_config, tiny_target
from .test_engine import random_head

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this PyTorch build has no oneDNN: nothing is packed")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 5), (8, 2)])
def test_packed_linear_equals_the_dense_layer(bias, lead):
    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(dense)
    x = torch.randn(*lead, 48)
    with torch.inference_mode():
        y = packed(x)
        assert y.shape == (*lead, 80)
        torch.testing.assert_close(y, dense(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(x.transpose(0, -1).contiguous().transpose(0, -1)), y)  # strided input
    assert torch.equal(packed.weight, dense.weight.detach())
    assert "packed_weight" not in packed.state_dict()
    twin = copy.deepcopy(packed)
    with torch.inference_mode():
        assert torch.equal(twin(x), y)


def test_target_packs_float32_on_cpu_only():
    def count(target):
        mods = list(target.model.modules())
        return (sum(isinstance(m, PackedLinear) for m in mods), sum(type(m) is torch.nn.Linear for m in mods))

    assert count(tiny_target("llama")) == (6 * 7 + 1, 0)  # q k v o gate up down per layer, lm_head
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16)
    assert not can_pack(bf16)
    assert count(TargetModel(bf16))[0] == 0
    with pytest.raises(ValueError, match="float32 weights on a CPU"):
        TargetModel(bf16, pack=True)
    with pytest.raises(ValueError, match="device_map"):  # refused before anything loads
        TargetModel.from_pretrained("/nonexistent", device_map="auto", pack=True)
    fp32 = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    assert count(TargetModel(fp32, pack=False)) == (0, 6 * 7 + 1)
    assert pack_linears(fp32) == 6 * 7 + 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_target_stays_exact_against_the_stock_model(arch):
    """DART on the packed target (multi-token trees from an oracle) and plain greedy
    decoding on the packed target both equal greedy decoding of the unpacked model."""
    stock = tiny_target(arch, seed=7)  # packed (float32 on a CPU)
    unpacked = copy.deepcopy(stock)  # the same weights back in nn.Linear layers
    for mod in list(unpacked.model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, PackedLinear):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    dense.weight.copy_(child.weight)
                    if child.bias is not None:
                        dense.bias.copy_(child.bias)
                setattr(mod, child_name, dense)
    assert not any(isinstance(m, PackedLinear) for m in unpacked.model.modules())
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (6, 3, 11)]
    reference = [hf_greedy(unpacked, p, 32) for p in prompts]
    sp = SamplingParams(max_new_tokens=32)
    assert DartEngine(stock).generate(prompts, sp, speculative=False).token_ids == reference
    oracle = OracleTreeSearch([p + r for p, r in zip(prompts, reference)], depth=6)
    dart = DartEngine(stock, random_head(stock), oracle).generate(prompts, sp)
    assert dart.token_ids == reference
    assert dart.tau > 2.0


def test_packed_linear_computes_only_the_real_rows():
    from dart_core.model.rows import PackedLinear, can_pack, real_rows

    lin = torch.nn.Linear(8, 5)
    if not can_pack(lin):
        pytest.skip("this PyTorch cannot pack linear layers (no oneDNN)")
    packed = PackedLinear(lin)
    x = torch.randn(2, 3, 8)
    full = packed(x)
    rows = torch.tensor([0, 1, 3])
    z = torch.randn(7, 8)
    with real_rows(rows, 6):
        part = packed(x)
        other = packed(z)  # another row count (not the padded batch): computed in full
    assert torch.allclose(part.view(6, 5)[rows], full.view(6, 5)[rows], atol=1e-6)
    assert part.view(6, 5)[[2, 4, 5]].abs().max() == 0
    assert torch.equal(other, packed(z))
    assert torch.equal(packed(x), full)  # outside the block every row again


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_ragged_prefill_computes_only_the_prompts_tokens_with_the_same_results(kind):
    """On a packed target a group of prompts of different lengths runs its linear layers over the
    prompts' own tokens only (TargetModel.forward rows); logits, taps and valid KV entries equal the
    forward that computes the padding too, bit for bit."""
    from dart_core.model.target import TargetCache

    target = tiny_target(kind, seed=3)
    assert target.packed
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (11, 4, 7)]
    seen = []
    forward = target.forward

    def spy(*args, rows=None, **kwargs):
        seen.append(rows)
        return forward(*args, rows=rows, **kwargs)

    target.forward = spy
    target.prefill(prompts, TargetCache(3, "cpu"))
    target.forward = forward
    assert seen[0] is not None and len(seen[0]) == 22  # 11 + 4 + 7 of 3 x 11 positions
    target.packed = False  # forward then ignores rows: every position computed
    full_cache = TargetCache(3, "cpu")
    full = target.prefill(prompts, full_cache)
    target.packed = True
    cache = TargetCache(3, "cpu")
    sparse = target.prefill(prompts, cache)
    for i, p in enumerate(prompts):
        n = len(p)
        assert torch.equal(sparse.logits[i, :n], full.logits[i, :n]) and torch.equal(sparse.taps[i, :n], full.taps[i, :n])
        for a, b in zip(cache.cache.layers, full_cache.cache.layers):
            assert torch.equal(a.keys[i, :, :n], b.keys[i, :, :n]) and torch.equal(a.values[i, :, :n], b.values[i, :, :n])
    assert torch.equal(cache.lengths, full_cache.lengths)


@pytest.mark.parametrize("kind,packed", [("llama", True), ("llama", False), ("qwen3", True)])
def test_prefill_of_the_last_logits_equals_the_full_prefill(kind, packed):
    """prefill(last_logits=True) (the engine's: the output layer on each prompt's last token only)
    against the full prefill: the same last-position logits, taps and KV cache, on the decoder path
    (llama packed), the stock forward's (llama unpacked) and a model without the decoder (qwen3);
    ragged prompts, two of one length (one output position shared)."""
    from dart_core.model.target import TargetCache

    target = tiny_target(kind, seed=4)
    target.packed = packed
    if not packed:
        target.decoder = None
    assert (target.decoder is not None) == (kind == "llama" and packed)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (9, 4, 9, 6)]
    caches = [TargetCache(4, "cpu"), TargetCache(4, "cpu")]
    full = target.prefill(prompts, caches[0])
    last = target.prefill(prompts, caches[1], last_logits=True)
    assert last.logits.shape == (4, 1, VOCAB) and last.taps.shape == full.taps.shape
    for i, p in enumerate(prompts):
        n = len(p)
        torch.testing.assert_close(last.logits[i, 0], full.logits[i, n - 1], rtol=1e-5, atol=1e-5)
        assert torch.equal(last.taps[i, :n], full.taps[i, :n])
    for a, b in zip(caches[1].cache.layers, caches[0].cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

