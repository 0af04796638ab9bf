"""Sampling parameters and the target distribution they define.

Lossless speculative sampling draws from exactly the distribution plain
decoding would use: the target's logits after temperature, top-k and top-p
(Hugging Face's warper order: temperature, then top-k, then top-p).
Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "target_probs", "batch_target_probs", "sample_token"]


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
    # structured output: a compiled dart_core.step.grammar.Grammar every emitted token follows (None: unconstrained)
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
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p (one
    parameter set for every row; ``params`` must not be greedy)."""
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    one = torch.ones(1, 1, device=logits.device)
    k = params.top_k if 0 < params.top_k < v else 0
    return _warped_probs(flat, one * params.temperature, one.long() * (k or v), one * params.top_p, k,
                         params.top_p < 1.0).view(logits.shape)


def batch_target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] logits, one parameter set per row -> [R, V] float32 probabilities as
    :func:`target_probs` gives them row by row (a greedy row is warped at temperature 1: the caller
    takes its argmax instead).  No host read: the parameters are host values."""
    v = logits.shape[-1]
    dev = logits.device
    temperature = torch.tensor([[p.temperature if p.temperature > 0 else 1.0] for p in params], device=dev)
    top_k = torch.tensor([[p.top_k if 0 < p.top_k < v else v] for p in params], device=dev)
    top_p = torch.tensor([[p.top_p] for p in params], device=dev)
    return _warped_probs(logits, temperature, top_k, top_p, max((p.top_k for p in params if 0 < p.top_k < v),
                                                                 default=0), any(p.top_p < 1.0 for p in params))


def _warped_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  largest_k: int, use_top_p: bool) -> torch.Tensor:
    """logits [R, V]; temperature, top_p: [R or 1, 1] float32; top_k: [R or 1, 1] int64 (V: off);
    largest_k: the largest top-k in use (0: none)."""
    logits = logits.float() / temperature
    v = logits.shape[-1]
    if largest_k:
        ordered = torch.topk(logits, largest_k, dim=-1).values  # [R, largest_k], descending
        kth = ordered.gather(-1, (top_k.clamp(max=largest_k) - 1).expand(logits.shape[0], 1))
        kth = kth.masked_fill(top_k >= v, float("-inf"))  # rows without top-k keep every token
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if use_top_p:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= 1 - top_p
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample_token(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse transform sampling: the first token whose cumulative
    probability reaches ``uniform`` × the row's total.

    Args:
        probs: [..., V] non-negative weights (need not sum to 1).
        uniform: [...] float64 draws in (0, 1] (``1 - torch.rand``: 0 could pick a token of
            probability 0).

    Returns:
        [...] int64 token ids; a token of probability 0 is never drawn.
    """
    cdf = probs.double().cumsum(-1)
    level = uniform.to(cdf.dtype)[..., None] * cdf[..., -1:]
    return torch.searchsorted(cdf, level).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
