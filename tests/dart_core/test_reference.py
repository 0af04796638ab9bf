"""The one-sequence reference step (dart_core.step.reference) as the oracle of the engine's fast paths: at
a fixed budget the engine (batched, KV cached, folded and static draft caches, C++ acceptance)
accepts the same tokens step for step, and both equal the target's greedy output."""

from __future__ import annotations

import numpy as np
import pytest

from dart_core.step.engine import DartEngine
from dart_core.step.reference import reference_generate
from dart_core.step.sampling import SamplingParams
from ngram_service.client import InProcessTreeSearch
from ngram_service.tree_search import SearchParams

from .conftest import hf_greedy, tiny_target
from .test_engine import prompts_of, random_head


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_engine_accepts_what_the_reference_step_accepts(arch):
    target = tiny_target(arch, seed=7)
    head = random_head(target, seed=3)
    params = SearchParams(top_k=8, beam_width=4, budget=12)
    prompts = prompts_of(np.random.default_rng(7), [6, 11, 3])
    n = 24
    engine = DartEngine(target, head, InProcessTreeSearch(None), params)
    steps = list(engine.generate_stream(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    speculated = 0
    for i, prompt in enumerate(prompts):
        ref = reference_generate(target, head, InProcessTreeSearch(None), prompt, n, params)
        assert ref.tokens == hf_greedy(target, prompt, n)
        got = [s.new_tokens[s.seq_ids.index(i)] for s in steps if i in s.seq_ids]
        assert [t for toks in got for t in toks] == ref.tokens
        # the prefill's first token, then one step per entry of the reference, τ for τ
        assert [len(toks) for toks in got[1:]] == ref.accepted
        speculated += sum(a > 1 for a in ref.accepted)
    assert speculated >= 3  # draft nodes were accepted, so the trees were compared, not only the roots
