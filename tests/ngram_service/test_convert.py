"""``python -m ngram_service.convert``: the DART reference's ``.trie`` into our trie.

The fixture (``tests/fixtures/reference-ngram``, written by the reference's own
``TrieNgram.save``) converts with every count and every probability of the
reference's definition.  Merged and pruned files are written here in the reference
format from its description (node ids in any parent-first order, child lists
unsorted; merging sums counts; ``reduce`` drops nodes below the threshold and
subtracts each dropped subtree's counts from every kept ancestor), and the
pruned ones answer a probability in [0, 1] for every query, by the documented
rule, equal to the reference's wherever that is one in (0, 1].  Truncated and corrupted copies get ReferenceTrieError and leave nothing.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ngram_service.convert import ReferenceTrieError, convert_reference_trie, main
from ngram_service.trie import NgramTrie

FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference-ngram"
VOCAB = 49152


# -- the reference format, from its description ----------------------------------------


def count_windows(docs, order: int) -> dict[tuple, int]:
    """freq of every m-gram: the windows doc[i:i+order] (shorter at a document's end) that start with it."""
    counts: dict[tuple, int] = defaultdict(int)
    for doc in docs:
        doc = [int(t) for t in doc]
        for i in range(len(doc)):
            for m in range(1, min(order, len(doc) - i) + 1):
                counts[tuple(doc[i:i + m])] += 1
    return dict(counts)


def reduce_counts(counts: dict[tuple, int], threshold: int) -> dict[tuple, int]:
    """The reference's reduce(): nodes below the threshold go, and each dropped subtree's total
    (every dropped node's freq) is subtracted from every kept ancestor, the root included (key ())."""
    out = {(): 0} | dict(counts)  # a reduced root starts from 0
    dropped = {k for k, c in counts.items() if c < threshold}
    for k in dropped:  # each dropped node's freq comes off every kept ancestor
        for m in range(len(k) - 1, -1, -1):
            if k[:m] not in dropped:
                out[k[:m]] -= counts[k]
    return {k: c for k, c in out.items() if k not in dropped}


def write_reference(path: Path, counts: dict[tuple, int], order: int, seed: int = 0,
                    root_freq: int | None = None) -> None:
    """A reference-format file: ids in a random parent-first order, child lists shuffled."""
    rng = np.random.default_rng(seed)
    keys = [k for k in counts if len(k) >= 1]
    rng.shuffle(keys)
    keys.sort(key=len)  # parents first (a random order inside each depth)
    ids = {(): 0} | {k: i + 1 for i, k in enumerate(keys)}
    children: dict[tuple, list] = defaultdict(list)
    for k in keys:
        children[k[:-1]].append(k)
    blob = [struct.pack("<QQ", order, len(ids))]
    for k in [()] + keys:
        kids = list(children[k])
        rng.shuffle(kids)
        freq = counts.get(k, 0) if k else (root_freq if root_freq is not None else counts.get((), 0))
        blob.append(struct.pack("<iQiQ", k[-1] if k else 0, ids[k[:-1]] if k else 0, freq, len(kids)))
        blob.extend(struct.pack("<iQ", c[-1], ids[c]) for c in kids)
    path.write_bytes(b"".join(blob))


def reference_match(counts: dict[tuple, int], order: int, context, tok: int) -> tuple[int, int] | None:
    """(count of context + tok, count of context) for the longest context the reference's
    get_probability stops at (the longest stored suffix with a child ``tok``); None if none."""
    tail = tuple(context)[-(order - 1):]
    for m in range(len(tail), 0, -1):
        s = tail[-m:]
        if s in counts and s + (tok,) in counts:
            return counts[s + (tok,)], counts[s]
    return None


def reference_probability(counts: dict[tuple, int], order: int, context, tok: int) -> float:
    """The reference's get_probability, float32."""
    match = reference_match(counts, order, context, tok)
    if match is None:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float32(match[0]) / np.float32(match[1]))


