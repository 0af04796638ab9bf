"""HTTP (OpenAI-compatible, FastAPI) and gRPC (``protos/dart.proto``) ingress.

HTTP: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming
ending with ``data: [DONE]``, or one JSON body), ``GET /v1/models``,
``GET /health``.  Request and response shapes follow the OpenAI API so the
official ``openai`` client works unchanged; ``usage`` carries the token counts
and a ``dart`` field (τ, steps, drafted and accepted tokens); each streamed chunk
carries a ``dart`` field with its verification step's figures (accepted draft
tokens, draft-tree size, the bonus token's share of the text), which OpenAI
clients ignore; ``logprobs`` / ``top_logprobs`` return the target's
log-probabilities.  ``GET /`` and ``GET /compare`` serve the compare page
(DART beside autoregressive decoding in the browser, from files in the
package).  Every request becomes a validated
:class:`dart_core.serve.request.GenerationRequest` before it reaches the engine,
and every field the server would not honour is refused: an OpenAI field it
does not implement (penalties, logit bias, tools, n > 1, ...) unless it has
its neutral value, and any unknown field.  Structured output:
``response_format`` (``json_object``, ``json_schema``) and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` become a
:class:`dart_core.step.grammar.GrammarSpec`, compiled on the engine replica.
Errors use the OpenAI error body ``{"error": {"message", "type", "param",
"code"}}``, for whatever fails — a body that is not JSON or not UTF-8, an
unknown route, invalid parameters → 400/404/405, unknown model → 404,
missing/wrong API key → 401, a full queue → 503 with ``Retry-After``.  A
client that disconnects cancels its generation (the engine drops the sequence
at its next step).

gRPC: Serve's gRPC proxy calls :meth:`OpenAIIngress.Generate` and
:meth:`OpenAIIngress.GenerateStream` by method name; invalid input (both a
prompt and messages, a bad field) → ``INVALID_ARGUMENT``, a full queue →
``RESOURCE_EXHAUSTED``.
"""


import asyncio
import functools
import hmac
import itertools
import json
import logging
import os
import re
import time
import uuid
from importlib import resources
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dart_core.step.grammar import GrammarError, GrammarSpec
from dart_core.serve.request import (MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN, ChatMessage, GenerationChunk, GenerationRequest,
                               InvalidRequest)
from deployments.config import AppConfig
from deployments.engine import DartEngineDeployment

logger = logging.getLogger("ray.serve")

app = FastAPI(title="dart-serve", description="DART speculative decoding, OpenAI-compatible")


# -- OpenAI request schemas ---------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    content: str | list[TextPart] = Field(description="text, or OpenAI content parts of type text")
    name: str | None = Field(None, description="accepted; not passed to the chat template")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        return _without_nulls(cls, data)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    role: Literal["developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] = Field(description="the assistant's text (tool calls are not supported, so "
                                                      "it is required)")
    refusal: str | None = Field(None, description="accepted; not passed to the chat template")


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str = Field(description="the tool call this message answers")


