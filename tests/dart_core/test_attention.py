"""The engine's SDPA backend choice (dart_core.model.attention): cuDNN left out on CUDA, PyTorch's own
choice on a CPU, the override for measurements, and a clear error for a bad name."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from dart_core.model.attention import attention_backend, sdpa_backends


def test_auto_leaves_cudnn_out_on_cuda_and_the_cpu_choice_alone():
    cuda = sdpa_backends("cuda")
    assert SDPBackend.CUDNN_ATTENTION not in cuda and SDPBackend.EFFICIENT_ATTENTION in cuda
    assert SDPBackend.MATH in cuda  # always a fallback
    assert sdpa_backends("cpu") is None and sdpa_backends(torch.device("cpu")) is None


def test_the_kernel_config_overrides_the_choice():
    """KernelConfig.sdpa_backends (what DartModel.from_pretrained hands the target and the head)."""
    assert sdpa_backends("cuda", "default") is None
    assert sdpa_backends("cpu", " Math, efficient ") == (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION)
    with pytest.raises(ValueError, match="fastest"):
        sdpa_backends("cuda", "fastest")
    with pytest.raises(ValueError, match="sdpa_backends"):
        attention_backend("cpu", "fastest")


def test_a_chosen_backend_is_the_one_that_runs():
    """Under the context only the named kernels may run: the math kernel gives SDPA's result, and a
    choice that cannot run (cuDNN on a CPU) fails the call instead of silently falling back."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 3, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 3, 3)
    mask[..., 0] = torch.finfo(torch.float32).min
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with attention_backend("cpu", "math"):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref)
    with attention_backend("cpu", "cudnn"), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
