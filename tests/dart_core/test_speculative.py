"""SpeculativeConfig: every speculation setting validated in one place, taken by
DartModel.from_pretrained, and reachable from the Serve application's config."""

from __future__ import annotations

import dataclasses

import pytest

from dart_core.spec.speculative import SpeculativeConfig
from ngram_service.tree_search import SearchParams


@pytest.mark.parametrize("bad", [dict(budget=0), dict(budget=True), dict(budget="fast"), dict(context_window=0),
                                 dict(context_order=0), dict(lookup_length=-1), dict(gate_probe_every=4),
                                 dict(gate_probe_every=2048), dict(max_prefill_tokens=0),
                                 dict(lookup_preference=0.0)])
def test_bad_settings_are_refused_by_name(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SpeculativeConfig(**bad)


def test_a_fixed_budget_sets_the_search_budget():
    assert SpeculativeConfig().search_params.budget == SearchParams().budget  # auto: the upper bound
    assert SpeculativeConfig(budget=7).search_params.budget == 7
    kw = SpeculativeConfig(lookup_length=0, context_order=2).engine_kwargs()
    assert kw["lookup_length"] == 0 and kw["context_order"] == 2


def test_from_pretrained_takes_it(tiny_model_dir):
    from dart_core.api import DartModel

    spec = SpeculativeConfig(budget=5, search=SearchParams(top_k=7, beam_width=3), context_window=300,
                             context_order=3, lookup_length=0, max_prefill_tokens=100)
    engine = DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, speculative_config=spec).engine
    assert (engine.context_window, engine.context_order, engine.max_prefill_tokens) == (300, 3, 100)
    assert engine.drafter.lookup_length == 0
    assert engine.search_params.budget == 5 and engine.search_params.top_k == 7 and engine.budget is None
    with pytest.raises(TypeError, match="speculative_config"):
        DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, budget=4, speculative_config=spec)


def test_every_field_is_reachable_from_the_app_config():
    from deployments.config import AppConfig

    values = dict(budget=9, top_k=5, beam_width=4, context_weight=0.25, cuda_graphs=True, context_window=500,
                  context_order=3, lookup_length=6, lookup_preference=1.5, gate_probe_every=32,
                  max_prefill_tokens=1000, draft_graphs=False, pooled_budget=True, grammar_drafting=False,
                  fold_width=7, prefix_cache_tokens=100, method="eagle3", eagle3_total_tokens=20, eagle3_depth=3,
                  eagle3_top_k=5)
    spec = AppConfig.model_validate(values).speculative_config()
    for f in dataclasses.fields(SpeculativeConfig):
        if f.name != "search":
            assert getattr(spec, f.name) == values[f.name], f.name
    assert (spec.search.top_k, spec.search.beam_width, spec.search.context_weight) == (5, 4, 0.25)
    # null fields: the defaults; the one served default that differs: the prefix cache is on in a deployment
    assert AppConfig.model_validate({}).speculative_config() == SpeculativeConfig(prefix_cache_tokens=8192)
