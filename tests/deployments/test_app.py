"""End to end through Ray Serve on a local cluster: the official ``openai``
client (streamed and not), gRPC through Serve's gRPC proxy, every documented
bad input with its status code, continuous batching under concurrent streams,
client disconnects, and an n-gram replica killed mid-traffic.

The target is a tiny random Llama with the real SmolLM2 tokenizer and chat
template (fast on 2 cores) and a random head; at temperature 0 the served
text must equal transformers' greedy output for the same chat prompt.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import grpc
import httpx
import pytest
import ray
from ray import serve

from .conftest import ADMIN_KEY, GUARDED_KEY, HTTP, NAME, client

pytestmark = pytest.mark.slow


def test_models_and_health(app):
    assert httpx.get(f"{HTTP}/health").json() == {"status": "ok"}
    assert [m.id for m in client().models.list().data] == [NAME]
    # a dart-serve extension: the drafters a request's "method" may name here
    assert httpx.get(f"{HTTP}/v1/models").json()["data"][0]["methods"] == ["dart", "none"]


def test_health_follows_the_engine_replicas():
    """/health is 503 until an engine replica is RUNNING (Serve's status), whatever else runs."""
    from types import SimpleNamespace as NS

    from deployments.engine import DartEngineDeployment
    from deployments.ingress import _running_replicas

    ENGINE_DEPLOYMENT = DartEngineDeployment.name

    def snapshot(engine_states):
        deps = {"OpenAIIngress": NS(replica_states={"RUNNING": 1}), "NgramService": NS(replica_states={"RUNNING": 1})}
        if engine_states is not None:
            deps[ENGINE_DEPLOYMENT] = NS(replica_states=engine_states)
        return NS(applications={"dart": NS(deployments=deps)})

    assert _running_replicas(snapshot({"STARTING": 1}), "dart", ENGINE_DEPLOYMENT) == 0
    assert _running_replicas(snapshot(None), "dart", ENGINE_DEPLOYMENT) == 0
    assert _running_replicas(snapshot({"RUNNING": 2, "STARTING": 1}), "dart", ENGINE_DEPLOYMENT) == 2
    assert _running_replicas(snapshot({"RUNNING": 1}), "other-app", ENGINE_DEPLOYMENT) == 0


def test_openai_chat_streamed_and_not_equals_greedy(app, reference):
    msgs = [{"role": "user", "content": "Write a haiku about caches."}]
    want = reference(msgs, 24)
    out = client().chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0)
    assert out.choices[0].message.content == want
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens > 5
    assert out.usage.model_extra["dart"]["steps"] >= 1
    chunks = list(client().chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_and_stop_strings(app, tiny_model_dir):
    c = client()
    full = c.completions.create(model=NAME, prompt="def fib(n):", max_tokens=16, temperature=0).choices[0].text
    assert len(full) > 0
    cut = full[3:5]
    stopped = c.completions.create(model=NAME, prompt="def fib(n):", max_tokens=16, temperature=0, stop=[cut])
    assert stopped.choices[0].text == full[: full.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "malformed JSON"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "messages": []}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 65}, 400, "limit of 64"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": NAME, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "context"),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(app, body, status, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{HTTP}/v1/chat/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and err["code"] == status
    ok = client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, status, needle", [
    ({"presence_penalty": 0.5}, 400, "presence_penalty is not supported"),
    ({"logit_bias": {"42": 5}}, 400, "logit_bias is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools is not supported"),
    ({"response_format": {"type": "grammar", "grammar": "x"}}, 400, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, 400, "json_schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strang"}}}},
     400, "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     400, "response_format.json_schema.name"),
    ({"guided_regex": "(unclosed"}, 400, "does not compile"),
    ({"guided_json": "{not json"}, 400, "invalid structured-output constraint"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, 400, "at most one of"),
    ({"response_format": {"type": "text"}}, 200, ""),
    ({"top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ({"repetition_penalty": 1.2}, 400, "repetition_penalty is not supported"),
    ({"min_tokens": 2, "stop": ["x"]}, 400, "not supported together with stop strings"),
    ({"presence_penalty": 0, "frequency_penalty": 0.0, "user": "u1", "logit_bias": {}, "store": False}, 200, ""),
    ({"repetition_penalty": 1.0, "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": True,
      "stop_token_ids": [], "include_stop_str_in_output": False}, 200, ""),
    ({"method": "eagle3"}, 400, "method eagle3 is not loaded by this deployment (loaded: dart, none)"),
    ({"method": "medusa"}, 400, "method must be one of dart, eagle3, none"),
    ({"method": "dart"}, 200, ""),
    ({"method": "none"}, 200, ""),
])
def test_openai_fields_work_or_are_refused(app, extra, status, needle):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | extra
    r = httpx.post(f"{HTTP}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    if status != 200:
        assert needle in r.json()["error"]["message"] and r.json()["error"]["code"] == status


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    """POSTs ``body`` as JSON with non-ASCII text escaped (httpx's ``json=`` sends UTF-8, which cannot
    carry a lone surrogate; a JSON escape can, as any client may send)."""
    return httpx.post(url, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize("route, extra, status, needle", [
    # explicit nulls of optional fields read as "not set"
    ("chat", {"temperature": None, "top_p": None, "n": None, "stream": None, "seed": None, "stop": None,
              "presence_penalty": None, "logprobs": None, "top_logprobs": None, "response_format": None,
              "messages": [{"role": "user", "content": "hi", "name": None}]}, 200, ""),
    # types are strict: no coercion
    ("chat", {"temperature": "0.5"}, 400, "temperature: Input should be a valid number"),
    ("chat", {"stream": 1}, 400, "stream"),
    ("chat", {"max_tokens": 2.0}, 400, "max_tokens"),
    ("chat", {"speculative": "false"}, 400, "speculative"),
    ("chat", {"learn": "false"}, 400, "learn"),
    ("chat", {"stop": 5}, 400, "stop: must be a string or a list of strings"),
    # integers outside their range
    ("chat", {"seed": 2 ** 70}, 400, "seed"),
    ("chat", {"seed": -(2 ** 64)}, 400, "seed"),
    ("chat", {"max_tokens": 10 ** 30}, 400, "limit"),
    ("chat", {"top_k": -1}, 400, "top_k"),
    ("chat", {"ignore_eos": True, "min_tokens": 10 ** 6}, 400, "min_tokens"),
    # every prompt form of /v1/completions
    ("completions", {"prompt": [1, 2, 3]}, 200, ""),
    ("completions", {"prompt": [[1, 2, 3]]}, 200, ""),
    ("completions", {"prompt": ["one string"]}, 200, ""),
    ("completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("completions", {"prompt": [[1], [2]]}, 400, "one prompt per request"),
    ("completions", {"prompt": []}, 400, "empty"),
    ("completions", {"prompt": 5}, 400, "prompt: must be text"),
    ("completions", {"prompt": [10 ** 9]}, 400, "outside the vocabulary"),
    ("completions", {"prompt": [-1]}, 400, "token ids must be integers >= 0"),
    # text that is not valid Unicode: a lone half of a UTF-16 surrogate pair, escaped in the JSON
    ("completions", {"prompt": "abc \ud800 def"}, 400, "prompt holds a lone UTF-16 surrogate (U+D800 at character 4)"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400,
     "messages.0.content.0.text holds a lone UTF-16 surrogate"),
    ("chat", {"stop": ["ok", "\ud83d"]}, 400, "stop.1 holds a lone UTF-16 surrogate"),
    ("completions", {"prompt": "a pair is fine: \U0001f600"}, 200, ""),
    # a schema no value satisfies (it only refers to itself): refused, not answered with an empty text
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}},
     400, "admits no output"),
    # role-specific required fields
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
    ("chat", {"messages": [{"role": "user"}]}, 400, "content"),
    ("chat", {"messages": [{"role": "assistant", "content": None}]}, 400, "content"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
     "unknown or unsupported field: messages.1.assistant.tool_calls"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "only text parts"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                           {"role": "assistant", "content": "hello"},
                           {"role": "tool", "content": "42", "tool_call_id": "c1"},
                           {"role": "user", "content": "and?"}]}, 200, ""),
])
def test_requests_follow_openais_rules(app, route, extra, status, needle):
    body = (CHAT if route == "chat" else {"model": NAME, "max_tokens": 2}) | extra
    r = _post(f"{HTTP}/v1/{'chat/completions' if route == 'chat' else 'completions'}", body)
    assert r.status_code == status, r.text
    if status != 200:
        assert needle in r.json()["error"]["message"], r.text


