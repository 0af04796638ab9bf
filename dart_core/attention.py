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

The environment variable ``DART_SDPA_BACKENDS`` overrides the choice for
measurements: ``default`` (PyTorch's own priority, cuDNN included), or a
comma-separated list of ``flash``, ``efficient``, ``math``, ``cudnn``.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["sdpa_backends", "attention_backend", "ENV_VAR"]

ENV_VAR = "DART_SDPA_BACKENDS"

_NAMES = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
          "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
_CUDA_AUTO = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends(device: torch.device | str, setting: str | None = None) -> tuple[SDPBackend, ...] | None:
    """The SDPA backends the engine allows on ``device``; None leaves PyTorch's own choice.

    Args:
        device: where the attention runs.
        setting: ``auto`` (the module docstring's choice), ``default`` or a comma-separated list
            of backend names; None reads ``DART_SDPA_BACKENDS`` (``auto`` when unset).

    Raises:
        ValueError: an unknown backend name.
    """
    setting = (os.environ.get(ENV_VAR, "auto") if setting is None else setting).strip().lower() or "auto"
    if setting == "default":
        return None
    if setting == "auto":
        return _CUDA_AUTO if torch.device(device).type == "cuda" else None
    names = [x.strip() for x in setting.split(",") if x.strip()]
    unknown = [x for x in names if x not in _NAMES]
    if unknown or not names:
        raise ValueError(f"{ENV_VAR}={setting!r}: use auto, default or a list of {', '.join(_NAMES)}")
    return tuple(_NAMES[x] for x in names)


def attention_backend(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context under which SDPA calls use :func:`sdpa_backends` (a no-op where that is None).

    Raises:
        ValueError: as :func:`sdpa_backends`.
    """
    backends = sdpa_backends(device)
    return contextlib.nullcontext() if backends is None else sdpa_kernel(list(backends))
