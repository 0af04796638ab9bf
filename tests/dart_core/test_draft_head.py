"""Draft head: reference checkpoint layout, shape checks against the target,
clear errors for mismatched or corrupt heads, and the forward contract."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig, HeadLoadError, load_draft_head, save_draft_head

from .conftest import tiny_config

REFERENCE_NAMES = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mask_rep",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture
def head():
    h = DartDraftHead(DraftHeadConfig.for_target(tiny_config("llama"), draft_vocab_size=40))
    h.reset_parameters(0)
    h.d2t[:] = torch.arange(40) * 1  # draft i -> target 2i
    h.t2d[:] = False
    h.t2d[torch.arange(40) * 2] = True
    return h.eval()


def test_checkpoint_uses_reference_names(tmp_path, head):
    save_draft_head(head, tmp_path, dtype=torch.float16)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == REFERENCE_NAMES
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_length"] == 7 and cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == 64


def test_roundtrip(tmp_path, head):
    save_draft_head(head, tmp_path, dtype=None)
    loaded = load_draft_head(tmp_path, tiny_config("llama"))
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.draft_to_target(torch.tensor([0, 3, 39])).tolist() == [0, 6, 78]


def test_mismatched_target_is_refused(tmp_path, head):
    save_draft_head(head, tmp_path)
    other = tiny_config("llama")
    other.hidden_size = 128
    with pytest.raises(HeadLoadError, match="hidden size 64, target has 128"):
        load_draft_head(tmp_path, other)
    other = tiny_config("llama")
    other.vocab_size = 1000
    with pytest.raises(HeadLoadError, match="vocabulary"):
        load_draft_head(tmp_path, other)


def test_weights_that_disagree_with_config(tmp_path, head):
    save_draft_head(head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :10].contiguous()
    del state["midlayer.mask_rep"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadLoadError, match=r"missing midlayer.mask_rep.*fc.weight: checkpoint \(64, 10\)"):
        load_draft_head(tmp_path)


@pytest.mark.parametrize("damage", ["no_files", "bad_json", "bad_weights", "short_config"])
def test_corrupt_checkpoints(tmp_path, head, damage):
    save_draft_head(head, tmp_path)
    if damage == "no_files":
        (tmp_path / "model.safetensors").unlink()
    elif damage == "bad_json":
        (tmp_path / "config.json").write_text("{not json")
    elif damage == "bad_weights":
        (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    else:
        (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(HeadLoadError):
        load_draft_head(tmp_path)


def _draft_inputs(c, b, t):
    """Random taps [B, T, 3H_target], next embeddings [B, T, H], positions [B, T] and an empty KV cache."""
    return (torch.randn(b, t, 3 * c.target_hidden_size), torch.randn(b, t, c.hidden_size),
            torch.arange(t).expand(b, t), torch.zeros(b, c.num_key_value_heads, 0, c.head_dim))


def test_forward_shapes_and_ragged_batch(head):
    """A sequence's drafts do not depend on what else is in the batch or on padding."""
    torch.manual_seed(0)
    c = head.config
    t, b = 5, 2
    taps, emb, pos, empty = _draft_inputs(c, b, t)
    logits, k, v = head(taps, emb, pos, torch.tensor([4, 2]), empty, empty, torch.zeros(b, dtype=torch.long))
    assert logits.shape == (b, c.depth, c.draft_vocab_size)
    assert k.shape == (b, c.num_key_value_heads, t, c.head_dim)
    # sequence 1 alone, with only its 3 real positions
    e1 = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim)
    alone, _, _ = head(taps[1:, :3], emb[1:, :3], pos[1:, :3], torch.tensor([2]), e1, e1, torch.zeros(1, dtype=torch.long))
    torch.testing.assert_close(logits[1], alone[0], rtol=1e-5, atol=1e-5)