def test_no_malformed_body_gets_a_5xx(app):
    """Every field of a chat and a completions request replaced by values of the wrong type or out of
    range: each answer is a 200 or a 4xx in the OpenAI error shape."""
    odd = [None, "x", -1, 2 ** 70, -(2 ** 70), 1.5, float("1e308"), [], {}, True, [None], {"a": None}, "\ud800"]
    chat = CHAT | {"temperature": 0, "seed": 1, "stop": ["x"], "stream": False, "logprobs": True, "top_logprobs": 1,
                   "top_k": 5, "top_p": 0.9, "response_format": {"type": "json_object"}, "ignore_eos": False,
                   "stream_options": None, "guided_choice": None}
    completion = {"model": NAME, "prompt": "hi", "max_tokens": 2, "logprobs": 1, "stop_token_ids": [1]}
    for route, body in (("chat/completions", chat), ("completions", completion)):
        for field in body:
            for value in odd:
                r = _post(f"{HTTP}/v1/{route}", body | {field: value})
                assert r.status_code < 500, (route, field, value, r.text)
                if r.status_code != 200:
                    assert r.json()["error"]["code"] == r.status_code


def test_errors_before_the_apps_own_validation_are_openai_shaped(app):
    for r, status in ((httpx.post(f"{HTTP}/v1/chat/completions", content=b'{"model": "\xff\xfe"}',
                                  headers={"content-type": "application/json"}), 400),
                      (httpx.post(f"{HTTP}/v1/chat/completions", content=b"\xff\xfe\x00",
                                  headers={"content-type": "application/json"}), 400),
                      (httpx.post(f"{HTTP}/v1/chat/completions", content=b"[1, 2]",
                                  headers={"content-type": "application/json"}), 400),
                      (httpx.get(f"{HTTP}/v1/nothing-here"), 404),
                      (httpx.get(f"{HTTP}/v1/chat/completions"), 405)):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == status and err["message"] and err["type"]


def test_logprobs_chat_and_completions(app):
    c = client()
    msgs = [{"role": "user", "content": "Name a colour."}]
    out = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
    streamed = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                              logprobs=True, stream=True))
    tokens = [e.token for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]
    plain = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None
    comp = c.completions.create(model=NAME, prompt="def fib(n):", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == comp.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)


def test_usage_chunk_only_when_asked_for(app):
    msgs = [{"role": "user", "content": "hi"}]
    without = list(client().chat.completions.create(model=NAME, messages=msgs, max_tokens=3, stream=True))
    assert all(ch.usage is None for ch in without)
    with_usage = list(client().chat.completions.create(model=NAME, messages=msgs, max_tokens=3, stream=True,
                                                       stream_options={"include_usage": True}))
    assert with_usage[-1].usage.completion_tokens == 3 and not with_usage[-1].choices


