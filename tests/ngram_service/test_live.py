"""The live corpus (ngram_service.live): its continuation against a plain Python reference, the cap
under inserts, concurrent inserts and searches, and the chain choice beside a request's own context."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ngram_service.live import BOUNDARY, LONG_MATCH, MAX_MATCH, LiveCorpus, with_live_chains
from ngram_service.tree_search import ContextChain

#: a corpus matching suffixes of 1 to 4 tokens (the shipped one matches 8 only): the tests of what
#: does not depend on the match length use short documents
SHORT = {"max_context": 4, "min_match": 1}


def reference_chain(docs: list[list[int]], query: list[int], max_len: int, max_context: int = 4,
                    min_match: int = 1):
    """What followed the most recent occurrence of the longest suffix of ``query`` (min_match..max_context
    tokens) that did not end its document, up to max_len tokens within that document; each token's q as
    ContextIndex.probability: (|s| / max_context) · count(s·tok) / count(s) for the longest suffix s
    (at least min_match tokens) of the query and the chain so far with count(s·tok) > 0.  The match
    length: how far back the query's last MAX_MATCH tokens and the corpus agree there, within the document."""
    corpus = [t for d in docs for t in d + [BOUNDARY]]
    query = query[-max(MAX_MATCH, max_context):]

    def q(tail, tok):
        for m in range(min(max_context, len(tail)), min_match - 1, -1):
            s = tail[-m:]
            starts = [i for i in range(len(corpus) - m) if corpus[i:i + m] == s]
            if not starts:
                continue
            hits = sum(corpus[i + m] == tok for i in starts)
            if hits:
                return m / max_context * hits / len(starts)
        return 0.0

    def agree(e, m):  # how far back the query and the corpus agree before position e
        while m < len(query) and m < e and corpus[e - 1 - m] == query[-1 - m] != BOUNDARY:
            m += 1
        return m

    for m in range(min(max_context, len(query)), min_match - 1, -1):
        s = query[-m:]
        ends = [i + m for i in range(len(corpus) - m) if corpus[i:i + m] == s]
        if not ends or corpus[ends[-1]] == BOUNDARY:
            continue
        e, match = ends[-1], agree(ends[-1], m)
        if m == max_context and len(query) > m:  # the occurrence agreeing furthest back, of the latest 64
            for other in ends[::-1][1:64]:
                if corpus[other] != BOUNDARY and agree(other, m) > match:
                    e, match = other, agree(other, m)
        tokens, probs, tail = [], [], list(query)
        for tok in corpus[e:]:
            if tok == BOUNDARY or len(tokens) == max_len:
                break
            probs.append(q(tail, tok))
            tokens.append(tok)
            tail.append(tok)
        return tokens, probs, match
    return [], [], 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("max_context, min_match", [(4, 1), (6, 3), (8, 8)])
def test_the_chain_equals_the_reference(seed, max_context, min_match):
    """Every suffix length from ``min_match`` to ``max_context`` (the shipped corpus: 8 and 8); half the
    queries end with a piece of a document, so that long matches occur; a shorter match proposes
    nothing."""
    rng = np.random.default_rng(seed)
    docs = [list(map(int, rng.integers(0, 6, size=int(rng.integers(1, 30))))) for _ in range(12)]
    live = LiveCorpus(max_tokens=4096, max_context=max_context, min_match=min_match)
    assert live.add(docs) == sum(len(d) + 1 for d in docs)
    matched = set()
    for i in range(60):
        query = list(map(int, rng.integers(0, 6, size=int(rng.integers(1, 10)))))
        if i % 2:
            doc = docs[int(rng.integers(0, len(docs)))]
            end = int(rng.integers(1, len(doc) + 1))
            query += doc[max(0, end - int(rng.integers(1, 11))):end]
        got = live.chain(query, 8)
        tokens, probs, match = reference_chain(docs, query, 8, max_context, min_match)
        matched.add(match)
        assert got.tokens.tolist() == tokens and got.match_length == match
        np.testing.assert_allclose(got.probs, probs, rtol=1e-6)
    assert max(matched) >= min_match and all(m == 0 or m >= min_match for m in matched)
    assert live.chain([5, 4, 3], 0).tokens.tolist() == []


