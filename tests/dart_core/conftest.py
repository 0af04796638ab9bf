from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dart_core.model.target import TargetModel
from ngram_service.client import TreeSearchClient
from ngram_service.tree_search import DraftTree

VOCAB = 96


def tiny_config(arch: str):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None)
    if arch == "llama":
        return LlamaConfig(**common)
    return Qwen3Config(head_dim=16, **common)


def tiny_target(arch: str, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> TargetModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
    # sharper distributions than a fresh init, so sampled text has structure
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return TargetModel(model.to(device=device, dtype=dtype))


@pytest.fixture(params=["llama", "qwen3"])
def target(request) -> TargetModel:
    return tiny_target(request.param)


def hf_greedy(target: TargetModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=None, min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def make_tree(tokens: list[int], parents: list[int], probs: list[float] | None = None) -> DraftTree:
    """A DraftTree from depth-ordered tokens/parents (node 0 = root); nodes scored with ``probs``
    (default: 0.5 each, the root 1)."""
    depths = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depths[i] = depths[parents[i]] + 1
    probs = [1.0] + [0.5] * (len(tokens) - 1) if probs is None else probs
    return DraftTree.from_parents(tokens, parents, depths, np.zeros(len(tokens)), probs)


class OracleTreeSearch(TreeSearchClient):
    """Drafts from known continuations: the true next tokens on one branch (cut
    short by a wrong token at a random depth), with wrong siblings around it.
    Exercises multi-token acceptance and KV compaction that a random head never reaches."""

    def __init__(self, full_sequences: list[list[int]], depth: int = 6, seed: int = 0) -> None:
        self.full = full_sequences
        self.depth = depth
        self.rng = np.random.default_rng(seed)

    def _truth(self, context: list[int]) -> list[int]:
        for seq in self.full:
            if seq[: len(context)] == context:
                return seq[len(context): len(context) + self.depth]
        return []

    def search(self, topk_ids, topk_probs, contexts, params, chains=None):
        trees = []
        for ctx in contexts:
            ctx = [int(t) for t in ctx]
            truth = self._truth(ctx)
            wrong_at = int(self.rng.integers(0, len(truth) + 1)) if truth else 0
            tokens, parents = [ctx[-1]], [-1]
            prev = 0
            for d, tok in enumerate(truth):
                wrong = (tok + 1 + int(self.rng.integers(VOCAB - 1))) % VOCAB
                tokens.append(wrong)  # a wrong sibling first
                parents.append(prev)
                tokens.append(wrong if d == wrong_at else tok)
                parents.append(prev)
                prev = len(tokens) - 1
            trees.append(make_tree(tokens, parents))
        return trees
