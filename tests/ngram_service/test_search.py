"""DART tree search: hand-written trees with exact arrays, invariants, and
equality with the Python reference on more than 1,000 random cases."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngram_service.tree_search import (ContextChain, DraftTree, SearchParams, TreeBatch, search_tree, search_tree_batch,
                                      search_trees)

from .conftest import make_trie, random_docs
from .reference import RefParams, ReferenceNgram, reference_search

FIELDS = ("tokens", "parents", "depths", "scores", "tree_mask", "retrieve_indices", "probs")


def assert_tree_equal(tree: DraftTree, want: dict):
    for name in FIELDS:
        got = getattr(tree, name)
        assert got.shape == want[name].shape, name
        np.testing.assert_array_equal(got, want[name], err_msg=name)


def test_worked_example_logits_only():
    ids = np.array([[5, 6], [7, 8]])
    probs = np.array([[0.6, 0.4], [0.9, 0.1]], dtype=np.float32)
    tree = search_tree(ids, probs, [1, 2, 3],
                       params=SearchParams(top_k=2, beam_width=1, max_depth=2, budget=2, use_ngram=False))
    np.testing.assert_array_equal(tree.tokens, [3, 5, 7])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 1])
    np.testing.assert_array_equal(tree.depths, [0, 1, 2])
    np.testing.assert_array_equal(tree.tree_mask, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(tree.retrieve_indices, [[0, 1, 2]])
    s1 = np.log(np.float64(np.float32(0.6)) + 1e-10)
    s2 = s1 + 2 ** -0.7 * 0.9 * np.log(np.float64(np.float32(0.9)) + 1e-10)
    np.testing.assert_array_equal(tree.scores, [0.0, s1, s2])


def test_hand_written_tree_with_trie(tiny):
    trie, _ = tiny  # docs [1 2 3 1 2 4] [2 3 1]
    ids = np.array([[2, 3], [3, 4]])
    probs = np.array([[0.6, 0.4], [0.9, 0.1]], dtype=np.float32)
    tree = search_tree(ids, probs, [1], trie=trie,
                       params=SearchParams(top_k=2, beam_width=2, max_depth=2, budget=5))
    # level 0 (no n-gram term): 2 (-0.51), 3 (-0.92).  Level 1: after [1 2], p_ngram(3) = p_ngram(4) = 1/2;
    # after [1 3] nothing follows 3 but 1, so 3 and 4 get log(1e-10) and rank last.
    np.testing.assert_array_equal(tree.tokens, [1, 2, 3, 3, 4, 3])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 0, 1, 1, 2])
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(tree.retrieve_indices, [[0, 1, 3], [0, 1, 4], [0, 2, 5]])
    np.testing.assert_array_equal(tree.tree_mask.astype(int), [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ])
    lam1 = 2 ** -0.7
    p = lambda x: np.float64(np.float32(x))  # noqa: E731
    want_23 = np.log(p(0.6) + 1e-10) + lam1 * (0.9 * np.log(p(0.9) + 1e-10) + 0.5 * np.log(0.5 + 1e-10))
    assert tree.scores[3] == want_23


def test_eos_ranks_last_and_is_not_extended():
    ids = np.array([[9, 5, 6], [7, 8, 1]])
    probs = np.array([[0.9, 0.05, 0.05], [0.5, 0.3, 0.2]], dtype=np.float32)
    tree = search_tree(ids, probs, [1], params=SearchParams(
        top_k=3, beam_width=2, max_depth=2, budget=10, eos_token_id=9, use_ngram=False))
    # 9 (EOS) has the best score but loses its beam slot; it is still a leaf of the tree
    assert 9 in tree.tokens.tolist()
    eos_node = tree.tokens.tolist().index(9)
    assert eos_node not in tree.parents.tolist()
    assert sorted(tree.tokens[tree.depths == 2].tolist()) == sorted([7, 8, 1] * 2)


def test_prefix_closed_with_certain_drafts():
    # p = 1 makes every increment log(1 + 1e-10) > 0: a child outscores its parent
    ids = np.tile(np.arange(3), (6, 1))
    probs = np.tile(np.array([1.0, 0.0, 0.0], dtype=np.float32), (6, 1))
    tree = search_tree(ids, probs, [0], params=SearchParams(top_k=3, beam_width=3, max_depth=6, budget=4,
                                                             use_ngram=False))
    np.testing.assert_array_equal(tree.depths, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 1, 2, 3])


def test_budget_zero_and_small_inputs():
    tree = search_tree(np.array([[4]]), np.array([[1.0]], dtype=np.float32), [7], params=SearchParams(budget=0))
    np.testing.assert_array_equal(tree.tokens, [7])
    np.testing.assert_array_equal(tree.retrieve_indices, [[0]])
    tree = search_tree(np.array([[4]]), np.array([[1.0]], dtype=np.float32), [7])
    np.testing.assert_array_equal(tree.tokens, [7, 4])


@pytest.mark.parametrize("bad", [
    dict(ids=np.zeros((2, 3), np.int64), probs=np.zeros((2, 2), np.float32), ctx=[1], match="shapes"),
    dict(ids=np.zeros((2, 3), np.int64), probs=np.full((2, 3), 1.5, np.float32), ctx=[1], match="probabilit"),
    dict(ids=np.zeros((2, 3), np.int64), probs=np.full((2, 3), np.nan, np.float32), ctx=[1], match="probabilit"),
    dict(ids=np.full((2, 3), -4, np.int64), probs=np.zeros((2, 3), np.float32), ctx=[1], match="out of range"),
    dict(ids=np.zeros((2, 3), np.int64), probs=np.zeros((2, 3), np.float32), ctx=[], match="root token"),
    dict(ids=np.zeros((3,), np.int64), probs=np.zeros((3,), np.float32), ctx=[1], match="dimensions"),
])
def test_invalid_inputs_raise(bad):
    with pytest.raises(ValueError, match=bad["match"]):
        search_tree(bad["ids"], bad["probs"], bad["ctx"])


@pytest.mark.parametrize("field,value", [("top_k", 0), ("beam_width", 0), ("budget", -1), ("num_threads", 0),
                                         ("epsilon", 0.0), ("ngram_weight", -1.0)])
def test_invalid_params_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SearchParams(**{field: value})
    params = SearchParams()
    with pytest.raises(dataclasses.FrozenInstanceError):  # no setter can skip the validation
        setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(params, **{field: value})
    assert getattr(params.native(), field) == getattr(params, field)


def _random_case(rng: np.random.Generator, vocab: int, reference_defaults: bool):
    if reference_defaults:
        p = RefParams()
    else:
        p = RefParams(top_k=int(rng.integers(1, 8)), beam_width=int(rng.integers(1, 7)),
                      max_depth=int(rng.integers(1, 6)), budget=int(rng.integers(0, 30)),
                      level_weight_exponent=float(rng.uniform(0, 1.5)), logit_weight_base=float(rng.uniform(0.5, 1.0)),
                      ngram_weight=float(rng.choice([0.0, 0.5, rng.uniform(0, 2)])),
                      eos_token_id=int(rng.integers(-1, vocab)), ngram_at_level0=bool(rng.random() < 0.3),
                      use_ngram=bool(rng.random() < 0.85))
    depth = int(rng.integers(1, 9))
    k = int(rng.integers(1, 26)) if not reference_defaults else 25
    ids = np.stack([rng.choice(vocab, size=k, replace=k > vocab) for _ in range(depth)]).astype(np.int64)
    logits = rng.normal(size=(depth, k)) * rng.uniform(0.5, 4)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    probs = -np.sort(-probs, axis=-1).astype(np.float32)
    if rng.random() < 0.1:  # ties and certain drafts
        probs = np.round(probs, 1).astype(np.float32)
    ctx = [int(x) for x in rng.integers(0, vocab, size=rng.integers(1, 10))]
    return p, ids, probs, ctx


def _native_params(p: RefParams, threads: int = 1) -> SearchParams:
    return SearchParams(**vars(p), num_threads=threads)


def _random_chain(rng: np.random.Generator, vocab: int, ids: np.ndarray):
    """A context continuation: some tokens the head also drafted, some it missed."""
    n = int(rng.integers(0, ids.shape[0] + 2))
    tokens = [int(ids[l, rng.integers(ids.shape[1])]) if l < ids.shape[0] and rng.random() < 0.5
              else int(rng.integers(vocab)) for l in range(n)]
    probs = rng.choice([0.0, 0.25, 1.0, rng.uniform()], size=n).astype(np.float32)
    return ContextChain(np.array(tokens, dtype=np.int64), probs)


def _random_trie(tmp_path, rng, order: int, *, max_vocab: int, num_docs: int, max_len: int):
    """(vocab, docs, trie, reference) of a random corpus: the C++ trie and its plain-Python reference."""
    vocab = int(rng.integers(4, max_vocab))
    docs = random_docs(rng, vocab, num_docs=num_docs, max_len=max_len)
    return vocab, docs, make_trie(tmp_path, docs, order, vocab), ReferenceNgram(docs, order)


def test_context_chains_match_reference(tmp_path):
    """Random cases with a context continuation and κ > 0: identical trees, node probabilities."""
    for seed in range(6):
        rng = np.random.default_rng(2000 + seed)
        vocab, docs, trie, ref = _random_trie(tmp_path, rng, 2 + seed % 3, max_vocab=30, num_docs=40, max_len=60)
        for i in range(60):
            p, ids, probs, ctx = _random_case(rng, vocab, reference_defaults=i % 10 == 0)
            p.context_weight = float(rng.choice([0.0, 0.5, 1.0, rng.uniform(0, 3)]))
            chain = _random_chain(rng, vocab, ids)
            want = reference_search(ids, probs, ctx, ref, p, chain.tokens, chain.probs)
            got = search_tree(ids, probs, ctx, trie=trie, params=_native_params(p), chain=chain)
            assert_tree_equal(got, want)
            want_none = reference_search(ids, probs, ctx, ref, p)
            if p.context_weight == 0 or len(chain.tokens) == 0:  # κ = 0 or no chain: the plain search
                assert_tree_equal(got, want_none)


def test_a_chain_the_head_missed_enters_the_tree():
    ids = np.array([[5, 6], [7, 8], [9, 10]])
    probs = np.array([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3]], dtype=np.float32)
    chain = ContextChain(np.array([40, 41, 42]), np.array([1.0, 1.0, 0.5], dtype=np.float32))
    params = SearchParams(top_k=2, beam_width=2, max_depth=3, budget=12, use_ngram=False, context_weight=0.8)
    tree = search_tree(ids, probs, [1, 2], params=params, chain=chain)
    path = [(int(tree.tokens[i]), int(tree.parents[i])) for i in range(tree.num_nodes)]
    at = {tok: i for i, (tok, _) in enumerate(path)}
    assert {40, 41, 42} <= set(at) and path[at[41]][1] == at[40] and path[at[42]][1] == at[41]
    # scored with κ·q, priced with q (the budget's acceptance estimate)
    np.testing.assert_allclose(tree.probs[[at[40], at[41], at[42]]], [1.0, 1.0, 0.5])
    plain = search_tree(ids, probs, [1, 2], params=dataclasses.replace(params, context_weight=0.0), chain=chain)
    assert not {40, 41, 42} & set(plain.tokens.tolist())  # κ = 0: the chain is ignored


def test_context_index_matches_reference():
    from ngram_service.context import ContextIndex

    from .reference import ReferenceContext

    for seed in range(40):
        rng = np.random.default_rng(seed)
        vocab = int(rng.integers(2, 12))
        max_context, max_tokens = int(rng.integers(1, 6)), int(rng.integers(14, 80))
        idx, ref = ContextIndex(max_context, max_tokens), ReferenceContext(max_context, max_tokens)
        for _ in range(int(rng.integers(1, 12))):
            chunk = rng.integers(0, vocab, size=int(rng.integers(0, 20))).tolist()
            idx.append(chunk)
            ref.append(chunk)
            assert len(idx) == len(ref.tokens)
            for _ in range(5):
                extra = rng.integers(0, vocab, size=int(rng.integers(0, 4))).tolist()
                tok = int(rng.integers(vocab))
                assert idx.probability(tok, extra) == ref.probability(extra, tok)
            max_len = int(rng.integers(0, 10))
            got, (tokens, probs, match) = idx.continuation(max_len), ref.continuation(max_len)
            assert got.tokens.tolist() == tokens and got.match_length == match
            np.testing.assert_array_equal(got.probs, np.array(probs, dtype=np.float32).reshape(-1))


def test_context_index_worked_example_and_errors():
    from ngram_service.context import ContextIndex

    idx = ContextIndex(max_context=3, max_tokens=64)
    idx.append([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    chain = idx.continuation(5)  # "1 2" last followed "... 4 1 2" by 3 5 1 2, then the copy repeats itself
    assert chain.tokens.tolist() == [3, 5, 1, 2, 3] and chain.match_length == 2
    # q = (|s| / 3) · count(s·tok) / count(s): "1 2" → 3 twice in two (2/3 · 1); "1 2 3" → 5 once in two
    # (3/3 · 1/2); "2 3 5" → 1 and "3 5 1" → 2 once in one; then "1 2" → 3 again
    np.testing.assert_allclose(chain.probs, [2 / 3, 0.5, 1.0, 1.0, 2 / 3], rtol=1e-6)
    assert idx.probability(3) == pytest.approx(2 / 3) and idx.probability(4, extra=[3]) == 0.5
    assert idx.probability(9) == 0.0
    assert ContextIndex(2, 16).continuation(4).tokens.tolist() == []
    with pytest.raises(ValueError):
        ContextIndex(0, 64)
    with pytest.raises(ValueError):
        ContextIndex(4, 4)
    with pytest.raises(ValueError):
        idx.append([-1])


def test_random_cases_match_reference(tmp_path):
    """1,200 random cases over random tries of every order: trees identical, scores bit for bit."""
    cases = 0
    for seed in range(12):
        rng = np.random.default_rng(1000 + seed)
        vocab, docs, trie, ref = _random_trie(tmp_path, rng, 2 + seed % 5, max_vocab=40, num_docs=60, max_len=80)
        for i in range(100):
            p, ids, probs, ctx = _random_case(rng, vocab, reference_defaults=i % 10 == 0)
            if i % 2 == 0 and docs[i % len(docs)]:  # contexts seen in the corpus exercise long suffixes
                ctx = docs[i % len(docs)][: int(rng.integers(1, len(docs[i % len(docs)]) + 1))]
            want = reference_search(ids, probs, ctx, ref, p)
            assert_tree_equal(search_tree(ids, probs, ctx, trie=trie, params=_native_params(p)), want)
            cases += 1
    assert cases >= 1000


def test_logits_only_matches_reference():
    rng = np.random.default_rng(5)
    for _ in range(100):
        p, ids, probs, ctx = _random_case(rng, 50, reference_defaults=False)
        want = reference_search(ids, probs, ctx, None, p)
        assert_tree_equal(search_tree(ids, probs, ctx, trie=None, params=_native_params(p)), want)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), order=st.integers(2, 6), vocab=st.integers(2, 20))
def test_property_search_matches_reference(tmp_path_factory, seed, order, vocab):
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, vocab, num_docs=20, max_len=40)
    trie = make_trie(tmp_path_factory.mktemp("s"), docs, order, vocab)
    ref = ReferenceNgram(docs, order)
    p, ids, probs, ctx = _random_case(rng, vocab, reference_defaults=False)
    tree = search_tree(ids, probs, ctx, trie=trie, params=_native_params(p))
    assert_tree_equal(tree, reference_search(ids, probs, ctx, ref, p))
    # invariants: prefix-closed, parents first, mask = ancestors, retrieve rows are root-to-leaf paths
    assert all(0 <= tree.parents[i] < i for i in range(1, tree.num_nodes))
    assert all(tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, tree.num_nodes))
    assert tree.num_nodes <= p.budget + 1


def test_batched_and_threaded_equal_single(tmp_path):
    rng = np.random.default_rng(3)
    docs = random_docs(rng, 30, num_docs=50, max_len=60)
    trie = make_trie(tmp_path, docs, 3, 30)
    batch, depth, k = 16, 8, 25
    ids = rng.integers(0, 30, size=(batch, depth, k))
    probs = rng.dirichlet(np.ones(k), size=(batch, depth)).astype(np.float32)
    contexts = [list(rng.integers(0, 30, size=rng.integers(1, 20))) for _ in range(batch)]
    single = [search_tree(ids[b], probs[b], contexts[b], trie=trie) for b in range(batch)]
    for threads in (1, 4):
        trees = search_trees(ids, probs, contexts, trie=trie, params=SearchParams(num_threads=threads))
        for a, b in zip(trees, single):
            for name in FIELDS:
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    with pytest.raises(ValueError):
        search_trees(ids, probs, contexts[:-1], trie=trie)
    with pytest.raises(ValueError, match="non-empty context"):
        search_trees(ids[:2], probs[:2], [[1], []], trie=trie, params=SearchParams(num_threads=2))


def test_the_in_process_client_searches_a_batch_on_its_threads(tmp_path, monkeypatch):
    """InProcessTreeSearch runs a batch on up to ``threads`` C++ threads (default: the usable
    CPUs, as the gRPC service), whatever num_threads the caller's params hold, with the same
    trees as one thread; a bad thread count is refused."""
    from ngram_service import client as client_mod

    rng = np.random.default_rng(4)
    trie = make_trie(tmp_path, random_docs(rng, 30, num_docs=50, max_len=60), 3, 30)
    ids = rng.integers(0, 30, size=(6, 8, 25))
    probs = rng.dirichlet(np.ones(25), size=(6, 8)).astype(np.float32)
    contexts = [list(rng.integers(0, 30, size=rng.integers(1, 20))) for _ in range(6)]
    seen = []
    real = client_mod.search_trees
    monkeypatch.setattr(client_mod, "search_trees", lambda *a, params, **kw: seen.append(params.num_threads)
                        or real(*a, params=params, **kw))
    one = client_mod.InProcessTreeSearch(trie, threads=1).search(ids, probs, contexts, SearchParams(num_threads=3))
    four = client_mod.InProcessTreeSearch(trie, threads=4)
    for batch in (6, 2):
        trees = four.search(ids[:batch], probs[:batch], contexts[:batch], SearchParams())
        for a, b in zip(trees, one[:batch]):
            for name in FIELDS:
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert seen == [1, 4, 2]  # never more threads than sequences
    assert client_mod.InProcessTreeSearch(trie).threads >= 1
    with pytest.raises(ValueError, match="threads"):
        client_mod.InProcessTreeSearch(trie, threads=0)


def test_selecting_a_subtree_keeps_every_field_consistent():
    rng = np.random.default_rng(11)
    for _ in range(30):
        ids = rng.integers(0, 40, size=(4, 6))
        probs = rng.dirichlet(np.ones(6), size=4).astype(np.float32)
        tree = search_tree(ids, probs, [1, 2], params=SearchParams(top_k=6, beam_width=3, budget=12,
                                                                    use_ngram=False))
        keep = np.zeros(tree.num_nodes, dtype=bool)
        keep[0] = True
        for i in range(1, tree.num_nodes):  # a random prefix-closed subset
            keep[i] = keep[tree.parents[i]] and rng.random() < 0.7
        sub = tree.select(keep)
        rebuilt = DraftTree.from_parents(sub.tokens, sub.parents, sub.depths, sub.scores, sub.probs)
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(sub, f), getattr(rebuilt, f), err_msg=f)
        assert sub.retrieve_indices.shape[0] >= 1 and (sub.retrieve_indices[:, 0] == 0).all()
        clipped = tree.clip_depth(2)
        assert clipped.depths.max() <= 2 and clipped.retrieve_indices.shape[1] == int(clipped.depths.max()) + 1
        assert tree.select(np.ones(tree.num_nodes, dtype=bool)) is tree
    with pytest.raises(ValueError, match="prefix-closed"):
        tree.select(np.r_[True, False, np.ones(tree.num_nodes - 2, dtype=bool)])
    with pytest.raises(ValueError, match="prefix-closed"):
        tree.select(np.r_[False, np.ones(tree.num_nodes - 1, dtype=bool)])


def test_the_tree_batch_search_writes_the_trees_padded(tmp_path):
    """search_tree_batch (the C++ search writing one padded batch) equals search_trees' trees packed, on
    one and several threads, with and without chains; its ancestor mask, path products and rows equal
    each tree's own; padding is token 0, parent 0, depth 0, probability 0 and sees only itself."""
    rng = np.random.default_rng(5)
    trie = make_trie(tmp_path, random_docs(rng, 30, num_docs=50, max_len=60), 3, 30)
    batch, depth, k = 7, 5, 6
    ids = rng.integers(0, 30, size=(batch, depth, k))
    probs = np.sort(rng.dirichlet(np.ones(k), size=(batch, depth)).astype(np.float32), axis=-1)[..., ::-1].copy()
    contexts = [list(rng.integers(0, 30, size=rng.integers(1, 20))) for _ in range(batch)]
    chains = [None, ContextChain(np.array([3, 4, 5]), np.array([0.9, 0.8, 0.7], np.float32), 2)] * 3 + [None]
    for threads, budget, with_chains in ((1, 9, False), (3, 9, True), (2, 0, False), (1, 40, True)):
        params = SearchParams(top_k=k, beam_width=3, max_depth=depth, budget=budget, num_threads=threads)
        trees = search_trees(ids, probs, contexts, trie=trie, params=params, chains=chains if with_chains else None)
        got = search_tree_batch(ids, probs, contexts, trie=trie, params=params, chains=chains if with_chains else None)
        want = TreeBatch.from_trees(trees)
        for name in ("tokens", "parents", "depths", "scores", "probs", "counts"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
        mask, est = got.ancestor_mask(), got.path_products()
        n = got.num_nodes
        for i, tree in enumerate(trees):
            m = tree.num_nodes
            np.testing.assert_array_equal(mask[i, :m, :m], tree.tree_mask)
            np.testing.assert_array_equal(mask[i, m:], np.eye(n, dtype=bool)[m:])
            assert not mask[i, :m, m:].any()
            np.testing.assert_allclose(est[i, :m], _path_products(tree))
            assert (est[i, m:] == 0).all() and (got.tokens[i, m:] == 0).all() and (got.parents[i, m:] == 0).all()
            row = got.tree(i)
            for name in FIELDS:
                np.testing.assert_array_equal(getattr(row, name), getattr(tree, name), err_msg=name)
        assert got.max_depth == max(int(t.depths.max()) for t in trees)


def _path_products(tree: DraftTree) -> np.ndarray:
    est = np.ones(tree.num_nodes)
    for i in range(1, tree.num_nodes):
        est[i] = est[tree.parents[i]] * tree.probs[i]
    return est


def test_a_tree_batch_selects_and_clips_as_each_tree_does():
    """TreeBatch.select and clip_depth (whole-batch array operations) equal DraftTree.select and
    clip_depth row by row, on random prefix-closed subsets of searched trees; the errors are
    DraftTree's; keeping everything returns the batch itself."""
    rng = np.random.default_rng(12)
    for _ in range(40):
        b = int(rng.integers(1, 6))
        ids = rng.integers(0, 40, size=(b, 4, 6))
        probs = rng.dirichlet(np.ones(6), size=(b, 4)).astype(np.float32)
        params = SearchParams(top_k=6, beam_width=int(rng.integers(1, 4)), budget=int(rng.integers(0, 14)),
                              use_ngram=False)
        trees = search_trees(ids, probs, [[1, 2]] * b, params=params)
        batch = search_tree_batch(ids, probs, [[1, 2]] * b, params=params)
        keep = rng.random(batch.tokens.shape) < 0.7
        keep[:, 0] = True
        for i, tree in enumerate(trees):  # prefix-closed per row (padding entries are ignored)
            for j in range(1, tree.num_nodes):
                keep[i, j] &= keep[i, tree.parents[j]]
        sub = batch.select(keep)
        limits = rng.integers(-1, 4, size=b)
        clipped = batch.clip_depth(limits)
        for i, tree in enumerate(trees):
            for name in FIELDS:
                want = tree.select(keep[i, : tree.num_nodes])
                np.testing.assert_array_equal(getattr(sub.tree(i), name), getattr(want, name), err_msg=name)
                want = tree.clip_depth(int(limits[i]))
                np.testing.assert_array_equal(getattr(clipped.tree(i), name), getattr(want, name), err_msg=name)
        assert sub.num_nodes == int(sub.counts.max())
    assert batch.select(np.ones(batch.tokens.shape, dtype=bool)) is batch
    assert batch.clip_depth(np.full(b, 99)) is batch
    deep = TreeBatch.from_trees([DraftTree.from_parents([1, 2, 3], [-1, 0, 1], [0, 1, 2], [0, 0, 0], [1, 1, 1])])
    with pytest.raises(ValueError, match="prefix-closed"):
        deep.select(np.array([[True, False, True]]))
    with pytest.raises(ValueError, match="root"):
        deep.select(np.array([[False, True, True]]))
    with pytest.raises(ValueError, match="shape"):
        deep.select(np.array([True, True, True]))
    with pytest.raises(ValueError, match="counts"):
        TreeBatch(deep.tokens, deep.parents, deep.depths, deep.scores, deep.probs, np.array([4]))
    with pytest.raises(ValueError, match="one shape"):
        TreeBatch(deep.tokens, deep.parents[:, :2], deep.depths, deep.scores, deep.probs, deep.counts)
    loop = TreeBatch(deep.tokens, np.array([[-1, 2, 1]], np.int32), deep.depths, deep.scores, deep.probs, deep.counts)
    for method in (loop.ancestor_mask, loop.path_values, lambda: loop.select(np.array([[True, True, False]]))):
        with pytest.raises(ValueError, match="parent must precede"):
            method()
    with pytest.raises(ValueError, match="follow their parents"):
        TreeBatch.checked(loop.tokens, loop.parents, loop.depths, loop.scores, loop.probs, loop.counts)
    roots = TreeBatch.roots([7, 8])
    assert roots.num_nodes == 1 and roots.max_depth == 0 and roots.tree(1).tokens.tolist() == [8]