#: OpenAI's message types, told apart by ``role``; each has its own required fields
Message = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
                    Field(discriminator="role")]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(data, path: str = "") -> None:
    """Refuses text that is not valid Unicode: JSON may escape half of a UTF-16 surrogate pair
    (``"\\ud800"``), which no tokenizer or grammar can encode (a tokenizer's own error, or a 500,
    otherwise).

    Raises:
        ValueError: naming the field, the code point and its position."""
    if isinstance(data, str):
        m = _SURROGATE.search(data)
        if m:
            raise ValueError(f"{path or 'a string'} holds a lone UTF-16 surrogate (U+{ord(m.group()):04X} at "
                             f"character {m.start()}); text must be valid Unicode")
    elif isinstance(data, dict):
        for k, v in data.items():
            _refuse_lone_surrogates(k, path or "a key")
            _refuse_lone_surrogates(v, f"{path}.{k}" if path else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _refuse_lone_surrogates(v, f"{path}.{i}" if path else str(i))


class _ValidText(BaseModel):
    """A request body whose every string is valid Unicode (:func:`_refuse_lone_surrogates`)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        _refuse_lone_surrogates(data)
        return data


def _without_nulls(model: type[BaseModel], data):
    """A request body with explicit nulls of known fields dropped, so they read as "not set" (what
    OpenAI's API does with null for an optional field); unknown fields are kept, and refused."""
    if not isinstance(data, dict):
        return data
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    known |= set(getattr(model, "_NEUTRAL_ONLY", ()))
    return {k: v for k, v in data.items() if not (v is None and k in known)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="a last chunk with the usage (and the dart statistics)")
    continuous_usage_stats: bool = Field(False, description="vLLM extension: every chunk carries the usage so far")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="the schema's name (OpenAI's rule: "
                                                                      "letters, digits, _ and -, up to 64)")
    description: str | None = Field(None, description="accepted; not given to the model")
    json_schema: dict | None = Field(None, alias="schema", description="the JSON schema the output follows "
                                                                       "(absent: any JSON object)")
    strict: bool | None = Field(None, description="true: a schema with keywords the grammar cannot enforce is "
                                                  "refused (400); otherwise they are left out and every other "
                                                  "keyword is enforced")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema" and only with it')
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return GrammarSpec("json_object")
        if self.type == "json_schema":
            schema = self.json_schema.json_schema
            return GrammarSpec("json_object") if schema is None else GrammarSpec.json_schema(
                schema, strict=bool(self.json_schema.strict))
        return None


#: OpenAI fields dart-serve does not implement: accepted only with their neutral value.
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "store": (None, False), "service_tier": (None, "auto", "default"), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "modalities": (None, ["text"]),
    "repetition_penalty": (None, 1, 1.0),
}


#: an admin corpus request's bounds (one call; larger corpora go in several)
ADMIN_MAX_DOCUMENT_CHARS = 16 << 20
ADMIN_MAX_TOKEN_IDS = 1 << 20


class AdminCorpusRequest(_ValidText):
    """``POST /admin/corpus``: texts and/or token-id documents for the live corpus."""

    model_config = ConfigDict(extra="forbid", strict=True)

    documents: list[str] = Field(default_factory=list, description="texts, encoded with the model's tokenizer")
    token_ids: list[list[int]] = Field(default_factory=list, description="documents as token ids")

    @model_validator(mode="after")
    def _bounded(self):
        if not any(self.documents) and not any(self.token_ids):
            raise ValueError("give at least one non-empty document or token_ids list")
        if sum(len(d) for d in self.documents) > ADMIN_MAX_DOCUMENT_CHARS:
            raise ValueError(f"documents exceed {ADMIN_MAX_DOCUMENT_CHARS} characters in one call")
        if sum(len(d) for d in self.token_ids) > ADMIN_MAX_TOKEN_IDS:
            raise ValueError(f"token_ids exceed {ADMIN_MAX_TOKEN_IDS} ids in one call")
        return self


class AdminTrieRequest(_ValidText):
    """``POST /admin/trie``: the trie file the n-gram service serves from now on."""

    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(min_length=1, description="a trie file on the n-gram node")