def test_what_load_generators_send_is_served(app):
    """guidellm's requests (vLLM's ignore_eos and continuous usage statistics): every chunk carries
    the usage so far, and the output runs to max_tokens.

    The body is the one guidellm 0.8.1 builds for a chat request with a fixed output length
    (``guidellm/backends/openai/request_handlers.py``).  guidellm itself is not run by the suite: it
    needs datasets, sanic and an unpinned torch, more than the test environment should carry; a
    guidellm run against ``serve run deployments/dart.yaml`` is in BENCHMARKS.md instead."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "stop": None, "ignore_eos": True, "tool_choice": "none",
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = []
    with httpx.stream("POST", f"{HTTP}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    content = [c for c in chunks if c["choices"] and "dart" in c]
    assert content and all("usage" in c for c in content)
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1]["usage"]["completion_tokens"] == 5


def test_per_step_figures_in_the_stream_and_totals_in_usage(app):
    """The ``dart`` extension field of each streamed chunk (HTTP and gRPC) and the usage block's
    totals: the official client parses every chunk, the steps add up to the totals, and a request
    with speculation off drafts nothing."""
    from deployments._proto import dart_pb2, dart_pb2_grpc

    msgs = [{"role": "user", "content": "List the planets."}]
    n = 20
    for speculative in (True, False):
        chunks = list(client().chat.completions.create(
            model=NAME, messages=msgs, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"speculative": speculative}))
        steps = [c.model_extra["dart"] for c in chunks if c.choices and "dart" in c.model_extra]
        texts = [c.choices[0].delta.content or "" for c in chunks if c.choices and "dart" in c.model_extra]
        usage = chunks[-1].usage
        dart = usage.model_extra["dart"]
        assert len(steps) == len([c for c in chunks if c.choices]) - 1  # all but the role chunk
        assert steps[0]["prefill"] and steps[0]["tokens"] == 1 and not any(s["prefill"] for s in steps[1:])
        assert sum(s["tokens"] for s in steps) == usage.completion_tokens == n
        assert dart["steps"] == len(steps) - 1 and dart["tau"] == round((n - 1) / dart["steps"], 3)
        assert dart["accepted_tokens"] == sum(s["accepted"] for s in steps)
        assert dart["draft_tokens"] == sum(s["draft_nodes"] for s in steps)
        assert all(0 <= s["bonus_chars"] <= len(t) for s, t in zip(steps, texts))
        if speculative:  # budget 8: trees were drafted and each full step closed with a bonus token
            assert dart["draft_tokens"] > 0 and sum(s["bonus_chars"] > 0 for s in steps) >= 1
        else:
            assert dart["draft_tokens"] == dart["accepted_tokens"] == 0 and dart["tau"] == 1.0
            assert all(s["bonus_chars"] == 0 and s["draft_nodes"] == 0 for s in steps)
    whole = client().chat.completions.create(model=NAME, messages=msgs, max_tokens=n, temperature=0).usage
    totals = whole.model_extra["dart"]
    assert set(totals) == {"tau", "steps", "draft_tokens", "accepted_tokens"} and totals["draft_tokens"] > 0
    assert totals["tau"] == round((n - 1) / totals["steps"], 3) and totals["accepted_tokens"] <= n - 1
    with grpc.insecure_channel("127.0.0.1:9000") as channel:
        stub = dart_pb2_grpc.DartGenerationStub(channel)
        meta = (("application", "dart"),)
        req = dart_pb2.GenerateRequest(messages=[dart_pb2.ChatMessage(**m) for m in msgs], max_tokens=n)
        parts = list(stub.GenerateStream(req, metadata=meta, timeout=60))
        assert all(p.HasField("step") for p in parts)
        assert sum(p.step.tokens for p in parts) == n and parts[0].step.tokens == 1 and parts[0].step.accepted == 0
        assert parts[-1].dart.accepted_tokens == sum(p.step.accepted for p in parts)
        assert parts[-1].dart.draft_tokens == sum(p.step.draft_nodes for p in parts) > 0
        one = stub.Generate(req, metadata=meta, timeout=60)
        assert not one.HasField("step") and one.dart.steps >= 1 and one.completion_tokens == n
        assert one.dart.draft_tokens > 0 and one.dart.accepted_tokens <= n - 1


def test_grpc_generate_and_stream(app, reference):
    from deployments._proto import dart_pb2, dart_pb2_grpc

    msgs = [{"role": "user", "content": "Name three colours."}]
    want = reference(msgs, 12)
    with grpc.insecure_channel("127.0.0.1:9000") as channel:
        stub = dart_pb2_grpc.DartGenerationStub(channel)
        meta = (("application", "dart"),)
        req = dart_pb2.GenerateRequest(messages=[dart_pb2.ChatMessage(**m) for m in msgs], max_tokens=12)
        resp = stub.Generate(req, metadata=meta, timeout=60)
        assert resp.text == want and resp.finish_reason == "length" and resp.completion_tokens == 12
        parts = list(stub.GenerateStream(req, metadata=meta, timeout=60))
        assert "".join(p.text for p in parts) == want and parts[-1].finish_reason == "length"
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(dart_pb2.GenerateRequest(prompt="hi", max_tokens=1000), metadata=meta, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in e.value.details()
        both = dart_pb2.GenerateRequest(prompt="hi", messages=[dart_pb2.ChatMessage(role="user", content="hi")])
        with pytest.raises(grpc.RpcError) as e:  # the proto says: exactly one of them
            stub.Generate(both, metadata=meta, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly one" in e.value.details()
        # vLLM's extensions, as over HTTP
        fixed = stub.Generate(dart_pb2.GenerateRequest(prompt="hi", max_tokens=4, ignore_eos=True, min_tokens=4),
                              metadata=meta, timeout=60)
        assert fixed.completion_tokens == 4 and fixed.finish_reason == "length"
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(dart_pb2.GenerateRequest(prompt="hi", max_tokens=4, min_tokens=2, stop=["x"]), metadata=meta,
                          timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in e.value.details()
        # the drafter per request: "none" decodes without speculation; a head the deployment lacks is refused
        plain = stub.Generate(dart_pb2.GenerateRequest(messages=req.messages, max_tokens=12, method="none"),
                              metadata=meta, timeout=60)
        assert plain.text == want and plain.dart.draft_tokens == 0  # no tree verified
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(dart_pb2.GenerateRequest(prompt="hi", max_tokens=2, method="eagle3"), metadata=meta,
                          timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not loaded" in e.value.details()


STRUCTURED = {"type": "object", "additionalProperties": False, "required": ["colour", "count"],
              "properties": {"colour": {"enum": ["red", "green", "blue"]},
                             "count": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_structured_output_is_valid_lossless_and_shares_the_batch(app, reference):
    """response_format json_schema through the openai client: the text validates, DART's equals the
    request without speculation, and unconstrained requests running beside it keep their text."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": STRUCTURED, "strict": True}}
    msgs = [{"role": "user", "content": "Pick a colour."}]
    free_msgs = [{"role": "user", "content": "Count to 5 in words."}]
    want_free = reference(free_msgs, 20)

    def constrained(speculative: bool) -> str:
        r = client().chat.completions.create(model=NAME, messages=msgs, max_tokens=64, temperature=0,
                                             response_format=fmt, extra_body={"speculative": speculative})
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    def free(_) -> str:
        r = client().chat.completions.create(model=NAME, messages=free_msgs, max_tokens=20, temperature=0)
        return r.choices[0].message.content

    with cf.ThreadPoolExecutor(4) as pool:
        frees = pool.map(free, range(3))
        dart = constrained(True)
        assert list(frees) == [want_free] * 3
    jsonschema.validate(json.loads(dart), STRUCTURED)
    assert dart == constrained(False)
    obj = client().chat.completions.create(model=NAME, messages=msgs, max_tokens=64, temperature=0.8,
                                          response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)
    r = httpx.post(f"{HTTP}/v1/completions", json={"model": NAME, "prompt": "Answer:", "max_tokens": 8,
                                                     "guided_choice": ["yes", "no"]}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    too_big = {"type": "json_schema", "json_schema": {"name": "big", "schema": {"enum": ["x" * 1000] * 70}}}
    r = httpx.post(f"{HTTP}/v1/chat/completions", json={"model": NAME, "messages": msgs,
                                                         "response_format": too_big}, timeout=60)
    assert r.status_code == 400 and "at most 65536" in r.json()["error"]["message"]


def test_grpc_structured_output(app):
    from deployments._proto import dart_pb2, dart_pb2_grpc

    with grpc.insecure_channel("127.0.0.1:9000") as channel:
        stub = dart_pb2_grpc.DartGenerationStub(channel)
        meta = (("application", "dart"),)
        resp = stub.Generate(dart_pb2.GenerateRequest(prompt="JSON:", max_tokens=64, json_schema=json.dumps(STRUCTURED)),
                             metadata=meta, timeout=60)
        assert resp.finish_reason == "stop" and set(json.loads(resp.text)) == {"colour", "count"}
        for bad, needle in ((dart_pb2.GenerateRequest(prompt="x", json_schema="{nope"), "not JSON"),
                            (dart_pb2.GenerateRequest(prompt="x", regex="a", choice=["a"]), "at most one"),
                            (dart_pb2.GenerateRequest(prompt="x", regex="(a"), "does not compile")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(bad, metadata=meta, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_concurrent_streams_are_batched_and_exact(app, reference):
    prompts = [f"Count to {i} in words." for i in range(8)]
    wants = [reference([{"role": "user", "content": p}], 20) for p in prompts]

    def run(p):
        chunks = client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                                  max_tokens=20, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with cf.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, prompts)) == wants


def test_disconnect_cancels_generation(app):
    engine = serve.get_deployment_handle("DartEngine", app_name="dart")
    with httpx.stream("POST", f"{HTTP}/v1/completions", json={"model": NAME, "prompt": "Once upon a time",
                                                               "max_tokens": 64, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.time() + 30
    while engine.stats.remote().result()["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert engine.stats.remote().result()["running"] == 0


def test_killing_the_ngram_replica_fails_no_request(app):
    engine = serve.get_deployment_handle("DartEngine", app_name="dart")
    before = engine.stats.remote().result()
    replica = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                   if "NgramService" in a["name"] and a["namespace"] == "serve")
    ray.kill(ray.get_actor(replica["name"], namespace="serve"), no_restart=True)

    def run(i):
        return client().completions.create(model=NAME, prompt=f"{i} + {i} =", max_tokens=16, temperature=0)

    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(run, range(12)))
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    # one node: the engine searched in its own process over the service's trie file (ngram.local_search),
    # and goes on doing so while the service is away, or falls back until it is back; a replica on
    # another node falls back (the two-node test kills the service under such a replica)
    assert before["ngram_local"]
    # Serve replaces the replica; the engine finds the new address and fallbacks stop
    deadline = time.time() + 120
    while time.time() < deadline:
        run(0)
        s = engine.stats.remote().result()
        if s["ngram_address"] != before["ngram_address"]:
            break
        time.sleep(1)
    assert s["ngram_address"] != before["ngram_address"]
    fb = engine.stats.remote().result()["ngram_fallbacks"]
    run(1)
    assert engine.stats.remote().result()["ngram_fallbacks"] == fb


def test_finished_requests_feed_the_live_corpus_unless_they_opt_out(app):
    """The engine replica sends each finished request's generated tokens to the n-gram service's live
    corpus (one document boundary after each), off the decoding path; ``"learn": false`` keeps a
    request's tokens out."""
    engine = serve.get_deployment_handle("DartEngine", app_name="dart")
    msgs = [{"role": "user", "content": "Name three rivers of Europe."}]

    def learned(at_least: int = 0) -> int:
        for _ in range(100):  # the sender sends every half second
            n = engine.stats.remote().result()["learned_tokens"]
            if n >= at_least:
                return n
            time.sleep(0.1)
        return n

    time.sleep(1.0)  # what earlier tests' requests left in the sender's queue goes out first
    before = learned()
    client().chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0,
                                     extra_body={"learn": False})
    time.sleep(1.0)
    assert learned() == before
    mirrored = engine.stats.remote().result()["ngram_mirror_tokens"]
    out = client().chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    assert learned(before + 1) == before + out.usage.completion_tokens + 1
    # the engine searches in process here (one node): its mirror of the service's corpus takes them too
    for _ in range(50):
        now = engine.stats.remote().result()["ngram_mirror_tokens"]
        if now > mirrored:
            break
        time.sleep(0.1)
    assert now == mirrored + out.usage.completion_tokens + 1


def test_an_output_through_one_engine_replica_drafts_for_another(app):
    """Two engine replicas, one n-gram service, through the OpenAI API: replica A and replica B
    (two applications, each its own ingress and engine, B's engine bound to the service of A's
    application) share one live corpus.  The target is the embedded SmolLM2 (the tiny random
    model's greedy text repeats one token, which its own context drafts already) with a random
    head and budget 8.  A prompt sent through B first (``"learn": false``) is drafted from its own
    context, the trie and the head only; after the same prompt went through A, B drafts it from
    A's output (its mirror of the service's corpus), so its τ rises; the text is the same each time."""
    from openai import OpenAI

    from deployments.config import AppConfig
    from deployments.engine import DartEngineDeployment
    from deployments.ingress import OpenAIIngress
    from deployments.ngram import NgramService, resolve_ngram_config

    token = "tw1n-t0ken"
    cfg = AppConfig.model_validate({"served_model_name": "twin", "head": "random", "budget": 8,
                                    "ngram": {"trie": app["ngram"]["trie"], "port": 0, "timeout_ms": 200}})
    config = cfg.model_dump()
    ngram = NgramService.options(name="TwinNgram", ray_actor_options={"num_cpus": 0.25}).bind(
        resolve_ngram_config(cfg).model_dump(), auth_token=token)

    def twin(name: str, ngram_service) -> None:
        engine = DartEngineDeployment.options(name=f"TwinEngine{name}", ray_actor_options={"num_cpus": 0.25}).bind(
            config, ngram_service, ngram_auth_token=token)
        ingress = OpenAIIngress.options(name=f"TwinIngress{name}", ray_actor_options={"num_cpus": 0.05}).bind(
            engine, config)
        serve.run(ingress, name=f"twin-{name.lower()}", route_prefix=f"/twin-{name.lower()}")

    try:
        twin("A", ngram)
        twin("B", serve.get_deployment_handle("TwinNgram", app_name="twin-a"))
        engine_b = serve.get_deployment_handle("TwinEngineB", app_name="twin-b")
        msgs = [{"role": "user", "content": "Write a short note to a neighbour about a parcel left at the door."}]

        def ask(name: str, learn: bool):
            return OpenAI(base_url=f"{HTTP}/twin-{name}/v1", api_key="unused", max_retries=0).chat.completions.create(
                model="twin", messages=msgs, max_tokens=40, temperature=0, extra_body={"learn": learn})

        before = ask("b", False)
        mirrored = engine_b.stats.remote().result()["ngram_mirror_tokens"]
        out_a = ask("a", True)
        for _ in range(100):  # A's sender sends every half second; B's mirror asks every half second
            stats = engine_b.stats.remote().result()
            if stats["ngram_mirror_tokens"] >= mirrored + out_a.usage.completion_tokens + 1:
                break
            time.sleep(0.1)
        assert stats["ngram_local"] and stats["learned_tokens"] == 0  # B itself learned nothing
        assert stats["ngram_mirror_tokens"] == mirrored + out_a.usage.completion_tokens + 1
        after = ask("b", False)
        texts = {o.choices[0].message.content for o in (before, out_a, after)}
        assert len(texts) == 1 and out_a.usage.completion_tokens == 40
        tau_before, tau_after = (o.usage.model_extra["dart"]["tau"] for o in (before, after))
        assert tau_after >= tau_before + 1.0, (tau_before, tau_after)
    finally:
        for name in ("twin-b", "twin-a"):
            serve.delete(name)


def test_repeated_prompts_prefill_from_the_prefix_cache_unless_they_opt_out(app, reference):
    """The engine replica keeps prompts' KV entries (``prefix_cache_tokens``, on by default): a
    repeated prompt reads all but its last block from the cache, with the reference's greedy text;
    a request with ``"learn": false`` leaves nothing there, so the prompt's next request prefills
    it whole (what it shares with earlier requests, the chat template's start, aside)."""
    engine = serve.get_deployment_handle("DartEngine", app_name="dart")
    msgs = [{"role": "user", "content": "Describe, step by step and with care, how a lighthouse keeper of the "
                                        "northern coast prepared the lamp, the lens and the logbook each night "
                                        "before the first ship of the season came past the headland."}]

    def hit_tokens() -> int:
        return engine.stats.remote().result()["prefix_cache_hit_tokens"]

    counts = [hit_tokens()]
    for learn in (False, True, True):
        out = client().chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0,
                                               extra_body={"learn": learn})
        assert out.choices[0].message.content == reference(msgs, 8)
        counts.append(hit_tokens())
    opted_out, first, repeat = (b - a for a, b in zip(counts, counts[1:]))
    assert first == opted_out  # the opted-out request stored nothing
    assert repeat >= first + 48, counts  # the repeat found its own prompt


