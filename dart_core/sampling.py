"""Sampling parameters and the target distribution they define.

Lossless speculative sampling draws from exactly the distribution plain
decoding would use: the target's logits after temperature, top-k and top-p
(Hugging Face's warper order: temperature, then top-k, then top-p).
Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "target_probs"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # EOS and the like; included in the output
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: stop tokens are masked until this many tokens are generated
    logprobs: int | None = None  # None: none; k >= 0: each emitted token's log-probability and the k most likely
    # structured output: a compiled dart_core.grammar.Grammar every emitted token follows (None: unconstrained)
    grammar: object | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")

    @classmethod
    def stopping_at(cls, eos_token_id: int | None, **fields) -> "SamplingParams":
        """Parameters that end a sequence at the model's EOS token (unless ``stop_token_ids`` is
        given): how every front end builds them.

        Raises:
            ValueError: a field out of range (see the class).
        """
        if fields.get("stop_token_ids") is None:
            fields["stop_token_ids"] = () if eos_token_id is None else (int(eos_token_id),)
        return cls(**fields)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= 1 - params.top_p
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)