class _Common(_ValidText):
    """Fields are typed strictly (no "0.5" for a number, no 1 for a boolean) and an explicit null
    reads as "not set"."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="the served model name (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (newer clients)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy: exactly the target's greedy output")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off (an extension of the OpenAI API, as in vLLM)")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="a 64-bit signed integer")
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings, not included in the text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only n = 1 is supported")
    user: str | None = Field(None, description="an end-user identifier: accepted, not used")
    metadata: dict[str, str] | None = Field(None, description="accepted, not used")
    speculative: bool = Field(True, description="dart-serve extension: false decodes this request without "
                                                "speculation (A/B comparisons); while it runs, its batch "
                                                "steps autoregressively")
    learn: bool = Field(True, description="dart-serve extension: false keeps this request's tokens out of the "
                                          "n-gram service's live corpus (where the deployment keeps one)")
    method: str | None = Field(None, description='dart-serve extension: the drafter, "dart", "eagle3" (where the '
                                                 'deployment loads an EAGLE-3 head: eagle3_head) or "none" (as '
                                                 '"speculative": false); null = the deployment\'s method')
    # vLLM's sampling extensions, as vLLM means them (load generators such as guidellm send them)
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past the EOS token")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: EOS and stop_token_ids are held back until this "
                                                 "many tokens are generated (not with stop strings)")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension: more token ids that end the output")
    skip_special_tokens: bool = Field(True, description="vLLM extension: leave special tokens out of the text")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the matched stop string")
    # vLLM's structured-output extensions (chat completions also take OpenAI's response_format)
    guided_json: dict | str | None = Field(None, description="vLLM extension: a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="vLLM extension: a regular expression the output matches")
    guided_choice: list[str] | None = Field(None, description="vLLM extension: the output is one of these strings")
    _NEUTRAL_ONLY: ClassVar[tuple[str, ...]] = ("frequency_penalty", "presence_penalty", "logit_bias", "best_of",
                                                "store", "service_tier", "repetition_penalty")

    @model_validator(mode="before")
    @classmethod
    def _only_neutral(cls, data):
        """Drops the OpenAI fields this server does not implement when they hold their neutral
        value, and refuses them otherwise (any other unknown field is refused by ``extra``)."""
        if not isinstance(data, dict):
            return data
        data = _without_nulls(cls, data)
        for name in cls._NEUTRAL_ONLY:
            if name in data and data[name] not in _NEUTRAL[name]:
                raise ValueError(f"{name} is not supported by this server (only its default is accepted)")
        return {k: v for k, v in data.items() if k not in cls._NEUTRAL_ONLY}

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def grammar(self) -> GrammarSpec | None:
        """What the output is constrained to (structured output), None for free text.

        Raises:
            APIError: 400 for more than one constraint or a malformed one.
        """
        fmt = getattr(self, "response_format", None)
        try:
            return GrammarSpec.at_most_one([
                ("response_format", fmt.grammar() if fmt is not None else None),
                ("guided_json", None if self.guided_json is None
                 else GrammarSpec.json_schema(self.guided_json, strict=False)),
                ("guided_regex", None if self.guided_regex is None else GrammarSpec("regex", self.guided_regex)),
                ("guided_choice", None if self.guided_choice is None else GrammarSpec.choice(self.guided_choice))])
        except GrammarError as e:
            raise APIError(400, f"invalid structured-output constraint: {e}", param=e.param) from None


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = Field(False, description="return the log-probability of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="with logprobs: this many most likely tokens per position")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema "
                                                                     "(structured output)")
    _NEUTRAL_ONLY = _Common._NEUTRAL_ONLY + ("tools", "tool_choice", "functions", "function_call",
                                             "parallel_tool_calls", "modalities", "audio",
                                             "prediction", "reasoning_effort", "web_search_options")

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, or token ids; OpenAI's lists of several prompts are refused (one prompt per request)")
    logprobs: int | None = Field(None, ge=0, le=5, description="return each output token's log-probability and "
                                                               "this many most likely tokens")
    _NEUTRAL_ONLY = _Common._NEUTRAL_ONLY + ("echo", "suffix")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompt_fields(self) -> dict:
        """The GenerationRequest fields of the prompt: ``prompt`` (text) or ``prompt_token_ids``.

        Raises:
            APIError: 400 for a list of several prompts, or an empty one."""
        p = self.prompt
        if isinstance(p, str):
            return {"prompt": p}
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return {"prompt_token_ids": tuple(p)}
        if len(p) != 1:
            raise APIError(400, f"one prompt per request is supported; got a list of {len(p)} prompts",
                           param="prompt")
        return {"prompt": p[0]} if isinstance(p[0], str) else {"prompt_token_ids": tuple(p[0])}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def _error(status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": type_, "param": param, "code": status}})


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError):
    return _error(e.status, e.message, e.type, e.param, e.headers)


#: how pydantic names the alternatives of a union field in an error's location
_UNION_BRANCHES = {"str", "list[str]", "list[int]", "list[list[int]]", "list[TextPart]", "dict[any,any]",
                   "dict[str,str]"}
_UNION_FIELDS = {
    "prompt": "text, a list of one string, a list of token ids or a list of one list of token ids",
    "content": 'text or a list of content parts {"type": "text", "text": ...} (only text parts are supported)',
    "stop": "a string or a list of strings",
    "guided_json": "a JSON schema, as an object or as JSON text",
}


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "missing":  # an unsupported field beside it is the cause (tool_calls for content)
        parent = tuple(first.get("loc", ()))[:-1]
        first = next((x for x in errs if x.get("type") == "extra_forbidden"
                      and tuple(x.get("loc", ()))[:-1] == parent), first)
    raw = [x for x in first.get("loc", ()) if x != "body"]
    branch = next((x for x in raw if isinstance(x, str) and x in _UNION_BRANCHES), None)
    loc = ".".join(str(x) for x in (raw[: raw.index(branch)] if branch else raw))
    if branch is not None:  # a union field (text or a list): one message for it, not one per alternative
        field = loc.rsplit(".", 1)[-1]
        return _error(400, f"invalid request: {loc}: must be {_UNION_FIELDS.get(field, 'one of its documented forms')}",
                      "invalid_request_error", loc)
    kind = first.get("type")
    if kind == "json_invalid":
        return _error(400, f"malformed JSON body: {first.get('msg')}", "invalid_request_error")
    if kind == "extra_forbidden":
        return _error(400, f"unknown or unsupported field: {loc}", "invalid_request_error", loc or None)
    if kind == "model_attributes_type" and not loc:
        return _error(400, "the body must be a JSON object (Content-Type: application/json)", "invalid_request_error")
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    return _error(400, f"invalid request: {loc + ': ' if loc else ''}{msg}", "invalid_request_error", loc or None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException):
    """Errors raised before the app's own code (a body that cannot be read as JSON text, an unknown
    route, a wrong method), in the OpenAI shape too."""
    detail = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
    if e.status_code == 400 and "parsing the body" in detail:
        detail = "the body could not be read as JSON text (is it UTF-8?)"
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error(e.status_code, detail, kind, headers=getattr(e, "headers", None))


def _generation_request(body: _Common, **prompt) -> GenerationRequest:
    """The typed request the engine takes (400 for anything it refuses)."""
    try:
        return GenerationRequest(**prompt, max_tokens=body.max_completion_tokens or body.max_tokens,
                                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                 stop=body.stop_strings(), speculative=body.speculative, learn=body.learn,
                                 method=body.method,
                                 logprobs=body.logprobs_k(),
                                 ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                                 stop_token_ids=tuple(body.stop_token_ids or ()),
                                 skip_special_tokens=body.skip_special_tokens,
                                 include_stop_str_in_output=body.include_stop_str_in_output,
                                 grammar=body.grammar())
    except InvalidRequest as e:
        raise APIError(400, str(e)) from None


def _grpc_grammar(request) -> GrammarSpec | None:
    """The structured-output constraint of a gRPC GenerateRequest (fields json_schema, json_object,
    regex, choice).

    Raises:
        GrammarError: more than one is set, or the schema is not JSON text.
    """
    return GrammarSpec.at_most_one([
        ("json_schema", GrammarSpec.json_schema(request.json_schema, strict=request.strict)
         if request.json_schema else None),
        ("json_object", GrammarSpec("json_object") if request.json_object else None),
        ("regex", GrammarSpec("regex", request.regex) if request.regex else None),
        ("choice", GrammarSpec.choice(list(request.choice)) if request.choice else None)])


def _grpc_response(pb, text: str, chunk: GenerationChunk | None, token_ids=None, *, per_step: bool = True):
    c = chunk
    step = None
    if c is not None and per_step:
        step = pb.StepStats(tokens=len(c.token_ids), accepted=c.accepted, draft_nodes=c.draft_nodes,
                            bonus_chars=c.bonus_chars)
    return pb.GenerateResponse(
        text=text, token_ids=list(c.token_ids if token_ids is None else token_ids) if c else [],
        finish_reason=(c.finish_reason or "") if c else "", prompt_tokens=c.prompt_tokens if c else 0,
        completion_tokens=c.completion_tokens if c else 0,
        dart=pb.DartStats(tau=(c.tau or 0.0) if c else 0.0, steps=c.steps if c else 0,
                          draft_tokens=c.draft_tokens if c else 0, accepted_tokens=c.accepted_tokens if c else 0),
        step=step)


def _cause_message(e: BaseException) -> str:
    """The message of the exception a deployment raised (without Ray's remote traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        return _cause_message(cause)
    return str(e.args[0]) if e.args else str(e)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def _chat_logprobs(chunks: list[GenerationChunk]) -> dict | None:
    entries = [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
                "top_logprobs": [{"token": s, "logprob": q, "bytes": _bytes(s)} for _, s, q in t.top]}
               for c in chunks for t in (c.logprobs or ())]
    return {"content": entries, "refusal": None} if any(c.logprobs is not None for c in chunks) else None


