from __future__ import annotations

import numpy as np
import pytest

from ngram_service.build import build_trie
from ngram_service.trie import NgramTrie

from .reference import ReferenceNgram


def random_docs(rng: np.random.Generator, vocab: int, num_docs: int, max_len: int) -> list[list[int]]:
    """Documents with repeated phrases, so that back-off paths of every length occur."""
    phrases = [list(rng.integers(0, vocab, size=rng.integers(2, 6))) for _ in range(6)]
    docs = []
    for _ in range(num_docs):
        doc: list[int] = []
        target = int(rng.integers(0, max_len + 1))
        while len(doc) < target:
            doc.extend(phrases[rng.integers(len(phrases))] if rng.random() < 0.5 else [int(rng.integers(vocab))])
        docs.append([int(t) for t in doc[:target]])
    return docs


def make_trie(tmp_path, docs, order, vocab_size, **kwargs) -> NgramTrie:
    path = tmp_path / f"t{order}-{len(list(tmp_path.iterdir()))}.trie"
    build_trie(docs, path, vocab_size=vocab_size, order=order, **kwargs)
    return NgramTrie(path)


@pytest.fixture
def tiny(tmp_path):
    """The hand-written corpus used by the exact tests, order 3."""
    docs = [[1, 2, 3, 1, 2, 4], [2, 3, 1]]
    return make_trie(tmp_path, docs, 3, 10), ReferenceNgram(docs, 3)
