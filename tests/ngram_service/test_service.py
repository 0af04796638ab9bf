"""The tree-search service over a real gRPC channel on loopback: results
identical to the in-process search, every invalid input answered with
INVALID_ARGUMENT while the server keeps serving, auth, health, reflection,
and a client that falls back when the server dies and recovers when it
returns."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ngram_service._proto import ngram_pb2, ngram_pb2_grpc
from ngram_service.build import build_trie
from ngram_service.client import GrpcTreeSearch
from ngram_service.server import SERVICE_NAME, NgramServer
from ngram_service.tree_search import SearchParams, TreeBatch, search_tree_batch, search_trees
from ngram_service.trie import NgramTrie

from .conftest import random_docs

VOCAB = 50
HASH = "ab" * 32
FIELDS = ("tokens", "parents", "depths", "scores", "tree_mask", "retrieve_indices")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trie_path(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("svc") / "t.trie"
    build_trie(random_docs(rng, VOCAB, 60, 120), path, vocab_size=VOCAB, order=3, tokenizer_name="t", vocab_hash=HASH)
    return path


@pytest.fixture(scope="module")
def server(trie_path):
    srv = NgramServer(str(trie_path), threads=2).start()
    yield srv
    srv.stop()


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield ngram_pb2_grpc.NgramTreeSearchStub(channel)
    channel.close()


def inputs(rng, batch, depth=8, k=25):
    ids = rng.integers(0, VOCAB, size=(batch, depth, k))
    probs = rng.dirichlet(np.ones(k), size=(batch, depth)).astype(np.float32)
    contexts = [rng.integers(0, VOCAB, size=rng.integers(1, 12)) for _ in range(batch)]
    return ids, probs, contexts


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f)


@pytest.mark.parametrize("batch", [1, 16])
def test_results_identical_to_in_process(server, trie_path, batch):
    rng = np.random.default_rng(batch)
    trie = NgramTrie(trie_path)
    client = GrpcTreeSearch(server.address, vocab_hash=HASH, timeout_ms=5000)
    for params in (SearchParams(), SearchParams(top_k=10, beam_width=5, budget=20, ngram_at_level0=True),
                   SearchParams(use_ngram=False, eos_token_id=3)):
        ids, probs, contexts = inputs(rng, batch)
        assert_same(client.search(ids, probs, contexts, params),
                    search_trees(ids, probs, contexts, trie=trie, params=params))
        assert_same_batch(client.search_batch(ids, probs, contexts, params),
                          search_tree_batch(ids, probs, contexts, trie=trie, params=params))
    assert client.fallbacks == 0 and client.calls == 6


def assert_same_batch(a: TreeBatch, b: TreeBatch):
    for f in ("tokens", "parents", "depths", "scores", "probs", "counts"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
        assert getattr(a, f).dtype == getattr(b, f).dtype, f


def test_a_padded_answer_is_checked_and_an_old_services_trees_are_packed():
    """The client reads a padded answer (``batch``) through TreeBatch.checked, packs the per-tree
    answer of a service that predates ``padded``, and refuses a malformed or short answer (ValueError:
    the client counts it as a failure and falls back)."""
    from ngram_service.client import _answer

    rng = np.random.default_rng(9)
    ids, probs, contexts = inputs(rng, 3, depth=4, k=5)
    params = SearchParams(top_k=5, beam_width=3, budget=7, use_ngram=False)
    trees = search_trees(ids, probs, contexts, params=params)
    want = search_tree_batch(ids, probs, contexts, params=params)
    old = ngram_pb2.TreeSearchResponse(trees=[ngram_pb2.DraftTree(
        tokens=t.tokens.tolist(), parents=t.parents.tolist(), depths=t.depths.tolist(), scores=t.scores.tolist(),
        probs=t.probs.tolist()) for t in trees])
    assert_same_batch(_answer(old, 3, padded=True), want)
    assert_same(_answer(old, 3, padded=False), trees)
    fields = dict(num_nodes=want.num_nodes, counts=want.counts.tolist(), tokens=want.tokens.ravel().tolist(),
                  parents=want.parents.ravel().tolist(), depths=want.depths.ravel().tolist(),
                  scores=want.scores.ravel().tolist(), probs=want.probs.ravel().tolist())
    assert_same_batch(_answer(ngram_pb2.TreeSearchResponse(batch=ngram_pb2.TreeBatch(**fields)), 3, padded=True), want)
    bad_parent = want.parents.copy()
    bad_parent[0, want.counts[0] - 1] = want.counts[0] - 1  # a node that is its own parent
    deep = want.depths.copy()
    deep[1, want.counts[1] - 1] += 1  # two levels below its parent
    for broken, match in ((dict(parents=bad_parent.ravel().tolist()), "follow their parents"),
                          (dict(depths=deep.ravel().tolist()), "follow their parents"),
                          (dict(tokens=fields["tokens"][:-1]), "equal-length"),
                          (dict(counts=[want.num_nodes + 1] * 3), "counts"),
                          (dict(num_nodes=want.num_nodes + 1), "nodes per tree")):
        with pytest.raises(ValueError, match=match):
            _answer(ngram_pb2.TreeSearchResponse(batch=ngram_pb2.TreeBatch(**{**fields, **broken})), 3, padded=True)
    with pytest.raises(ValueError, match="2 trees for 3"):
        _answer(ngram_pb2.TreeSearchResponse(trees=old.trees[:2]), 3, padded=True)


def test_lookup_and_info(server, trie_path, stub):
    trie = NgramTrie(trie_path)
    contexts = [[1, 2], [3], [4, 5, 6]]
    tokens = np.arange(3 * VOCAB).reshape(3, VOCAB) % VOCAB
    r = stub.Lookup(ngram_pb2.LookupRequest(contexts=sum(contexts, []), context_lengths=[2, 1, 3],
                                            tokens=tokens.ravel().tolist(), num_tokens=VOCAB, vocab_hash=HASH))
    np.testing.assert_array_equal(np.array(r.probabilities).reshape(3, VOCAB), trie.probability_batch(contexts, tokens))
    info = stub.Info(ngram_pb2.InfoRequest())
    assert (info.order, info.vocab_size, info.num_nodes, info.vocab_hash) == (3, VOCAB, trie.info.num_nodes, HASH)
    assert list(info.nodes_per_level) == list(trie.info.nodes_per_level) and info.max_budget == 256


def _valid(batch=2, depth=3, k=4):
    return dict(batch=batch, depth=depth, k=k, topk_ids=[1] * (batch * depth * k),
                topk_probs=[0.25] * (batch * depth * k), contexts=[1, 2, 3], context_lengths=[1, 2],
                vocab_hash=HASH)


INVALID = {
    "token id outside the vocabulary": dict(topk_ids=[VOCAB] + [1] * 23),
    "negative token id": dict(topk_ids=[-1] + [1] * 23),
    "context id outside the vocabulary": dict(contexts=[1, 2, 999]),
    "topk_ids length": dict(topk_ids=[1] * 23),
    "topk_probs length": dict(topk_probs=[0.25] * 25),
    "context_lengths count": dict(context_lengths=[3]),
    "context_lengths sum": dict(context_lengths=[1, 1]),
    "empty context": dict(contexts=[1, 2], context_lengths=[0, 2]),
    "probabilities": dict(topk_probs=[1.5] * 24),
    "batch": dict(batch=0),
    "k over the limit": dict(k=65),
    "depth over the limit": dict(depth=17),
    "budget over the limit": dict(params=ngram_pb2.SearchOverrides(budget=257)),
    "beam over the limit": dict(params=ngram_pb2.SearchOverrides(beam_width=65)),
    "bad parameter": dict(params=ngram_pb2.SearchOverrides(top_k=0)),
    "tokenizer mismatch": dict(vocab_hash="cd" * 32),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_inputs_are_rejected_and_server_keeps_serving(stub, case):
    with pytest.raises(grpc.RpcError) as err:
        stub.TreeSearch(ngram_pb2.TreeSearchRequest(**{**_valid(), **INVALID[case]}), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details()
    ok = stub.TreeSearch(ngram_pb2.TreeSearchRequest(**_valid()), timeout=5)
    assert len(ok.trees) == 2


def test_invalid_lookup(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(ngram_pb2.LookupRequest(contexts=[1], context_lengths=[1], tokens=[VOCAB], num_tokens=1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status == \
            health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in replies[0].list_services_response.service}
        assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


def test_shared_secret(trie_path):
    srv = NgramServer(str(trie_path), auth_token="s3cret").start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = ngram_pb2_grpc.NgramTreeSearchStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Info(ngram_pb2.InfoRequest())
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Info(ngram_pb2.InfoRequest(), metadata=(("authorization", "Bearer s3cret"),)).order == 3
        client = GrpcTreeSearch(srv.address, auth_token="s3cret", vocab_hash=HASH, timeout_ms=5000)
        client.search(*inputs(np.random.default_rng(0), 1), SearchParams())
        assert client.fallbacks == 0
    finally:
        srv.stop()


def test_silent_service_falls_back_within_the_timeout():
    """A peer that accepts connections but never answers: the step waits one timeout, then uses the fallback."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        client = GrpcTreeSearch(f"127.0.0.1:{silent.getsockname()[1]}", vocab_hash=HASH, timeout_ms=100, retries=1,
                                cooldown_s=60)
        ids, probs, contexts = inputs(np.random.default_rng(1), 4)
        t0 = time.monotonic()
        trees = client.search(ids, probs, contexts, SearchParams())
        assert time.monotonic() - t0 < 1.0
        assert client.fallbacks == 1 and sum(client.errors.values()) == 1
        assert set(client.errors) <= {"DEADLINE_EXCEEDED", "UNAVAILABLE"}
        assert_same(trees, search_trees(ids, probs, contexts, trie=None, params=SearchParams()))  # logits-only
        client.search(ids, probs, contexts, SearchParams())  # during the cooldown: no call, no timeout paid
        assert client.fallbacks == 2 and sum(client.errors.values()) == 1