def test_cached_forward_equals_full_forward(head):
    """Drafting from the head's KV cache equals one forward over all positions."""
    from dart_core.model.kv_cache import HeadKVCache

    torch.manual_seed(1)
    c = head.config
    taps = torch.randn(1, 6, 3 * c.target_hidden_size)
    emb = torch.randn(1, 6, c.hidden_size)
    pos = torch.arange(6)[None]
    cache = HeadKVCache(1, c.num_key_value_heads, c.head_dim, device="cpu", dtype=torch.float32)
    full, _, _ = head(taps, emb, pos, torch.tensor([5]), cache.keys, cache.values, cache.lengths)
    _, k, v = head(taps[:, :4], emb[:, :4], pos[:, :4], torch.tensor([3]), cache.keys, cache.values, cache.lengths)
    cache.append(k, v, torch.tensor([4]))
    step, _, _ = head(taps[:, 4:], emb[:, 4:], pos[:, 4:], torch.tensor([1]), cache.keys, cache.values, cache.lengths)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_keys_values_equal_the_forwards_new_cache_entries(head):
    """keys_values (used to fold held inputs into the head KV cache without drafting) gives the
    entries forward returns for the same real positions, and drafting from a cache filled by it
    equals drafting from one filled by forward."""
    from dart_core.model.kv_cache import HeadKVCache

    torch.manual_seed(2)
    c = head.config
    taps, emb, pos, empty = _draft_inputs(c, 2, 7)
    pos = pos + torch.tensor([[0], [11]])  # rows at different RoPE offsets
    _, k, v = head(taps, emb, pos, torch.tensor([6, 6]), empty, empty, torch.zeros(2, dtype=torch.long))
    kk, vv = head.keys_values(taps, emb, pos)
    torch.testing.assert_close(kk, k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vv, v, rtol=1e-5, atol=1e-5)
    # row 0 folds 5 positions, row 1 folds 2, in two rounds (extend, no device read), then both
    # draft from position 5 / 2
    folded = HeadKVCache(2, c.num_key_value_heads, c.head_dim, device="cpu", dtype=torch.float32)
    folded.extend(kk[:, :, :3], vv[:, :, :3], torch.tensor([2, 1]), 3)

    def rest(x):  # each row's next 3 positions
        return torch.stack([x[0, :, 2:5], x[1, :, 1:4]])

    folded.extend(rest(kk), rest(vv), torch.tensor([3, 1]), 7)
    assert folded.lengths.tolist() == [5, 2] and folded.keys.shape[2] == 6
    drafted = HeadKVCache(2, c.num_key_value_heads, c.head_dim, device="cpu", dtype=torch.float32)
    _, k5, v5 = head(taps[:, :5], emb[:, :5], pos[:, :5], torch.tensor([4, 1]), empty, empty,
                     torch.zeros(2, dtype=torch.long))
    drafted.append(k5, v5, torch.tensor([5, 2]))
    idx = torch.tensor([[5], [2]])  # [B, 1] each row's next position

    def step(cache):
        return head(taps.gather(1, idx[..., None].expand(2, 1, taps.shape[-1])),
                    emb.gather(1, idx[..., None].expand(2, 1, emb.shape[-1])), pos.gather(1, idx),
                    torch.zeros(2, dtype=torch.long), cache.keys, cache.values, cache.lengths)[0]

    torch.testing.assert_close(step(folded), step(drafted), rtol=1e-5, atol=1e-5)


