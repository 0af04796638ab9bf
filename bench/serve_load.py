"""Load test of a running dart-serve app over HTTP with the official ``openai`` client.

``python bench/serve_load.py --url http://localhost:8000/v1 --clients 8 --seconds 60``

N concurrent streaming clients send MT-Bench first turns (chat, T = 0) in a
loop for T seconds (bounded: each stops after the deadline); reports aggregate
generated tokens/s, requests, errors, time to first token and inter-token
latency (p50/p99), and the server's mean τ, as JSON.  Run it once against the
DART app and once against the same app with ``speculative: false`` to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://localhost:8000/v1")
    ap.add_argument("--model", default=None, help="served model name [the first of /v1/models]")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--api-key", default="unused")
    args = ap.parse_args(argv)

    from openai import OpenAI

    from ngram_service.corpus import mt_bench_first_turns

    prompts = mt_bench_first_turns()
    client = OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    lock = threading.Lock()
    stats = {"tokens": 0, "requests": 0, "errors": [], "ttft_ms": [], "itl_ms": [], "tau": []}
    deadline = time.perf_counter() + args.seconds

    def worker(cid: int) -> None:
        i = cid
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            last = None
            try:
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                    max_tokens=args.max_tokens, temperature=0, stream=True)
                usage = None
                for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices and chunk.choices[0].delta.content:
                        with lock:
                            (stats["ttft_ms"] if last is None else stats["itl_ms"]).append(
                                1e3 * (now - (t0 if last is None else last)))
                        last = now
                    if chunk.usage is not None:
                        usage = chunk.usage
                with lock:
                    stats["requests"] += 1
                    if usage is not None:
                        stats["tokens"] += usage.completion_tokens
                        stats["tau"].append(usage.model_extra.get("dart", {}).get("tau", 0.0))
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    stats["errors"].append(repr(e)[:200])
            i += args.clients

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    print(json.dumps({
        "url": args.url, "model": model, "clients": args.clients, "seconds": round(wall, 1),
        "max_tokens": args.max_tokens, "requests": stats["requests"], "errors": len(stats["errors"]),
        "error_samples": stats["errors"][:3], "tokens_per_s": round(stats["tokens"] / wall, 2),
        "ttft_ms": {"p50": _pct(stats["ttft_ms"], 0.5), "p99": _pct(stats["ttft_ms"], 0.99)},
        "itl_ms": {"p50": _pct(stats["itl_ms"], 0.5), "p99": _pct(stats["itl_ms"], 0.99)},
        "tau_mean": round(statistics.mean(stats["tau"]), 3) if stats["tau"] else None,
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