def test_refused_call_falls_back_without_failing(server):
    client = GrpcTreeSearch(server.address, vocab_hash="cd" * 32, timeout_ms=5000)
    ids, probs, contexts = inputs(np.random.default_rng(2), 2)
    assert len(client.search(ids, probs, contexts, SearchParams())) == 2
    assert client.errors == {"INVALID_ARGUMENT": 1}


def _spawn(trie_path, port):
    proc = subprocess.Popen([sys.executable, "-m", "ngram_service.server", "--trie", str(trie_path), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert "serving on" in proc.stdout.readline()
    return proc


def test_server_killed_mid_stream_then_restarted(trie_path):
    port = free_port()
    proc = _spawn(trie_path, port)
    trie = NgramTrie(trie_path)
    client = GrpcTreeSearch(f"127.0.0.1:{port}", vocab_hash=HASH, timeout_ms=2000, cooldown_s=0.2)
    rng = np.random.default_rng(3)
    try:
        for _ in range(5):
            ids, probs, contexts = inputs(rng, 4)
            assert_same(client.search(ids, probs, contexts, SearchParams()),
                        search_trees(ids, probs, contexts, trie=trie, params=SearchParams()))
        assert client.fallbacks == 0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for _ in range(20):  # every step still gets a tree
            ids, probs, contexts = inputs(rng, 4)
            assert len(client.search(ids, probs, contexts, SearchParams())) == 4
        assert client.fallbacks == 20
        proc = _spawn(trie_path, port)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            before = client.fallbacks
            ids, probs, contexts = inputs(rng, 4)
            trees = client.search(ids, probs, contexts, SearchParams())
            if client.fallbacks == before:
                break
            time.sleep(0.1)
        assert client.fallbacks == before, "the client never returned to the service"
        assert_same(trees, search_trees(ids, probs, contexts, trie=trie, params=SearchParams()))
    finally:
        proc.kill()
        proc.wait()


def test_a_slow_resolver_never_stalls_a_search(server, trie_path):
    """The resolver (a Serve handle call, seconds while a replica is replaced) runs on a
    background thread: searches fall back meanwhile instead of waiting for it."""
    import threading

    release, asked = threading.Event(), threading.Event()

    def resolver():
        asked.set()
        if not release.wait(30):
            raise TimeoutError("never released")
        return server.address

    client = GrpcTreeSearch(resolver=resolver, vocab_hash=HASH, timeout_ms=2000, cooldown_s=0.05)
    ids, probs, contexts = inputs(np.random.default_rng(4), 2)
    assert asked.wait(10)
    trees = client.search(ids, probs, contexts, SearchParams())  # resolver still blocked: fallback at once
    assert len(trees) == 2 and client.fallbacks == 1 and client.errors == {} and not release.is_set()
    release.set()
    assert client.wait_resolved(10)
    trie = NgramTrie(trie_path)
    assert_same(client.search(ids, probs, contexts, SearchParams()),
                search_trees(ids, probs, contexts, trie=trie, params=SearchParams()))
    assert client.fallbacks == 1
    client.close()


def test_server_threads_search_the_sequences_of_a_call_in_parallel(trie_path, monkeypatch):
    """``threads`` sizes both the call pool and the C++ search's own threads (num_threads)."""
    from ngram_service import server as server_module

    seen = []
    real = server_module.search_trees
    monkeypatch.setattr(server_module, "search_trees", lambda *a, **kw: seen.append(kw["params"]) or real(*a, **kw))
    srv = NgramServer(str(trie_path), threads=3).start()
    try:
        assert srv.params.num_threads == 3
        client = GrpcTreeSearch(srv.address, vocab_hash=HASH, timeout_ms=5000)
        client.search(*inputs(np.random.default_rng(5), 4), SearchParams(budget=7))
        client.close()
        assert client.fallbacks == 0 and [(p.num_threads, p.budget) for p in seen] == [(3, 7)]
    finally:
        srv.stop()


def test_a_new_address_ends_the_cooldown(server):
    """After a failure the service is skipped for cooldown_s; when the resolver then reports
    another address, the next search goes there at once instead of waiting out the cooldown."""
    import threading

    addresses = iter(["127.0.0.1:1", server.address])  # a dead one first, then the live server
    second = threading.Event()

    def resolver():
        address = next(addresses, server.address)
        if address == server.address:
            second.set()
        return address

    client = GrpcTreeSearch(resolver=resolver, vocab_hash=HASH, timeout_ms=500, retries=0, cooldown_s=0.2)
    assert client.wait_resolved(10)
    ids, probs, contexts = inputs(np.random.default_rng(6), 2)
    client.search(ids, probs, contexts, SearchParams())  # the dead address: fallback, cooldown
    assert client.fallbacks == 1
    time.sleep(0.25)
    client.search(ids, probs, contexts, SearchParams())  # cooldown over: re-resolve in the background
    assert second.wait(10)
    for _ in range(100):
        if client.address == server.address:
            break
        time.sleep(0.02)
    fallbacks = client.fallbacks
    client.search(ids, probs, contexts, SearchParams())
    assert client.address == server.address and client.fallbacks == fallbacks
    client.close()