def _completion_logprobs(chunks: list[GenerationChunk], offset: int) -> dict | None:
    if not any(c.logprobs is not None for c in chunks):
        return None
    toks = [t for c in chunks for t in (c.logprobs or ())]
    offsets = []
    for t in toks:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in toks], "token_logprobs": [t.logprob for t in toks],
            "top_logprobs": [{s: q for _, s, q in t.top} for t in toks], "text_offset": offsets}


def _choice(chat: bool, text: str, finish_reason, chunks: list[GenerationChunk], *, full: bool,
            offset: int = 0) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": _completion_logprobs(chunks, offset),
                "finish_reason": finish_reason}
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": _chat_logprobs(chunks)}
    if full:
        return choice | {"message": {"role": "assistant", "content": text}}
    return choice | {"delta": {"content": text} if text else {}}


def _usage(last: GenerationChunk | None) -> dict:
    """OpenAI's usage block, with the request's speculation totals under the ``dart`` extension
    field: τ (tokens per verification step, bonus included; None before any step), steps,
    draft_tokens (draft-tree nodes verified) and accepted_tokens (draft tokens accepted)."""
    prompt = last.prompt_tokens if last else 0
    completion = last.completion_tokens if last else 0
    tau = last.tau if last else None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "dart": {"tau": round(tau, 3) if tau is not None else None, "steps": last.steps if last else 0,
                     "draft_tokens": last.draft_tokens if last else 0,
                     "accepted_tokens": last.accepted_tokens if last else 0}}


