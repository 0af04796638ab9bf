"""C++ kernels of the CPU target's forward: row-exact tree attention, and the rotary embedding fused
with the KV-cache append.

A target whose linear layers are row-exact (:class:`~dart_core.model.quant.Int4Linear`: a row's result
does not depend on the other rows of the call) verifies a draft tree exactly as one-token steps
would compute it, provided its attention is row-exact too.  PyTorch's attention kernels are not:
their blocking, and the order in which they sum over keys, change with the number of query rows
and with the key length, and the last-bit differences grow into different tokens.

:func:`row_exact_attention` computes ``softmax(scale · q·kᵀ + mask)·v`` (paper §3, tree
attention in verification) row by row with one fixed arithmetic:

- a query row visits its keys in cache order and skips the masked ones (additive mask entries at
  or below float32's lowest value, ``-inf`` included) without touching them;
- the softmax's maximum, its sum and the value accumulation run key after key in that order, in
  float32; each q·k product sums the head dimension in 16 fixed lanes; e^x is a polynomial
  written out in the kernel (within about one unit in the last place), not the C library's;
- rows are independent (spread over PyTorch's OpenMP threads when the call is large enough).

So a row's result depends only on its query and the sequence of keys and values it attends to: a
tree node attends to its prefix and then its ancestors, in order, which is exactly what the
one-token step that would have produced it attends to, and the two agree bit for bit, however
many rows, sequences or padding entries share the call.  The arithmetic is plain IEEE float32
(no fused multiply-add, no fast-math), and the AVX-512, AVX2 and baseline versions of the kernel
do the same operations in the same order.

:func:`rope_append` does one layer's rotary embedding of q and k and writes k and v into the KV
cache's buffers in one call, with PyTorch's operator-by-operator arithmetic (bit for bit), instead of
about twenty small operators; :func:`rope_attend` continues in the same call with the row-exact
attention over the cache (the 4-bit target's attention block, one call per layer).

The kernels are built with the package (``dart_core/csrc/attention.cpp``, pybind11).
"""

from __future__ import annotations

import torch  # first: the extension's OpenMP runtime is then the one PyTorch already loaded

from dart_core import _kernels

__all__ = ["row_exact_attention", "additive_mask", "attend", "rope_append", "rope_attend", "RopeTables",
           "PARALLEL_WORK"]

#: calls with at least this many multiply-adds per q·k pass (rows · keys · head size) use every
#: OpenMP thread; smaller ones (a one-token step over a short prefix) run on the calling thread
PARALLEL_WORK = 1 << 17