def test_fewer_levels_equal_the_first_levels_of_a_full_draft(head):
    """``levels=L`` appends L-1 mask slots: the same first L distributions and the same real-position
    keys/values as a full draft, for a ragged batch over a cache."""
    torch.manual_seed(2)
    c = head.config
    b, t = 2, 4
    taps = torch.randn(b, t, 3 * c.target_hidden_size)
    emb = torch.randn(b, t, c.hidden_size)
    pos = torch.arange(3, 3 + t).expand(b, t)
    past_k, past_v = (torch.randn(b, c.num_key_value_heads, 3, c.head_dim) for _ in range(2))
    args = (taps, emb, pos, torch.tensor([3, 1]), past_k, past_v, torch.tensor([3, 2]))
    full, k, v = head(*args)
    for levels in range(1, c.depth + 1):
        part, pk, pv = head(*args, levels=levels)
        assert part.shape == (b, levels, c.draft_vocab_size)
        torch.testing.assert_close(part, full[:, :levels], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pk, k) and torch.testing.assert_close(pv, v)
    for bad in (0, c.depth + 1):
        with pytest.raises(ValueError, match="levels"):
            head(*args, levels=bad)


def test_d2t_outside_the_vocabulary_is_refused(tmp_path, head):
    head.d2t[-1] = 10_000
    save_draft_head(head, tmp_path)
    with pytest.raises(HeadLoadError, match="outside the target vocabulary"):
        load_draft_head(tmp_path)


def test_training_forward_equals_decoding_forward(head):
    """forward_train's block mask: anchor a's d distributions equal a decoding
    forward over the prefix ending at a (fresh cache), for every anchor at once."""
    torch.manual_seed(0)
    c = head.config
    t = 12
    taps = torch.randn(2, t, 3 * c.target_hidden_size)
    embeds = torch.randn(2, t, c.hidden_size)
    anchors = torch.tensor([[0, 5, 11], [3, 4, 9]])
    with torch.no_grad():
        train_logits = head.forward_train(taps, embeds, anchors)  # [2, 3, d, V]
        assert train_logits.shape == (2, 3, c.depth, c.draft_vocab_size)
        empty = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim)
        for b in range(2):
            for i, a in enumerate(anchors[b].tolist()):
                n = a + 1
                ref, _, _ = head(taps[b:b + 1, :n], embeds[b:b + 1, :n], torch.arange(n)[None],
                                 torch.tensor([a]), empty, empty, torch.zeros(1, dtype=torch.long))
                torch.testing.assert_close(train_logits[b, i], ref[0], atol=1e-5, rtol=1e-4)


_REFERENCE_HEAD = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "reference-head"


def test_a_reference_checkpoint_drafts_as_the_reference_generation_path(tmp_path):
    """Fixture made by running the reference DART code (tests/fixtures/reference-head/README.md): its
    generation path normalises twice before lm_head; a checkpoint of its class keeps that path here,
    through a prefill step and a cached decoding step, and keeps it when re-saved by dart-serve."""
    from safetensors.torch import load_file

    inp = load_file(str(_REFERENCE_HEAD / "inputs.safetensors"))
    ref = load_file(str(_REFERENCE_HEAD / "ref_logits.safetensors"))

    def two_steps(head):
        c = head.config
        empty = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim)
        with torch.no_grad():
            l1, k, v = head(inp["step1_aux_hidden_states"], inp["step1_inputs_embeds"], torch.arange(11)[None],
                            torch.tensor([10]), empty, empty, torch.tensor([0]))
            l2, _, _ = head(inp["step2_aux_hidden_states"], inp["step2_inputs_embeds"], torch.arange(11, 14)[None],
                            torch.tensor([2]), k, v, torch.tensor([11]))
        return l1, l2

    head = load_draft_head(_REFERENCE_HEAD)
    assert head.config.final_norm_twice
    l1, l2 = two_steps(head)
    assert (l1 - ref["step1_logits"]).abs().max() < 1e-4
    assert (l2 - ref["step2_logits"]).abs().max() < 1e-4
    save_draft_head(head, tmp_path / "resaved", dtype=None)
    again = load_draft_head(tmp_path / "resaved")
    assert again.config.final_norm_twice and torch.equal(two_steps(again)[1], l2)
    # the single-norm path is a different function on the same weights (dart-serve's own heads)
    single = DartDraftHead(dataclasses.replace(head.config, final_norm_twice=False))
    single.load_state_dict(head.state_dict())
    s1, _ = two_steps(single)
    assert (s1 - ref["step1_logits_single_norm"]).abs().max() < 1e-4
    assert (s1 - ref["step1_logits"]).abs().max() > 0.1