def _step_stats(chunk: GenerationChunk) -> dict:
    """The ``dart`` extension field of a streamed chunk: this verification step's figures
    (see :class:`~dart_core.serve.request.GenerationChunk`); OpenAI clients ignore the field."""
    return {"tokens": len(chunk.token_ids), "accepted": chunk.accepted, "draft_nodes": chunk.draft_nodes,
            "bonus_chars": chunk.bonus_chars, "prefill": chunk.steps == 0}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@functools.cache
def compare_page() -> str:
    """The compare page's HTML (``deployments/static/compare.html``, shipped in the package;
    self-contained: its script and styles are inline, nothing is fetched from elsewhere)."""
    return resources.files("deployments").joinpath("static", "compare.html").read_text(encoding="utf-8")


def _bearer_is(authorization: str | None, key: str) -> bool:
    """Whether ``authorization`` (an HTTP header's or a gRPC metadata value, ``Bearer <key>``)
    carries ``key``, compared in constant time."""
    token = (authorization or "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(token.encode(), key.encode())


def _running_replicas(status, app_name: str, deployment: str) -> int:
    """Replicas of ``deployment`` in ``app_name`` that are RUNNING in a ``serve.status()`` snapshot."""
    app = status.applications.get(app_name)
    dep = app.deployments.get(deployment) if app is not None else None
    return int(dep.replica_states.get("RUNNING", 0)) if dep is not None else 0


# the route handlers below see module globals as they are when the class is decorated:
# every helper they use is defined above this line
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, config: dict) -> None:
        self.engine = engine
        self.cfg = AppConfig.model_validate(config)
        self.api_key = os.environ.get(self.cfg.api_key_env) or None
        self.admin_key = os.environ.get(self.cfg.admin_key_env) or None
        self.name = None
        self.methods: list[str] | None = None  # the drafters a request may name (asked of an engine once)
        self._engine_up, self._engine_checked = False, float("-inf")

    async def _model_name(self) -> str:
        if self.name is None:
            self.name = await self.engine.model_name.remote()
        return self.name

    async def _methods(self) -> list[str]:
        if self.methods is None:
            self.methods = list(await self.engine.methods.remote())
        return self.methods

    def _key_ok(self, authorization: str | None) -> bool:
        """Whether ``authorization`` carries the API key (:func:`_bearer_is`); True when no key is set
        (open access)."""
        return self.api_key is None or _bearer_is(authorization, self.api_key)

    def _check_key(self, authorization: str | None) -> None:
        if not self._key_ok(authorization):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error")

    def _check_admin(self, authorization: str | None) -> None:
        """The admin routes want the admin key (``admin_key_env``), never the API key: 403 while the
        app has none (the routes are off), 401 for a missing or wrong one (compared in constant time)."""
        if self.admin_key is None:
            raise APIError(403, f"the admin routes are off: set ${self.cfg.admin_key_env} where the application "
                                "runs", "permission_error")
        if not _bearer_is(authorization, self.admin_key):
            raise APIError(401, "missing or wrong admin key (Authorization: Bearer <admin key>)",
                           "authentication_error")

    @staticmethod
    def _admin_answer(out: dict) -> dict:
        if "error" in out:
            raise APIError(out["error"]["status"], out["error"]["message"])
        return out

    # -- HTTP -----------------------------------------------------------------------

    @app.get("/health")
    async def health(self):
        """200 while at least one engine replica is RUNNING (Serve's own view, refreshed at most
        once a second), else 503 with Retry-After: a load balancer sends nothing to an app whose
        engine is still loading.  It does not queue a request behind generations, so a busy
        engine stays healthy."""
        now = time.monotonic()
        if now - self._engine_checked > 1.0:
            try:
                status = await asyncio.to_thread(serve.status)
                self._engine_up = _running_replicas(status, serve.get_replica_context().app_name,
                                                    DartEngineDeployment.name) > 0
            except Exception:
                logger.exception("serve.status() failed")
                self._engine_up = False
            self._engine_checked = now
        if not self._engine_up:
            return JSONResponse({"status": "unavailable",
                                 "detail": f"no {DartEngineDeployment.name} replica is running yet"},
                                status_code=503, headers={"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/", include_in_schema=False)
    @app.get("/compare", include_in_schema=False)
    async def compare(self):
        """The compare page: one prompt decoded with DART and autoregressively, side by side
        (it calls this server's ``/v1/chat/completions``, with the API key the user types)."""
        return HTMLResponse(compare_page())

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._check_key(request.headers.get("authorization"))
        # "methods" (a dart-serve extension): what a request's "method" may name on this deployment
        return {"object": "list", "data": [{"id": await self._model_name(), "object": "model",
                                            "created": 0, "owned_by": "dart-serve",
                                            "methods": await self._methods()}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_key(request.headers.get("authorization"))
        messages = tuple(ChatMessage(m.role, m.text()) for m in body.messages)
        return await self._complete(body, _generation_request(body, messages=messages), chat=True, request=request)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_key(request.headers.get("authorization"))
        return await self._complete(body, _generation_request(body, **body.prompt_fields()), chat=False,
                                    request=request)

    @app.post("/admin/corpus")
    async def admin_corpus(self, body: AdminCorpusRequest, request: Request):
        """Adds documents (texts, encoded with the model's tokenizer) and token-id documents to the
        n-gram service's live corpus, as if the traffic had generated them (docs/ngram.md, "Admin
        routes").  200 ``{"documents", "tokens_added", "tokens_held"}``; 400 a token id outside the
        vocabulary, 409 no live corpus (``ngram.learn: false``) or no n-gram service, 401/403 the
        admin key."""
        self._check_admin(request.headers.get("authorization"))
        return self._admin_answer(await self.engine.add_corpus.remote(body.documents, body.token_ids))

    @app.post("/admin/trie")
    async def admin_trie(self, body: AdminTrieRequest, request: Request):
        """The n-gram service serves the trie file at ``path`` (on its node) from now on; searches
        already running finish on the old one.  200 the new trie's ``{"trie", "order", "num_nodes",
        "tokenizer"}``; 400 no such file, not a sound trie, or a trie of another tokenizer (the old
        one is served on); 409 no n-gram service; 401/403 the admin key."""
        self._check_admin(request.headers.get("authorization"))
        return self._admin_answer(await self.engine.swap_trie.remote(body.path))

    async def _start(self, gen: GenerationRequest):
        """Sends the request to the engine; returns (stream, first list of chunks).  The engine
        streams lists of chunks (:meth:`DartEngineDeployment.generate`) and validates before its
        first list, so errors surface here, before any response is committed."""
        stream = self.engine.generate.options(stream=True).remote(gen)
        try:
            return stream, await stream.__anext__()
        except InvalidRequest as e:
            raise APIError(400, _cause_message(e)) from None
        except BackPressureError:
            raise APIError(503, "the server is at capacity; retry shortly", "server_busy",
                           headers={"Retry-After": "1"}) from None

    async def _complete(self, body: _Common, gen: GenerationRequest, *, chat: bool, request: Request):
        name = await self._model_name()
        if body.model != name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", type_="not_found_error")
        stream, first = await self._start(gen)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            opts = body.stream_options
            usage = opts is not None and opts.include_usage
            every = opts is not None and opts.continuous_usage_stats
            return StreamingResponse(self._sse(stream, first, rid, created, name, chat, usage, request, every),
                                     media_type="text/event-stream")
        chunks = list(first)
        async for batch in stream:
            chunks += batch
        text = "".join(c.text for c in chunks)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": name, "choices": [_choice(chat, text, chunks[-1].finish_reason, chunks, full=True)],
                "usage": _usage(chunks[-1])}

    async def _sse(self, stream, first: list[GenerationChunk], rid, created, name, chat, usage: bool,
                   request: Request, every_chunk_usage: bool = False):
        """The SSE events of a streamed completion: one event per engine chunk (one decoding step),
        the events of one list of chunks written together."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": created, "model": name}
        try:
            if chat:  # the first chunk carries the role, as OpenAI's does
                yield _sse(head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            last, offset = None, 0
            batch = first
            while batch is not None:
                if await request.is_disconnected():
                    stream.cancel()
                    return
                events = []
                for chunk in batch:
                    last = chunk
                    body = head | {"choices": [_choice(chat, chunk.text, chunk.finish_reason, [chunk], full=False,
                                                       offset=offset)], "dart": _step_stats(chunk)}
                    if every_chunk_usage:  # vLLM's continuous_usage_stats: the counts so far on every chunk
                        body["usage"] = _usage(chunk)
                    events.append(_sse(body))
                    offset += len(chunk.text)
                yield "".join(events)
                batch = await anext(stream, None)
            if usage:
                yield _sse(head | {"choices": [], "usage": _usage(last)})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in the stream
            logger.exception("stream failed")
            yield _sse({"error": {"message": _cause_message(e), "type": "server_error", "param": None,
                                  "code": 500}})

    # -- gRPC (Serve's gRPC proxy routes by method name) --------------------------------

    async def _grpc_stream(self, request, context):  # context: RayServegRPCContext
        """The chunks of one gRPC request.  With an API key set, the call's ``authorization``
        metadata must carry it (``Bearer <key>``, as HTTP's header): otherwise UNAUTHENTICATED,
        before the request is read or anything is queued.  Serve's own gRPC health method stays
        open (the proxy answers it without calling the application)."""
        import grpc

        if self.api_key is not None:
            metadata = dict(context.invocation_metadata() or ()) if context is not None else {}
            if not self._key_ok(metadata.get("authorization")):
                message = "missing or wrong API key (metadata authorization: Bearer <key>)"
                if context is not None:
                    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
                    context.set_details(message)
                raise PermissionError(message)  # a plain exception the proxy can unpickle
        try:
            messages = tuple(ChatMessage(m.role, m.content) for m in request.messages) or None
            gen = GenerationRequest(
                prompt=request.prompt if request.prompt or messages is None else None, messages=messages,
                max_tokens=request.max_tokens or None, temperature=request.temperature, top_p=request.top_p or 1.0,
                top_k=request.top_k, seed=request.seed if request.HasField("seed") else None,
                stop=tuple(request.stop),
                speculative=request.speculative if request.HasField("speculative") else True,
                learn=request.learn if request.HasField("learn") else True,
                method=request.method if request.HasField("method") else None,
                ignore_eos=request.ignore_eos, stop_token_ids=tuple(request.stop_token_ids),
                skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
                include_stop_str_in_output=request.include_stop_str_in_output, min_tokens=request.min_tokens,
                grammar=_grpc_grammar(request))
            stream, first = await self._start(gen)
        except (InvalidRequest, APIError, GrammarError) as e:  # the code set on the context is what the client gets
            busy = isinstance(e, APIError) and e.status == 503
            message = e.message if isinstance(e, APIError) else str(e)
            if isinstance(e, GrammarError):
                message = f"invalid structured-output constraint: {message}"
            if context is not None:
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED if busy else grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(message)
            raise InvalidRequest(message) from None  # a plain exception the proxy can unpickle
        for chunk in first:
            yield chunk
        async for batch in stream:
            for chunk in batch:
                yield chunk

    async def _grpc_admin(self, context, call):
        """An admin gRPC call: the admin key from the ``authorization`` metadata, then ``call()`` (an
        awaitable of the engine's answer); refusals as status codes (PERMISSION_DENIED: admin off,
        UNAUTHENTICATED, INVALID_ARGUMENT, FAILED_PRECONDITION)."""
        import grpc

        metadata = dict(context.invocation_metadata() or ()) if context is not None else {}
        try:
            self._check_admin(metadata.get("authorization"))
            return self._admin_answer(await call())
        except APIError as e:
            code = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED,
                    409: grpc.StatusCode.FAILED_PRECONDITION}.get(e.status, grpc.StatusCode.INVALID_ARGUMENT)
            if context is not None:
                context.set_code(code)
                context.set_details(e.message)
            raise InvalidRequest(e.message) from None  # a plain exception the proxy can unpickle

    async def AddCorpus(self, request, grpc_context=None):  # noqa: N802 - the gRPC method name
        from deployments._proto import dart_pb2

        lengths, ids = list(request.token_lengths), list(request.token_ids)

        async def call():
            if any(n < 0 for n in lengths) or sum(lengths) != len(ids):
                raise APIError(400, f"token_lengths sum to {sum(lengths)} but token_ids has {len(ids)} values")
            ends = itertools.accumulate(lengths)
            docs = [ids[e - n:e] for e, n in zip(ends, lengths)]
            try:
                body = AdminCorpusRequest(documents=list(request.documents), token_ids=docs)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            return await self.engine.add_corpus.remote(body.documents, body.token_ids)

        out = await self._grpc_admin(grpc_context, call)
        return dart_pb2.AddCorpusResponse(**out)

    async def SwapTrie(self, request, grpc_context=None):  # noqa: N802 - the gRPC method name
        from deployments._proto import dart_pb2

        async def call():
            if not request.path:
                raise APIError(400, "path is required")
            return await self.engine.swap_trie.remote(request.path)

        out = await self._grpc_admin(grpc_context, call)
        return dart_pb2.SwapTrieResponse(**out)

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802 - the gRPC method name
        from deployments._proto import dart_pb2

        async for chunk in self._grpc_stream(request, grpc_context):
            yield _grpc_response(dart_pb2, chunk.text, chunk)

    async def Generate(self, request, grpc_context=None):  # noqa: N802 - the gRPC method name
        from deployments._proto import dart_pb2

        text, ids, last = "", [], None
        async for chunk in self._grpc_stream(request, grpc_context):
            text += chunk.text
            ids += chunk.token_ids
            last = chunk
        return _grpc_response(dart_pb2, text, last, token_ids=ids, per_step=False)