def row_exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None) -> torch.Tensor:
    """softmax(scale · q·kᵀ + mask)·v, each query row computed on its own (module docstring).

    Args:
        query: [B, H, Q, D] on the CPU, any float dtype (computed in float32), any strides.
        key, value: [B, H_kv, T, D], H a multiple of H_kv (query head h reads key/value head
            h // (H / H_kv), as grouped-query attention does); any strides.
        attention_mask: [B, 1, Q, ≥ T] additive float (0 to attend; float32's lowest or -inf to
            mask; other values are added to the scores) or boolean (True = attend), or None.
        scaling: the factor on q·k; None: D ** -0.5.

    Returns:
        [B, Q, H, D] in the query's dtype (contiguous). A row that attends to no key is zero.

    Raises:
        ValueError: tensors off the CPU, or shapes that do not match.
    """
    if query.device.type != "cpu" or key.device.type != "cpu" or value.device.type != "cpu":
        raise ValueError("row_exact_attention runs on the CPU only")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"row_exact_attention: query, key and value must be 4-dimensional, not "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    b, h, q, d = query.shape
    scale = d ** -0.5 if scaling is None else float(scaling)
    out = attend(_as_f32(query), _as_f32(key), _as_f32(value), additive_mask(attention_mask), scale)
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def additive_mask(attention_mask: torch.Tensor | None):
    """The mask as the kernel reads it (a float32 numpy view, made once and reused by every layer of a
    forward): additive masks converted to float32 (float64's lowest becomes -inf: still masked out),
    boolean ones (True = attend) to 0 / -inf; None stays None."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=torch.float32).masked_fill_(
            ~attention_mask, float("-inf"))
    elif attention_mask.dtype != torch.float32:
        attention_mask = attention_mask.float()
    return _inner_contiguous(attention_mask).numpy()


def attend(query, key, value, mask, scale: float) -> torch.Tensor:
    """:func:`row_exact_attention` without its conversions, for a forward's inner loop: query, key and
    value float32 CPU tensors (or numpy views) of the shapes there with a contiguous last dimension,
    ``mask`` from :func:`additive_mask`, ``scale`` a float. Returns a new [B, Q, H, D] float32 tensor.

    Raises:
        ValueError: shapes that do not match, or a strided last dimension."""
    b, h, q, d = query.shape
    out = torch.empty(b, q, h, d, dtype=torch.float32)
    try:
        _kernels.row_exact_attention(_numpy(query), _numpy(key), _numpy(value), mask, scale, out.numpy(),
                                     PARALLEL_WORK)
    except ValueError as e:  # pybind11 maps std::invalid_argument to ValueError
        raise ValueError(f"row_exact_attention: {e}") from None
    return out


def _numpy(x):
    return x.numpy() if isinstance(x, torch.Tensor) else x


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _as_f32(x: torch.Tensor):
    """A float32 numpy view of ``x`` (a copy only for another dtype or a strided last dimension)."""
    if x.dtype != torch.float32:
        x = x.float()
    return _inner_contiguous(x).detach().numpy()


class RopeTables:
    """The rotary cos/sin of positions, read from tables grown on demand, each entry computed as
    transformers' rotary embedding does (position · inv_freq, then cos/sin, times the attention
    scaling): what :func:`rope_append` and :func:`rope_attend` take.

    Args:
        inv_freq: [D/2] the rotary frequencies (kept as float32 on the CPU).
        scale: the rotary embedding's attention scaling."""

    def __init__(self, inv_freq: torch.Tensor, scale: float) -> None:
        self.inv_freq, self.scale = inv_freq.float().cpu(), float(scale)
        self.cos = self.sin = torch.zeros(0, 2 * self.inv_freq.shape[0])

    def __call__(self, positions, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, D] float32 for int positions (a tensor or array, all below
        ``bound``, a host-side bound so no tensor is read)."""
        if bound > self.cos.shape[0]:
            size = max(bound, 2 * self.cos.shape[0], 256)
            freqs = torch.arange(size, dtype=torch.long)[:, None].float() * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos() * self.scale, emb.sin() * self.scale
        return self.cos[positions], self.sin[positions]


def rope_append(qkv: torch.Tensor, cos, sin, heads: int, kv_heads: int, key_buffer: torch.Tensor,
                value_buffer: torch.Tensor, t: int) -> torch.Tensor:
    """One layer's rotary embedding and KV-cache append, as transformers' Llama attention computes them
    (``x·cos + rotate_half(x)·sin``, each product and the sum rounded to float32: the same bits).

    Args:
        qkv: [B, Q, (H + 2·H_kv)·D] float32, the q, k and v projections side by side.
        cos, sin: [B·Q, D] float32 numpy views (made once per forward), the rotary tables at each
            token's position.
        heads, kv_heads: H and H_kv.
        key_buffer, value_buffer: [B, H_kv, ≥ t + Q, D] float32, written at positions t .. t + Q - 1.
        t: the cache length before this forward.

    Returns:
        the rotated query [B, H, Q, D] (a transposed view of a new [B, Q, H, D] tensor).

    Raises:
        ValueError: shapes that do not match, or a strided last dimension.
    """
    b, q, n = qkv.shape
    d = n // (heads + 2 * kv_heads)
    query = torch.empty(b, q, heads, d, dtype=torch.float32)
    _kernels.rope_append(qkv.view(b * q, n).numpy(), cos, sin, heads, kv_heads, query.numpy(), key_buffer.numpy(),
                         value_buffer.numpy(), t)
    return query.transpose(1, 2)


def rope_attend(qkv: torch.Tensor, cos, sin, heads: int, kv_heads: int, key_buffer: torch.Tensor,
                value_buffer: torch.Tensor, t: int, mask, scale: float) -> torch.Tensor:
    """:func:`rope_append`, then :func:`row_exact_attention` of the rotated queries over the cache's
    first t + Q positions, in one call (the same values as the two calls).

    Args:
        qkv: [B, Q, (H + 2·H_kv)·D] float32.
        cos, sin, key_buffer, value_buffer, t: as :func:`rope_append` (written at t .. t + Q - 1).
        mask: [B, 1, Q, ≥ t + Q] from :func:`additive_mask`, or None.
        scale: the factor on q·k.

    Returns:
        the attention output [B, Q, H, D] float32.

    Raises:
        ValueError: shapes that do not match, or a strided last dimension.
    """
    b, q, n = qkv.shape
    out = torch.empty(b, q, heads, n // (heads + 2 * kv_heads), dtype=torch.float32)
    _kernels.rope_attend(qkv.view(b * q, n).numpy(), cos, sin, heads, kv_heads, key_buffer.numpy(),
                         value_buffer.numpy(), t, mask, scale, out.numpy(), PARALLEL_WORK)
    return out
