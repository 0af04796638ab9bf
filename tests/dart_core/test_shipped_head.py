"""The draft head shipped for SmolLM2-135M-Instruct (issue 5): the files are
what the model card says (bf16, no embedding, ≤ 32 MB), it is the head every
entry point loads by default, and with it greedy DART decoding on the real
target is exact and accepts drafts (a random head's τ stays below 1.3).  The
EAGLE-3 head shipped beside it likewise (method eagle3, ``eagle3_head="auto"``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dart_core.api import SHIPPED_EAGLE3_HEADS, SHIPPED_HEADS, DartModel, default_draft_dtype, eagle3_drafter
from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams
from dart_core.model.tokenizer import DEFAULT_MODEL
from ngram_service.client import InProcessTreeSearch
from ngram_service.tree_search import SearchParams

from .test_smollm2 import PROMPTS, chat

HEAD = SHIPPED_HEADS[DEFAULT_MODEL]


def _check_shipped_folder(folder) -> tuple[dict, set]:
    """What every head shipped in the package keeps to: its weights, config, training record and
    card, at most 32 MiB in all, no copy of the target's embedding, bfloat16 weights (the draft
    vocabulary's maps aside).  Returns its config and tensor names."""
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "training.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 32 * 2**20
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert not any("embed" in k for k in keys)
        dtypes = {f.get_tensor(k).dtype for k in keys if k not in ("d2t", "t2d")}
    assert dtypes == {torch.bfloat16}
    return json.loads((folder / "config.json").read_text()), keys


def test_shipped_head_files():
    config, keys = _check_shipped_folder(HEAD)
    assert config["draft_length"] == 7 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    assert {"fc.weight", "midlayer.mask_rep", "lm_head.weight", "d2t", "t2d"} <= keys


@pytest.mark.slow
def test_shipped_head_is_the_default_and_exact_on_smollm2(smollm2):
    # what DartModel / the Serve app load for head=None (bf16 beside the fp32 target where the CPU has bf16 matmul)
    head = DartModel._load_head(None, DEFAULT_MODEL, smollm2, default_draft_dtype(smollm2))
    assert head is not None
    prompts = [chat(smollm2, p) for p in PROMPTS]
    engine = DartEngine(smollm2, head, InProcessTreeSearch(None), SearchParams(budget=16))
    sp = SamplingParams(max_new_tokens=48)
    ar = engine.generate(prompts, sp, speculative=False)
    dart = engine.generate(prompts, sp)
    assert dart.token_ids == ar.token_ids
    assert dart.tau > 1.4, dart.tau


EAGLE3_HEAD = SHIPPED_EAGLE3_HEADS[DEFAULT_MODEL]


def test_shipped_eagle3_head_files():
    config, keys = _check_shipped_folder(EAGLE3_HEAD)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["hidden_size"] == 576
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= keys


@pytest.mark.slow
def test_shipped_eagle3_head_is_the_default_and_exact_on_smollm2(smollm2):
    """``eagle3_drafter(None)`` (method eagle3 with no head, ``eagle3_head: auto``) loads the shipped
    EAGLE-3 head; greedy decoding with it on the real target equals autoregressive decoding and
    accepts drafts."""
    drafter = eagle3_drafter(None, smollm2, total_tokens=16, depth=3, top_k=4)
    prompts = [chat(smollm2, p) for p in PROMPTS]
    sp = SamplingParams(max_new_tokens=48)
    ar = DartEngine(smollm2).generate(prompts, sp, speculative=False)
    out = DartEngine(smollm2, drafter=drafter).generate(prompts, sp)
    assert out.token_ids == ar.token_ids
    assert out.tau > 1.15, out.tau
