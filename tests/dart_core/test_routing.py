"""One engine, two drafters: each sequence drafted by the method its request named
(dart_core.spec.routing), verified together, output exactly the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_core.spec.budget import AdaptiveBudget, VerifyCostCurve
from dart_core.spec.drafters import HeadState
from dart_core.spec.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from dart_core.spec.routing import RoutedDrafter, RoutedState
from dart_core.step.engine import DartEngine, NewSequence
from dart_core.step.sampling import SamplingParams
from ngram_service.tree_search import SearchParams

from .conftest import VOCAB, tiny_target
from .test_engine import random_head


def _eagle3(target, seed: int = 1) -> Eagle3Head:
    torch.manual_seed(seed)
    return Eagle3Head(Eagle3Config.for_target(target.config)).eval()


def _routed_engine(target, budget=None) -> DartEngine:
    """A DART engine (random head, logits-only search) whose drafter routes to an EAGLE-3 drafter too."""
    engine = DartEngine(target, random_head(target), search_params=SearchParams(top_k=4, beam_width=4, budget=10),
                        budget=budget)
    eagle3 = Eagle3Drafter(_eagle3(target), target.embed_tokens, total_tokens=10, depth=3, top_k=3)
    engine.drafter = RoutedDrafter({"dart": engine.drafter, "eagle3": eagle3}, default="dart")
    engine.drafter.budget = budget
    return engine


class _Counting:
    """Wraps a drafter's propose and propose_trees, counting the rows each call drafted."""

    def __init__(self, drafter):
        self.rows, self.mixed = [], 0
        for name in ("propose", "propose_trees"):
            inner = getattr(drafter, name)

            def wrapped(inputs, inner=inner, name=name):
                self.rows.append(len(inputs.tokens))
                self.mixed += name == "propose_trees"
                return inner(inputs)
            setattr(drafter, name, wrapped)


def _run(engine, waves: dict[int, list[NewSequence]], **kw) -> dict[int, list[int]]:
    """Streams the engine with sequences joining at the given step numbers; every sequence's tokens."""
    out: dict[int, list[int]] = {}
    calls = [0]

    def admit():
        calls[0] += 1
        return waves.get(calls[0] - 1, [])
    for step in engine.generate_stream([], admit=admit, **kw):
        for sid, toks in zip(step.seq_ids, step.new_tokens):
            out.setdefault(sid, []).extend(toks)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_batch_of_dart_and_eagle3_sequences_decodes_exactly(arch, adaptive):
    """Sequences naming dart, eagle3 or neither (the default, dart) join a running batch in two waves,
    leave at different lengths, and pass a stretch of autoregressive steps (more running than
    ``max_speculative_batch``, their draft inputs held and then released per method): greedy output
    equals autoregressive decoding for every one, and each drafter drafted only its own rows."""
    target = tiny_target(arch, seed=5)
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(0, VOCAB, size=n)] for n in (6, 3, 9, 4, 7)]
    lengths = [18, 9, 14, 20, 6]
    methods = ["eagle3", "dart", None, "eagle3", "dart"]
    budget = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.5))) if adaptive else None
    engine = _routed_engine(target, budget)
    counts = {m: _Counting(d) for m, d in engine.drafter.drafters.items()}
    seqs = [NewSequence(p, SamplingParams(max_new_tokens=n), method=m) for p, n, m in zip(prompts, lengths, methods)]
    got = _run(engine, {0: seqs[:2], 3: seqs[2:]}, max_speculative_batch=4)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        ar = DartEngine(target).generate([p], SamplingParams(max_new_tokens=n), speculative=False).token_ids[0]
        assert got[i] == ar, f"sequence {i} ({methods[i]})"
    assert counts["dart"].mixed and counts["eagle3"].mixed  # steps that verified both drafters' trees together
    assert max(counts["eagle3"].rows) <= 2 and max(counts["dart"].rows) <= 3  # each only its own rows


def test_a_routed_state_keeps_each_methods_rows_in_batch_order():
    """merge, select and add split by method: each method's state holds its rows' pending tokens
    in batch order, and dropping rows of one method leaves the other's alone."""
    target = tiny_target("llama")
    engine = _routed_engine(target)
    drafter = engine.drafter
    state = drafter.new_state(3, torch.device("cpu"), methods=["eagle3", "dart", "eagle3"])
    state.merge(drafter.new_state(2, torch.device("cpu"), methods=[None, "eagle3"]))
    assert state.methods == ["eagle3", "dart", "eagle3", "dart", "eagle3"]
    assert {m: len(s.next) for m, s in state.states.items()} == {"eagle3": 3, "dart": 2}
    h = 3 * target.config.hidden_size
    taps = torch.arange(5, dtype=torch.float32)[:, None, None].expand(5, 1, h).clone()
    state.add(taps, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, dtype=torch.long), [[i] for i in range(5)])
    assert state.next == [[0], [1], [2], [3], [4]]
    assert state.states["eagle3"].next == [[0], [2], [4]] and state.states["dart"].next == [[1], [3]]
    assert state.states["eagle3"].taps[:, 0, 0].tolist() == [0.0, 2.0, 4.0]
    state.hold(taps, torch.zeros(5, dtype=torch.long), [[10 + i] for i in range(5)])
    assert len(state.held) == 1
    assert state.release() == [[10 + i] for i in range(5)] and not state.held
    state.select([4, 1, 3])
    assert state.methods == ["eagle3", "dart", "dart"] and state.next == [[4, 14], [1, 11], [3, 13]]
    assert state.states["dart"].next == [[1, 11], [3, 13]]
    state.select([1, 2])  # the eagle3 rows leave: its state goes
    assert list(state.states) == ["dart"] and state.width == 2


