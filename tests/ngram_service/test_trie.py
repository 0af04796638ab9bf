"""Trie counts and back-off lookups: exact hand-written cases, then the C++
trie against the Python reference on random corpora (in memory and with
sorted runs spilled to disk)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngram_service.build import build_trie
from ngram_service.trie import NgramTrie, TokenizerMismatchError

from .conftest import make_trie, random_docs
from .reference import ReferenceNgram


def test_hand_written_counts(tiny):
    trie, _ = tiny
    # docs [1 2 3 1 2 4] [2 3 1]
    assert trie.info.nodes_per_level == (4, 4, 4)  # {1,2,3,4} {12,23,31,24} {123,231,312,124}
    assert trie.count([]) == 9
    assert [trie.count([t]) for t in (1, 2, 3, 4, 5)] == [3, 3, 2, 1, 0]
    assert trie.count([1, 2]) == 2 and trie.count([2, 3]) == 2 and trie.count([3, 1]) == 2
    assert trie.count([2, 4]) == 1 and trie.count([4, 1]) == 0
    assert trie.count([1, 2, 3]) == 1 and trie.count([2, 3, 1]) == 2 and trie.count([1, 2, 4]) == 1
    assert trie.count([1, 2, 3, 1]) == 0  # longer than the order
    assert trie.count([99]) == 0  # outside the vocabulary


def test_hand_written_probabilities(tiny):
    trie, _ = tiny
    np.testing.assert_array_equal(trie.probability([1, 2], [3, 4, 1]), [0.5, 0.5, 0.0])
    # [9, 2]: 2-suffix absent -> back off to [2]: children 3 (2/3), 4 (1/3)
    np.testing.assert_array_equal(trie.probability([9, 2], [3, 4]), [2 / 3, 1 / 3])
    # [2, 3] -> 1 with 2/2; [3] alone predicts 1 with 2/2 as well
    np.testing.assert_array_equal(trie.probability([2, 3], [1, 2]), [1.0, 0.0])
    # empty context: no non-empty suffix -> 0 (the unigram is never used)
    np.testing.assert_array_equal(trie.probability([], [1, 2]), [0.0, 0.0])
    # only the last order-1 tokens matter
    np.testing.assert_array_equal(trie.probability([4, 4, 4, 1, 2], [3]), [0.5])


def test_probability_batch_shapes(tiny):
    trie, _ = tiny
    out = trie.probability_batch([[1, 2], [2], []], np.array([[3, 4], [3, 3], [1, 1]]))
    np.testing.assert_array_equal(out, [[0.5, 0.5], [2 / 3, 2 / 3], [0.0, 0.0]])
    with pytest.raises(ValueError):
        trie.probability_batch([[1, 2]], np.array([[3, 4], [1, 1]]))
    with pytest.raises(ValueError):
        trie.probability([-1, 2], [3])


def test_info_and_metadata(tmp_path):
    path = tmp_path / "m.trie"
    build_trie([[1, 2, 3]], path, vocab_size=5, order=4, tokenizer_name="tok", vocab_hash="ab" * 32,
               metadata={"corpus": "unit"})
    trie = NgramTrie(path, verify=True)
    assert (trie.order, trie.vocab_size, trie.info.total_tokens) == (4, 5, 3)
    assert trie.info.tokenizer_name == "tok" and trie.info.vocab_hash == "ab" * 32
    assert trie.info.metadata["corpus"] == "unit" and trie.info.metadata["min_count"] == 1
    trie.check_tokenizer("ab" * 32)
    with pytest.raises(TokenizerMismatchError, match="rebuild"):
        trie.check_tokenizer("cd" * 32)


def _assert_matches_reference(trie: NgramTrie, ref: ReferenceNgram, rng: np.random.Generator, vocab: int):
    assert list(trie.info.nodes_per_level) == ref.nodes_per_level()
    assert trie.info.total_tokens == ref.total
    for ngram, c in ref.counts.items():
        assert trie.count(ngram) == c, ngram
    for _ in range(50):  # absent n-grams
        g = tuple(int(x) for x in rng.integers(0, vocab, size=rng.integers(1, ref.order + 1)))
        assert trie.count(g) == ref.count(g)
    contexts = [list(rng.integers(0, vocab, size=rng.integers(0, ref.order + 2))) for _ in range(40)]
    grams = [g for g in ref.counts if len(g) > 1]
    contexts += [list(grams[i][:-1]) for i in rng.integers(0, len(grams), size=40)] if grams else []
    tokens = rng.integers(0, vocab, size=(len(contexts), vocab))
    got = trie.probability_batch(contexts, tokens)
    want = [[ref.probability(c, int(t)) for t in row] for c, row in zip(contexts, tokens)]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("order", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("spill", [False, True])
def test_random_corpora_match_reference(tmp_path, order, spill):
    rng = np.random.default_rng(order * 10 + spill)
    vocab = 12
    docs = random_docs(rng, vocab, num_docs=300 if spill else 40, max_len=60)
    trie = make_trie(tmp_path, docs, order, vocab, memory_mb=0 if spill else 64)
    trie.verify()
    _assert_matches_reference(trie, ReferenceNgram(docs, order), rng, vocab)


@pytest.mark.parametrize("min_count", [2, 3])
def test_min_count_pruning_matches_reference(tmp_path, min_count):
    rng = np.random.default_rng(min_count)
    docs = random_docs(rng, 10, num_docs=80, max_len=40)
    trie = make_trie(tmp_path, docs, 3, 10, min_count=min_count, memory_mb=0)
    trie.verify()
    _assert_matches_reference(trie, ReferenceNgram(docs, 3, min_count), rng, 10)


def test_spilled_runs_give_identical_arrays(tmp_path):
    rng = np.random.default_rng(7)
    docs = random_docs(rng, 30, num_docs=400, max_len=50)
    a, b = tmp_path / "mem.trie", tmp_path / "disk.trie"
    sa = build_trie(docs, a, vocab_size=30, order=3, memory_mb=64)
    sb = build_trie(docs, b, vocab_size=30, order=3, memory_mb=0)
    assert sa.num_runs == 0 and sb.num_runs > 1
    ha, hb = NgramTrie(a).native.header_bytes, NgramTrie(b).native.header_bytes
    assert a.read_bytes()[ha:] == b.read_bytes()[hb:]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.integers(2, 6), vocab=st.integers(1, 8),
       docs=st.lists(st.lists(st.integers(0, 7), max_size=30), max_size=12))
def test_property_counts_match_reference(tmp_path_factory, order, vocab, docs):
    docs = [[t % vocab for t in d] for d in docs]
    trie = make_trie(tmp_path_factory.mktemp("p"), docs, order, vocab)
    trie.verify()
    _assert_matches_reference(trie, ReferenceNgram(docs, order), np.random.default_rng(0), vocab)


def test_bad_build_arguments(tmp_path):
    with pytest.raises(ValueError, match="order"):
        build_trie([[1]], tmp_path / "x.trie", vocab_size=5, order=7)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_trie([[1, 9]], tmp_path / "x.trie", vocab_size=5, order=3)
    with pytest.raises(ValueError, match="negative"):
        build_trie([[1, -2]], tmp_path / "x.trie", vocab_size=5, order=3)
    with pytest.raises(ValueError, match="min_count"):
        build_trie([[1]], tmp_path / "x.trie", vocab_size=5, order=3, min_count=0)
    assert not (tmp_path / "x.trie").exists()  # nothing half-written is left behind
