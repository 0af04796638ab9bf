"""The engine's SDPA backend choice (dart_core.attention): cuDNN left out on CUDA, PyTorch's own
choice on a CPU, the override for measurements, and a clear error for a bad name."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from dart_core.attention import ENV_VAR, attention_backend, sdpa_backends


def test_auto_leaves_cudnn_out_on_cuda_and_the_cpu_choice_alone(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    cuda = sdpa_backends("cuda")
    assert SDPBackend.CUDNN_ATTENTION not in cuda and SDPBackend.EFFICIENT_ATTENTION in cuda
    assert SDPBackend.MATH in cuda  # always a fallback
    assert sdpa_backends("cpu") is None and sdpa_backends(torch.device("cpu")) is None


def test_the_environment_overrides_the_choice(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "default")
    assert sdpa_backends("cuda") is None
    monkeypatch.setenv(ENV_VAR, " Math, efficient ")
    assert sdpa_backends("cpu") == (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION)
    monkeypatch.setenv(ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="fastest"):
        sdpa_backends("cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        attention_backend("cpu")


def test_a_chosen_backend_is_the_one_that_runs(monkeypatch):
    """Under the context only the named kernels may run: the math kernel gives SDPA's result, and a
    choice that cannot run (cuDNN on a CPU) fails the call instead of silently falling back."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 3, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 3, 3)
    mask[..., 0] = torch.finfo(torch.float32).min
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    monkeypatch.setenv(ENV_VAR, "math")
    with attention_backend("cpu"):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref)
    monkeypatch.setenv(ENV_VAR, "cudnn")
    with attention_backend("cpu"), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