def test_methods_are_checked():
    """A method the engine does not hold is refused when the sequence joins, naming what is loaded;
    a plain DART engine holds dart only; a routed drafter needs its default among its drafters."""
    target = tiny_target("llama")
    engine = _routed_engine(target)
    assert engine.methods == ("dart", "eagle3")
    plain = DartEngine(target, random_head(target))
    assert plain.methods == ("dart",) and DartEngine(target).methods == ()
    with pytest.raises(ValueError, match=r"method 'medusa'.*loaded: dart"):
        _run(plain, {0: [NewSequence([1, 2, 3], SamplingParams(max_new_tokens=2), method="medusa")]})
    # a plain engine takes its own method by name
    assert _run(plain, {0: [NewSequence([1, 2, 3], SamplingParams(max_new_tokens=2), method="dart")]})[0]
    with pytest.raises(ValueError, match="default method"):
        RoutedDrafter({"dart": plain.drafter}, default="eagle3")
    with pytest.raises(ValueError, match="no drafter for method eagle3"):
        RoutedDrafter({"dart": plain.drafter}, default="dart").new_state(1, torch.device("cpu"), methods=["eagle3"])
    with pytest.raises(ValueError, match="states are given"):
        RoutedState(["dart"], {"eagle3": HeadState.empty(1, plain.head, torch.device("cpu"))})


def test_settings_the_engine_shares_reach_every_drafter():
    """The engine sets its tree search and budget on its drafter (a server swaps in its gRPC
    client): through a routed drafter they reach the DART drafter, and the budget the EAGLE-3 one."""
    target = tiny_target("llama")
    engine = _routed_engine(target)
    budget = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 10.5)))
    engine.budget = budget
    engine.search_params = SearchParams(top_k=3, budget=7)
    dart, eagle3 = engine.drafter.drafters["dart"], engine.drafter.drafters["eagle3"]
    assert dart.budget is budget and eagle3.budget is budget
    assert dart.search_params.budget == 7 and engine.drafter.search_params.budget == 7
    assert engine.drafter.lookup_length == dart.lookup_length


def test_dart_model_with_both_heads(tiny_model_dir):
    """``from_pretrained(eagle3_head=...)`` loads an EAGLE-3 head beside the DART head, sized by the
    config and by the adaptive budget; ``generate(method=...)`` picks the drafter per call, and both
    give the autoregressive text.  ``eagle3_head`` with another method, and a method not loaded,
    are refused by name."""
    from dart_core.api import DartModel
    from dart_core.spec.speculative import SpeculativeConfig

    cfg = SpeculativeConfig(eagle3_total_tokens=12, eagle3_depth=3, eagle3_top_k=4)
    model = DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, speculative_config=cfg,
                                      eagle3_head="random")
    drafter = model.engine.drafter
    assert isinstance(drafter, RoutedDrafter) and model.engine.methods == ("dart", "eagle3")
    assert drafter.drafters["eagle3"].budget is model.engine.budget is not None
    assert drafter.drafters["eagle3"].total_tokens == 12
    prompt = [{"role": "user", "content": "Count from one to ten."}]
    ar = model.generate(prompt, max_new_tokens=16, speculative=False)[0].token_ids
    for method in (None, "dart", "eagle3"):
        out = model.generate(prompt, max_new_tokens=16, method=method)
        assert out[0].token_ids == ar and out.result.verified_nodes > out.result.target_forwards
    with pytest.raises(ValueError, match="method 'medusa'"):
        model.generate(prompt, max_new_tokens=4, method="medusa")
    with pytest.raises(ValueError, match="method 'eagle3'.*loaded: dart"):
        DartModel.from_pretrained(tiny_model_dir, head="random", trie=None).generate(prompt, method="eagle3")
    with pytest.raises(ValueError, match="eagle3_head loads an EAGLE-3 head beside"):
        DartModel.from_pretrained(tiny_model_dir, head="random", trie=None, eagle3_head="random",
                                  speculative_config=SpeculativeConfig(method="eagle3"))
