"""The typed boundary between a front end (HTTP, gRPC, a Python caller) and the
batcher: one validated request type in, one chunk type out.

:class:`GenerationRequest` is checked when it is made, so a bad field raises
:class:`InvalidRequest` (HTTP 400, gRPC ``INVALID_ARGUMENT``) before anything
is queued.  The stream of a request is a sequence of :class:`GenerationChunk`:
each carries the step's new tokens and the text that may be shown now, and
the running statistics of the request; the last one has a finish reason.

Terms (DART, arXiv 2601.19278; speculative decoding in general): a *step* is
one verification forward of the target; it emits the draft tokens the target
accepted plus one *bonus* token (the target's own next token), so τ = tokens
emitted by steps ÷ steps ≥ 1.  The first token comes from the prefill, which
is no step.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from dart_core.spec.speculative import METHODS
from dart_core.step.grammar import GrammarSpec

__all__ = ["InvalidRequest", "ChatMessage", "GenerationRequest", "TokenLogprob", "GenerationChunk",
           "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "SEED_MIN", "SEED_MAX"]

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a 64-bit signed seed, as vLLM takes
FINISH_REASONS = ("stop", "length")


class InvalidRequest(ValueError):
    """A request the server refuses, with a message for the client (HTTP 400, gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user", "assistant", ...
    content: str


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class GenerationRequest:
    """One completion request: a text prompt or chat messages, and how to sample.

    Fields are validated on construction.

    Raises:
        InvalidRequest: not exactly one of ``prompt``, ``messages`` and ``prompt_token_ids``; an
            empty prompt; a field of the wrong type or out of range.
    """

    prompt: str | None = None  # plain text, tokenised as is (no chat template)
    messages: tuple[ChatMessage, ...] | None = None  # rendered with the model's chat template
    prompt_token_ids: tuple[int, ...] | None = None  # token ids, used as they are
    max_tokens: int | None = None  # None: the server's default
    temperature: float = 0.0  # 0 = greedy: exactly the target's greedy output
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, not included in the text
    speculative: bool = True  # False: decode this request without speculation (its batch steps autoregressively)
    learn: bool = True  # False: this request's tokens never enter the n-gram service's live corpus
    method: str | None = None  # the drafter ("dart", "eagle3" where loaded; "none" = speculative False); None: default
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and the k most likely
    # vLLM's sampling extensions, with vLLM's meaning
    ignore_eos: bool = False  # keep generating past the model's EOS token (load generators fix lengths so)
    stop_token_ids: tuple[int, ...] = ()  # more token ids that end the sequence (the token stays in the output)
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens (not with stop strings)
    grammar: GrammarSpec | None = None  # structured output: what every generated token must follow

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        _require(given == 1, "give exactly one of a prompt, messages or prompt token ids")
        if self.prompt_token_ids is not None:
            ids = tuple(self.prompt_token_ids)
            _require(len(ids) > 0, "the prompt is empty")
            _require(all(_is_int(t) and t >= 0 for t in ids), "prompt token ids must be integers >= 0")
            object.__setattr__(self, "prompt_token_ids", ids)
        elif self.prompt is not None:
            _require(isinstance(self.prompt, str), "prompt must be text")
            _require(len(self.prompt) > 0, "the prompt is empty")
        else:
            msgs = tuple(self.messages)
            _require(len(msgs) > 0, "messages must not be empty")
            _require(all(isinstance(m, ChatMessage) and isinstance(m.role, str) and isinstance(m.content, str)
                         for m in msgs), "each message needs a role and text content")
            object.__setattr__(self, "messages", msgs)
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                 "max_tokens must be an integer >= 1")
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0")
        _require(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
                 f"seed must be an integer in {SEED_MIN}..{SEED_MAX} (64-bit)")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _require(all(isinstance(s, str) for s in stop), "stop must be strings")
        stop = tuple(s for s in stop if s)
        _require(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        object.__setattr__(self, "stop", stop)
        _require(isinstance(self.speculative, bool), "speculative must be true or false")
        _require(isinstance(self.learn, bool), "learn must be true or false")
        _require(self.method is None or self.method in METHODS,
                 f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                 f"top logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be true or false")
        ids = tuple(self.stop_token_ids or ())
        _require(all(_is_int(t) and t >= 0 for t in ids), "stop_token_ids must be token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", ids)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be an integer >= 0")
        # min_tokens masks EOS and the stop token ids until that many tokens are generated (vLLM); stop
        # strings are matched on text as it comes, so the two are not taken together
        _require(self.min_tokens == 0 or not stop, "min_tokens > 0 is not supported together with stop strings")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens")
        _require(self.grammar is None or isinstance(self.grammar, GrammarSpec), "grammar must be a GrammarSpec")

    def chat(self) -> list[dict] | None:
        """The messages as the chat template takes them (None for a text prompt)."""
        return None if self.messages is None else [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target (before temperature,
    top-p and top-k: the model's own distribution, as vLLM reports by default)."""

    token_id: int
    token: str  # the token decoded alone (a part of a multi-byte character reads as U+FFFD)
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob) of the most likely tokens, best first


@dataclass(frozen=True)
class GenerationChunk:
    """One step of a request's stream.

    ``text`` may be empty while an incomplete character or a possible stop string is held
    back; joined over the stream it is the completion.  The counters are the request's totals so far.

    Per-step figures (DART, arXiv 2601.19278 §3: one verification of a draft tree per step):
    a step's tokens are ``accepted`` draft tokens followed by the target's own bonus token,
    unless the sequence ended inside them (EOS, length).  ``bonus_chars`` is the length of
    the bonus token's text at the end of ``text`` (0 for the prefill's chunk and for
    autoregressive steps); text held back by an incomplete character or a possible stop
    string shows in the chunk that releases it, so there it counts with the token released.
    The acceptance rate of the request's trees is ``accepted_tokens / draft_tokens``.
    """

    text: str
    token_ids: tuple[int, ...]  # tokens emitted by this step (after a stop string: the ones before it)
    finish_reason: str | None  # "stop" (EOS or a stop string), "length", or None while running
    prompt_tokens: int
    completion_tokens: int
    steps: int  # verification steps so far (the prefill is none)
    step_tokens: int  # tokens those steps emitted (accepted draft tokens + bonus tokens)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids, when asked for
    # this step (0 for the prefill's chunk and for an autoregressive step's draft figures)
    accepted: int = 0  # accepted draft tokens among token_ids (the bonus token not counted)
    draft_nodes: int = 0  # draft-tree nodes verified (0: no speculation this step)
    bonus_chars: int = 0  # characters at the end of ``text`` that the bonus token produced (see below)
    # the request's totals so far
    draft_tokens: int = 0  # draft-tree nodes verified over all steps
    accepted_tokens: int = 0  # accepted draft tokens emitted over all steps

    @property
    def tau(self) -> float | None:
        """Mean acceptance length so far: tokens per verification step, bonus included (None before any step)."""
        return self.step_tokens / self.steps if self.steps else None
