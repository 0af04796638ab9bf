"""The application's config, without a cluster: its bounds are the n-gram
server's, the budget is "auto" or an int in range, the tree-search defaults
come from one place, the n-gram replica gets model-free settings, and the engine's gRPC client is a proper tree-search client."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig
from ngram_service.client import TreeSearchClient
from ngram_service.server import ServerLimits
from ngram_service.tree_search import SearchParams

LIMITS = ServerLimits()


@pytest.mark.parametrize("field", ["top_k", "beam_width"])
def test_tree_search_bounds_are_the_servers(field):
    limit = getattr(LIMITS, {"top_k": "max_k", "beam_width": "max_beam_width"}[field])
    assert getattr(AppConfig.model_validate({field: limit}), field) == limit
    with pytest.raises(ValidationError, match=field):  # the server would refuse every search
        AppConfig.model_validate({field: limit + 1})


@pytest.mark.parametrize("budget", ["Auto", "AUTO", "sixty", -1, 0, LIMITS.max_budget + 1, 2.5])
def test_a_budget_is_auto_or_an_int_in_range(budget):
    with pytest.raises(ValidationError, match="budget"):
        AppConfig.model_validate({"budget": budget})


def test_search_params_follow_the_config():
    assert AppConfig.model_validate({"budget": "auto"}).search_params() == SearchParams()
    cfg = AppConfig.model_validate({"budget": 7, "top_k": 9, "beam_width": 3})
    assert cfg.search_params() == SearchParams(top_k=9, beam_width=3, budget=7)
    assert AppConfig().top_k == SearchParams().top_k and AppConfig().beam_width == SearchParams().beam_width
    assert AppConfig().context_weight == SearchParams().context_weight > 0  # the request's context is on
    assert AppConfig.model_validate({"context_weight": 0}).search_params().context_weight == 0.0
    with pytest.raises(ValidationError, match="context_weight"):
        AppConfig.model_validate({"context_weight": -1})


def test_the_ngram_replica_gets_model_free_settings():
    from deployments.ngram import resolve_ngram_config

    default = resolve_ngram_config(AppConfig())
    assert default.trie == "auto" and default.tokenizer is None  # the replica resolves the default model's
    mine = resolve_ngram_config(AppConfig.model_validate({"model": "/models/my-llama"}))
    assert mine.tokenizer == "/models/my-llama"
    given = AppConfig.model_validate({"ngram": {"trie": "/data/x.trie"}})
    assert resolve_ngram_config(given) == given.ngram  # a path is passed as it is
    with pytest.raises(ValidationError, match="corpus"):
        AppConfig.model_validate({"ngram": {"corpus": "wikipedia"}})


def test_the_engines_grpc_client_is_a_tree_search_client():
    from deployments.engine import grpc_tree_search

    resolved = []
    client = grpc_tree_search(AppConfig().ngram, lambda: resolved.append(1) or "127.0.0.1:1", "hash", "t0ken")
    assert isinstance(client, TreeSearchClient)
    assert client.wait_resolved(10) and resolved == [1]
    assert client.metadata == (("authorization", "Bearer t0ken"),)
    client.close()


def test_the_app_hands_one_ngram_token_to_the_service_and_the_engines(monkeypatch):
    """The n-gram service is never open in the application: without DART_NGRAM_AUTH_TOKEN where it is
    built, a fresh random token per build goes to the service and to the engine deployment as bound
    arguments (not in the config they log or show); with the variable set, that token."""
    from deployments.app import build_app

    def tokens(app):
        engine = app._bound_deployment.init_args[0]
        ngram = engine._bound_deployment.init_args[1]
        token = engine._bound_deployment.init_kwargs["ngram_auth_token"]
        assert ngram._bound_deployment.init_kwargs["auth_token"] == token
        configs = (app._bound_deployment.init_args[1], engine._bound_deployment.init_args[0],
                   ngram._bound_deployment.init_args[0])
        assert all(token not in repr(c) for c in configs)
        return token

    monkeypatch.delenv("DART_NGRAM_AUTH_TOKEN", raising=False)
    first, second = tokens(build_app({})), tokens(build_app({}))
    assert len(first) >= 40 and first != second  # 32 random bytes, new at every build
    monkeypatch.setenv("DART_NGRAM_AUTH_TOKEN", "operators-token")
    assert tokens(build_app({})) == "operators-token"
    monkeypatch.setenv("MY_TOKEN", "other")
    assert tokens(build_app({"ngram": {"auth_token_env": "MY_TOKEN"}})) == "other"
    engine = build_app({"ngram": {"enabled": False}})._bound_deployment.init_args[0]
    assert engine._bound_deployment.init_args[1] is None  # no service, no token


def test_step_metrics_record_the_verification_budget(monkeypatch):
    """The engine replica's Prometheus hooks: per speculative step the verified tokens, the tokens
    emitted and the padding share of the tree layout; autoregressive steps add none of these, nor
    draft or tree-search phases. Counters and the batch gauge are summed and handed to Ray at a
    request's end (or once a second), not at every step."""
    import types

    from dart_core.step.engine import StepOutput
    from deployments import engine as engine_module

    class Metric:
        def __init__(self, name, **kw):
            self.name, self.seen = name, []

        def observe(self, value, tags=None):
            self.seen.append(value if tags is None else (tags["phase"], value))

        def inc(self, value=1, tags=None):
            self.seen.append(value if tags is None else (tags["mode"], value))

        def set(self, value):
            self.seen.append(value)

    engine_module._Metrics()  # Ray's own metric classes accept every definition (bucket boundaries > 0, ...)
    monkeypatch.setattr(engine_module, "metrics", types.SimpleNamespace(Counter=Metric, Histogram=Metric,
                                                                        Gauge=Metric))
    m = engine_module._Metrics()
    spec = StepOutput(seq_ids=[0, 1], new_tokens=[[5], [6, 7]], finish_reasons=[None, None], accepted_lengths=[1, 2],
                      draft_nodes=[0, 3], num_nodes=4, draft_ms=1.0, tree_search_ms=1.0, verify_ms=1.0, step_ms=4.0)
    m.on_step(spec, prefill=False)
    m.on_step(StepOutput(seq_ids=[0, 1], new_tokens=[[5], [6]], finish_reasons=[None, None], accepted_lengths=[1, 1],
                         draft_nodes=[0, 0], num_nodes=1, draft_ms=0.0, tree_search_ms=0.0, verify_ms=1.0,
                         step_ms=1.0), prefill=False)
    m.on_step(StepOutput(seq_ids=[1], new_tokens=[[8]], finish_reasons=[None], accepted_lengths=[1], draft_nodes=[0],
                         num_nodes=1, draft_ms=0.0, tree_search_ms=0.0, verify_ms=2.0, step_ms=2.5), prefill=False)
    assert m.verified.seen == [5] and m.accepted.seen == [3] and m.padding.seen == [0.375]
    assert m.phase.seen == [("draft", 1.0), ("tree_search", 1.0), ("verify", 1.0), ("step", 4.0),
                            ("verify", 1.0), ("step", 1.0), ("verify", 2.0), ("step", 2.5)]
    assert m.tokens.seen == m.steps.seen == m.batch.seen == []  # not yet handed over
    m.on_finish(types.SimpleNamespace(tau=1.5))
    assert m.tau.seen == [1.5] and m.tokens.seen == [6] and m.batch.seen == [1]
    assert m.steps.seen == [("autoregressive", 2), ("speculative", 1)]
    m.flush()  # nothing new: nothing sent
    assert m.tokens.seen == [6] and len(m.steps.seen) == 2 and m.batch.seen == [1]
    m.flush_s = 0.0  # a flush after every step
    m.on_step(StepOutput(seq_ids=[1], new_tokens=[[9]], finish_reasons=[None], accepted_lengths=[1], draft_nodes=[0],
                         num_nodes=1, draft_ms=0.0, tree_search_ms=0.0, verify_ms=2.0, step_ms=2.5), prefill=False)
    assert m.tokens.seen == [6, 1] and m.steps.seen[-1] == ("autoregressive", 1)