def test_our_heads_keep_the_single_norm_path_and_rope_scaling_reaches_the_rotary_embedding():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    base = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100,
                draft_vocab_size=50, max_position_embeddings=4096)
    assert not DraftHeadConfig.from_json_dict({**base, "architectures": ["DartDraftHead"]}).final_norm_twice
    assert not DraftHeadConfig.from_json_dict(base).final_norm_twice  # no architectures: ours
    assert DraftHeadConfig.from_json_dict({**base, "architectures": ["Qwen3ForCausalLMDart"]}).final_norm_twice
    for scaling in ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 1024},
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
                    {"rope_type": "linear", "factor": 2.0}):
        for cfg in (DraftHeadConfig.from_json_dict({**base, "rope_scaling": scaling}),
                    DraftHeadConfig.from_json_dict({**base, "rope_parameters": {**scaling, "rope_theta": 10000.0}})):
            assert cfg.rope_scaling["rope_type"] == scaling["rope_type"]
            head = DartDraftHead(cfg)
            target_rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4,
                                                           max_position_embeddings=4096, rope_scaling=dict(scaling)))
            x = torch.zeros(1, 3, 8)
            pos = torch.tensor([[0, 1500, 4000]])
            for ours, theirs in zip(head.rotary(x, pos), target_rope(x, pos)):
                torch.testing.assert_close(ours, theirs)
            plain = DartDraftHead(dataclasses.replace(cfg, rope_scaling=None))
            assert not torch.allclose(plain.rotary(x, pos)[0], head.rotary(x, pos)[0])
        # a head made for a target (the trainer's) takes the target's scaling
        target_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100,
                                 max_position_embeddings=4096, rope_scaling=dict(scaling))
        assert DraftHeadConfig.for_target(target_cfg).rope_scaling["rope_type"] == scaling["rope_type"]
    assert DraftHeadConfig.for_target(LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                                  vocab_size=100)).rope_scaling is None


def test_a_packed_float32_head_drafts_as_the_dense_one(head):
    """DartModel packs a float32 head on a CPU (oneDNN, as the target): same logits to float32
    rounding, same cache entries, and its dtype still reads from the head."""
    import copy

    from dart_core.model.rows import PackedLinear, can_pack, pack_linears

    assert can_pack(head) and not can_pack(copy.deepcopy(head).to(torch.bfloat16))
    dense, packed_head = head, copy.deepcopy(head)
    assert pack_linears(packed_head) == 9  # fc, q/k/v/o, the MLP's three, lm_head
    assert isinstance(packed_head.lm_head, PackedLinear) and packed_head.dtype == torch.float32
    torch.manual_seed(1)
    taps, emb, pos, empty = _draft_inputs(head.config, 2, 4)
    args = (taps, emb, pos, torch.tensor([3, 1]), empty, empty, torch.zeros(2, dtype=torch.long))
    with torch.inference_mode():
        want, want_k, _ = dense(*args)
        got, got_k, _ = packed_head(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-4)


def test_the_rotary_frequencies_stay_float32_in_a_bf16_head():
    """A bf16 inv_freq is off by up to 0.4 %: radians of rotation error a few hundred positions in."""
    target_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=6, vocab_size=96)
    head = DartDraftHead(DraftHeadConfig.for_target(target_config))
    ref = head.rotary.inv_freq.clone()
    head = head.to(torch.bfloat16)
    assert head.dtype == torch.bfloat16 and head.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(head.rotary.inv_freq, ref)
    x = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    cos, _ = head.rotary(x, torch.tensor([[500]]))
    torch.testing.assert_close(cos.float(), torch.cos(500 * torch.cat([ref, ref]))[None, None], atol=1e-2, rtol=0)
