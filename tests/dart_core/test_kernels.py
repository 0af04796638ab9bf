"""The row-exact attention kernel (dart_core.model.kernels): values, row independence, errors."""

import pytest
import torch

from dart_core.model import kernels
from dart_core.model.kernels import row_exact_attention
from dart_core.model.attention import matmul_attention

MIN = torch.finfo(torch.float32).min


def _inputs(b=2, h=6, h_kv=2, q=5, t=40, d=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, q, d, generator=g), torch.randn(b, h_kv, t, d, generator=g),
            torch.randn(b, h_kv, t, d, generator=g))


def test_values_match_attention_computed_in_float64():
    query, key, value = _inputs()
    mask = torch.zeros(2, 1, 5, 43)  # longer than the keys: only the first T columns are read
    mask[0, :, :, 30:] = MIN
    mask[1, :, 2, 5:9] = float("-inf")
    mask[1, :, 3, :7] = -2.5  # an additive bias other than 0 is added, not treated as masked
    expected = matmul_attention(query, key, value, mask.double(), 0.3, torch.float64)
    got = row_exact_attention(query, key, value, mask, 0.3)
    assert got.shape == (2, 5, 6, 24) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    boolean = row_exact_attention(query, key, value, mask[..., :40] > -1e30, 0.3)
    torch.testing.assert_close(boolean, row_exact_attention(query, key, value, torch.where(
        mask[..., :40] > -1e30, 0.0, MIN), 0.3), rtol=0, atol=0)
    default_scale = row_exact_attention(query, key, value, None)
    torch.testing.assert_close(default_scale, matmul_attention(query, key, value, None, 24 ** -0.5, torch.float64),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h, h_kv, d", [(9, 3, 64), (40, 2, 64), (4, 4, 7), (1, 1, 130)])
def test_head_layouts_and_sizes(h, h_kv, d):
    """The head size the kernel is specialised for (64), others, more query heads per key/value
    head than it handles in one pass (16), and no grouping."""
    query, key, value = _inputs(b=2, h=h, h_kv=h_kv, q=3, t=33, d=d, seed=h + d)
    mask = torch.zeros(2, 1, 3, 33)
    mask[1, :, 1, ::3] = MIN
    torch.testing.assert_close(row_exact_attention(query, key, value, mask, 0.2),
                               matmul_attention(query, key, value, mask.double(), 0.2, torch.float64),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("g", [1, 2, 3, 4])
def test_unrolled_group_sizes_give_the_generic_codes_bits(g):
    """Head size 64 with 1 to 4 query heads per key/value head runs unrolled code; with 5 heads the
    generic code runs: the same query rows over the same keys give the same bits either way."""
    query, key, value = _inputs(b=2, h=5, h_kv=1, q=3, t=40, d=64, seed=g)
    mask = torch.zeros(2, 1, 3, 40)
    mask[1, :, 2, ::4] = MIN
    generic = row_exact_attention(query, key, value, mask, 0.125)
    unrolled = row_exact_attention(query[:, :g].contiguous(), key, value, mask, 0.125)
    assert torch.equal(unrolled, generic[:, :, :g])  # [B, Q, H, D]


def test_a_row_equals_itself_computed_alone_over_its_attended_keys():
    """The property verification needs: a query row's bits depend only on its query and the keys and
    values it attends to, in order, not on the other rows, the padding or where the keys sit."""
    query, key, value = _inputs(b=3, q=7, t=60)
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(3, 1, 7, 60, generator=g) < 0.4
    allowed[..., 0] = True
    mask = torch.where(allowed, 0.0, MIN)
    batched = row_exact_attention(query, key, value, mask, 0.125)
    for b in range(3):
        for i in range(7):
            keep = allowed[b, 0, i].nonzero().flatten()
            alone = row_exact_attention(query[b:b + 1, :, i:i + 1], key[b:b + 1, :, keep], value[b:b + 1, :, keep],
                                        None, 0.125)
            assert torch.equal(alone[0, 0], batched[b, i]), (b, i)
    # strided views (a transposed query, a cache slice) give the same bits as contiguous copies
    wide = torch.randn(3, 2, 80, 24)
    wide[:, :, :60] = key
    view = row_exact_attention(query.transpose(1, 2).contiguous().transpose(1, 2), wide[:, :, :60], value, mask, 0.125)
    assert torch.equal(view, batched)


def test_threads_do_not_change_the_bits(monkeypatch):
    query, key, value = _inputs(b=4, q=9, t=100)
    mask = torch.zeros(4, 1, 9, 100)
    monkeypatch.setattr(kernels, "PARALLEL_WORK", 1 << 62)
    alone = row_exact_attention(query, key, value, mask, 0.2)
    monkeypatch.setattr(kernels, "PARALLEL_WORK", 0)
    assert torch.equal(row_exact_attention(query, key, value, mask, 0.2), alone)


def test_masked_rows_other_dtypes_and_bad_inputs():
    query, key, value = _inputs(b=1, q=2, t=8)
    mask = torch.zeros(1, 1, 2, 8)
    mask[0, 0, 1] = MIN  # a row that attends to nothing gets zeros, not NaN
    out = row_exact_attention(query, key, value, mask, 0.5)
    assert torch.equal(out[0, 1], torch.zeros(6, 24)) and out[0, 0].abs().sum() > 0
    half = row_exact_attention(query.bfloat16(), key, value, mask.double(), 0.5)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), row_exact_attention(query.bfloat16().float(), key, value, mask, 0.5)
                               .bfloat16().float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not match"):
        row_exact_attention(query, key[:, :, :, :16], value, None)
    with pytest.raises(ValueError, match="do not match"):
        row_exact_attention(_inputs(h=5)[0], key, value, None)
    with pytest.raises(ValueError, match=r"mask must be \[B, 1, Q, >=T\]"):
        row_exact_attention(query, key, value, mask[..., :4])
    with pytest.raises(ValueError, match="4-dimensional"):
        row_exact_attention(query[0], key, value, None)


def _rope_inputs(seed, b, q, h, h_kv, d, capacity):
    """qkv [b, q, (h + 2 h_kv) d], cos and sin [b, q, d], key and value buffers [b, h_kv, capacity, d]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, q, (h + 2 * h_kv) * d, generator=g), torch.randn(b, q, d, generator=g),
            torch.randn(b, q, d, generator=g), torch.randn(b, h_kv, capacity, d, generator=g),
            torch.randn(b, h_kv, capacity, d, generator=g))


def test_rope_append_equals_the_rotation_and_cache_write_of_pytorch_operators():
    from dart_core.model.decoder import _rotate
    from dart_core.model.kernels import rope_append

    b, q, h, h_kv, d, t = 2, 3, 6, 2, 64, 5
    qkv, cos, sin, kb, vb = _rope_inputs(3, b, q, h, h_kv, d, 16)
    before_k, before_v = kb.clone(), vb.clone()
    cos_np, sin_np = cos.view(b * q, d).numpy(), sin.view(b * q, d).numpy()
    query = rope_append(qkv, cos_np, sin_np, h, h_kv, kb, vb, t)
    qk = _rotate(qkv[..., :(h + h_kv) * d].view(b, q, h + h_kv, d), cos[:, :, None], sin[:, :, None])
    assert query.shape == (b, h, q, d)
    assert torch.equal(query, qk[:, :, :h].transpose(1, 2))
    assert torch.equal(kb[:, :, t:t + q], qk[:, :, h:].transpose(1, 2))
    assert torch.equal(vb[:, :, t:t + q], qkv[..., (h + h_kv) * d:].view(b, q, h_kv, d).transpose(1, 2))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[t:t + q] = False
    assert torch.equal(kb[:, :, untouched], before_k[:, :, untouched])
    assert torch.equal(vb[:, :, untouched], before_v[:, :, untouched])
    with pytest.raises(ValueError, match="cache buffers"):
        rope_append(qkv, cos_np, sin_np, h, h_kv, kb[:, :, :6], vb, t)
    with pytest.raises(ValueError, match="do not match"):
        rope_append(qkv, cos_np[:, :32], sin_np, h, h_kv, kb, vb, t)


def test_rope_attend_equals_rope_append_then_attention():
    from dart_core.model.kernels import additive_mask, rope_append, rope_attend

    b, q, h, h_kv, d, t = 2, 4, 9, 3, 64, 7
    qkv, cos, sin, kb, vb = _rope_inputs(4, b, q, h, h_kv, d, 32)
    mask = torch.zeros(b, 1, q, t + q)
    mask[0, :, :, t + 1:] = MIN  # a tree: each node sees the prefix and itself only
    mask[0, 0, torch.arange(q), t + torch.arange(q)] = 0.0
    kb2, vb2 = kb.clone(), vb.clone()
    cos_np, sin_np = cos.view(b * q, d).numpy(), sin.view(b * q, d).numpy()
    query = rope_append(qkv, cos_np, sin_np, h, h_kv, kb, vb, t)
    expected = row_exact_attention(query, kb[:, :, :t + q], vb[:, :, :t + q], mask, 0.125)
    got = rope_attend(qkv, cos_np, sin_np, h, h_kv, kb2, vb2, t, additive_mask(mask), 0.125)
    assert torch.equal(got, expected) and torch.equal(kb2, kb) and torch.equal(vb2, vb)
    with pytest.raises(ValueError, match=r"mask must be \[B, 1, Q, >=T\]"):
        rope_attend(qkv, cos_np, sin_np, h, h_kv, kb2, vb2, t, additive_mask(mask[..., :t]), 0.125)