class _Recorded:
    """A Ray Serve Counter or Gauge that records what it is given."""

    def __init__(self, name, **kw):
        self.name, self.seen = name, []

    def inc(self, value=1):
        self.seen.append(value)

    def set(self, value):
        self.seen.append(value)


def test_the_prefix_cache_figures_reach_prometheus_with_each_flush(monkeypatch):
    """The engine replica's exporter of its prefix cache (the same StatsMetrics as the live
    corpus's): gauges of positions and bytes held, counters of lookups, hits, tokens read from the
    cache and evictions, each grown by what happened since the last flush."""
    import types

    import torch

    from dart_core.model.prefix_cache import PrefixCache
    from deployments import engine as engine_module
    from deployments import metrics as metrics_module

    cache = PrefixCache(8, block=4)
    engine_module._Metrics(prefix_cache=cache)  # Ray's own metric classes accept the definitions
    monkeypatch.setattr(metrics_module, "metrics", types.SimpleNamespace(Counter=_Recorded, Gauge=_Recorded))
    m = engine_module._Metrics(prefix_cache=cache)
    entries = [torch.zeros(1, 8, 2)], [torch.zeros(1, 8, 2)], torch.zeros(8, 3)
    cache.store([1] * 8, *entries)
    cache.lookup([1] * 8 + [2])
    m.flush()
    gauges, counters = m.prefix_metrics.gauges, m.prefix_metrics.counters
    assert gauges["tokens"].seen == [8] and gauges["bytes"].seen == [cache.bytes]
    assert {k: c.seen for k, c in counters.items()} == {"lookups": [1], "hits": [1], "hit_tokens": [8],
                                                          "evictions": []}
    cache.store([2] * 8, *entries)  # evicts the first
    m.flush()
    assert counters["evictions"].seen == [1] and counters["lookups"].seen == [1] and gauges["tokens"].seen == [8, 8]


