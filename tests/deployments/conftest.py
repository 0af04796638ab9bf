"""The served application shared by this package's tests: one local Ray cluster with the
app on a tiny random Llama (the real SmolLM2 tokenizer and chat template), a random head and
a trie built from CPython's sources, and transformers' greedy output to compare with."""

from __future__ import annotations

import os
import socket

import pytest
import ray
from ray import serve
from ray.serve.config import gRPCOptions
from transformers import AutoModelForCausalLM, AutoTokenizer

from ngram_service.build import build_trie_from_texts
from ngram_service.corpus import cpython_stdlib_sources

HTTP = "http://127.0.0.1:8000"
NAME = "tiny-dart"
ADMIN_KEY = "adm1n-s3cret"


@pytest.fixture(scope="package")
def app(tiny_model_dir, tmp_path_factory, default_tokenizer):
    from deployments.app import build_app

    for port in (8000, 9000):  # another `serve run` or Ray cluster would answer in this app's place
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is already in use (a `serve run`, or another Ray cluster's proxy?): "
                            "stop it (`ray stop --force`) and run the tests again", pytrace=False)
    sources = cpython_stdlib_sources()
    trie = tmp_path_factory.mktemp("trie") / "py.trie"
    build_trie_from_texts((next(sources) for _ in range(100)), trie, default_tokenizer, progress=False)
    # a loaded 2-core machine can take longer than Serve's 5 s to start the proxy, which Serve then kills;
    # the cluster's processes inherit this from the driver
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ["DART_TEST_ADMIN_KEY"] = ADMIN_KEY  # the admin routes' key (the guarded app has none: off)
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000},
                grpc_options=gRPCOptions(port=9000, grpc_servicer_functions=[
                    "deployments._proto.dart_pb2_grpc.add_DartGenerationServicer_to_server"]))
    args = {"model": tiny_model_dir, "served_model_name": NAME, "head": "random", "budget": 8,
            "max_batch_size": 8, "max_speculative_batch": 4, "max_tokens_limit": 64,
            "admin_key_env": "DART_TEST_ADMIN_KEY", "ngram": {"trie": str(trie), "port": 0, "timeout_ms": 200}}
    serve.run(build_app(args), name="dart", route_prefix="/")
    yield args
    serve.shutdown()
    ray.shutdown()


GUARDED_KEY = "s3cret"


@pytest.fixture(scope="package")
def guarded(app):
    """A second app on the same cluster (route /guarded, gRPC application "guarded") that requires
    the bearer key GUARDED_KEY, and whose engine takes one request plus one queued."""
    from deployments.config import AppConfig
    from deployments.engine import DartEngineDeployment
    from deployments.ingress import OpenAIIngress

    cfg = AppConfig.model_validate({"model": app["model"], "served_model_name": "guarded", "head": "random",
                                    "budget": 4, "api_key_env": "DART_TEST_KEY", "ngram": {"enabled": False}})
    engine = DartEngineDeployment.options(max_ongoing_requests=1, max_queued_requests=1,
                                          ray_actor_options={"num_cpus": 0.5}).bind(cfg.model_dump(), None)
    ingress = OpenAIIngress.options(ray_actor_options={
        "num_cpus": 0.1, "runtime_env": {"env_vars": {"DART_TEST_KEY": GUARDED_KEY}}}).bind(engine, cfg.model_dump())
    serve.run(ingress, name="guarded", route_prefix="/guarded")
    yield f"{HTTP}/guarded"
    serve.delete("guarded")


@pytest.fixture(scope="package")
def both(app):
    """A third app on the same cluster (route /both): a random DART head and a random EAGLE-3 head
    (``eagle3_head``) on one target, each request naming its drafter (``"method"``)."""
    from deployments.config import AppConfig
    from deployments.engine import DartEngineDeployment
    from deployments.ingress import OpenAIIngress

    cfg = AppConfig.model_validate({"model": app["model"], "served_model_name": "both", "head": "random",
                                    "eagle3_head": "random", "budget": 8, "eagle3_total_tokens": 12,
                                    "eagle3_depth": 3, "eagle3_top_k": 4, "max_tokens_limit": 64,
                                    "ngram": {"enabled": False}})
    # no logical CPUs reserved: it stays up for the whole package, and the cluster's 4 must still fit
    # the apps other tests deploy for a while (the SmolLM2 app's engine takes 1)
    engine = DartEngineDeployment.options(name="BothEngine", ray_actor_options={"num_cpus": 0}).bind(
        cfg.model_dump(), None)
    ingress = OpenAIIngress.options(name="BothIngress", ray_actor_options={"num_cpus": 0}).bind(
        engine, cfg.model_dump())
    serve.run(ingress, name="both", route_prefix="/both")
    yield f"{HTTP}/both"
    serve.delete("both")


@pytest.fixture(scope="package")
def reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def greedy(messages, max_tokens):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
        return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    return greedy


def client():
    from openai import OpenAI

    return OpenAI(base_url=f"{HTTP}/v1", api_key="unused", max_retries=0)
