"""dart-serve on a two-node Ray cluster: the KubeRay application, placed by node, over real addresses.

Node A (the head, a ``num_gpus: 1`` label and no CUDA) and node B (``ngram_host``, the only
holder of the trie) run in their own network namespaces (tests/multinode/netns.py); exactly
the ``serveConfigV2`` of ``k8s/rayservice.yaml`` is deployed through the dashboard, as KubeRay
does.  The engine must reach the n-gram service at B's address: A's loopback port of the
service holds a trap that records any connection, and B's own loopback is not A's.  Under
``openai``-client load, B's n-gram replica is killed, then every process of node B; no
request may fail (the engines fall back to the logits-only search), every answer must equal
autoregressive decoding, and once B is back the tree search must resume there.

Skipped, saying why, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.multinode.netns import HEAD_IP, HEAD_TEST_IP, NGRAM_IP, TwoNodes, unavailable_reason

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = f"http://{HEAD_TEST_IP}:8265"
HTTP = f"http://{HEAD_TEST_IP}:8000"
NGRAM_PORT = 50051  # the port args.ngram.port of k8s/rayservice.yaml sets
MAX_TOKENS = 24
# prompts whose answers quote them: the context branch drafts well, so the speculation gate keeps
# speculating and the tree search is called on most steps (rather than on rare gate probes)
SNIPPET = ("def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
           "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n")
PROMPTS = [
    f"Repeat this code exactly, with no comment:\n```python\n{SNIPPET}```",
    "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
    f"Rename the function merge to merge_sorted and print the code:\n```python\n{SNIPPET}```",
    "List the numbers from 1 to 30, separated by commas.",
]

PROBE = r"""
import json, sys
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
engine = serve.get_deployment_handle("DartEngine", app_name="dart")
for _ in sys.stdin:
    try:
        out = engine.stats.remote().result(timeout_s=60)
    except Exception as e:  # reported to the test, which decides
        out = {"error": repr(e)}
    print("STATS " + json.dumps(out), flush=True)
"""

TRAP = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
print("listening", flush=True)
while True:
    conn, peer = s.accept()
    print("connection from", peer, flush=True)
    conn.close()
"""


