"""Load benchmark of the tree-search service on loopback:
``python -m ngram_service.load_bench --trie PATH``.

Starts the server as a subprocess on 127.0.0.1, then for each batch size
runs ``--clients`` engine-side clients (:class:`GrpcTreeSearch`, one per
thread) for ``--seconds``, and reports calls/s, p50/p99 latency, failed
calls (exceptions reaching the engine) and fallbacks.  ``--kill-at`` kills
the server that many seconds into each run and ``--restart-after`` starts it
again, to show that no engine call fails and that the service answers again.
Before the load, it measures the round-trip overhead of a batch-1 call
beyond the search itself (p50 of latency minus the server-reported search
time).  Calls the service answered and calls the fallback answered are
reported apart.  Bounded in time and count, loopback only; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

from ngram_service._proto import ngram_pb2_grpc
from ngram_service.client import GrpcTreeSearch
from ngram_service.trie import NgramTrie
from ngram_service.tree_search import SearchParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(trie: str, port: int, threads: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ngram_service.server", "--trie", trie, "--port", str(port)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if "serving on" not in proc.stdout.readline():
        raise RuntimeError("the server did not start")
    return proc


def _inputs(rng, frequent, batch, depth=8, k=25):
    ids = np.stack([[rng.choice(frequent, size=k, replace=False) for _ in range(depth)] for _ in range(batch)])
    logits = np.sort(rng.normal(size=(batch, depth, k)) * 2.0, axis=-1)[..., ::-1]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    contexts = [rng.choice(frequent, size=int(rng.integers(8, 64))) for _ in range(batch)]
    return ids.astype(np.int64), probs, contexts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ngram_service.load_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trie", required=True)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--server-threads", type=int, default=None)
    ap.add_argument("--timeout-ms", type=float, default=100.0)
    ap.add_argument("--kill-at", type=float, default=None, help="kill the server this many seconds into each run")
    ap.add_argument("--restart-after", type=float, default=1.0, help="restart it this many seconds after the kill")
    args = ap.parse_args(argv)

    trie = NgramTrie(args.trie)
    vocab_hash = trie.info.vocab_hash
    counts = np.array([trie.count([t]) for t in range(trie.vocab_size)])
    frequent = np.argsort(-counts)[:2000]
    port = _free_port()
    address = f"127.0.0.1:{port}"
    proc = _spawn(args.trie, port, args.server_threads)
    result: dict = {"clients": args.clients, "seconds": args.seconds, "params": "k=25 w=20 d=8 budget=60"}
    try:
        # round-trip overhead at batch 1, one client
        client = GrpcTreeSearch(address, vocab_hash=vocab_hash, timeout_ms=1000)
        stub = ngram_pb2_grpc.NgramTreeSearchStub(grpc.insecure_channel(address))
        rng = np.random.default_rng(0)
        over, lat = [], []
        for i in range(600):
            req = client._request(*_inputs(rng, frequent, 1), SearchParams(), None)
            t0 = time.perf_counter()
            resp = stub.TreeSearch(req, timeout=1)
            ms = 1e3 * (time.perf_counter() - t0)
            if i >= 100:  # warm-up
                lat.append(ms)
                over.append(ms - resp.search_ms)
        result["batch1_roundtrip"] = {"latency_p50_ms": round(statistics.median(lat), 3),
                                      "overhead_p50_ms": round(statistics.median(over), 3),
                                      "overhead_p99_ms": round(float(np.percentile(over, 99)), 3)}
        for batch in args.batch:
            clients = [GrpcTreeSearch(address, vocab_hash=vocab_hash, timeout_ms=args.timeout_ms, cooldown_s=0.25)
                       for _ in range(args.clients)]
            latencies: list[list[float]] = [[] for _ in clients]  # calls the service answered
            fallback_latencies: list[list[float]] = [[] for _ in clients]  # calls answered by the fallback
            failures = [0] * len(clients)
            stop = time.monotonic() + args.seconds

            def run(i: int) -> None:
                r = np.random.default_rng(100 + i)
                pool = [_inputs(r, frequent, batch) for _ in range(16)]
                n = 0
                while time.monotonic() < stop:
                    fell = clients[i].fallbacks
                    t0 = time.perf_counter()
                    try:
                        trees = clients[i].search(*pool[n % len(pool)], SearchParams())
                        assert len(trees) == batch
                    except Exception:  # noqa: BLE001 - counted: a failed engine-side call
                        failures[i] += 1
                    ms = 1e3 * (time.perf_counter() - t0)
                    (fallback_latencies if clients[i].fallbacks > fell else latencies)[i].append(ms)
                    n += 1

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
            start = time.monotonic()
            for t in threads:
                t.start()
            restarted_at = None
            if args.kill_at is not None:
                time.sleep(args.kill_at)
                proc.kill()
                proc.wait()
                time.sleep(args.restart_after)
                proc = _spawn(args.trie, port, args.server_threads)
                restarted_at = time.monotonic() - start
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
            all_lat = [x for per in latencies for x in per]
            fb_lat = [x for per in fallback_latencies for x in per]
            # does the service answer again? a fresh call after the run must not fall back
            probe = GrpcTreeSearch(address, vocab_hash=vocab_hash, timeout_ms=1000)
            probe.search(*_inputs(rng, frequent, batch), SearchParams())
            result[f"batch{batch}"] = {
                "service_calls": len(all_lat), "service_calls_per_s": round(len(all_lat) / elapsed, 1),
                "service_sequences_per_s": round(batch * len(all_lat) / elapsed, 1),
                "latency_p50_ms": round(statistics.median(all_lat), 3),
                "latency_p99_ms": round(float(np.percentile(all_lat, 99)), 3),
                "fallback_calls": len(fb_lat),
                "fallback_latency_p50_ms": round(statistics.median(fb_lat), 3) if fb_lat else None,
                "failed_calls": sum(failures), "fallbacks": sum(c.fallbacks for c in clients),
                "errors": {k: sum(c.errors.get(k, 0) for c in clients) for c in clients for k in c.errors},
                "killed_at_s": args.kill_at, "restarted_at_s": None if restarted_at is None else round(restarted_at, 2),
                "service_answers_after_run": probe.fallbacks == 0,
            }
    finally:
        proc.kill()
        proc.wait()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