def documented_probability(counts: dict[tuple, int], order: int, context, tok: int) -> float:
    """The converter's rule for pruned files as a model: the reference's ratio, but a context or
    child whose count is <= 0 is no evidence (the query backs off past it), and a ratio above 1
    is clamped to 1."""
    tail = tuple(context)[-(order - 1):]
    for m in range(len(tail), 0, -1):
        s = tail[-m:]
        if counts.get(s, 0) > 0 and counts.get(s + (tok,), 0) > 0:
            return min(1.0, float(np.float32(counts[s + (tok,)]) / np.float32(counts[s])))
    return 0.0


def fixture_docs():
    tokens = np.load(FIXTURE / "corpus_tokens.npy")
    offsets = np.load(FIXTURE / "corpus_doc_offsets.npy")
    return [tokens[offsets[d]:offsets[d + 1]] for d in range(len(offsets) - 1)]


def queries(docs, order: int):
    """Every (context, token) pair of the corpus: the order - 1 tokens before each position."""
    for doc in docs:
        doc = [int(t) for t in doc]
        for i in range(1, len(doc)):
            yield doc[max(0, i - order + 1):i], doc[i]


def convert(src: Path, dst: Path):
    return convert_reference_trie(src, dst, vocab_size=VOCAB, progress=False)


# -- tests -------------------------------------------------------------------------------


def test_the_fixture_converts_with_the_references_counts_and_probabilities(tmp_path):
    docs = fixture_docs()
    summary = convert(FIXTURE / "ref_order3.trie", tmp_path / "ref.trie")
    assert (summary.source_nodes, summary.nodes, summary.zero_count_nodes, summary.flags) == (90788, 90787, 0, 0)
    assert summary.total_tokens == sum(len(d) for d in docs) == 98507
    assert summary.file_bytes < summary.source_bytes / 3
    trie = NgramTrie(tmp_path / "ref.trie", verify=True)
    counts = count_windows(docs, 3)
    assert sum(summary.nodes_per_level) == len(counts)  # the same nodes ...
    keys = list(counts)
    assert all(trie.count(k) == counts[k] for k in keys)  # ... with the same counts
    pairs = list(queries(docs, 3))
    got = np.array([trie.probability(ctx, [tok])[0] for ctx, tok in pairs])
    want = np.array([reference_probability(counts, 3, ctx, tok) for ctx, tok in pairs])
    assert np.abs(got - want).max() <= 1e-6 and (got > 0).all()
    # a token never seen after a context backs off to shorter ones, as in the reference
    rng = np.random.default_rng(0)
    for ctx, _ in pairs[:: 97]:
        toks = rng.integers(0, VOCAB, 8)
        want = [reference_probability(counts, 3, ctx, int(t)) for t in toks]
        assert np.abs(trie.probability(ctx, toks) - want).max() <= 1e-6


def test_a_merged_file_converts_to_the_counts_of_both_corpora(tmp_path):
    docs = fixture_docs()
    a, b = count_windows(docs[:20], 4), count_windows(docs[20:], 4)
    merged = {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}  # add_all sums the freqs
    write_reference(tmp_path / "merged.trie", merged, 4, seed=1, root_freq=sum(len(d) for d in docs))
    summary = convert(tmp_path / "merged.trie", tmp_path / "out.trie")
    trie = NgramTrie(tmp_path / "out.trie")
    assert summary.order == 4 and summary.nodes == len(merged) and summary.flags == 0
    assert merged == count_windows(docs, 4)
    assert all(trie.count(k) == c for k, c in merged.items())