class StatsProbe:
    """A Ray driver inside node A's namespace that answers the engine's ``stats()`` on demand."""

    def __init__(self, nodes: TwoNodes) -> None:
        self.proc = nodes.in_ns("a", sys.executable, "-u", "-c", PROBE, f"{HEAD_IP}:6379", stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def __call__(self) -> dict:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("STATS "):
                out = json.loads(line[6:])
                assert "error" not in out, out["error"]
                return out
        raise RuntimeError("the stats probe exited")

    def close(self) -> None:
        self.proc.kill()


def successes(stats: dict) -> int:
    """Tree searches answered by the n-gram service (calls that did not fall back)."""
    return stats["ngram_calls"] - stats["ngram_fallbacks"]


def _state(kind: str, **filters: str) -> list[dict]:
    """Rows of the dashboard's state API (``/api/v0/<kind>``), with this cluster's token sent
    explicitly: Ray's own client reads the token once per process, and earlier tests in the
    same pytest process may have run a cluster of their own."""
    params = {"detail": "false", "limit": "1000"}
    for key, value in filters.items():
        params.update(filter_keys=key, filter_predicates="=", filter_values=value)
    r = requests.get(f"{DASHBOARD}/api/v0/{kind}", params=params, timeout=30,
                     headers={"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"})
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


def alive_actors() -> dict[str, list[str]]:
    """Node ids of the live actors, by class name."""
    out: dict[str, list[str]] = {}
    for a in _state("actors", state="ALIVE"):
        out.setdefault(a["class_name"], []).append(a["node_id"])
    return out


def alive_nodes(ip: str) -> list[str]:
    """Ids of the live Ray nodes at ``ip`` (a killed node stays listed ALIVE until the GCS notices)."""
    return [n["node_id"] for n in _state("nodes") if n["node_ip"] == ip and n["state"] == "ALIVE"]


def wait_for(what: str, check, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except Exception:  # noqa: BLE001 - the cluster is settling; the deadline decides
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def client():
    from openai import OpenAI

    return OpenAI(base_url=f"{HTTP}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(prompt: str, *, stream: bool, speculative: bool = True) -> str:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                  temperature=0, extra_body={"speculative": speculative})
    if not stream:
        return client().chat.completions.create(**kwargs).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client().chat.completions.create(stream=True, **kwargs)
                   if c.choices)


MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_tokenizer):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-node test needs network namespaces: {reason}")
    from ngram_service.build import build_trie_from_texts
    from ngram_service.cache import cache_root, default_trie_path
    from ngram_service.corpus import cpython_stdlib_sources
    from ngram_service.tokenizer import source_name

    root = tmp_path_factory.mktemp("multinode")
    cache_a, cache_b = root / "cache-a", root / "cache-b"
    # A shares the converted model cache (no tries there); B holds the only trie, where `trie: auto` looks
    (cache_root() / "models").mkdir(parents=True, exist_ok=True)
    cache_a.mkdir()
    (cache_a / "models").symlink_to(cache_root() / "models")
    trie = cache_b / default_trie_path(source_name(None), "default", 3).relative_to(cache_root())
    sources = cpython_stdlib_sources()
    build_trie_from_texts((next(sources) for _ in range(300)), trie, default_tokenizer, progress=False)

    service = next(d for d in yaml.safe_load_all((REPO / "k8s" / "rayservice.yaml").read_text())
                   if d and d.get("kind") == "RayService")
    serve_config = root / "serve-config.yaml"
    serve_config.write_text(service["spec"]["serveConfigV2"])
    assert yaml.safe_load(serve_config.read_text())["applications"][0]["args"]["ngram"]["port"] == NGRAM_PORT

    nodes = TwoNodes(cache_a, cache_b)
    probe = trap = None
    mp = pytest.MonkeyPatch()
    try:
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # the state API and `serve deploy` of this process
            mp.setenv(key, nodes.env()[key])
        nodes.start_head()
        trap_log = root / "loopback-trap.log"
        trap = nodes.in_ns("a", sys.executable, "-u", "-c", TRAP, str(NGRAM_PORT), stdout=open(trap_log, "w"),
                           stderr=subprocess.STDOUT)
        wait_for("the loopback trap", lambda: "listening" in trap_log.read_text(), 30, 0.2)
        nodes.start_ngram_node()
        def serve_cli(*args: str) -> subprocess.CompletedProcess:  # Ray Serve's own CLI, with this cluster's token
            return subprocess.run([sys.executable, "-c", "from ray.serve.scripts import cli; cli()", *args, "-a",
                                   DASHBOARD], env=nodes.env(), capture_output=True, text=True, timeout=300)

        r = serve_cli("deploy", str(serve_config))
        assert r.returncode == 0, r.stderr[-3000:]
        try:
            wait_for("the application to answer", lambda: requests.get(f"{HTTP}/v1/models", timeout=5).ok, 900, 5)
        except AssertionError:
            status = serve_cli("status")
            raise AssertionError(f"the application did not come up:\n{status.stdout[-3000:]}") from None
        probe = StatsProbe(nodes)
        yield {"nodes": nodes, "probe": probe, "trap_log": trap_log, "cache_a": cache_a, "cache_b": cache_b}
    finally:
        if probe is not None:
            probe.close()
        if trap is not None:
            trap.kill()
        nodes.close()
        mp.undo()


@pytest.fixture(scope="module")
def expected(cluster):
    """Autoregressive answers (``speculative: false``) of every prompt, from the same engine."""
    return {p: complete(p, stream=False, speculative=False) for p in PROMPTS}


def test_placement_by_node_and_lossless_traffic_over_bs_address(cluster, expected):
    (node_a,), (node_b,) = alive_nodes(HEAD_IP), alive_nodes(NGRAM_IP)
    assert node_a != node_b
    actors = alive_actors()
    assert actors["ServeReplica:dart:DartEngine"] == [node_a]
    assert actors["ServeReplica:dart:OpenAIIngress"] == [node_a]
    assert actors["ServeReplica:dart:NgramService"] == [node_b]
    assert not (cluster["cache_a"] / "tries").exists()  # the trie is B's alone

    before = cluster["probe"]()
    for i, p in enumerate(PROMPTS):
        assert complete(p, stream=bool(i % 2)) == expected[p]
    after = cluster["probe"]()
    assert after["ngram_address"] == f"{NGRAM_IP}:{NGRAM_PORT}"
    assert successes(after) > successes(before), after  # answered by B's service, not the fallback
    trap = cluster["trap_log"].read_text()
    assert "connection" not in trap, f"the engine dialled A's loopback for the n-gram service:\n{trap}"


def test_killing_bs_replica_then_node_b_under_load_fails_no_request(cluster, expected):
    nodes, probe = cluster["nodes"], cluster["probe"]
    results: list[tuple[str, str]] = []  # (kind, detail) per request
    stop = threading.Event()

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            p = PROMPTS[i % len(PROMPTS)]
            try:
                text = complete(p, stream=bool(i % 2))
                results.append(("ok", "") if text == expected[p] else ("differs", f"{p!r}: {text!r}"))
            except Exception as e:  # noqa: BLE001 - every failure counts against the bar
                results.append(("failed", repr(e)))
            i += 2

    def served() -> int:
        return len(results)

    def wait_requests(n: int, timeout_s: float = 300) -> None:
        target = served() + n
        wait_for(f"{n} more requests", lambda: served() >= target, timeout_s, 0.5)

    with cf.ThreadPoolExecutor(2) as pool:
        workers = [pool.submit(load, w) for w in range(2)]
        try:
            wait_requests(2)
            # 1. the n-gram replica dies (SIGKILL of its worker process); Serve starts another on B
            replica = next(a for a in _state("actors", state="ALIVE")
                           if a["class_name"] == "ServeReplica:dart:NgramService")
            subprocess.run(["kill", "-9", str(replica["pid"])], check=True)
            wait_requests(2)
            wait_for("a new n-gram replica on B", lambda: any(
                a["class_name"] == "ServeReplica:dart:NgramService" and a["pid"] != replica["pid"]
                and a["node_id"] == replica["node_id"] for a in _state("actors", state="ALIVE")), 300)
            mark = successes(probe())
            wait_for("the tree search to resume after the replica restart", lambda: successes(probe()) > mark, 300)

            # 2. node B dies whole: raylet, agents, the replica
            (old_b,) = alive_nodes(NGRAM_IP)
            assert nodes.kill_node("b") > 0
            fallbacks = probe()["ngram_fallbacks"]
            wait_for("the engine to fall back", lambda: probe()["ngram_fallbacks"] > fallbacks, 300)
            wait_requests(4)  # served through the fallback meanwhile

            # 3. B comes back (a new node id): Serve places the replica there and the search resumes
            nodes.start_ngram_node()
            new_b = wait_for("node B to rejoin", lambda: next((n for n in alive_nodes(NGRAM_IP) if n != old_b), None),
                             120)
            wait_for("the n-gram replica on the new node B",
                     lambda: alive_actors().get("ServeReplica:dart:NgramService") == [new_b], 300)
            mark = successes(probe())
            wait_for("the tree search to resume on the new node B", lambda: successes(probe()) > mark, 300)
            wait_requests(2)
        finally:
            stop.set()
            for w in workers:
                w.result(timeout=600)
    final = probe()
    print(f"\n{len(results)} requests under load; engine: {final['speculative_steps']} speculative and "
          f"{final['autoregressive_steps']} autoregressive steps, {final['ngram_calls']} tree searches, "
          f"{final['ngram_fallbacks']} answered by the fallback")
    failed = [d for k, d in results if k == "failed"]
    differs = [d for k, d in results if k == "differs"]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    assert not differs, f"{len(differs)} of {len(results)} answers differ from autoregressive decoding: {differs[:3]}"
    assert final["ngram_address"] == f"{NGRAM_IP}:{NGRAM_PORT}"
    assert "connection" not in cluster["trap_log"].read_text()