def test_the_live_corpus_counters_reach_prometheus_as_deltas(monkeypatch):
    """The n-gram replica's exporter: gauges of what the corpus holds, counters that grow by what
    happened since the last export (nothing when nothing did)."""
    import types

    from deployments import metrics as metrics_module
    from deployments import ngram as ngram_module
    from ngram_service.live import LiveCorpus

    ngram_module._LiveMetrics(LiveCorpus(max_tokens=64))  # Ray's own metric classes accept the definitions
    monkeypatch.setattr(metrics_module, "metrics", types.SimpleNamespace(Counter=_Recorded, Gauge=_Recorded))
    live = LiveCorpus(max_tokens=64, max_context=2)  # matches of 2 tokens: [2, 3] below
    m = ngram_module._LiveMetrics(live)
    live.add([[1, 2, 3], [2, 3, 4]])
    live.chain([2, 3], 2)
    live.chain([9], 2)
    m.update()
    assert m.gauges["tokens"].seen == [8] and m.gauges["bytes"].seen[0] > 0
    assert {k: c.seen for k, c in m.counters.items()} == {"inserts": [2], "evicted": [], "lookups": [2], "hits": [1]}
    m.update()
    assert m.counters["inserts"].seen == [2] and m.gauges["tokens"].seen == [8, 8]
    live.add([list(range(10, 40)), list(range(40, 70))])  # past the cap: the oldest are evicted
    m.update()
    assert m.counters["inserts"].seen == [2, 2] and m.counters["evicted"].seen and m.gauges["tokens"].seen[-1] <= 64


def test_the_torch_free_copies_of_the_kernel_and_draft_weight_choices_match_the_engines():
    """deployments.config (imported by the ingress, without torch) and the benchmarks' CLI spell out
    ``gguf_kernel`` and ``draft_weights`` values; they must be the engine's own."""
    import argparse
    import typing

    from dart_core.api import DRAFT_WEIGHTS
    from dart_core.bench import add_weights_argument
    from dart_core.model.quant import KERNELS
    from deployments.config import AppConfig

    kernels, drafts = {"auto", *KERNELS}, set(DRAFT_WEIGHTS)
    fields = AppConfig.model_fields
    assert set(typing.get_args(fields["gguf_kernel"].annotation)) == kernels
    assert set(typing.get_args(fields["draft_weights"].annotation)) == drafts
    ap = argparse.ArgumentParser()
    add_weights_argument(ap, argparse.Namespace(weights="auto"))
    choices = {a.dest: set(a.choices) for a in ap._actions if a.choices}
    assert choices["gguf_kernel"] == kernels and choices["draft_weights"] == drafts
    from dart_core.bench.verify_curve import build_parser

    assert {a.dest: set(a.choices) for a in build_parser()._actions if a.choices}["gguf_kernel"] == kernels