def test_per_request_opt_out_and_the_serving_benchmark(app, reference, tmp_path, tiny_model_dir):
    """``"speculative": false`` (the benchmark's baseline mode) gives the same greedy text
    with τ = 1; the serving benchmark sweeps both modes on this app without an error, keeps its
    requests out of the live corpus, pairs each 1-client pass with the same requests through
    the engine in its own process, and reads the engine's step counters after every pass."""
    from dart_core.bench import serving

    msgs = [{"role": "user", "content": "Say something about rivers."}]
    engine = serve.get_deployment_handle("DartEngine", app_name="dart")
    before = engine.stats.remote().result()
    out = client().chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0,
                                           extra_body={"speculative": False})
    assert out.choices[0].message.content == reference(msgs, 12)
    assert out.usage.model_extra["dart"]["tau"] == 1.0
    after = engine.stats.remote().result()  # the dart_steps counter's numbers: one step per token after the prefill
    assert after["autoregressive_steps"] - before["autoregressive_steps"] == out.usage.completion_tokens - 1 > 0
    assert after["speculative_steps"] == before["speculative_steps"]
    bad = httpx.post(f"{HTTP}/v1/chat/completions", json={"model": NAME, "messages": msgs, "speculative": "maybe"})
    assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about the number {i}."}) for i in range(5)))
    cfg = serving.ServingConfig(url=f"{HTTP}/v1", concurrency=[1, 3], requests_per_client=1, max_tokens=8,
                                dataset=str(prompts), in_process=True, in_process_model=tiny_model_dir,
                                engine_app="dart")
    time.sleep(1.0)  # what earlier requests left in the live corpus's sender goes out first
    learned = engine.stats.remote().result()["learned_tokens"]
    result = serving.run_serving(cfg, progress=False)
    time.sleep(1.0)
    # the benchmark's requests say "learn": false: its repeated passes stay first-seen traffic
    assert engine.stats.remote().result()["learned_tokens"] == learned
    rows = {(r["concurrency"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(1, "dart"), (1, "no-speculation"), (3, "dart"), (3, "no-speculation")}
    assert all(r["errors"] == 0 and r["requests"] == r["concurrency"] for r in rows.values())
    assert all(r["tokens_per_s"] > 0 and r["ttft_ms"]["p50"] is not None for r in rows.values())
    assert rows[(1, "no-speculation")]["tau_mean"] == 1.0
    # the engine's step counters, read after every pass: a no-speculation pass never speculates, and
    # every pass's requests took steps
    assert all(r["engine_steps_all"]["speculative"] == 0 for (_, m), r in rows.items() if m == "no-speculation")
    assert all(sum(r["engine_steps_all"].values()) >= r["concurrency"] for r in rows.values())
    assert all(rows[(1, m)]["in_process_tokens_per_s"] > 0 and "in_process_tokens_per_s" not in rows[(3, m)]
               for m in ("dart", "no-speculation"))
    paths = serving.save(result, tmp_path)
    md = paths["md"].read_text()
    assert paths["png"].stat().st_size > 0 and "| 3 | no-speculation |" in md and "speculative steps |" in md
    local = rows[(1, "no-speculation")]
    assert (f"| 1 | no-speculation | {local['tokens_per_s']:.1f} | {local['in_process_tokens_per_s']:.1f} | "
            f"{local['tokens_per_s'] / local['in_process_tokens_per_s']:.2f}× |") in md


def test_the_serving_benchmark_runs_eagle3_beside_dart(app, both, tmp_path):
    """``--modes dart eagle3 no-speculation`` on a server with both heads: every mode's rows, no
    error, the DART-against-EAGLE-3 table; a server without an EAGLE-3 head is refused up front."""
    from dart_core.bench import serving

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about the number {i}."}) for i in range(3)))
    cfg = serving.ServingConfig(url=f"{both}/v1", concurrency=[1, 2], requests_per_client=1, max_tokens=8,
                                dataset=str(prompts), modes=["dart", "eagle3", "no-speculation"])
    result = serving.run_serving(cfg, progress=False)
    rows = {(r["concurrency"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("dart", "eagle3", "no-speculation")}
    assert all(r["errors"] == 0 and r["requests"] == r["concurrency"] and r["tokens_per_s"] > 0
               for r in rows.values())
    assert rows[(1, "no-speculation")]["tau_mean"] == 1.0 and rows[(1, "eagle3")]["tau_mean"] >= 1.0
    md = serving.markdown_table(result)
    assert "| 2 | eagle3 |" in md and "DART ÷ EAGLE-3 tokens/s" in md
    with pytest.raises(ValueError, match="mode eagle3 needs a server that loads an EAGLE-3 head"):
        serving.run_serving(serving.ServingConfig(url=f"{HTTP}/v1", concurrency=[1], dataset=str(prompts),
                                                  modes=["eagle3"]), progress=False)


def test_api_key_and_full_queue(guarded):
    """An app that requires a bearer key (401 without it, in the OpenAI error shape) and
    whose engine takes one request plus one queued: the rest get 503 with Retry-After,
    and it serves again once the burst is over."""
    url = f"{guarded}/v1/chat/completions"
    body = {"model": "guarded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{guarded}/v1/models", headers=headers).status_code == 401
    key = {"authorization": f"Bearer {GUARDED_KEY}"}
    assert httpx.post(url, json=body, headers=key, timeout=60).status_code == 200

    long = body | {"max_tokens": 60, "temperature": 0}
    with cf.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: httpx.post(url, json=long, headers=key, timeout=120), range(8)))
    busy = [r for r in replies if r.status_code == 503]
    assert busy and all(r.status_code in (200, 503) for r in replies)
    assert all(r.headers.get("retry-after") and r.json()["error"]["code"] == 503 for r in busy)
    assert httpx.post(url, json=body, headers=key, timeout=60).status_code == 200


def test_grpc_honours_the_api_key(guarded):
    """The gRPC door checks the same key as HTTP, from ``authorization: Bearer <key>`` metadata:
    unary and streaming calls without it or with a wrong one get UNAUTHENTICATED and queue nothing
    (the engine's step counters do not move); with it they are served.  Serve's health method
    stays open."""
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    from deployments._proto import dart_pb2, dart_pb2_grpc

    engine = serve.get_deployment_handle("DartEngine", app_name="guarded")
    req = dart_pb2.GenerateRequest(prompt="1, 2, 3,", max_tokens=4, temperature=0)
    with grpc.insecure_channel("127.0.0.1:9000") as channel:
        stub = dart_pb2_grpc.DartGenerationStub(channel)
        before = engine.stats.remote().result()
        for auth in ((), (("authorization", "Bearer wrong"),)):
            meta = (("application", "guarded"),) + auth
            for call in (lambda: stub.Generate(req, metadata=meta, timeout=60),
                         lambda: list(stub.GenerateStream(req, metadata=meta, timeout=60))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
        after = engine.stats.remote().result()
        assert {k: after[k] for k in ("autoregressive_steps", "speculative_steps", "queued")} == \
            {k: before[k] for k in ("autoregressive_steps", "speculative_steps", "queued")}
        meta = (("application", "guarded"), ("authorization", f"Bearer {GUARDED_KEY}"))
        one = stub.Generate(req, metadata=meta, timeout=60)
        parts = list(stub.GenerateStream(req, metadata=meta, timeout=60))
        assert one.text and "".join(p.text for p in parts) == one.text
        health = serve_pb2_grpc.RayServeAPIServiceStub(channel).Healthz(serve_pb2.HealthzRequest(), timeout=10)
        assert health.message == "success"  # Serve's own gRPC health method, without a key


def test_the_ngram_service_refuses_callers_without_the_apps_token(app):
    """With no token configured the application generated one: the n-gram service answers a caller
    without it, or with a wrong one, UNAUTHENTICATED, while the engines (which hold it) search there."""
    from ngram_service._proto import ngram_pb2, ngram_pb2_grpc

    engine = serve.get_deployment_handle("DartEngine", app_name="dart")
    before = engine.stats.remote().result()
    out = client().completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert out.usage.model_extra["dart"]["tau"] >= 1.0
    after = engine.stats.remote().result()
    assert after["ngram_calls"] > before["ngram_calls"] and after["ngram_fallbacks"] == before["ngram_fallbacks"]
    with grpc.insecure_channel(after["ngram_address"]) as channel:
        stub = ngram_pb2_grpc.NgramTreeSearchStub(channel)
        for meta in ((), (("authorization", "Bearer guessed"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Info(ngram_pb2.InfoRequest(), metadata=meta, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_smollm2_app_serves_the_targets_greedy_text(app):
    """The embedded default model behind the same app (second application on the
    cluster, random head so every step drafts and verifies a tree): on a CPU it serves
    the GGUF's own 4-bit weights (``weights: auto``), and the text equals that target's
    autoregressive greedy text."""
    from dart_core.step.engine import DartEngine
    from dart_core.step.sampling import SamplingParams
    from dart_core.model.target import TargetModel
    from deployments.app import build_app

    serve.run(build_app({"head": "random", "budget": 4, "ngram": {"enabled": False}}), name="smol",
              route_prefix="/smol")
    try:
        from openai import OpenAI

        c = OpenAI(base_url=f"{HTTP}/smol/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Give me three tips for writing clear technical documentation."}]
        target = TargetModel.from_pretrained(weights="gguf-native")
        ids = list(target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
        sp = SamplingParams.stopping_at(target.tokenizer.eos_token_id, max_new_tokens=48)
        ref = DartEngine(target).generate([ids], sp, speculative=False)
        want = target.tokenizer.decode(ref.token_ids[0], skip_special_tokens=True)
        out = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=48, temperature=0)
        assert out.choices[0].message.content == want
        streamed = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=48,
                                             temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == want
    finally:
        serve.delete("smol")


def test_the_engine_streams_chunks_in_groups(app):
    """The engine replica's stream (what the ingress reads) groups chunks by ``stream_interval_ms``:
    the prefill's chunk alone first, fewer Ray items than decoding steps, every step still its own
    chunk (the tokens add up, one chunk per step)."""
    from dart_core.serve.request import GenerationRequest

    engine = serve.get_deployment_handle("DartEngine", app_name="dart")

    async def collect():
        return [batch async for batch in engine.generate.options(stream=True).remote(
            GenerationRequest(prompt="Once upon a time", max_tokens=32, ignore_eos=True, speculative=False))]

    import asyncio

    lists = asyncio.run(collect())
    chunks = [c for batch in lists for c in batch]
    assert len(lists[0]) == 1 and lists[0][0].steps == 0
    assert sum(len(c.token_ids) for c in chunks) == 32 and len(chunks) == 32  # one token per step, speculation off
    assert len(lists) < len(chunks) and chunks[-1].finish_reason == "length"


def test_admin_routes_add_a_corpus_and_swap_the_trie(app, tmp_path):
    """POST /admin/corpus and /admin/trie (and gRPC AddCorpus, SwapTrie) want the admin key; a
    corpus lands in the live corpus; a missing or unsound trie file is refused and the old trie
    served on; the same trie file swaps in and requests keep being served."""
    from deployments._proto import dart_pb2, dart_pb2_grpc

    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    body = {"documents": ["def walrus():\n    return 42\n"], "token_ids": [[5, 6, 7]]}
    assert httpx.post(f"{HTTP}/admin/corpus", json=body, timeout=60).status_code == 401
    r = httpx.post(f"{HTTP}/admin/corpus", json=body, headers={"authorization": "Bearer wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{HTTP}/admin/corpus", json=body, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["documents"] == 2 and out["tokens_added"] >= 3 + 1 + 2 and out["tokens_held"] >= out["tokens_added"]
    for bad, needle in (({"token_ids": [[-1]]}, "outside the vocabulary"), ({"documents": []}, "at least one"),
                        ({"documents": ["x"], "extra": 1}, "extra"),
                        ({"documents": ["ok", "half a pair \ud800"]}, "documents.1 holds a lone UTF-16 surrogate")):
        r = _post(f"{HTTP}/admin/corpus", bad, headers=admin)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    (tmp_path / "junk.trie").write_bytes(b"not a trie" * 100)
    for path in (tmp_path / "missing.trie", tmp_path / "junk.trie"):
        r = httpx.post(f"{HTTP}/admin/trie", json={"path": str(path)}, headers=admin, timeout=60)
        assert r.status_code == 400 and "old one is served on" in r.json()["error"]["message"], r.text
    # swaps while requests stream: none fails, every answer is whole
    def ask(i: int) -> int:
        return client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"count {i}"}],
                                                max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
                                                ).usage.completion_tokens

    with cf.ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(ask, i) for i in range(12)]
        for _ in range(5):
            r = httpx.post(f"{HTTP}/admin/trie", json={"path": app["ngram"]["trie"]}, headers=admin, timeout=60)
            assert r.status_code == 200 and r.json()["order"] == 3, r.text
        assert [a.result(timeout=120) for a in answers] == [12] * 12
    with grpc.insecure_channel("127.0.0.1:9000") as channel:
        stub = dart_pb2_grpc.DartGenerationStub(channel)
        meta = (("application", "dart"),)
        request = dart_pb2.AddCorpusRequest(documents=["hello there"], token_ids=[1, 2, 3], token_lengths=[3])
        with pytest.raises(grpc.RpcError) as e:
            stub.AddCorpus(request, metadata=meta, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        keyed = meta + (("authorization", f"Bearer {ADMIN_KEY}"),)
        assert stub.AddCorpus(request, metadata=keyed, timeout=60).documents == 2
        with pytest.raises(grpc.RpcError) as e:
            stub.AddCorpus(dart_pb2.AddCorpusRequest(token_ids=[1, 2], token_lengths=[3]), metadata=keyed, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_lengths" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.SwapTrie(dart_pb2.SwapTrieRequest(path=str(tmp_path / "missing.trie")), metadata=keyed, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not swapped" in e.value.details()
        assert stub.SwapTrie(dart_pb2.SwapTrieRequest(path=app["ngram"]["trie"]), metadata=keyed, timeout=60).order == 3


def test_admin_routes_are_off_without_an_admin_key(guarded):
    r = httpx.post(f"{guarded}/admin/corpus", json={"documents": ["x"]},
                   headers={"authorization": f"Bearer {GUARDED_KEY}"}, timeout=60)
    assert r.status_code == 403 and "admin routes are off" in r.json()["error"]["message"]


def test_the_ngram_service_writes_its_snapshot_when_serve_stops_it(app, tmp_path):
    """With ``ngram.learn_snapshot``, what the live corpus holds is written when Serve stops the
    replica (its graceful shutdown calls the deployment's ``__del__``), not only every minute: a
    corpus added seconds before the application is deleted is in the file afterwards."""
    from deployments.ngram import NgramService
    from ngram_service.live import read_snapshot

    snap = tmp_path / "live.snap"
    cfg = {"trie": app["ngram"]["trie"], "port": 0, "learn": True, "learn_snapshot": str(snap)}
    handle = serve.run(NgramService.options(name="SnapshotNgram").bind(cfg, "t0ken"), name="snapshot-ngram",
                       route_prefix=None)
    docs = [[5, 6, 7, 8, 9], [11, 12, 13]]
    assert handle.add_corpus.remote(docs).result()["tokens_added"] == 8 + 2  # a boundary after each
    assert not snap.exists()  # the periodic snapshot (every minute) has not run yet
    serve.delete("snapshot-ngram")
    assert [d.tolist() for d in read_snapshot(snap).documents()] == docs


def test_an_app_with_method_eagle3_answers_with_the_targets_greedy_text(app, both, reference):
    """``method: eagle3`` serves with an EAGLE-3 drafter (here a random head on the tiny target): the
    OpenAI client's answer is the target's greedy text, ``usage.dart.tau`` is reported, and the
    engine's steps speculate.  Then an app with both heads (``eagle3_head`` beside a DART head):
    each request's ``"method"`` picks the drafter, every answer the target's greedy text."""
    from openai import OpenAI

    from deployments.config import AppConfig
    from deployments.engine import DartEngineDeployment
    from deployments.ingress import OpenAIIngress

    cfg = AppConfig.model_validate({"model": app["model"], "served_model_name": "eagle3", "head": "random",
                                    "method": "eagle3", "budget": 8, "eagle3_total_tokens": 12, "eagle3_depth": 3,
                                    "eagle3_top_k": 4, "ngram": {"enabled": False}})
    engine = DartEngineDeployment.options(name="Eagle3Engine", ray_actor_options={"num_cpus": 0.5}).bind(
        cfg.model_dump(), None)
    ingress = OpenAIIngress.options(name="Eagle3Ingress", ray_actor_options={"num_cpus": 0.1}).bind(
        engine, cfg.model_dump())
    serve.run(ingress, name="eagle3", route_prefix="/eagle3")
    try:
        msgs = [{"role": "user", "content": "Name three colours."}]
        out = OpenAI(base_url=f"{HTTP}/eagle3/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="eagle3", messages=msgs, max_tokens=12, temperature=0)
        assert out.choices[0].message.content == reference(msgs, 12)
        assert out.usage.model_extra["dart"]["tau"] >= 1.0
        stats = serve.get_deployment_handle("Eagle3Engine", app_name="eagle3").stats.remote().result()
        assert stats["speculative_steps"] > 0
        assert httpx.get(f"{HTTP}/eagle3/v1/models").json()["data"][0]["methods"] == ["eagle3", "none"]
    finally:
        serve.delete("eagle3")
    client = OpenAI(base_url=f"{both}/v1", api_key="unused", max_retries=0)
    want = reference(msgs, 12)
    assert httpx.get(f"{both}/v1/models").json()["data"][0]["methods"] == ["dart", "eagle3", "none"]
    for method in ("eagle3", "dart", None, "none"):
        out = client.chat.completions.create(model="both", messages=msgs, max_tokens=12, temperature=0,
                                             extra_body={"method": method} if method else None)
        assert out.choices[0].message.content == want, method
        assert (out.usage.model_extra["dart"]["draft_tokens"] > 0) == (method != "none"), method


def test_library_logs_reach_the_replica_log(monkeypatch):
    """deployments.logs.route_library_logs (the engine and n-gram replicas call it): the libraries'
    INFO lines (kernel and speculative config, the verification cost curve, the speculation
    calibration, the n-gram server) go through the handlers Ray Serve gives its ``ray.serve``
    logger; before, a replica dropped them.  Outside a replica it changes nothing."""
    import logging

    from ray import serve

    from deployments.logs import route_library_logs

    lib_state = {name: (logging.getLogger(name).propagate, list(logging.getLogger(name).handlers))
                 for name in ("dart_core", "ngram_service")}
    route_library_logs()  # outside a replica: nothing changes
    assert {name: (logging.getLogger(name).propagate, list(logging.getLogger(name).handlers))
            for name in lib_state} == lib_state
    monkeypatch.setattr(serve, "get_replica_context", lambda: object())  # as inside a replica
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    serve_logger, handler = logging.getLogger("ray.serve"), Keep()
    serve_level = serve_logger.level
    serve_logger.setLevel(logging.INFO)
    serve_logger.addHandler(handler)
    libs = [logging.getLogger(name) for name in ("dart_core", "ngram_service")]
    saved = [(lib.level, lib.propagate, list(lib.handlers)) for lib in libs]
    try:
        route_library_logs()
        route_library_logs()  # twice: each line still arrives once
        logging.getLogger("dart_core.spec.budget").info("speculation calibration: %s", "batch 1")
        logging.getLogger("ngram_service.server").info("n-gram service on %s", "host:1")
        assert [r.getMessage() for r in records] == ["speculation calibration: batch 1", "n-gram service on host:1"]
        logging.getLogger("dart_core.step.engine").debug("gate: %s", "batch 1")  # Serve's level: INFO
        assert len(records) == 2
        serve_logger.setLevel(logging.DEBUG)  # as `logging_config: {log_level: DEBUG}` sets it
        route_library_logs()
        logging.getLogger("dart_core.step.engine").debug("gate: %s", "batch 1")
        assert [r.getMessage() for r in records][2:] == ["gate: batch 1"]
    finally:  # later tests read these loggers through the root logger (caplog)
        serve_logger.setLevel(serve_level)
        serve_logger.removeHandler(handler)
        for lib, (level, propagate, handlers) in zip(libs, saved):
            lib.setLevel(level)
            lib.propagate = propagate
            lib.handlers[:] = handlers
