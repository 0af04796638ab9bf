"""HTTP (OpenAI-compatible, FastAPI) and gRPC (``protos/dart.proto``) ingress.

HTTP: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming
ending with ``data: [DONE]``, or one JSON body), ``GET /v1/models``,
``GET /health``.  Request and response shapes follow the OpenAI API so the
official ``openai`` client works unchanged; ``usage`` carries the token counts
and a ``dart`` field (τ, steps).  Errors use the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``: malformed JSON or invalid
parameters → 400, unknown model → 404, missing/wrong API key → 401, a full
queue → 503 with ``Retry-After``.  A client that disconnects cancels its
generation (the engine drops the sequence at its next step).

gRPC: Serve's gRPC proxy calls :meth:`OpenAIIngress.Generate` and
:meth:`OpenAIIngress.GenerateStream` by method name; invalid input →
``INVALID_ARGUMENT``, a full queue → ``RESOURCE_EXHAUSTED``.
"""


import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.config import AppConfig
from deployments.engine import DartEngineDeployment, InvalidRequest

logger = logging.getLogger("ray.serve")

app = FastAPI(title="dart-serve", description="DART speculative decoding, OpenAI-compatible")


# -- OpenAI request schemas ---------------------------------------------------------


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] = Field(description="text, or OpenAI content parts of type text")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="the served model name (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (newer clients)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy: exactly the target's greedy output")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off (an extension of the OpenAI API, as in vLLM)")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings, not included in the text")
    stream: bool = False
    n: int = Field(1, ge=1, le=1, description="only n = 1 is supported")
    speculative: bool = Field(True, description="dart-serve extension: false decodes this request without "
                                                "speculation (A/B comparisons); while it runs, its batch "
                                                "steps autoregressively")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Common):
    prompt: str


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


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if first.get("type") == "json_invalid":
        return _error(400, f"malformed JSON body: {first.get('msg')}", "invalid_request_error")
    return _error(400, f"invalid request: {loc}: {first.get('msg')}", "invalid_request_error", loc or None)


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def _grpc_response(pb, text: str, item: dict, prompt_tokens: int):
    return pb.GenerateResponse(text=text, token_ids=item.get("token_ids", []),
                               finish_reason=item.get("finish_reason") or "", prompt_tokens=prompt_tokens,
                               completion_tokens=item.get("completion_tokens", 0),
                               dart=pb.DartStats(tau=item.get("tau", 0.0), steps=item.get("steps", 0)))


def _cause_message(e: BaseException) -> str:
    """The message of the exception a deployment raised (without Ray's remote traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        return _cause_message(cause)
    return str(e.args[0]) if e.args else str(e)


def _choice(chat: bool, text: str, finish_reason, *, full: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if full:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}


def _usage(prompt_tokens: int, last: dict) -> dict:
    completion = last.get("completion_tokens", 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "dart": {"tau": last.get("tau", 0.0), "steps": last.get("steps", 0)}}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


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
        self.name = None
        self._engine_up, self._engine_checked = False, float("-inf")

    async def _model_name(self) -> str:
        if self.name is None:
            self.name = await self.engine.model_name.remote()
        return self.name

    def _check_key(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        token = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error")

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

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._check_key(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": await self._model_name(), "object": "model",
                                            "created": 0, "owned_by": "dart-serve"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_key(request.headers.get("authorization"))
        messages = [{"role": m.role, "content": _text_of(m.content)} for m in body.messages]
        return await self._complete(body, {"messages": messages}, chat=True, request=request)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_key(request.headers.get("authorization"))
        return await self._complete(body, {"prompt": body.prompt}, chat=False, request=request)

    async def _complete(self, body: _Common, payload: dict, *, chat: bool, request: Request):
        name = await self._model_name()
        if body.model != name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", type_="not_found_error")
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop strings", param="stop")
        payload |= {"max_tokens": body.max_completion_tokens or body.max_tokens, "temperature": body.temperature,
                    "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed, "stop": stop,
                    "speculative": body.speculative}
        stream = self.engine.generate.options(stream=True).remote(payload)
        try:
            head = await stream.__anext__()  # validation happens before the first item
        except InvalidRequest as e:
            raise APIError(400, _cause_message(e)) from None
        except BackPressureError:
            raise APIError(503, "the server is at capacity; retry shortly", "server_busy",
                           headers={"Retry-After": "1"}) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        prompt_tokens = head["prompt_tokens"]
        if body.stream:
            return StreamingResponse(self._sse(stream, rid, created, name, chat, prompt_tokens, request),
                                     media_type="text/event-stream")
        text, last = "", {}
        async for item in stream:
            text += item["text"]
            last = item
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": name, "choices": [_choice(chat, text, last.get("finish_reason"), full=True)],
                "usage": _usage(prompt_tokens, last)}

    async def _sse(self, stream, rid, created, name, chat, prompt_tokens, request: Request):
        kind = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:  # the first chunk carries the role, as OpenAI's does
                yield _sse({"id": rid, "object": kind, "created": created, "model": name,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
            last = {}
            async for item in stream:
                last = item
                if await request.is_disconnected():
                    stream.cancel()
                    return
                yield _sse({"id": rid, "object": kind, "created": created, "model": name,
                            "choices": [_choice(chat, item["text"], item["finish_reason"], full=False)]})
            yield _sse({"id": rid, "object": kind, "created": created, "model": name, "choices": [],
                        "usage": _usage(prompt_tokens, last)})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in the stream
            logger.exception("stream failed")
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})

    # -- gRPC (Serve's gRPC proxy routes by method name) --------------------------------

    async def _grpc_stream(self, request, context):  # context: RayServegRPCContext
        import grpc

        payload = {"max_tokens": request.max_tokens or None, "temperature": request.temperature,
                   "top_p": request.top_p or 1.0, "top_k": request.top_k,
                   "seed": request.seed if request.HasField("seed") else None, "stop": list(request.stop),
                   "speculative": request.speculative if request.HasField("speculative") else True}
        if request.messages:
            payload["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        else:
            payload["prompt"] = request.prompt
        stream = self.engine.generate.options(stream=True).remote(payload)
        try:
            head = await stream.__anext__()
        except InvalidRequest as e:  # the code set on the context is what the client gets
            if context is not None:
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(_cause_message(e))
            raise
        except BackPressureError:
            if context is not None:
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                context.set_details("the server is at capacity; retry shortly")
            raise
        yield {"prompt_tokens": head["prompt_tokens"]}
        async for item in stream:
            yield item

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802 - the gRPC method name
        from deployments._proto import dart_pb2

        prompt_tokens = 0
        async for item in self._grpc_stream(request, grpc_context):
            if "prompt_tokens" in item:
                prompt_tokens = item["prompt_tokens"]
                continue
            yield _grpc_response(dart_pb2, item["text"], item, prompt_tokens)

    async def Generate(self, request, grpc_context=None):  # noqa: N802 - the gRPC method name
        from deployments._proto import dart_pb2

        text, ids, last, prompt_tokens = "", [], {}, 0
        async for item in self._grpc_stream(request, grpc_context):
            if "prompt_tokens" in item:
                prompt_tokens = item["prompt_tokens"]
                continue
            text += item["text"]
            ids += item["token_ids"]
            last = item
        resp = _grpc_response(dart_pb2, text, last, prompt_tokens)
        del resp.token_ids[:]
        resp.token_ids.extend(ids)
        return resp
