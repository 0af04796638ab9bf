"""The drafter interface: a drafter the engine has never seen plugs in with DartEngine(drafter=...)
and decodes losslessly through the same select, verify and accept phases; DraftBatch's fields."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dart_core.spec.budget import AdaptiveBudget, VerifyCostCurve, node_acceptance_estimates
from dart_core.spec.drafters import DraftBatch, Drafter, DraftInputs, NoDraft, Proposal, ProposalKind
from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams
from ngram_service.client import InProcessTreeSearch
from ngram_service.live import LiveCorpus
from ngram_service.tree_search import DraftTree, SearchParams, TreeBatch

from .conftest import make_tree, tiny_target
from .test_engine import prompts_of, random_head


class ChainOracle(Drafter):
    """A one-pass drafter of whole chains (as a DFlash-style block drafter would propose): the true
    continuation, wrong from a random depth on, with a wrong sibling at the first level. Reads no
    hidden states, so the engine keeps none for it."""

    def __init__(self, truth: list[list[int]], depth: int = 6, seed: int = 0) -> None:
        self.truth, self.depth, self.rng = truth, depth, np.random.default_rng(seed)
        self.proposed = []

    def propose(self, inputs):
        trees = []
        for seq in inputs.tokens:
            full = next((t for t in self.truth if t[: len(seq)] == seq), seq)
            chain = list(full[len(seq): len(seq) + self.depth])
            cut = int(self.rng.integers(0, len(chain) + 1))
            chain = chain[:cut] + [(x + 1) % 96 for x in chain[cut:]]
            tokens = [seq[-1]] + chain + [(chain[0] + 7) % 96 if chain else 5]
            parents = [-1] + list(range(len(chain))) + [0]
            depths = [0] + list(range(1, len(chain) + 1)) + [1]
            order = np.argsort(depths, kind="stable")  # depth order, as trees are stored
            remap = {int(o): i for i, o in enumerate(order)}
            tokens = [tokens[o] for o in order]
            parents = [-1 if parents[o] < 0 else remap[parents[o]] for o in order]
            depths = [depths[o] for o in order]
            probs = [1.0] + [0.9 if tok in chain else 0.1 for tok in tokens[1:]]
            trees.append(DraftTree.from_parents(tokens, parents, depths, np.zeros(len(tokens)), probs))
        self.proposed.append(len(trees))
        return Proposal(trees, kind="tree")


def test_a_new_drafter_plugs_in_without_engine_changes_and_stays_lossless():
    target = tiny_target("llama", seed=3)
    rng = np.random.default_rng(2)
    prompts = prompts_of(rng, [5, 8, 3])
    sp = SamplingParams(max_new_tokens=40)
    ar = DartEngine(target).generate(prompts, sp, speculative=False)
    truth = [p + o for p, o in zip(prompts, ar.token_ids)]
    drafter = ChainOracle(truth)
    engine = DartEngine(target, drafter=drafter)  # no draft head at all
    out = engine.generate(prompts, sp)
    assert out.token_ids == ar.token_ids and out.tau > 2.0 and drafter.proposed
    # the select phase applies to it too: an adaptive budget cuts its trees to what it prices
    budget = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 74.0)))
    engine = DartEngine(target, drafter=ChainOracle(truth, seed=1), budget=budget)
    steps = list(engine.generate_stream(prompts, sp))
    assert [t for s in steps for t in s.new_tokens] and engine.generate(prompts, sp).token_ids == ar.token_ids
    # speculative=False and a drafter that proposes nothing both step autoregressively
    assert DartEngine(target, drafter=drafter).generate(prompts, sp, speculative=False).tau == 1.0

    class Silent(Drafter):
        def propose(self, inputs):
            return None

    assert DartEngine(target, drafter=Silent()).generate(prompts, sp).token_ids == ar.token_ids


def test_draft_batch_fields():
    trees = [make_tree([5, 6, 7, 8], [-1, 0, 0, 1], [1.0, 0.5, 0.25, 0.5]), make_tree([9], [-1])]
    batch = DraftBatch.pack(trees, torch.device("cpu"))
    assert batch.num_nodes == 4 and batch.max_depth == 2 and batch.counts.tolist() == [4, 1]
    assert batch.tokens.tolist() == [[5, 6, 7, 8], [9, 0, 0, 0]]
    assert batch.parents.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]] and batch.depths[0].tolist() == [0, 1, 1, 2]
    assert np.allclose(batch.estimates[0].numpy(), node_acceptance_estimates(trees[0]))  # 1, .5, .25, .25
    assert batch.estimates[1].tolist() == [1.0, 0.0, 0.0, 0.0]  # padding is worth nothing
    assert batch.tree_mask[0, 3].tolist() == [True, True, False, True]
    assert batch.tree_mask[1].equal(torch.eye(4, dtype=torch.bool))  # padding sees only itself
    roots = NoDraft().propose(DraftInputs([[1, 2], [3]], [None, None]))
    assert roots.kind is ProposalKind.NONE and roots.trees.tokens.tolist() == [[2], [3]]
    assert roots.trees.counts.tolist() == [1, 1]
    assert Proposal(roots.trees, kind="lookup").kind is ProposalKind.LOOKUP  # the former strings still work
    with pytest.raises(ValueError, match="bush"):
        Proposal(roots.trees, kind="bush")


def test_root_only_trees_and_their_batch_equal_the_general_ones():
    """TreeBatch.roots equals the packing of lone-root trees made by from_parents, field by field;
    DraftBatch.pack of roots alone (the autoregressive step's shortcut) gives the fields the general
    packing gives a batch of one-node trees."""
    lone = [DraftTree.from_parents([t], [-1], [0], [0.0], [1.0]) for t in (3, 1, 4)]
    roots, slow = TreeBatch.roots([3, 1, 4]), TreeBatch.from_trees(lone)
    for name in ("tokens", "parents", "depths", "scores", "probs", "counts"):
        a, b = getattr(roots, name), getattr(slow, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert roots.clip_depth(np.zeros(3)) is roots
    batch = DraftBatch.pack(roots, torch.device("cpu"))
    # the general path, forced by one tree of two nodes, then cut back to the first column
    general = DraftBatch.pack(lone + [make_tree([5, 6], [-1, 0])], torch.device("cpu"))
    assert batch.num_nodes == 1 and batch.max_depth == 0
    for name in ("tokens", "parents", "depths", "estimates"):
        a, b = getattr(batch, name), getattr(general, name)[:3, :1]
        assert a.dtype == b.dtype and a.equal(b), name
    assert batch.counts.equal(general.counts[:3]) and batch.tree_mask.equal(general.tree_mask[:3, :1, :1])


def test_what_is_set_on_the_engine_reaches_its_default_drafter():
    """A server swaps in its gRPC tree search and a benchmark its parameters or budget on the engine:
    the default drafter reads the same objects; a drafter given to the engine is left alone."""
    target = tiny_target("llama")
    engine = DartEngine(target, random_head(target))
    search, params = InProcessTreeSearch(None), SearchParams(top_k=3, budget=5)
    budget = AdaptiveBudget(VerifyCostCurve((1, 64), (10.0, 74.0)))
    engine.tree_search, engine.search_params, engine.budget = search, params, budget
    d = engine.drafter
    assert (d.tree_search, d.search_params, d.budget) == (search, params, budget)
    mine = ChainOracle([[1]])
    engine = DartEngine(target, drafter=mine)
    engine.tree_search = search
    assert not hasattr(mine, "tree_search") and engine.tree_search is search


def test_an_exact_repeat_drafts_from_the_first_answer_and_stays_exact():
    """The n-gram service's live corpus (in process here): the engine's answer to a prompt, learned, lets a repeat of the prompt accept more
    tokens per step, and the greedy output is the same."""
    target = tiny_target("llama", seed=5)
    live = LiveCorpus(max_tokens=1 << 14)
    engine = DartEngine(target, random_head(target, seed=5), InProcessTreeSearch(None, live=live),
                        SearchParams(top_k=8, beam_width=4, budget=12))
    prompt = prompts_of(np.random.default_rng(5), [9])
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    first = engine.generate(prompt, sp)
    engine.tree_search.learn([prompt[0] + first.token_ids[0]])
    again = engine.generate(prompt, sp)
    assert again.token_ids == first.token_ids
    assert again.tau > first.tau + 1.0, (first.tau, again.tau)


def test_a_lookup_step_takes_the_live_corpus_chain_where_it_matches_longer():
    """The lookup drafter asks its tree-search client for the chains (each sequence's last tokens):
    with a live corpus in process, the corpus's chain replaces a request's own where it matched a
    longer suffix; without one, the own chains stay."""
    import types

    from dart_core.spec.drafters import LookupDrafter
    from ngram_service.context import ContextIndex

    live = LiveCorpus(max_tokens=256, max_context=4, min_match=1)  # the 3-token match below
    live.add([[1, 9, 3, 4, 5, 6, 7, 8]])
    own = ContextIndex(4, 1 << 16)
    own.append([3, 4, 9, 3, 4])  # its own chain: after [3, 4] came 9 (a 2-token match)
    budget = types.SimpleNamespace(select_lookup=lambda chains: 3)  # verify 3 chain tokens
    inputs = DraftInputs([[3, 4, 9, 3, 4]], [own])
    with_live = LookupDrafter(budget, 24, 60, InProcessTreeSearch(None, live=live)).propose(inputs)
    # the corpus matched [9, 3, 4]: 3 tokens
    assert with_live.trees.tokens[0, :4].tolist() == [4, 5, 6, 7] and with_live.chains[0].match_length == 3
    alone = LookupDrafter(budget, 24, 60, InProcessTreeSearch(None)).propose(inputs)
    assert alone.trees.tokens[0, :4].tolist() == [4, 9, 3, 4] and alone.chains[0].match_length == 2


@pytest.mark.parametrize("hints", [True, False])
def test_two_engines_one_service_a_repeat_through_the_other_drafts_from_the_first(hints):
    """Two engine replicas, one n-gram service (gRPC, live corpus): an answer generated through
    engine A and learned lets the same request through engine B accept more tokens per step, with
    the same greedy output, with and without live continuations answered beside each search (a tiny
    random target loops, so its own context competes with them: the next test isolates them)."""
    from ngram_service.client import GrpcTreeSearch
    from ngram_service.server import NgramServer

    target = tiny_target("llama", seed=5)
    server = NgramServer(None, threads=1, learn_max_tokens=1 << 14).start()
    clients = [GrpcTreeSearch(server.address, timeout_ms=5000, live_chain_length=24 if hints else 0)
               for _ in range(2)]

    def run(engine, prompt, sp):
        """(tokens, τ, the longest match of a lookup step's chain)"""
        matches = []
        propose = engine.drafter.propose

        def spy(inputs):
            p = propose(inputs)
            matches.extend(c.match_length for c in p.chains or ())
            return p

        engine.drafter.propose = spy
        steps = list(engine.generate_stream(prompt, sp))
        engine.drafter.propose = propose
        tokens = [t for s in steps for t in s.new_tokens[0]]
        spec = [s.accepted_lengths[0] for s in steps[1:]]
        return tokens, sum(spec) / len(spec), max(matches, default=0)

    try:
        a, b = (DartEngine(target, random_head(target, seed=5), c, SearchParams(top_k=8, beam_width=4, budget=12),
                           budget=AdaptiveBudget(VerifyCostCurve((1, 64), (0.010, 0.012))))
                for c in clients)
        prompt = prompts_of(np.random.default_rng(5), [9])
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
        before, tau_before, match_before = run(b, prompt, sp)  # B alone: its own context only
        first, _, _ = run(a, prompt, sp)
        assert first == before
        assert clients[0].learn([prompt[0] + first]) == len(prompt[0]) + 40 + 1
        again, tau_again, match_again = run(b, prompt, sp)
        assert again == first
        assert tau_again > tau_before + 1.0, (tau_before, tau_again)
        assert clients[1].fallbacks == 0 and clients[1].service_live
        assert match_before <= 4  # the request's own index matches at most context_order (4) tokens
    finally:
        for c in clients:
            c.close()
        server.stop()


class _LiveOracle(InProcessTreeSearch):
    """A logits-only search that answers, beside each tree, a live continuation: the true greedy
    continuation of each context (``truth``), wrong from position ``wrong_at`` on, matched on 8 tokens
    (more than the request's own index can match)."""

    def __init__(self, truth: list[int], wrong_at: int = 10 ** 9) -> None:
        super().__init__(None)
        self.truth, self.wrong_at = truth, wrong_at

    def search_batch(self, topk_ids, topk_probs, contexts, params, chains=None):
        from dataclasses import replace

        from ngram_service.tree_search import ContextChain

        trees = super().search_batch(topk_ids, topk_probs, contexts, params, chains)
        live = []
        for ctx in contexts:
            cont = [t if len(ctx) + i < self.wrong_at else (t + 1) % 96
                    for i, t in enumerate(self.truth[len(ctx):len(ctx) + 24])]
            live.append(ContextChain(np.array(cont, np.int64), np.full(len(cont), 0.9, np.float32), 8))
        return replace(trees, live=tuple(live))


@pytest.mark.parametrize("wrong_at", [10 ** 9, 20])
def test_lookup_steps_follow_the_live_continuation_a_search_answered_and_stay_exact(wrong_at):
    """The live continuation a tree search answers (TreeBatch.live) becomes a hint in the request's
    context index; the next lookup steps verify what remains of it while the output follows it, with
    no search between.  Right, it is accepted whole; wrong from some token on, the output is still
    the target's own."""

    target = tiny_target("llama", seed=5)
    prompt = prompts_of(np.random.default_rng(5), [9])
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = DartEngine(target).generate(prompt, sp, speculative=False).token_ids[0]
    engine = DartEngine(target, random_head(target, seed=5), _LiveOracle(prompt[0] + ar, wrong_at),
                        SearchParams(top_k=8, beam_width=4, budget=12),
                        budget=AdaptiveBudget(VerifyCostCurve((1, 64), (0.010, 0.012))))
    matches = []
    propose = engine.drafter.propose

    def spy(inputs):
        p = propose(inputs)
        matches.extend((c.match_length, int(n) - 1) for c, n in zip(p.chains or (), p.trees.counts))
        return p

    engine.drafter.propose = spy
    steps = list(engine.generate_stream(prompt, sp))
    assert [t for s in steps for t in s.new_tokens[0]] == ar
    # the oracle's chains match 8 tokens; followed since the search they report max_context + 1 (5 here),
    # which no own chain (context_order 4) reaches
    assert any(m == 5 for m, _ in matches), matches
    if wrong_at > len(prompt[0]) + 40:
        assert max(s.accepted_lengths[0] for s in steps if s.lookup) >= 12


def test_a_restarted_service_keeps_tau_on_repeats_from_its_snapshot(tmp_path):
    """What the service learned survives its restart through the snapshot: an answer learned before
    the restart still raises τ for its repeat after it, with the same greedy output."""
    from ngram_service.client import GrpcTreeSearch
    from ngram_service.server import NgramServer

    target = tiny_target("llama", seed=5)
    snap = str(tmp_path / "live.snap")
    prompt = prompts_of(np.random.default_rng(5), [9])
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)

    def run(server):
        client = GrpcTreeSearch(server.address, timeout_ms=5000, live_chain_length=24)
        client.wait_resolved(5)
        for _ in range(100):
            if client.service_live:
                break
            time.sleep(0.02)
        engine = DartEngine(target, random_head(target, seed=5), client, SearchParams(top_k=8, beam_width=4, budget=12),
                            budget=AdaptiveBudget(VerifyCostCurve((1, 64), (0.010, 0.012))))
        out = engine.generate(prompt, sp)
        return client, out

    first = NgramServer(None, threads=1, learn_max_tokens=1 << 14, learn_snapshot=snap).start()
    client, before = run(first)
    client.learn([prompt[0] + before.token_ids[0]])
    client.close()
    first.stop()  # writes the snapshot
    again = NgramServer(None, threads=1, learn_max_tokens=1 << 14, learn_snapshot=snap).start()
    try:
        client, after = run(again)
        client.close()
        assert after.token_ids == before.token_ids
        assert after.tau > before.tau + 1.0, (before.tau, after.tau)
    finally:
        again.stop()
