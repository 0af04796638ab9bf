"""The service in Ray: scheduled by its custom resource on a local cluster,
reachable through the resolver, restarted by Ray after it dies; NUMA pinning
on a fake two-node sysfs."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from ngram_service.client import GrpcTreeSearch
from ngram_service.ray_actor import (NGRAM_RESOURCE, bind_to_numa_node, numa_memory, numa_nodes, resolve_address,
                                     start_ngram_service)
from ngram_service.tree_search import SearchParams, search_trees
from ngram_service.trie import NgramTrie

from .test_service import HASH, assert_same, free_port, inputs, trie_path  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, resources={NGRAM_RESOURCE: 1}, include_dashboard=False, namespace="dart-serve-tests",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def test_actor_lands_on_the_ngram_host_and_survives_a_kill(ray_cluster, trie_path):  # noqa: F811
    ray = ray_cluster
    port = free_port()
    actor = start_ngram_service(str(trie_path), port=port, num_cpus=0.5, detached=False, name="ngram-test",
                                namespace="dart-serve-tests")
    described = ray.get(actor.describe.remote(), timeout=60)
    assert described["address"].endswith(f":{port}") and described["trie"] == str(trie_path)
    assert ray.available_resources().get(NGRAM_RESOURCE, 0) == 0  # the actor holds the custom resource

    client = GrpcTreeSearch(resolver=lambda: resolve_address("ngram-test", "dart-serve-tests").replace(
        "0.0.0.0", "127.0.0.1"), vocab_hash=HASH, timeout_ms=2000, cooldown_s=0.2)
    assert client.wait_resolved(30)
    trie = NgramTrie(trie_path)
    rng = np.random.default_rng(0)
    ids, probs, contexts = inputs(rng, 3)
    assert_same(client.search(ids, probs, contexts, SearchParams()),
                search_trees(ids, probs, contexts, trie=trie, params=SearchParams()))
    assert client.fallbacks == 0

    ray.kill(actor, no_restart=False)  # dies; Ray restarts it on the same resource and port
    deadline = time.monotonic() + 90
    recovered = False
    while time.monotonic() < deadline and not recovered:
        assert len(client.search(ids, probs, contexts, SearchParams())) == 3  # never raises, whatever the state
        try:
            pid = ray.get(actor.describe.remote(), timeout=2)["pid"]
        except (ray.exceptions.RayError, TimeoutError):
            continue
        if pid == described["pid"]:
            time.sleep(0.2)
            continue
        before = client.fallbacks  # restarted: the next calls must reach the service again
        for _ in range(50):
            trees = client.search(ids, probs, contexts, SearchParams())
            if client.fallbacks == before:
                assert_same(trees, search_trees(ids, probs, contexts, trie=trie, params=SearchParams()))
                recovered = True
                break
            before = client.fallbacks
            time.sleep(0.2)
    assert recovered, "the client never got back to the restarted service"


def test_numa_pinning_on_a_fake_two_node_host(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    for node, cpus in ((0, allowed[:1]), (1, allowed[1:] or allowed[:1])):
        d = tmp_path / f"node{node}"
        d.mkdir()
        d.joinpath("cpulist").write_text(",".join(map(str, cpus)) + "\n")
    assert numa_nodes(tmp_path) == {0: allowed[:1], 1: allowed[1:] or allowed[:1]}
    try:
        assert bind_to_numa_node(0, sysfs=tmp_path) == allowed[:1]
        assert sorted(os.sched_getaffinity(0)) == allowed[:1]
        with pytest.raises(ValueError, match="NUMA node 7"):
            bind_to_numa_node(7, sysfs=tmp_path)
    finally:
        os.sched_setaffinity(0, allowed)


def test_single_node_host_is_not_pinned(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text(f"0-{max(allowed)}\n")
    assert bind_to_numa_node(None, sysfs=tmp_path) == allowed
    assert sorted(os.sched_getaffinity(0)) == allowed


def _fake_topology(root, nodes: dict[int, tuple[list[int], int | None]]):
    """nodeN/cpulist and, when a size is given, nodeN/meminfo (MemTotal in kB) under ``root``."""
    for n, (cpus, mem_kb) in nodes.items():
        d = root / f"node{n}"
        d.mkdir(parents=True)
        d.joinpath("cpulist").write_text(",".join(map(str, cpus)) + "\n")
        if mem_kb is not None:
            d.joinpath("meminfo").write_text(f"Node {n} MemTotal:       {mem_kb} kB\nNode {n} MemFree:  1 kB\n")


def test_the_node_with_the_most_memory_is_chosen(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 CPUs to fake two NUMA nodes, this process may use {len(allowed)}")
    _fake_topology(tmp_path / "a", {0: (allowed[:1], 64 << 20), 1: (allowed[1:], 512 << 20)})
    _fake_topology(tmp_path / "b", {0: (allowed[:1], None), 1: (allowed[1:], None)})  # sizes unknown: lowest id wins
    assert numa_memory(tmp_path / "a") == {0: 64 << 30, 1: 512 << 30} and numa_memory(tmp_path / "b") == {}
    try:
        assert bind_to_numa_node(None, sysfs=tmp_path / "a") == allowed[1:]
        assert sorted(os.sched_getaffinity(0)) == allowed[1:]
        os.sched_setaffinity(0, allowed)
        assert bind_to_numa_node(None, sysfs=tmp_path / "b") == allowed[:1]
    finally:
        os.sched_setaffinity(0, allowed)


def test_a_host_that_refuses_pinning_logs_once_and_serves(tmp_path, monkeypatch, caplog):
    import ngram_service.ray_actor as ray_actor

    allowed = sorted(os.sched_getaffinity(0))
    _fake_topology(tmp_path, {0: (allowed[:1], 1 << 20), 1: (allowed[1:] or allowed[:1], 2 << 20)})

    def refuse(pid, cpus):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(ray_actor.os, "sched_setaffinity", refuse)
    monkeypatch.setattr(ray_actor, "_unpinnable_logged", False)
    servers = []
    try:
        with caplog.at_level("WARNING", logger="ngram_service.ray_actor"):
            for _ in range(2):
                server, cpus = ray_actor.start_pinned_server(None, port=0, threads=1, sysfs=tmp_path)
                servers.append(server)
                assert cpus == allowed and server.port > 0
        assert sum("could not pin" in r.message for r in caplog.records) == 1
    finally:
        for server in servers:
            server.stop(grace_s=0)