@pytest.mark.parametrize("order,threshold", [(3, 2), (4, 2), (4, 3)])
def test_pruned_files_answer_probabilities_in_0_1_by_the_documented_rule(tmp_path, order, threshold):
    docs = fixture_docs()[:24]
    pruned = reduce_counts(count_windows(docs, order), threshold)
    nodes = {k: c for k, c in pruned.items() if k}
    assert pruned[()] < 0  # as the reference: a reduced root goes negative
    assert any(c <= 0 for c in nodes.values())  # the cases the rule is for exist here
    write_reference(tmp_path / "pruned.trie", nodes, order, seed=order, root_freq=pruned[()])
    summary = convert(tmp_path / "pruned.trie", tmp_path / "out.trie")
    trie = NgramTrie(tmp_path / "out.trie", verify=True)
    assert summary.nodes == len(nodes) and summary.flags == 1  # every node kept: the reference's tree
    assert summary.zero_count_nodes == sum(c <= 0 for c in nodes.values())
    assert summary.above_parent == sum(1 for k, c in nodes.items() if len(k) > 1 and c > nodes[k[:-1]])
    assert all(trie.count(k) == max(c, 0) for k, c in nodes.items())
    pairs = list(queries(docs, order))
    got = np.array([trie.probability(ctx, [tok])[0] for ctx, tok in pairs])
    ref = np.array([reference_probability(nodes, order, ctx, tok) for ctx, tok in pairs])
    assert np.isfinite(got).all() and (got >= 0).all() and (got <= 1).all()
    assert np.abs(got - [documented_probability(nodes, order, c, t) for c, t in pairs]).max() <= 1e-6
    # every probability the reference computes from positive counts, in (0, 1], is the same here ...
    matches = [reference_match(nodes, order, ctx, tok) for ctx, tok in pairs]
    proper = np.array([m is not None and 0 < m[0] <= m[1] for m in matches])
    assert proper.any() and np.abs(got[proper] - ref[proper]).max() <= 1e-6
    # ... and the queries the rule is for are among these: NaN (0/0), infinite, negative, above 1 ...
    assert np.isnan(ref).any() and np.isinf(ref).any() and (ref < 0).any() and (ref[np.isfinite(ref)] > 1).any()
    # ... a ratio of two negative counts, and 0 from a child of count 0 (no back-off in the reference)
    # where a shorter context has evidence.  reduce() lowers only nodes with children, so these two
    # need a child of depth < order - 1: order 4 and up
    assert any(m is not None and m[0] < 0 and m[1] < 0 for m in matches) == (order >= 4)
    assert ((ref == 0) & (got > 0)).any() == (order >= 4)
    # a query about any token, not only the corpus's, gets the same treatment
    rng = np.random.default_rng(order)
    for ctx, tok in pairs[:: 53]:
        toks = np.append(rng.integers(0, VOCAB, 8), tok)
        want = [documented_probability(nodes, order, ctx, int(t)) for t in toks]
        assert np.abs(trie.probability(ctx, toks) - want).max() <= 1e-6


def test_a_file_with_consistent_counts_stays_format_version_1(tmp_path):
    """A reader that predates header flags opens every file that does not need them."""
    convert(FIXTURE / "ref_order3.trie", tmp_path / "ref.trie")
    head = (tmp_path / "ref.trie").read_bytes()[:64]
    assert struct.unpack_from("<I", head, 8) + struct.unpack_from("<I", head, 60) == (1, 0)  # version, flags


