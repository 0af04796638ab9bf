"""Which scaled-dot-product-attention kernel runs the engine's attention.

PyTorch chooses an SDPA backend for every call by a priority list and the
call's inputs.  Every attention call of the engine carries an additive 4D
mask (tree attention in verification, the ragged prefix in prefill, the
mask slots in the draft head), and on CUDA builds for Hopper (sm90) the
cuDNN backend ranks first for bf16/fp16 with such a mask.  cuDNN builds an
execution plan for every new shape, and the engine's shapes change every
step: the draft head's key length grows by the accepted tokens, an eager
verification's key length likewise.  So an eager bf16 step may build a new
plan per call (docs/design.md, "Attention backend").

The engine therefore runs its attention under an explicit choice,
:func:`sdpa_backends`, applied by :func:`attention_backend`:

- **CUDA** (``auto``): memory-efficient attention (takes an additive mask,
  no per-shape plan), flash attention for calls without a mask, the math
  kernel as the fallback; cuDNN is left out.
- **CPU** (``auto``): PyTorch's own choice, unchanged (its flash kernel for
  CPUs takes masks and builds no plans).

``KernelConfig.sdpa_backends`` (:mod:`dart_core.model.kernel_config`) overrides
the choice for measurements: ``default`` (PyTorch's own priority, cuDNN
included), or a comma-separated list of ``flash``, ``efficient``, ``math``,
``cudnn``.

**Grouped-query attention under a mask.** SmolLM2 shares each key/value
head among three query heads.  PyTorch's grouped-head option
(``enable_gqa``) does not reach CUDA's memory-efficient kernel, the one that
takes a mask, so transformers (and a plain call) repeat every key and value
of the KV cache per query head before each masked attention: on a GPU that
copy grows with the batch and the cache, in every layer of every step.
:func:`grouped_query_sdpa` stacks the query heads of a group along the query
axis instead, so the keys and values are read once and never copied; the
target's and the draft head's masked attention on CUDA go through it
(:func:`use_grouped_query`; ``KernelConfig.grouped_query=False`` restores
the repeated heads, for measurements).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dart_core.model import kernels
from dart_core.model.kernel_config import KernelConfig

__all__ = ["sdpa_backends", "attention_backend", "grouped_query_sdpa", "use_grouped_query", "grouped_sdpa",
           "matmul_attention", "row_exact_attention", "GROUPED_SDPA", "SMALL_QUERY", "ROW_EXACT_QUERY"]

_NAMES = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
          "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
_CUDA_AUTO = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends(device: torch.device | str, setting: str = "auto") -> tuple[SDPBackend, ...] | None:
    """The SDPA backends the engine allows on ``device``; None leaves PyTorch's own choice.

    Args:
        device: where the attention runs.
        setting: ``KernelConfig.sdpa_backends``: ``auto`` (the module docstring's choice),
            ``default`` or a comma-separated list of backend names.

    Raises:
        ValueError: an unknown backend name (as :class:`~dart_core.model.kernel_config.KernelConfig`).
    """
    if setting != "auto":
        setting = KernelConfig(sdpa_backends=setting).sdpa_backends
    if setting == "default":
        return None
    if setting == "auto":
        return _CUDA_AUTO if torch.device(device).type == "cuda" else None
    return tuple(_NAMES[x] for x in setting.split(","))


def attention_backend(device: torch.device | str, setting: str = "auto") -> contextlib.AbstractContextManager:
    """A context under which SDPA calls use :func:`sdpa_backends` (a no-op where that is None).

    Raises:
        ValueError: as :func:`sdpa_backends`.
    """
    backends = sdpa_backends(device, setting)
    return contextlib.nullcontext() if backends is None else sdpa_kernel(list(backends))


def use_grouped_query(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                      enabled: bool = True) -> bool:
    """Whether a masked attention call takes :func:`grouped_query_sdpa`: ``enabled``
    (``KernelConfig.grouped_query``), on CUDA, an additive mask shared by the heads ([B or 1, 1, Q,
    ≥T], floating point), fewer key/value heads than query heads.  Shapes: query [B, H, Q, D],
    key [B, H_kv, T, D]."""
    return (enabled and query.device.type == "cuda" and mask is not None and mask.is_floating_point()
            and mask.dim() == 4 and mask.shape[1] == 1 and key.shape[1] != query.shape[1])


def grouped_query_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                       scale: float | None) -> torch.Tensor:
    """Masked grouped-query attention through PyTorch's SDPA without repeating key/value heads.

    The G = H / H_kv query heads that share a key/value head (heads j·G .. j·G + G - 1, the order
    of transformers' ``repeat_kv``) are stacked along the query axis, [B, H_kv, G·Q, D], and the
    mask is repeated G times along it, [B, 1, G·Q, T]: G·Q·T mask entries per row instead of
    G - 1 extra copies of every cached key and value.  Each query row computes the same
    softmax(q·kᵀ · scale + mask)·v over the same keys as with repeated heads.

    Args:
        query: [B, H, Q, D]; key, value: [B, H_kv, T, D], H a multiple of H_kv.
        mask: [B or 1, 1, Q, ≥T] additive, the query's dtype; columns past T are ignored.
        scale: the softmax scale (None: D ** -0.5).

    Returns:
        [B, Q, H, D] (contiguous), the layout transformers' attention functions return.
    """
    b, h, q, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    groups = h // h_kv
    mask = mask[:, :, :, :t]
    if groups > 1:
        mask = mask[:, :, None].expand(mask.shape[0], 1, groups, q, t).reshape(mask.shape[0], 1, groups * q, t)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, h_kv, groups * q, d), key, value,
                                                           attn_mask=mask, scale=scale)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous()


# -- the target's attention plug-in (transformers' attention interface) --------------------------

SMALL_QUERY = 8  # at most this many query tokens per sequence: attention as two batched matmuls


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, minus two costs on CPUs.

    1. With a mask and more than one query token (tree verification,
       prefill) transformers repeats every key/value head
       ``num_key_value_groups`` times before calling SDPA: a copy of the
       whole KV cache in every layer, every step.  Here the grouped heads go
       to PyTorch's SDPA directly (``enable_gqa``), with identical results.
    2. For 2 to ``SMALL_QUERY`` query tokens (a verification step) PyTorch's
       CPU flash-attention kernel is slow at batch > 1; the plain
       softmax(q·kᵀ)·v in two batched matmuls used here is faster for so few
       queries (BENCHMARKS.md has the measured figures) and equal to float32
       rounding.  Each query head group shares its key/value head without a
       copy, as ``enable_gqa`` does.

    3. On CUDA with an additive mask, where transformers also repeats the
       key/value heads (its masked kernels do not take grouped heads), for
       every query size, the one-token step included: the query heads of a
       group are stacked along the query axis instead, so a layer reads its keys and values
       once, not ``num_key_value_groups`` times after copying them
       (:func:`~dart_core.model.attention.grouped_query_sdpa`).

    Elsewhere (CPU single-token queries, already copy-free) this defers to
    transformers. Boolean masks (transformers' own, e.g. in ``generate``)
    take SDPA.

    Shapes: query [B, H, Q, D], key/value [B, H_kv, T, D], attention_mask
    [B, 1, Q, T] additive (the engine's) or boolean; returns ([B, Q, H, D], None).
    """
    if getattr(module, "dart_row_exact", False) and query.device.type == "cpu" and not dropout \
            and query.shape[2] <= ROW_EXACT_QUERY:
        q, t = query.shape[2], key.shape[2]
        if attention_mask is None and q > 1 and (getattr(module, "is_causal", True) if is_causal is None else is_causal):
            # no mask means causal (transformers' own forwards, e.g. generate's prefill): the last q of t positions
            attention_mask = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)[None, None]
        return row_exact_attention(query, key, value, attention_mask, scaling), None
    if not dropout and use_grouped_query(query, key, attention_mask, getattr(module, "dart_grouped_query", True)):
        return grouped_query_sdpa(query, key, value, attention_mask, scaling), None
    if query.device.type != "cpu" or attention_mask is None or query.shape[2] == 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if query.shape[2] > SMALL_QUERY or attention_mask.shape[1] != 1 or not attention_mask.is_floating_point():
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None
    return matmul_attention(query, key, value, attention_mask, scaling, query.dtype), None


ROW_EXACT_QUERY = 256  # row-exact attention up to this many query tokens per call (prefill above: SDPA)


def row_exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """softmax(q·kᵀ + mask)·v with each query row computed on its own by one fixed arithmetic
    (:func:`dart_core.model.kernels.row_exact_attention`, a C++ kernel), so a row's result does not depend
    on how many other rows share the call or where its keys sit in the cache.  Used where the
    target's other layers are row-exact too (:class:`~dart_core.model.quant.Int4Linear`), which round
    activations to bfloat16: there a batched attention's last-bit differences between a one-token
    step and a tree verification grow into different tokens.  Shapes as :func:`matmul_attention`."""
    return kernels.row_exact_attention(query, key, value, attention_mask, scaling)


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None,
                      accumulate: torch.dtype) -> torch.Tensor:
    """softmax(q·kᵀ · scale + mask)·v in two batched matmuls computed in ``accumulate`` and returned in
    the query's dtype; each query head group shares its key/value head without a copy.

    Shapes: query [B, H, Q, D], key/value [B, H_kv, T, D], attention_mask [B, 1, Q, ≥T] additive or
    boolean (True = attend), or None; returns [B, Q, H, D]."""
    b, h, q, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    groups = h // h_kv
    scale = d ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.to(accumulate).reshape(b, h_kv, groups * q, d),
                          key.to(accumulate).transpose(-1, -2)) * scale
    scores = scores.view(b, h_kv, groups, q, t)
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :t]
        if not mask.is_floating_point():
            mask = torch.zeros(mask.shape, dtype=accumulate, device=mask.device).masked_fill_(~mask, float("-inf"))
        scores = scores + mask.to(accumulate)[:, :, None]
    probs = scores.softmax(-1).view(b, h_kv, groups * q, t)
    out = torch.matmul(probs, value.to(accumulate)).view(b, h, q, d).to(query.dtype)
    return out.transpose(1, 2).contiguous()


GROUPED_SDPA = "dart_grouped_sdpa"
AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # masks built by transformers (generate) stay sdpa's