def test_the_shipped_corpus_matches_eight_tokens_or_nothing():
    """The default corpus proposes a chain only after an 8-token match (``DEFAULT_MAX_CONTEXT``; tuned on
    the tuning split): a 7-token one, which the corpus of 4..8 would have taken, proposes nothing."""
    from ngram_service.live import DEFAULT_MAX_CONTEXT

    live = LiveCorpus(max_tokens=256)
    assert live.max_context == live.min_match == DEFAULT_MAX_CONTEXT == 8
    live.add([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    assert live.chain([1, 2, 3, 4, 5, 6, 7, 8], 8).tokens.tolist() == [9, 10, 11]
    assert live.chain([0, 2, 3, 4, 5, 6, 7, 8], 8).tokens.tolist() == []
    four = LiveCorpus(max_tokens=256, min_match=4)
    assert four.add([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]) == 12 and four.min_match == 4
    assert four.chain([0, 2, 3, 4, 5, 6, 7, 8], 8).match_length == 7
    with pytest.raises(ValueError, match="min_match"):
        LiveCorpus(max_tokens=256, max_context=4, min_match=5)


def test_a_chain_stops_at_its_document_and_skips_a_suffix_that_ended_one():
    live = LiveCorpus(max_tokens=256, **SHORT)
    live.add([[1, 2, 3], [3, 4, 5, 6]])
    assert live.chain([7, 2, 3], 8).tokens.tolist() == [4, 5, 6]  # [2, 3] ended the first document; [3] did not
    assert live.chain([4], 8).tokens.tolist() == [5, 6]
    assert live.chain([9, 9], 8).match_length == 0


def test_the_cap_holds_under_inserts_and_the_oldest_go_first():
    live = LiveCorpus(max_tokens=1000, **SHORT)
    rng = np.random.default_rng(4)
    sizes = []
    for i in range(300):
        live.add([rng.integers(0, 50, size=int(rng.integers(1, 40)))])
        sizes.append(len(live))
    assert max(sizes) <= 1000 and live.stats().evicted > 0 and live.stats().inserts == 300
    live.add([[777, 778, 779, 780]])  # the newest document stays
    assert live.chain([777, 778], 4).tokens.tolist() == [779, 780]
    st = live.stats()
    assert st.tokens == len(live) <= st.max_tokens and st.bytes > 0
    # a document longer than half the cap keeps its end
    live.add([list(range(100, 2100))])
    assert len(live) <= 1000 and live.chain([2097, 2098], 1).tokens.tolist() == [2099]
    with pytest.raises(ValueError, match="max_tokens"):
        LiveCorpus(max_tokens=10)
    with pytest.raises(ValueError, match=">= 0"):
        live.add([[1, -2]])


def test_concurrent_inserts_and_searches():
    """Four threads insert while four search; every chain is a run of some inserted document."""
    live = LiveCorpus(max_tokens=2000, **SHORT)
    docs = [[d * 10 + i for i in range(8)] for d in range(40)]
    errors = []

    def insert(k):
        try:
            for d in docs[k::4] * 5:
                live.add([d])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def search(k):
        try:
            for i in range(2000):
                d = docs[(i + k) % len(docs)]
                got = live.chain(d[:3], 5).tokens.tolist()
                assert got in ([], d[3:8]), got
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=insert, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=search, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(live) <= 2000 and live.stats().lookups == 8000


def test_the_longer_match_wins_and_the_request_keeps_its_own_on_a_tie():
    live = LiveCorpus(max_tokens=256, **SHORT)
    live.add([[1, 2, 3, 4, 5, 6]])
    own = ContextChain(np.array([9, 9]), np.array([0.5, 0.5], np.float32), 1)
    contexts = [np.array([2, 3]), np.array([3]), np.array([8])]
    chains = with_live_chains(live, contexts, [own, own, None], 3)
    assert chains[0].tokens.tolist() == [4, 5, 6]  # matched 2 tokens against the request's 1
    assert chains[1] is own  # a tie: the request's own
    assert chains[2] is None  # nothing anywhere
    assert with_live_chains(live, contexts[:1], None, 2)[0].tokens.tolist() == [4, 5]


def test_a_requests_own_full_length_match_is_kept_over_the_corpus_longer_one():
    """The shipped corpus matches 8 tokens, the request's own index at most 4 (REQUEST_MATCH_CAP): the
    corpus's chain replaces the request's own only where that matched fewer than 4 (a loop or a
    phrase the request repeats keeps its own continuation); a hint from the service follows the
    same rule, and wins once the sequence followed one of its tokens."""
    from ngram_service.context import ContextIndex
    from ngram_service.live import REQUEST_MATCH_CAP

    live = LiveCorpus(max_tokens=256)
    doc = list(range(10, 30))
    live.add([doc])
    context = [np.array(doc[:8])]
    corpus = live.chain(context[0], 3)
    assert corpus.tokens.tolist() == [18, 19, 20] and corpus.match_length == 8 and REQUEST_MATCH_CAP == 4
    for own_match, kept in ((3, False), (4, True)):
        own = ContextChain(np.array([7, 7]), np.array([0.5, 0.5], np.float32), own_match)
        assert (with_live_chains(live, context, [own], 3)[0] is own) == kept
    index = ContextIndex(4, 1 << 16)
    index.append([7, 7, 7, 7, 7, 7])  # a loop: its own chain matches 4 tokens
    index.hint(ContextChain(np.array([18, 19, 20]), np.full(3, 0.5, np.float32), 8))
    assert index.continuation(2).tokens.tolist() == [7, 7]  # a tie at 4: the sequence's own
    index.append([18])
    assert index.continuation(2).tokens.tolist() == [19, 20]  # followed: 5, longer than any own match


def test_a_match_is_measured_past_the_context_length_within_its_document_up_to_the_cap():
    """The corpus hashes 8-token suffixes, but a chain's match length counts how far back the query and
    the corpus agree at the matched place: the query's length at most, never across the boundary
    before the document, never past MAX_MATCH (a request repeating earlier traffic matches far)."""
    live = LiveCorpus(max_tokens=4096)
    doc = list(range(100, 180))
    live.add([[7, 7, 7], doc])
    assert live.chain(doc[:8], 4).match_length == 8
    assert live.chain([1, 2] + doc[:20], 4).match_length == 20  # the query departs before the document
    assert live.chain([7] + doc[:20], 4).match_length == 20  # the boundary before it is never matched
    far = live.chain(doc[:60], 4)
    assert far.match_length == MAX_MATCH == 32 and far.tokens.tolist() == doc[60:64]
    assert live.chain([5] + doc[3:14], 4).match_length == 11  # a match that starts inside the document
    assert live.chain(doc[:8], 4).tokens.tolist() == doc[8:12]  # the chain itself is unchanged


def test_a_long_query_continues_from_the_occurrence_that_agrees_furthest_back():
    """A text that repeats itself: its last 8 tokens occurred at several places; a query of 8 tokens
    continues from the latest, a longer one from the place that agrees with it furthest back (an exact
    repeat follows its own place in the earlier answer), the latest on a tie."""
    live = LiveCorpus(max_tokens=4096)
    line = list(range(200, 208))
    doc = [1, 2, 3] + line + [4, 5, 6] + line + [7, 8, 9] + line + [10, 11]
    live.add([doc])
    assert live.chain(line, 3).tokens.tolist() == [10, 11]  # 8 tokens: the latest occurrence
    first = live.chain([1, 2, 3] + line, 3)
    assert first.tokens.tolist() == [4, 5, 6] and first.match_length == 11
    second = live.chain([4, 5, 6] + line, 3)
    assert second.tokens.tolist() == [7, 8, 9] and second.match_length == 11
    assert live.chain([0, 0] + line, 3).tokens.tolist() == [10, 11]  # agrees nowhere further: the latest


def test_a_long_corpus_match_replaces_even_a_full_length_own_one():
    """A corpus match of LONG_MATCH tokens or more (the request repeats earlier traffic) replaces the
    request's own chain whatever that matched; a shorter one keeps the REQUEST_MATCH_CAP rule.  A hint
    from the service follows the same rule and reports its match in full."""
    from ngram_service.context import ContextIndex

    live = LiveCorpus(max_tokens=4096)
    doc = list(range(100, 180))
    live.add([doc])
    own = ContextChain(np.array([7, 7]), np.array([0.5, 0.5], np.float32), 4)  # a full-length own match
    short, long_ = [np.array(doc[:LONG_MATCH - 1])], [np.array(doc[:LONG_MATCH])]
    assert with_live_chains(live, short, [own], 3)[0] is own
    chain = with_live_chains(live, long_, [own], 3)[0]
    assert chain.tokens.tolist() == doc[LONG_MATCH:LONG_MATCH + 3] and chain.match_length == LONG_MATCH
    index = ContextIndex(4, 1 << 16)
    index.append([7, 7, 7, 7, 7, 7])  # a loop: its own chain matches 4 tokens
    index.hint(ContextChain(np.array([18, 19, 20]), np.full(3, 0.5, np.float32), LONG_MATCH))
    c = index.continuation(2)
    assert c.tokens.tolist() == [18, 19] and c.match_length == LONG_MATCH
    index.append([18])
    assert index.continuation(2).match_length == LONG_MATCH + 1  # followed: its match grows
    index.hint(ContextChain(np.array([19, 99]), np.full(2, 0.5, np.float32), 8))  # matched less: the long one kept
    assert index.continuation(3).tokens.tolist() == [19, 20]


def test_the_service_learns_and_every_client_drafts_from_what_another_sent(tmp_path):
    """Through gRPC: one client's Learn puts a sequence in the service's live corpus; another client's
    search for a context that matches it gets the continuation into its tree although the draft head's
    top-k (random here) never proposes it; Info reports the corpus and the client sends enough context
    for it; bad input is refused, a service without a live corpus says so, and auth holds."""
    import grpc

    from ngram_service._proto import ngram_pb2, ngram_pb2_grpc
    from ngram_service.client import GrpcTreeSearch
    from ngram_service.server import NgramServer
    from ngram_service.tree_search import SearchParams

    server = NgramServer(None, threads=2, learn_max_tokens=4096, auth_token="s3cret").start()
    plain = NgramServer(None, threads=1).start()
    try:
        a = GrpcTreeSearch(server.address, timeout_ms=2000, auth_token="s3cret")
        b = GrpcTreeSearch(server.address, timeout_ms=2000, auth_token="s3cret")
        doc = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        assert a.learn([doc, []]) == len(doc) + 1
        rng = np.random.default_rng(0)
        topk = rng.integers(30, 40, size=(1, 6, 4)).astype(np.int64)  # never the learned tokens
        probs = np.full((1, 6, 4), 0.25, np.float32)
        params = SearchParams(top_k=4, beam_width=4, budget=12)
        for _ in range(100):  # the client asks Info on a background thread (until then it sends 8 tokens)
            if b.service_live:
                break
            time.sleep(0.02)
        assert b.context_tail == MAX_MATCH  # the live corpus measures matches this long, more than a logits-only search needs
        context = np.array([1, 2, 11, 12, 13, 14, 15, 16, 17, 18])
        tree = b.search_batch(topk, probs, [context], params).tree(0)
        assert {19, 20} <= set(tree.tokens.tolist())
        assert not {19, 20} & set(b.search_batch(topk, probs, [context[:-1]], params).tree(0).tokens.tolist())
        without = b.search_batch(topk, probs, [context], SearchParams(
            top_k=4, beam_width=4, budget=12, context_weight=0.0)).tree(0)
        assert not {19, 20} & set(without.tokens.tolist())  # context weight 0: the paper's search
        channel = grpc.insecure_channel(server.address)
        stub = ngram_pb2_grpc.NgramTreeSearchStub(channel)
        auth = (("authorization", "Bearer s3cret"),)
        info = stub.Info(ngram_pb2.InfoRequest(), metadata=auth).live
        assert (info.tokens, info.max_tokens, info.inserts, info.max_context) == (11, 4096, 1, 8)
        assert info.lookups >= 1 and info.hits >= 1 and info.bytes > 0
        with pytest.raises(grpc.RpcError) as e:
            stub.Learn(ngram_pb2.LearnRequest(tokens=[1, 2, 3], lengths=[2]), metadata=auth)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lengths sum to 2" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Learn(ngram_pb2.LearnRequest(tokens=[1, -3], lengths=[2]), metadata=auth)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "negative" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Learn(ngram_pb2.LearnRequest(tokens=[1, 2], lengths=[2]))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Info(ngram_pb2.InfoRequest(), metadata=auth).live.tokens == 11  # nothing refused was stored
        channel.close()
        c = GrpcTreeSearch(plain.address, timeout_ms=2000)
        assert c.learn([doc]) == 0 and c.errors == {"learn-FAILED_PRECONDITION": 1}
        assert not ngram_pb2_grpc.NgramTreeSearchStub(grpc.insecure_channel(plain.address)).Info(
            ngram_pb2.InfoRequest()).HasField("live")
        for client in (a, b, c):
            client.close()
    finally:
        server.stop()
        plain.stop()



def test_the_learn_sender_batches_off_the_caller_and_drops_what_it_cannot_hold():
    from ngram_service.client import LearnSender, TreeSearchClient

    class Slow(TreeSearchClient):
        def __init__(self) -> None:
            self.calls, self.gate = [], threading.Event()

        def search(self, *a, **k):
            raise NotImplementedError

        def learn(self, documents):
            self.gate.wait(5)  # a service that answers slowly
            self.calls.append([list(d) for d in documents])
            if len(self.calls) == 2:
                raise RuntimeError("the service fell over")
            return sum(len(d) + 1 for d in documents)

    client = Slow()
    sender = LearnSender(client, interval_s=0.05, batch_tokens=6, max_queued_tokens=10)
    t0 = time.perf_counter()
    sender.put([1, 2, 3])
    sender.put([])
    sender.put([4, 5, 6])  # 6 tokens queued: sent now, in one call (which waits on the slow service)
    time.sleep(0.2)
    for _ in range(4):
        sender.put([7, 8, 9])  # the first three fit the queue while the send waits; the last is dropped
    assert time.perf_counter() - t0 < 1.0  # put never waited on the service
    assert sender.dropped == 1
    client.gate.set()
    sender.close()
    assert client.calls[0] == [[1, 2, 3], [4, 5, 6]] and client.calls[1] == [[7, 8, 9]] * 3
    assert sender.sent == 8 and sender.sends == 2  # the failed second call counted nothing, and raised nowhere
    sender.put([1])
    assert sender.dropped == 2  # closed: nothing more is queued


def test_a_snapshot_round_trips_and_a_corrupt_or_truncated_one_is_refused_by_name(tmp_path):
    from ngram_service.live import CorruptSnapshot

    live = LiveCorpus(max_tokens=512, **SHORT)
    live.add([[1, 2, 3, 4, 5], [6, 7, 8]])
    path = tmp_path / "live.snap"
    assert live.save(path) == 10 and not list(tmp_path.glob(".*tmp*"))  # written, nothing left beside it
    again = LiveCorpus(max_tokens=512, **SHORT)
    assert again.load(path) == 10 and len(again) == 10
    assert again.chain([2, 3], 4).tokens.tolist() == [4, 5]
    data = path.read_bytes()
    for bad, needle in ((data[:-3], "truncated"), (data[:10], "shorter"), (b"NOTLIVE!" + data[8:], "not a live"),
                        (data[:-8] + (99).to_bytes(8, "little"), "checksum")):
        path.write_bytes(bad)
        fresh = LiveCorpus(max_tokens=512)
        with pytest.raises(CorruptSnapshot, match=needle):
            fresh.load(path)
        assert len(fresh) == 0
    path.write_bytes(data)
    other = LiveCorpus(max_tokens=512, max_context=3)  # other context lengths: the tokens are indexed afresh
    assert other.load(path) == 10 and other.chain([1, 2, 3], 2).tokens.tolist() == [4, 5]


def test_a_restarted_service_keeps_what_it_learned_and_a_bad_snapshot_starts_it_empty(tmp_path, caplog):
    from ngram_service.server import NgramServer

    snap = str(tmp_path / "live.snap")
    server = NgramServer(None, threads=1, learn_max_tokens=4096, learn_snapshot=snap).start()
    server.live.add([list(range(11, 31))])
    server.stop()  # writes the snapshot
    again = NgramServer(None, threads=1, learn_max_tokens=4096, learn_snapshot=snap).start()
    try:
        assert again.live.chain(list(range(11, 19)), 3).tokens.tolist() == [19, 20, 21]
        assert not again.save_snapshot()  # nothing new since it was loaded
    finally:
        again.stop()
    (tmp_path / "live.snap").write_bytes(b"garbage")
    with caplog.at_level("ERROR", logger="ngram_service.server"):
        empty = NgramServer(None, threads=1, learn_max_tokens=4096, learn_snapshot=snap)
    assert len(empty.live) == 0 and "snapshot refused" in caplog.text


def test_a_hint_is_followed_while_the_sequence_follows_it_and_dropped_where_it_departs():
    """ContextIndex.hint: the live corpus's continuation from a search is proposed, tokens followed
    since advancing it, where it matched a longer suffix than the sequence's own (its own on a tie);
    one departing token drops it; a later hint does not replace one that now matches longer."""
    from ngram_service.context import ContextIndex

    index = ContextIndex(4, 1 << 16)
    index.append([5, 6, 7, 8, 5, 6])  # its own chain: after [5, 6] came 7 (a 2-token match)
    assert index.continuation(3).tokens.tolist() == [7, 8, 5]
    index.hint(ContextChain(np.array([20, 21, 22, 23, 24]), np.full(5, 0.5, np.float32), 2))
    assert index.continuation(3).tokens.tolist() == [7, 8, 5]  # a tie: the sequence's own
    index.hint(ContextChain(np.array([20, 21, 22, 23, 24]), np.full(5, 0.5, np.float32), 3))
    c = index.continuation(3)
    assert (c.tokens.tolist(), c.match_length) == ([20, 21, 22], 3)
    index.append([20, 21])  # followed: what remains, matched longer than any own match (max_context + 1)
    c = index.continuation(8)
    assert (c.tokens.tolist(), c.match_length) == ([22, 23, 24], 5) and index.hint_match_cap == 5
    index.hint(ContextChain(np.array([30, 31]), np.full(2, 0.5, np.float32), 4))  # matches less than 5
    assert index.continuation(8).tokens.tolist() == [22, 23, 24]
    index.hint(ContextChain(np.array([22, 23, 24, 25]), np.full(4, 0.5, np.float32), 4))  # reaches further
    assert index.continuation(8).tokens.tolist() == [22, 23, 24, 25]
    index.hint(ContextChain(np.zeros(0, np.int64), np.zeros(0, np.float32), 0))  # empty: nothing changes
    assert index.continuation(8).tokens.tolist() == [22, 23, 24, 25]
    index.append([22, 99])  # departs at its second token: dropped
    assert index.continuation(8).match_length <= 4
    index.hint(ContextChain(np.arange(40, 80), np.full(40, 0.5, np.float32), 4))
    index.append(list(range(40, 70)))
    assert index.continuation(4).match_length == index.hint_match_cap
    index.append(list(range(70, 80)))  # consumed: the sequence's own again
    assert not len(index.continuation(4).tokens) or index.continuation(4).match_length <= 4


def test_a_search_answers_the_live_continuation_the_engine_asked_for():
    """TreeSearch with live_chain_length: each sequence's live-corpus continuation comes back beside
    its tree, longer than the draft depth (TreeBatch.live); the client asks only once the service said
    it keeps a live corpus, and a length out of range is refused."""
    import grpc

    from ngram_service._proto import ngram_pb2, ngram_pb2_grpc
    from ngram_service.client import GrpcTreeSearch
    from ngram_service.server import NgramServer
    from ngram_service.tree_search import SearchParams

    server = NgramServer(None, threads=1, learn_max_tokens=4096).start()
    plain = NgramServer(None, threads=1).start()
    try:
        doc = list(range(100, 140))
        client = GrpcTreeSearch(server.address, timeout_ms=2000, live_chain_length=24)
        assert client.learn([doc]) == len(doc) + 1
        for _ in range(100):
            if client.service_live:
                break
            time.sleep(0.02)
        assert client.service_live
        topk = np.full((2, 4, 2), 7, np.int64)
        probs = np.full((2, 4, 2), 0.5, np.float32)
        params = SearchParams(top_k=2, beam_width=2, budget=6)
        trees = client.search_batch(topk, probs, [np.array([1] + doc[:8]), np.array([3, 4])], params)
        assert trees.live[0].tokens.tolist() == doc[8:32] and trees.live[0].match_length == 8
        assert len(trees.live[1].tokens) == 0 and trees.live[1].match_length == 0
        assert client.search_batch(topk[:1], probs[:1], [np.array(doc[2:10])], params).live[0].tokens.tolist() == \
            doc[10:34]
        assert client.search(topk[:1], probs[:1], [np.array(doc[:8])], params)[0].num_nodes >= 1  # trees: no live
        other = GrpcTreeSearch(plain.address, timeout_ms=2000, live_chain_length=24)
        time.sleep(0.3)
        assert not other.service_live and other.search_batch(topk, probs, [np.array([100])] * 2, params).live is None
        stub = ngram_pb2_grpc.NgramTreeSearchStub(grpc.insecure_channel(server.address))
        with pytest.raises(grpc.RpcError) as e:
            stub.TreeSearch(ngram_pb2.TreeSearchRequest(batch=1, depth=1, k=1, topk_ids=[1], topk_probs=[0.5],
                                                        contexts=[1], context_lengths=[1], live_chain_length=-1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "live_chain_length" in e.value.details()
        for c in (client, other):
            c.close()
    finally:
        server.stop()
        plain.stop()


def test_a_snapshot_names_its_tokenizer_and_another_tokenizer_is_refused(tmp_path):
    """Format 2 snapshots carry the vocabulary hash: a corpus of another tokenizer refuses the file
    (SnapshotMismatch, nothing added), one that knew none takes the file's; format 1 files still load."""
    import struct
    import zlib

    from ngram_service.live import SnapshotMismatch, read_snapshot

    live = LiveCorpus(max_tokens=512, vocab_hash="abc123")
    live.add([[1, 2, 3], [4, 5]])
    path = tmp_path / "live.snap"
    live.save(path)
    snap = read_snapshot(path)
    assert snap.vocab_hash == "abc123" and [d.tolist() for d in snap.documents()] == [[1, 2, 3], [4, 5]]
    other = LiveCorpus(max_tokens=512, vocab_hash="ffff00")
    with pytest.raises(SnapshotMismatch, match="another tokenizer"):
        other.load(path)
    assert len(other) == 0
    unknown = LiveCorpus(max_tokens=512)
    assert unknown.load(path) == 7 and unknown.vocab_hash == "abc123"
    tokens = np.array([7, 8, BOUNDARY], dtype="<i8")
    old = struct.pack("<8sIIQI", b"DARTLIVE", 1, 4, 3, zlib.crc32(tokens.tobytes())) + tokens.tobytes()
    (tmp_path / "v1.snap").write_bytes(old)
    assert LiveCorpus(max_tokens=512, vocab_hash="abc123").load(tmp_path / "v1.snap") == 3


def test_a_trie_is_built_from_the_corpus_and_what_the_service_learned(tmp_path, capsys):
    """python -m ngram_service.build --snapshot: the snapshot's documents are counted after the
    corpus files (n-grams never cross a document boundary); a snapshot of another tokenizer, or a
    corrupt one, is refused with exit status 2."""
    from ngram_service.build import main
    from ngram_service.tokenizer import load_trie_tokenizer
    from ngram_service.trie import NgramTrie

    tok = load_trie_tokenizer(None)
    learned = np.asarray(tok.encode_batch(["the quantum walrus sings"])[0], dtype=np.int64)
    live = LiveCorpus(max_tokens=4096, vocab_hash=tok.vocab_hash)
    live.add([learned, learned])
    snap = tmp_path / "live.snap"
    live.save(snap)
    (tmp_path / "corpus.txt").write_text("plain text about something else entirely")
    out = tmp_path / "t.trie"
    assert main([str(tmp_path / "corpus.txt"), "--snapshot", str(snap), "-o", str(out), "-q"]) == 0
    trie = NgramTrie(out)
    assert trie.info.metadata["snapshot_tokens"] == 2 * learned.size
    p = trie.probability_batch([learned[:2]], learned[2:3].reshape(1, 1))
    assert float(np.asarray(p).ravel()[0]) > 0.5  # learned continuation counted
    foreign = LiveCorpus(max_tokens=4096, vocab_hash="not-this-tokenizer")
    foreign.add([learned])
    foreign.save(tmp_path / "foreign.snap")
    assert main([str(tmp_path / "corpus.txt"), "--snapshot", str(tmp_path / "foreign.snap"), "-o",
                 str(tmp_path / "f.trie"), "-q"]) == 2
    assert "another tokenizer" in capsys.readouterr().err and not (tmp_path / "f.trie").exists()
    (tmp_path / "bad.snap").write_bytes(b"DARTLIVE" + b"\0" * 30)
    assert main([str(tmp_path / "corpus.txt"), "--snapshot", str(tmp_path / "bad.snap"), "-o",
                 str(tmp_path / "b.trie"), "-q"]) == 2


def test_a_trie_swap_under_load_fails_no_search_and_a_bad_file_keeps_the_old_trie(tmp_path):
    """NgramServer.swap_trie while client threads search without pause: no call fails or falls back,
    searches see the new trie's n-grams after the swap, and a missing file, a corrupt one and a trie
    of another tokenizer are refused by name with the old trie served on."""
    from ngram_service.build import build_trie
    from ngram_service.client import GrpcTreeSearch
    from ngram_service.server import NgramServer
    from ngram_service.trie import TokenizerMismatchError, TrieFormatError
    from ngram_service.tree_search import SearchParams

    a, b, other = tmp_path / "a.trie", tmp_path / "b.trie", tmp_path / "other.trie"
    build_trie([[1, 2, 3, 4]] * 5, a, vocab_size=64, vocab_hash="h1")
    build_trie([[1, 2, 9, 9]] * 5, b, vocab_size=64, vocab_hash="h1")
    build_trie([[1, 2, 3, 4]] * 5, other, vocab_size=64, vocab_hash="h2")
    server = NgramServer(str(a), threads=2).start()
    stop, failures, calls = threading.Event(), [], [0]
    params = SearchParams(top_k=2, beam_width=2, budget=4)

    def load() -> None:
        client = GrpcTreeSearch(server.address, timeout_ms=5000, retries=0)
        ids = np.full((1, 3, 2), 5, np.int64)
        probs = np.full((1, 3, 2), 0.4, np.float32)
        while not stop.is_set():
            client.search_batch(ids, probs, [np.array([1, 2])], params)
            calls[0] += 1
        failures.append(client.fallbacks)
        client.close()

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(20):
            info = server.swap_trie(b if i % 2 == 0 else a)
            assert info.path.endswith("b.trie" if i % 2 == 0 else "a.trie")
            time.sleep(0.01)
        for bad, error in ((tmp_path / "missing.trie", FileNotFoundError), (other, TokenizerMismatchError)):
            with pytest.raises(error):
                server.swap_trie(bad)
        (tmp_path / "junk.trie").write_bytes(b"DARTTRIE" + b"\0" * 400)
        with pytest.raises(TrieFormatError):
            server.swap_trie(tmp_path / "junk.trie")
        assert server.trie.path.name == "a.trie"  # the last good swap
    finally:
        stop.set()
        for t in threads:
            t.join()
    try:
        assert calls[0] > 50 and failures == [0, 0, 0]
        import grpc

        from ngram_service._proto import ngram_pb2, ngram_pb2_grpc

        server.swap_trie(b)
        with grpc.insecure_channel(server.address) as channel:
            lookup = ngram_pb2_grpc.NgramTreeSearchStub(channel).Lookup(ngram_pb2.LookupRequest(
                contexts=[1, 2], context_lengths=[2], tokens=[9, 3], num_tokens=2))
        p9, p3 = lookup.probabilities
        assert p9 > 0.5 and p3 == 0  # b's n-grams: [1, 2] is followed by 9, never by 3
    finally:
        server.stop()


def test_a_mirror_follows_the_stream_and_starts_over_after_an_eviction():
    """tokens_since gives what was appended after a position (the same tokens the corpus holds at its
    end); a position that was evicted since, or not one of this corpus's, gives everything held with
    reset; extend feeds a mirror whose chains equal the corpus's."""
    live = LiveCorpus(max_tokens=64, max_context=3)
    assert live.tokens_since(-1) == (0, True, pytest.approx(np.zeros(0)))
    live.add([[1, 2, 3, 4], [5, 6, 7]])
    position, reset, tokens = live.tokens_since(-1)
    assert (position, reset) == (9, True) and tokens.tolist() == [1, 2, 3, 4, BOUNDARY, 5, 6, 7, BOUNDARY]
    mirror = LiveCorpus(max_tokens=64, max_context=3)
    mirror.extend(tokens)
    live.add([[2, 3, 4, 9, 9]])
    position, reset, tokens = live.tokens_since(9)
    assert (position, reset) == (15, False) and tokens.tolist() == [2, 3, 4, 9, 9, BOUNDARY]
    mirror.extend(tokens)
    assert live.tokens_since(15)[2].size == 0 and not live.tokens_since(15)[1]
    for ctx in ([1, 2, 3], [2, 3, 4], [6, 7]):
        a, b = live.chain(ctx, 5), mirror.chain(ctx, 5)
        assert (a.tokens.tolist(), a.match_length) == (b.tokens.tolist(), b.match_length)
    stream = [1, 2, 3, 4, BOUNDARY, 5, 6, 7, BOUNDARY, 2, 3, 4, 9, 9, BOUNDARY]
    rng = np.random.default_rng(0)
    for _ in range(20):  # past the cap: the held tokens stay the end of the stream
        doc = rng.integers(0, 50, size=int(rng.integers(1, 9))).tolist()
        live.add([doc])
        stream += doc + [BOUNDARY]
    position, reset, tokens = live.tokens_since(15)
    assert reset and position == len(stream) and tokens.tolist() == stream[len(stream) - len(live):]
    assert live.tokens_since(position + 1)[1]  # a position this corpus never reached
    with pytest.raises(ValueError, match=">= 0"):
        mirror.extend([1, -2])


def test_the_colocated_client_searches_here_on_the_services_node_and_through_it_elsewhere(tmp_path, caplog):
    """ColocatedTreeSearch: on the service's node, with the trie file readable, searches run in this
    process over the same file with a mirror of the live corpus, the trees equal to the service's;
    a swapped trie is mapped on the next answer; another node, a missing file, a trie of another
    tokenizer or a failing locate send searches to the service; learning always goes to it."""
    import logging

    from ngram_service.build import build_trie
    from ngram_service.client import ColocatedTreeSearch, InProcessTreeSearch, TreeSearchClient
    from ngram_service.trie import NgramTrie
    from ngram_service.tree_search import SearchParams

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 40, size=30).tolist() for _ in range(20)]
    paths = [tmp_path / "a.trie", tmp_path / "b.trie"]
    build_trie(docs, paths[0], vocab_size=64, order=3)
    build_trie(docs[:5], paths[1], vocab_size=64, order=3)
    service_live = LiveCorpus(max_tokens=4096, max_context=4)
    state = {"node": "n1", "trie": str(paths[0]), "fail": False, "live": service_live}

    def locate(since):
        if state["fail"]:
            raise TimeoutError("no answer")
        live = state["live"]
        position, reset, tokens = live.tokens_since(since)
        return {"node_id": state["node"], "trie": state["trie"], "trie_mtime_ns": 1,
                "live": {"stream": live.stream_id, "position": position, "reset": reset, "tokens": tokens,
                         "max_tokens": 4096, "max_context": 4, "min_match": live.min_match, "vocab_hash": ""}}

    class Remote(TreeSearchClient):  # the service's client, counted
        vocab_hash, calls, fallbacks, errors, address = "", 0, 0, {}, "10.0.0.1:50051"

        def __init__(self):
            self.learned = []

        def search(self, topk_ids, *a, **kw):
            raise AssertionError("the engine asks search_batch")

        def search_batch(self, topk_ids, *a, **kw):
            self.calls += 1
            return "remote"

        def learn(self, documents):
            self.learned += documents
            return sum(len(d) + 1 for d in documents)

        def close(self):
            self.closed = True

    remote = Remote()
    client = ColocatedTreeSearch(remote, locate, "n1", interval_s=60)  # the thread's first refresh, then tests drive it
    for _ in range(200):
        if client.local:
            break
        time.sleep(0.01)
    assert client.local and client.why_remote is None
    topk = rng.integers(0, 40, size=(2, 5, 4)).astype(np.int64)
    probs = np.sort(rng.random((2, 5, 4)).astype(np.float32), -1)[..., ::-1].copy()
    contexts = [np.array(docs[0][:6]), np.array([7, 8, 9, 10, 11])]
    params = SearchParams(top_k=4, beam_width=4, budget=10)
    assert client.learn([[7, 8, 9, 10, 11, 12, 13, 14]]) == 9 and remote.learned == [[7, 8, 9, 10, 11, 12, 13, 14]]
    service_live.add(remote.learned)  # what the service does with it
    client.refresh()
    here = client.search_batch(topk, probs, contexts, params)
    reference = InProcessTreeSearch(NgramTrie(paths[0]), live=service_live).search_batch(topk, probs, contexts, params)
    for name in ("tokens", "parents", "counts"):
        assert np.array_equal(getattr(here, name), getattr(reference, name)), name
    assert {12, 13} <= set(here.tree(1).tokens.tolist())  # the learned continuation, from the mirror
    assert client.chains([np.array([8, 9, 10, 11])], None, 3)[0].tokens.tolist() == [12, 13, 14]
    assert remote.calls == 0 and client.calls == client.local_calls == 1
    restarted = LiveCorpus(max_tokens=4096, max_context=4)  # a restarted service: another stream, its
    restarted.add([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])  # position (13) inside the old one's (18)
    state["live"] = restarted
    client.refresh()
    client.refresh()
    assert client.chains([np.array([2, 3, 4, 5])], None, 3)[0].tokens.tolist() == [6, 7, 8]
    assert client.chains([np.array([8, 9, 10, 11])], None, 3)[0].tokens.tolist() == [12]  # the old mirror is gone
    state["trie"] = str(paths[1])  # a swap on the service
    client.refresh()
    assert str(client._local.trie.path) == str(paths[1])
    caplog.set_level(logging.INFO, logger="ngram_service.client")
    state["node"] = "n2"
    client.refresh()
    assert not client.local and "another node" in client.why_remote
    assert client.search_batch(topk, probs, contexts, params) == "remote" and remote.calls == 1
    state.update(node="n1", trie=str(tmp_path / "missing.trie"))
    client.refresh()
    assert not client.local and "not readable" in client.why_remote
    state["trie"] = str(paths[0])
    remote.vocab_hash = "another tokenizer"
    client.refresh()
    assert not client.local and "cannot be searched here" in client.why_remote
    remote.vocab_hash = ""
    client.refresh()
    assert client.local
    state["fail"] = True
    with pytest.raises(TimeoutError):
        client.refresh()  # the thread catches it and searches through the service (below)
    client.close()
    assert remote.closed
    with pytest.raises(ValueError, match="interval_s"):
        ColocatedTreeSearch(remote, locate, "n1", interval_s=0)


def test_the_colocated_clients_thread_searches_through_the_service_while_locate_fails():
    from ngram_service.client import ColocatedTreeSearch

    class Remote:
        vocab_hash, calls, fallbacks, errors, address = "", 0, 0, {}, None

        def close(self):
            pass

    calls = []

    def locate(since):
        calls.append(since)
        raise TimeoutError("the service is restarting")

    client = ColocatedTreeSearch(Remote(), locate, "n1", interval_s=0.01)
    for _ in range(200):
        if len(calls) >= 3:
            break
        time.sleep(0.01)
    client.close()
    assert len(calls) >= 3 and calls[0] == -1 and not client.local and "cannot be located" in client.why_remote


def test_two_colocated_replicas_draft_from_what_the_other_generated(tmp_path):
    """Two engine replicas on the service's node, one service whose live corpus every replica
    shares: each replica searches in its own process with a mirror of the service's corpus
    (ColocatedTreeSearch over the real server's ``location``, as ``NgramService.locate`` answers);
    what replica A sends to ``Learn`` reaches B's mirror on B's next ``locate``, and B's tree then
    holds the continuation A generated although the draft head's top-k (random here) never
    proposes it; before that answer, B's tree does not."""
    from ngram_service.build import build_trie
    from ngram_service.client import ColocatedTreeSearch, GrpcTreeSearch
    from ngram_service.server import NgramServer
    from ngram_service.tree_search import SearchParams

    rng = np.random.default_rng(5)
    trie = tmp_path / "base.trie"
    build_trie([rng.integers(0, 30, size=40).tolist() for _ in range(10)], trie, vocab_size=64, order=3)
    server = NgramServer(str(trie), threads=1, learn_max_tokens=4096).start()
    replicas = []
    try:
        def locate(since):
            return {"node_id": "n1", "address": server.address} | server.location(since)

        for _ in range(2):
            remote = GrpcTreeSearch(server.address, timeout_ms=2000)
            replicas.append(ColocatedTreeSearch(remote, locate, "n1", interval_s=60))  # tests drive refresh()
        a, b = replicas
        for _ in range(200):
            if a.local and b.local:
                break
            time.sleep(0.01)
        assert a.local and b.local
        generated = [41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # tokens the base trie never saw
        topk = rng.integers(30, 40, size=(1, 6, 4)).astype(np.int64)
        probs = np.full((1, 6, 4), 0.25, np.float32)
        params = SearchParams(top_k=4, beam_width=4, budget=12)
        context = [np.array([1, 2] + generated[:8])]  # 8 tokens of A's output: the live corpus's match
        assert not {49, 50} & set(b.search_batch(topk, probs, context, params).tree(0).tokens.tolist())
        assert a.learn([generated]) == len(generated) + 1  # replica A's finished sequence, to the service
        assert len(server.live) == len(generated) + 1 and b.mirror_tokens == 0
        b.refresh()
        assert b.mirror_tokens == len(generated) + 1 and b.local
        tree = b.search_batch(topk, probs, context, params).tree(0)
        assert {49, 50} <= set(tree.tokens.tolist())
        assert b.remote.calls == 0 and b.local_calls == 2  # both searches ran in B's process
    finally:
        for r in replicas:
            r.close()
        server.stop()