def _corrupt(tmp_path: Path, data: bytes, name: str) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_truncated_and_corrupted_files_get_a_named_error_and_leave_nothing(tmp_path):
    good = (FIXTURE / "ref_order3.trie").read_bytes()
    root_children = struct.unpack_from("<Q", good, 16 + 16)[0]
    first_child = 16 + 24  # the root's first (token, index) entry
    cases = {
        "empty": b"",
        "header only": good[:16],
        "truncated": good[: len(good) * 2 // 3],
        "trailing bytes": good + b"\0" * 12,
        "order 9": struct.pack("<Q", 9) + good[8:],
        "child index out of range": good[: first_child + 4] + struct.pack("<Q", 10**9) + good[first_child + 12:],
        "child index backwards": good[: first_child + 4] + struct.pack("<Q", 0) + good[first_child + 12:],
        "too many children": good[:32] + struct.pack("<Q", 10**12) + good[40:],
        "token outside the vocabulary": good[:16 + 24 + 12 * root_children] + struct.pack("<i", VOCAB + 5)
        + good[16 + 24 + 12 * root_children + 4:],
    }
    out_dir = tmp_path / "out"
    for name, data in cases.items():
        src = _corrupt(tmp_path, data, "bad.trie")
        with pytest.raises(ReferenceTrieError):
            convert(src, out_dir / "x.trie")
        assert not out_dir.exists() or list(out_dir.iterdir()) == [], name  # no output, no temporary files
    # a leaf at the order's depth with a child: deeper than the order
    counts = count_windows(fixture_docs()[:2], 2)
    deep = dict(counts)
    a, b = next(k for k in counts if len(k) == 2)
    deep[(a, b, 7)] = 1
    write_reference(tmp_path / "deep.trie", deep, 2)
    with pytest.raises(ReferenceTrieError, match="deeper than the order"):
        convert(tmp_path / "deep.trie", out_dir / "x.trie")
    assert list(out_dir.iterdir()) == []


def test_the_command_prints_a_summary_and_refuses_a_bad_file(tmp_path, capsys):
    assert main([str(FIXTURE / "ref_order3.trie"), str(tmp_path / "c.trie"), "-q", "--verify"]) == 0
    out = capsys.readouterr().out
    assert '"nodes": 90787' in out and '"peak_rss_mb"' in out
    _corrupt(tmp_path, (FIXTURE / "ref_order3.trie").read_bytes()[:1000], "cut.trie")
    assert main([str(tmp_path / "cut.trie"), str(tmp_path / "d.trie"), "-q"]) == 2
    assert "truncated" in capsys.readouterr().err and not (tmp_path / "d.trie").exists()


@pytest.mark.parametrize("id_order", ["dfs", "level"])
def test_the_benchmarks_reference_writer_round_trips_through_the_converter(tmp_path, id_order):
    """convert_bench writes a trie's nodes in the reference format (ids depth-first or level by
    level, child lists not sorted by token); converting it back gives the same arrays."""
    from ngram_service.build import build_trie
    from ngram_service.reference_format import read_levels, write_reference_format

    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 200, rng.integers(5, 300)) for _ in range(120)]
    build_trie(docs, tmp_path / "a.trie", vocab_size=200, order=4, tokenizer_name="t", vocab_hash="0" * 64)
    written = write_reference_format(tmp_path / "a.trie", tmp_path / "ref.trie", id_order=id_order, chunk=500,
                                     progress=False)
    raw = (tmp_path / "ref.trie").read_bytes()
    assert len(raw) == written["bytes"] and struct.unpack_from("<QQ", raw) == (4, written["nodes"])
    root_children = struct.unpack_from("<Q", raw, 16 + 16)[0]
    tokens = [struct.unpack_from("<i", raw, 16 + 24 + 12 * c)[0] for c in range(root_children)]
    assert tokens != sorted(tokens)  # listed by id, not by token
    convert(tmp_path / "ref.trie", tmp_path / "b.trie")
    for a, b in zip(read_levels(tmp_path / "a.trie"), read_levels(tmp_path / "b.trie")):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("order,threshold", [(3, 2), (4, 3)])
def test_the_builder_prunes_like_the_reference(tmp_path, order, threshold):
    """build_trie(prune="reference") gives the counts of the reference's reduce() (those <= 0 stored
    as 0) and the documented probabilities; prune="drop" keeps the counted values."""
    from ngram_service.build import build_trie

    docs = fixture_docs()[:24]
    counts = count_windows(docs, order)
    reduced = {k: c for k, c in reduce_counts(counts, threshold).items() if k}
    kw = dict(vocab_size=VOCAB, order=order, min_count=threshold, tokenizer_name="t", vocab_hash="0" * 64)
    summary = build_trie(docs, tmp_path / "ref.trie", prune="reference", **kw)
    trie = NgramTrie(tmp_path / "ref.trie", verify=True)
    assert summary.num_nodes == len(reduced) and trie.info.metadata["prune"] == "reference"
    assert all(trie.count(k) == max(c, 0) for k, c in reduced.items())
    pairs = list(queries(docs, order))[::7]
    got = [trie.probability(ctx, [tok])[0] for ctx, tok in pairs]
    assert np.abs(np.subtract(got, [documented_probability(reduced, order, c, t) for c, t in pairs])).max() <= 1e-6
    build_trie(docs, tmp_path / "drop.trie", **kw)
    dropped = NgramTrie(tmp_path / "drop.trie")
    assert all(dropped.count(k) == counts[k] for k in reduced)
