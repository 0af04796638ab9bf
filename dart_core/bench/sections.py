"""The generated blocks of the one-off studies' READMEs (``bench/results/<study>/README.md``),
rendered from their result files: ``python -m dart_core.bench.sections`` (``--check`` exits 1 where
a README is not what the files give).

Nine studies hold results that are not re-measured by the report itself:

- "Continuous batching without Ray": ``bench/results/batching_cpu/batching.json``
  (:mod:`dart_core.bench.batching`);
- "Importing the reference n-gram model": ``bench/results/convert_reference_*.json``
  (``python -m ngram_service.convert_bench``);
- "The trie at a billion tokens": ``bench/results/billion_trie.json`` (the build's summary,
  ``python -m ngram_service.bench`` and ``python -m ngram_service.load_bench`` on that trie and on
  the default one, and τ with each);
- "Serving threads": ``bench/results/serving_threads/*.json`` (:mod:`dart_core.bench.serving`
  against ``serve run deployments/dart.yaml`` with the engine's thread settings varied);
- "The speculation gate, replayed": the engine's debug logs of :data:`GATE_LOGS`
  (:mod:`dart_core.bench.gate_replay`);
- "Prefill and freed memory (CPU)": ``bench/results/cpu_memory/*.json`` (:mod:`dart_core.bench.batching`
  run by three engine versions, :func:`render_cpu_memory`);
- "Stream interval": ``bench/results/stream_interval/*.json`` (:mod:`dart_core.bench.serving` against
  ``serve run deployments/dart.yaml`` with the engine's stream grouping varied, :func:`render_stream_interval`);
- "Draft weights": ``bench/results/draft_weights/*.json`` (:mod:`dart_core.bench.decoding` with the draft head
  dense and in Q8_0 blocks, :func:`render_draft_weights`);
- "Where speculation can pay (CPU)": ``bench/results/speculation_ceiling/<kernel>/verify_curve.json``
  (:mod:`dart_core.bench.verify_curve` at several batch sizes, one folder per GGUF kernel,
  :func:`render_speculation_ceiling`).

Each is written between its own markers in its study's README (:data:`SECTION_FOLDERS`); the text
around them (what the figures mean)
cites the tables and copies none of their numbers. Derived rows (per-core capacity, the
extrapolations) are computed here from the measured figures, with the formula beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

__all__ = ["SECTION_FOLDERS", "render_batching", "render_reference_import", "render_billion_trie", "render_serving_threads",
           "render_gate_replay", "render_cpu_memory", "render_stream_interval", "render_draft_weights",
           "render_speculation_ceiling", "CEILING_KERNELS", "GATE_LOGS",
           "CPU_MEMORY_VARIANTS", "STREAM_VARIANTS", "DRAFT_WEIGHT_SETTINGS", "SECTIONS", "write_sections", "main"]

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def render_batching(results: Path = RESULTS) -> str:
    """The CPU batching sweep's tables (:func:`dart_core.bench.serving.markdown_table` and the
    speculative-steps table).

    Raises:
        FileNotFoundError: no ``batching_cpu/batching.json``.
    """
    from dart_core.bench import batching, decoding, serving

    r = json.loads((results / "batching_cpu" / "batching.json").read_text())
    c = r["config"]
    lines = [f"Measured on {decoding.hardware_line(r['hardware'])}; `{r.get('command', 'python -m dart_core.bench.batching')}` "
             f"(speculation allowed up to {c['max_speculative_batch']} running sequences, the gate "
             f"{'on' if c.get('gate', True) else 'off'}, budget `{c['budget']}`, weights `{c['weights']}`), "
             f"{r['seconds']:.0f} s.", "", serving.markdown_table(r)]
    if any("steps" in x for x in r["rows"]):
        lines += ["", batching.step_table(r)]
    return "\n".join(lines)


_ORDER = {"dfs": "ids depth-first (as a reference merge writes them)",
          "level": "ids level by level, shuffled in each level (a fresh build's insertion order)"}


def render_reference_import(results: Path = RESULTS) -> str:
    """One row per ``convert_reference_*.json``: the source's id order, the memory limit, the
    median conversion, and the extrapolation to the published full trie each file records.

    Raises:
        FileNotFoundError: no ``convert_reference_*.json``.
    """
    files = sorted(results.glob("convert_reference_*.json"))
    if not files:
        raise FileNotFoundError(f"no convert_reference_*.json in {results}")
    rows, extra = [], []
    runs_of = [json.loads(f.read_text()) for f in files]
    first = runs_of[0]
    for d in runs_of:
        c, runs = d["convert"], d["runs"]
        sec = statistics.median(x["seconds"] for x in runs)
        limit = "unlimited" if d["memory_limit_mb"] is None else \
            f"cgroup {d['memory_limit_mb']} MiB ({d['limit_vs_source']:.2f}× the file)"
        rss = _n(statistics.median(x["peak_rss_mb"] for x in runs))
        if c.get("cgroup_peak_mb"):
            rss += f" (cgroup peak {c['cgroup_peak_mb']:.0f})"
        rows.append(f"| {_ORDER.get(d['source']['id_order'], d['source']['id_order'])} | {limit} | {len(runs)} | "
                    f"{sec:.2f} | {c['source_bytes'] / 2**20 / sec:.0f} | {c['source_nodes'] / 1e6 / sec:.2f} | {rss} | "
                    f"{'identical' if d['levels_identical_to_source'] else '**differs**'} |")
        x = d["extrapolated_to_full_reference"]
        extra.append(f"| {_ORDER.get(d['source']['id_order'], d['source']['id_order']).split(' (')[0]}, {limit} | "
                     f"{x['seconds']:.0f} | {x['output_bytes'] / 1e9:.1f} | {x['temp_index_bytes'] / 1e9:.1f} | "
                     f"{x['visited_bits_bytes'] / 1e6:.0f} |")
    c = first["convert"]
    src_nodes, nodes = c["source_nodes"], c["nodes"]
    return "\n".join([
        f"Source: the default corpus counted at order {c['order']} ({_n(c['total_tokens'])} tokens, "
        f"{_n(src_nodes)} nodes with the root), written in the reference's format "
        f"({_n(c['source_bytes'])} B).", "",
        "| reference file | memory | runs | convert s (median) | source MiB/s | M nodes/s | peak RSS MB | result |",
        "|---|---|---:|---:|---:|---:|---:|---|", *rows, "",
        f"The converted file: {_n(nodes)} nodes in {_n(c['file_bytes'])} B, {c['bytes_ratio']:.3f}× the reference's "
        f"bytes ({c['file_bytes'] / nodes:.1f} B per node against {c['source_bytes'] / src_nodes:.1f}); it opens in "
        f"{statistics.median(x['open_ms'] for x in first['runs']):.2f} ms (median).", "",
        "Extrapolated to the published full trie (43.5 GB, about 1.3 B nodes; linear in nodes at these speeds):", "",
        "| conversion | seconds | result GB | temporary index GB | visited bits MB |",
        "|---|---:|---:|---:|---:|", *extra])


def render_billion_trie(results: Path = RESULTS) -> str:
    """The billion-token trie's build, lookups and searches against the default trie's, τ with
    each, the n-gram host's capacity, and the sizes and times they extrapolate to.

    Raises:
        FileNotFoundError: no ``billion_trie.json``.
    """
    d = json.loads((results / "billion_trie.json").read_text())
    b, m = d["build"], d["machine"]
    bd, bb = d["bench"]["default"], d["bench"]["billion"]
    ld, lb = d["load"]["default"], d["load"]["billion"]
    tok_cpu_s = b["total_tokens"] / (b["user_s"] + b["sys_s"])
    lines = [f"Machine: {m['cpu']}, {m['ram_gib']} GiB, {m['disk']} disk. Corpus: {_n(b['total_tokens'])} tokens, "
             f"{_n(b['num_documents'])} documents ({_n(d['corpus']['binary_files_skipped'])} binary files skipped).",
             "", "**Build** (one run):", "",
             "| stage | seconds | rate |", "|---|---:|---|",
             f"| reading and tokenising (not overlapped with counting) | {_n(b['tokenize_seconds'])} | "
             f"{b['total_tokens'] / b['tokenize_seconds'] / 1e6:.2f} M tokens/s; {tok_cpu_s / 1e6:.2f} M tokens per "
             f"CPU-second |",
             f"| counting ({b['num_runs']} sorted runs) | {_n(b['count_seconds'])} | "
             f"{b['count_tokens_per_s'] / 1e6:.1f} M tokens/s, one thread |",
             f"| merging the runs, writing the file | {_n(b['merge_seconds'])} | |",
             f"| total, `--verify` included | {_n(b['total_seconds'])} | |", "",
             f"Peak RSS {_n(b['peak_rss_mb'])} MB (the counting process); memory in use on the machine at most "
             f"{_n(b['peak_used_ram_mb_machine'])} MB; disk at the peak {b['peak_disk_bytes_out_dir'] / 1e9:.2f} GB "
             f"({b['peak_disk_bytes_out_dir'] / b['file_bytes']:.1f}× the result).", "",
             "| trie | corpus tokens | nodes (order 1 / 2 / 3) | file bytes | B per node |",
             "|---|---:|---|---:|---:|"]
    for name, t in (("default", bd["trie"]), ("billion-token", bb["trie"])):
        lines.append(f"| {name} | {_n(t['total_tokens'])} | {' / '.join(_n(x) for x in t['nodes_per_level'])} | "
                     f"{_n(t['file_bytes'])} | {t['bytes_per_node']:.2f} |")
    growth = math.log(bb["trie"]["num_nodes"] / bd["trie"]["num_nodes"]) / \
        math.log(bb["trie"]["total_tokens"] / bd["trie"]["total_tokens"])
    lines += ["", f"Nodes grow as tokens^{growth:.2f} between the two (log of the node ratio over log of the token "
              "ratio).", "", "**Lookups and searches** (`python -m ngram_service.bench`; warm: the file in the page "
              "cache; cold: the page cache dropped before each of 3 repeats):", "",
              "| | default trie | billion-token trie |", "|---|---:|---:|"]

    def row(label, f):
        lines.append(f"| {label} | {f(bd)} | {f(bb)} |")

    row("open warm / cold, ms", lambda x: f"{x['open_ms']:.2f} / {x['cold_one_by_one']['open_ms']:.2f}")
    row("full `verify` (payload CRC), s", lambda x: f"{x['verify_s']:.2f}")
    row("back-off lookup, batched, ns per (context, token)", lambda x: f"{x['lookup_ns']:.0f}")
    row("lookup hit rate", lambda x: f"{x['lookup_hit_rate']:.2f}")
    for kind in ("lookup", "search"):
        row(f"{'lookup, one call (25 tokens)' if kind == 'lookup' else 'tree search, one sequence'} p50 / p90 ms, "
            "warm", lambda x, k=kind: f"{x['warm_one_by_one'][k]['p50_ms']:.3f} / {x['warm_one_by_one'][k]['p90_ms']:.3f}")
        row("the same, cold (max)", lambda x, k=kind: f"{x['cold_one_by_one'][k]['p50_ms']:.3f} / "
            f"{x['cold_one_by_one'][k]['p90_ms']:.3f} ({x['cold_one_by_one'][k]['max_ms']:.2f})")
    row("tree search, batch of 16, µs per sequence, 1 / 2 threads",
        lambda x: f"{x['search_us_per_sequence']['batch16_threads1']:.0f} / "
                  f"{x['search_us_per_sequence']['batch16_threads2']:.0f}")
    tau = d["tau"]
    lines += ["", f"**τ with each trie** (head: {tau['head']}; {tau['weights']} target; budget {tau['budget']}, "
              f"κ = 0, T = 0, first {tau['num_prompts']} prompts, {tau['max_new_tokens']} new tokens, one "
              f"deterministic run, {tau['date']}; `{tau['command']}`):", "",
              "| trie | corpus tokens | nodes | MT-Bench τ | HumanEval τ |", "|---|---:|---:|---:|---:|"]
    for r in tau["rows"]:
        lines.append(f"| {r['trie']} | {_n(r['corpus_tokens'])} | {_n(r['nodes'])} | {r['mt-bench']:.3f} | "
                     f"{r['humaneval']:.3f} |")
    rebuilt = next(r for r in tau["rows"] if r["trie"] == "billion-token")
    if rebuilt["corpus_tokens"] != b["total_tokens"]:
        lines += ["", f"The billion-token trie of this table was rebuilt with the build command above from the "
                  f"packages' versions of {tau['date']}; the build table describes the first build."]
    cores = m["cores"]
    lines += ["", f"**The n-gram host's capacity** (`python -m ngram_service.load_bench`: the server with {cores} "
              f"threads, 4 gRPC clients on the same {cores} cores, median of {ld['runs']} runs):", "",
              "| trie | batch 1: sequences/s | p50 / p99 ms | batch 16: sequences/s | p50 / p99 ms | failed calls | "
              "batch-16 sequences/s per core |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, x in (("default", ld), ("billion-token", lb)):
        one, six = x["batch1"], x["batch16"]
        lines.append(f"| {name} | {one['service_sequences_per_s']:.0f} | {one['latency_p50_ms']:.1f} / "
                     f"{one['latency_p99_ms']:.1f} | {six['service_sequences_per_s']:.0f} | "
                     f"{six['latency_p50_ms']:.1f} / {six['latency_p99_ms']:.1f} | "
                     f"{one['failed_calls'] + six['failed_calls']} | {six['service_sequences_per_s'] / cores:.0f} |")
    per_core = lb["batch16"]["service_sequences_per_s"] / cores
    lines += ["", "Replicas one 16-core n-gram host serves with the billion-token trie, at that per-core rate "
              "(16 × rate ÷ the replica's searches per second; the step rates are assumed, not measured):", "",
              "| assumed per-replica demand | searches/s | replicas |", "|---|---:|---:|"]
    for batch, steps in ((16, 25), (16, 50), (64, 25)):
        lines.append(f"| batch {batch} at {steps} steps/s | {batch * steps} | {16 * per_core / (batch * steps):.0f} |")
    # a 100 GB trie, extrapolated from the rates above (order 5 bytes per node from the reference import)
    order5 = sorted(results.glob("convert_reference_*.json"))
    b5 = json.loads(order5[0].read_text())["convert"] if order5 else None
    target = 100e9
    lines += ["", "**Extrapolated to a 100 GB trie** (linear in the measured rates):", "",
              "| quantity | value | from |", "|---|---:|---|",
              f"| nodes at order 3 | {target / bb['trie']['bytes_per_node'] / 1e9:.1f} B | 100 GB ÷ the "
              "billion-token trie's bytes per node |"]
    if b5:
        per_node5 = b5["file_bytes"] / b5["nodes"]
        nodes5 = target / per_node5
        tokens5 = nodes5 / (b5["nodes"] / b5["total_tokens"])
        lines += [f"| nodes at order 5 | {nodes5 / 1e9:.1f} B | 100 GB ÷ the order-5 default trie's bytes per "
                  "node |",
                  f"| corpus tokens for order 5, at least | {tokens5 / 1e9:.1f} B | nodes ÷ the order-5 default "
                  "trie's nodes per token (more as growth bends) |",
                  f"| tokenising them on 63 cores, min | {tokens5 / tok_cpu_s / 63 / 60:.0f} | ÷ tokens per "
                  "CPU-second above |",
                  f"| counting them (one thread), min | {tokens5 / b['count_tokens_per_s'] / 60:.0f} | ÷ this "
                  "build's count rate (order 3) |"]
    lines += [f"| merging and writing 100 GB, min | {target / b['file_bytes'] * b['merge_seconds'] / 60:.0f} | "
              "scaled from this build's merge |",
              f"| disk at the peak, GB | {target * b['peak_disk_bytes_out_dir'] / b['file_bytes'] / 1e9:.0f} | "
              "this build's peak ÷ result |",
              f"| full `verify`, s | {target / bb['trie']['file_bytes'] * bb['verify_s']:.0f} | scaled from the "
              "billion-token trie's |"]
    return "\n".join(lines)


#: how a serving-threads run loaded its model, by file-name prefix
_LOADERS = {"loader-stays": "on the replica's thread (two OpenMP pools)",
            "own-thread": "on a thread that ends (`load_in_own_thread`)"}


def render_serving_threads(results: Path = RESULTS) -> str:
    """``serve run`` with the engine on 1 or 2 PyTorch threads, its model loaded on a thread that
    stays or one that ends: one row per run and level, from ``serving_threads/<loader>-omp<N>-<run>.json``
    (:mod:`dart_core.bench.serving` results; the file name says the loader and ``OMP_NUM_THREADS``).

    Raises:
        FileNotFoundError: no such files; ValueError: a file name of another form.
    """
    files = sorted((results / "serving_threads").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no serving results in {results / 'serving_threads'}")
    name = re.compile(rf"({'|'.join(map(re.escape, _LOADERS))})-omp(\d+)-(.+)")
    table = []
    for f in files:
        match = name.fullmatch(f.stem)
        if match is None:
            raise ValueError(f"{f.name}: expected <{'|'.join(_LOADERS)}>-omp<N>-<run>.json")
        loader, threads, run = match.groups()
        rows = json.loads(f.read_text())["rows"]
        for c in {r["concurrency"] for r in rows}:
            tps = {r["mode"]: r["tokens_per_s"] for r in rows if r["concurrency"] == c}
            table.append(((list(_LOADERS).index(loader), int(threads), c, run),
                          f"| {_LOADERS[loader]} | {threads} | {c} | {run} | {tps['dart']:.1f} | "
                          f"{tps['no-speculation']:.1f} | {tps['dart'] / tps['no-speculation']:.2f}× |"))
    return "\n".join(["| model loaded | engine threads | clients | run | DART tokens/s | no speculation tokens/s "
                      "| DART ÷ no speculation |", "|---|---:|---:|---|---:|---:|---:|"]
                     + [line for _, line in sorted(table)])


#: the stream settings of "Stream interval", in table order: (file prefix, heading)
STREAM_VARIANTS = (("per-step", "one item per step"), ("interval-0", "0 ms"), ("interval-20", "20 ms"),
                   ("interval-50", "50 ms"))


def render_stream_interval(results: Path = RESULTS) -> str:
    """``serve run deployments/dart.yaml`` with the engine replica streaming one item per decoding
    step (the engine before ``stream_interval_ms``) and with chunks grouped at 0, 20 and 50 ms:
    per level and mode, the median over runs of tokens/s and of the median time to first token,
    from ``stream_interval/<variant>-<run>.json`` (:mod:`dart_core.bench.serving` results).

    Raises:
        FileNotFoundError: a variant without result files.
    """
    runs = _variant_runs(results / "stream_interval", [p for p, _ in STREAM_VARIANTS], "{prefix}-r[0-9]*.json")
    c = runs[STREAM_VARIANTS[0][0]][0]["config"]

    def median(prefix: str, level: int, mode: str, key) -> float:
        return _level_median(runs[prefix], level, mode, key)

    heads = [h for _, h in STREAM_VARIANTS]
    first, last = STREAM_VARIANTS[0][0], STREAM_VARIANTS[-1][0]
    lines = [f"`python -m dart_core.bench.serving --concurrency {' '.join(map(str, c['concurrency']))} "
             f"--requests-per-client {c['requests_per_client']} --max-tokens {c['max_tokens']} --dataset "
             f"{c['dataset']}` against `serve run deployments/dart.yaml`; runs per setting: "
             f"{', '.join(f'{h} {len(runs[p])}' for p, h in STREAM_VARIANTS)}. Medians over runs.", "",
             "| clients | mode | " + " | ".join(f"tokens/s, {h}" for h in heads) + f" | {heads[-1]} ÷ {heads[0]} | "
             + f"TTFT p50 ms, {heads[0]} | TTFT p50 ms, {heads[-1]} |",
             "|---:|---|" + "---:|" * (len(heads) + 3)]
    for level in c["concurrency"]:
        for mode in c["modes"]:
            tps = [median(p, level, mode, lambda r: r["tokens_per_s"]) for p, _ in STREAM_VARIANTS]
            ttft = [median(p, level, mode, lambda r: r["ttft_ms"]["p50"]) for p in (first, last)]
            lines.append(f"| {level} | {mode} | " + " | ".join(f"{x:.1f}" for x in tps) + f" | {tps[-1] / tps[0]:.2f}× | "
                         + " | ".join(f"{x:.0f}" for x in ttft) + " |")
    return "\n".join(lines)


#: the draft-head weight settings of "Draft weights", in table order
DRAFT_WEIGHT_SETTINGS = ("dense", "q8_0")


def render_draft_weights(results: Path = RESULTS) -> str:
    """The decoding benchmark with the draft head's linear layers dense (bf16 on this kind of CPU)
    and in Q8_0 blocks, runs alternating: per setting the median over runs of DART's tokens/s, of
    autoregressive tokens/s, of DART ÷ autoregressive (each run's own ratio), of the draft's and the
    whole step's ms and of τ, from ``draft_weights/<setting>-r<run>.json``; and τ at a fixed budget
    of 60 nodes from ``draft_weights/tau60-<setting>.json`` (:mod:`dart_core.bench.decoding` results).

    Raises:
        FileNotFoundError: a setting without result files.
    """
    from dart_core.bench import decoding

    runs = _variant_runs(results / "draft_weights", DRAFT_WEIGHT_SETTINGS, "{prefix}-r[0-9]*.json")
    for setting in DRAFT_WEIGHT_SETTINGS:
        tau = results / "draft_weights" / f"tau60-{setting}.json"
        if not tau.is_file():
            raise FileNotFoundError(f"no results {tau}")
    first = runs[DRAFT_WEIGHT_SETTINGS[0]][0]
    c = first["config"]

    def row(run: dict, method: str) -> dict:
        return next(r for r in run["rows"] if r["method"] == method)

    def median(setting: str, key) -> float:
        return statistics.median(key(run) for run in runs[setting])

    lines = [f"Measured on {decoding.hardware_line(first['hardware'])}; `python -m dart_core.bench --datasets "
             f"{' '.join(c['datasets'])} --num-prompts {c['num_prompts']} --max-new-tokens {c['max_new_tokens']} "
             f"--threads {c['threads']} --methods autoregressive dart-context --draft-weights <setting>` (budget "
             f"`{c['budget']}`), runs per setting: "
             f"{', '.join(f'{s} {len(runs[s])}' for s in DRAFT_WEIGHT_SETTINGS)}, alternating. Medians over runs; "
             "τ at budget 60 from one run with `--budget 60 --methods dart-context`.", "",
             "| draft weights | DART tokens/s | autoregressive tokens/s | DART ÷ autoregressive | draft ms per step "
             "| step ms | τ | τ at budget 60 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in DRAFT_WEIGHT_SETTINGS:
        tau60 = row(json.loads((results / "draft_weights" / f"tau60-{s}.json").read_text()), "dart-context")["tau"]
        lines.append(f"| {s} | {median(s, lambda r: row(r, 'dart-context')['tokens_per_s']):.1f} | "
                     f"{median(s, lambda r: row(r, 'autoregressive')['tokens_per_s']):.1f} | "
                     f"{median(s, lambda r: row(r, 'dart-context')['speedup']):.2f}× | "
                     f"{median(s, lambda r: row(r, 'dart-context')['ms_per_step']['draft']):.2f} | "
                     f"{median(s, lambda r: row(r, 'dart-context')['ms_per_step']['total']):.2f} | "
                     f"{median(s, lambda r: row(r, 'dart-context')['tau']):.2f} | {tau60:.2f} |")
    return "\n".join(lines)


#: the GGUF kernels of "Where speculation can pay (CPU)", in table order (folders of ``speculation_ceiling``)
CEILING_KERNELS = ("qmm", "qmm-a8")


def render_speculation_ceiling(results: Path = RESULTS) -> str:
    """Per kernel of :data:`CEILING_KERNELS`: the verification timings by query tokens per sequence and
    batch size, then :func:`dart_core.bench.verify_curve.ceiling_table` (plain decoding's ms per token,
    a draft node's cost, the break-even acceptance and the best speed-up of drafts accepted at a given
    rate, drafting free), from ``speculation_ceiling/<kernel>/verify_curve.json``.

    Raises:
        FileNotFoundError: a kernel without its result file.
    """
    from dart_core.bench import decoding, verify_curve

    runs = {}
    for k in CEILING_KERNELS:
        path = results / "speculation_ceiling" / k / "verify_curve.json"
        if not path.is_file():
            raise FileNotFoundError(f"no results {path}")
        runs[k] = json.loads(path.read_text())
    first = runs[CEILING_KERNELS[0]]
    c = first["config"]
    lines = [f"Measured on {decoding.hardware_line(first['hardware'])}; `python -m dart_core.bench.verify_curve "
             f"--weights gguf-native --gguf-kernel <kernel> --nodes {' '.join(map(str, c['node_counts']))} "
             f"--batch-sizes {' '.join(map(str, c['batch_sizes']))} --threads {first['hardware']['threads']} "
             f"--repeats {c['repeats']}`, one run per kernel, one after the other. One target forward of n query "
             "tokens per sequence after a 256-token prefix (each sequence its own), ms, median of the passes.", ""]
    for k, r in runs.items():
        lines += [f"**{k}** ({r['curves']['gguf-native']['format']}):", "", verify_curve.markdown_table(r)]
    lines += ["What those timings allow, per kernel and batch size (`verify_curve.ceiling_table`; drafting, tree "
              "search and host time counted as free, so a real step does worse):", ""]
    lines.append(verify_curve.ceiling_table({"curves": {k: r["curves"]["gguf-native"] for k, r in runs.items()}})
                 .rstrip("\n"))
    return "\n".join(lines)


#: (title, log files under bench/results) of the gate replays: one engine debug log set per machine
GATE_LOGS = (("CPU: 2-core AMD EPYC with AVX512-BF16, the 4-bit target, AlpacaEval instructions (the tuning set), one "
              "client (`python -m dart_core.bench.batching --concurrency 1 --requests-per-client 4 --max-tokens 128 "
              "--dataset alpacaeval --threads 2 --modes dart --log-level debug`, two runs, the engine of 2026-11-28)", "gate/cpu-*.log"),
             ("GPU: one H200, bf16, CUDA graphs, the same kind of run (`scripts/gpu_session/bench.sh gate-bf16-graphs`)",
              "gpu-h200-7/gate-bf16-graphs.log"))


def render_gate_replay(results: Path = RESULTS) -> str:
    """The speculation gate replayed over the measured steps of each log set of :data:`GATE_LOGS`
    (:mod:`dart_core.bench.gate_replay`).

    Raises:
        FileNotFoundError: a set has no log; ValueError: a log without gated steps.
    """
    from dart_core.bench.gate_replay import render

    parts = []
    for title, pattern in GATE_LOGS:
        logs = sorted(results.glob(pattern))
        if not logs:
            raise FileNotFoundError(f"no gate logs {results / pattern}")
        parts.append(f"**{title}**\n\n{render(logs, seeds=12, num_steps=1500)}")
    return "\n\n".join(parts)


def _variant_runs(folder: Path, prefixes, pattern: str) -> dict[str, list[dict]]:
    """Each variant's result files under ``folder`` (``pattern`` with ``{prefix}``), read, in name order.

    Raises:
        FileNotFoundError: a variant without result files."""
    runs: dict[str, list[dict]] = {}
    for prefix in prefixes:
        files = sorted(folder.glob(pattern.format(prefix=prefix)))
        if not files:
            raise FileNotFoundError(f"no results {folder / prefix}-<run>.json")
        runs[prefix] = [json.loads(f.read_text()) for f in files]
    return runs


def _level_median(runs: list[dict], level: int, mode: str, key) -> float:
    """The median over ``runs`` (benchmark results with per-level ``rows``) of ``key(row)`` at one level and mode."""
    return statistics.median(key(r) for run in runs for r in run["rows"]
                             if r["concurrency"] == level and r["mode"] == mode)


#: the engine versions of "Prefill and freed memory (CPU)", in table order: (file prefix, heading)
CPU_MEMORY_VARIANTS = (("before", "before"), ("after-off", "prefill fix only"), ("after", "both"))


def render_cpu_memory(results: Path = RESULTS) -> str:
    """The in-process batching sweep run by three engine versions, interleaved: before the
    prefill and allocator changes, with the prefill change only (``DART_KEEP_FREED_MEMORY=0``),
    and with both: per level and mode, the median over runs of tokens/s and of the median time to
    first token, from ``cpu_memory/<variant>-<run>.json`` (:mod:`dart_core.bench.batching`).

    Raises:
        FileNotFoundError: a variant without result files.
    """
    from dart_core.bench import decoding

    runs = _variant_runs(results / "cpu_memory", [p for p, _ in CPU_MEMORY_VARIANTS], "{prefix}-[0-9]*.json")
    first = runs[CPU_MEMORY_VARIANTS[0][0]][0]
    c = first["config"]

    def median(prefix: str, level: int, mode: str, key) -> float:
        return _level_median(runs[prefix], level, mode, key)

    heads = [h for _, h in CPU_MEMORY_VARIANTS]
    lines = [f"Measured on {decoding.hardware_line(first['hardware'])}; `python -m dart_core.bench.batching "
             f"--concurrency {' '.join(map(str, c['concurrency']))} --requests-per-client {c['requests_per_client']} "
             f"--max-tokens {c['max_tokens']} --threads {c['threads']}` ({c['dataset']}, budget `{c['budget']}`, "
             f"the gate {'on' if c.get('gate', True) else 'off'}), runs per version: "
             f"{', '.join(f'{h} {len(runs[p])}' for p, h in CPU_MEMORY_VARIANTS)}, interleaved. Medians over runs.",
             "", "| clients | mode | " + " | ".join(f"tokens/s, {h}" for h in heads) + " | both ÷ before | "
             + " | ".join(f"TTFT p50 ms, {h}" for h in heads) + " |",
             "|---:|---|" + "---:|" * (2 * len(heads) + 1)]
    for level in c["concurrency"]:
        for mode in c["modes"]:
            tps = [median(p, level, mode, lambda r: r["tokens_per_s"]) for p, _ in CPU_MEMORY_VARIANTS]
            ttft = [median(p, level, mode, lambda r: r["ttft_ms"]["p50"]) for p, _ in CPU_MEMORY_VARIANTS]
            lines.append(f"| {level} | {mode} | " + " | ".join(f"{x:.1f}" for x in tps) + f" | {tps[-1] / tps[0]:.2f}× | "
                         + " | ".join(f"{x:.0f}" for x in ttft) + " |")
    return "\n".join(lines)


#: (marker name, renderer) of every section this module writes
SECTIONS = (("batching-cpu", render_batching), ("reference-import", render_reference_import),
            ("billion-trie", render_billion_trie), ("serving-threads", render_serving_threads),
            ("gate-replay", render_gate_replay), ("cpu-memory", render_cpu_memory),
            ("stream-interval", render_stream_interval), ("draft-weights", render_draft_weights),
            ("speculation-ceiling", render_speculation_ceiling))


def _block(name: str, body: str) -> str:
    return (f"<!-- {name}:start -->\n\n_Rendered by `python -m dart_core.bench.sections` from the files in "
            f"`bench/results/`._\n\n{body}\n\n<!-- {name}:end -->")


#: the study folder whose README holds each section's block (bench/results/<folder>/README.md)
SECTION_FOLDERS = {"batching-cpu": "batching_cpu", "reference-import": "reference_import",
                   "billion-trie": "billion_trie", "serving-threads": "serving_threads", "gate-replay": "gate",
                   "cpu-memory": "cpu_memory", "stream-interval": "stream_interval", "draft-weights": "draft_weights",
                   "speculation-ceiling": "speculation_ceiling"}


def write_sections(page: str | Path | None = None, results: Path = RESULTS, *, check: bool = False) -> bool:
    """Replaces each section's block in its study's README (``results/<folder>/README.md``,
    :data:`SECTION_FOLDERS`), or every block in ``page`` when given; with ``check``, only says
    whether any differs.

    Returns:
        True when a page changed (or, with ``check``, would change).

    Raises:
        ValueError: the page lacks a section's markers (they are placed by hand, under the
            section's heading); FileNotFoundError: as the renderers.
    """
    from dart_core.bench.report import replace_marked

    changed = False
    for name, render in SECTIONS:
        where = Path(page) if page is not None else results / SECTION_FOLDERS[name] / "README.md"
        text = where.read_text()
        new = replace_marked(text, _block(name, render(results)), f"<!-- {name}:start -->", f"<!-- {name}:end -->",
                             where)
        if new != text:
            changed = True
            if not check:
                where.write_text(new)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.sections", description=__doc__.split("\n\n")[0])
    ap.add_argument("--page", default=None, help="one page holding every block [each study's README]")
    ap.add_argument("--check", action="store_true", help="exit 1 where the page is not what the files give")
    args = ap.parse_args(argv)
    try:
        changed = write_sections(args.page, check=args.check)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check and changed:
        print(f"{args.page or 'a study README'}: a section differs from its result files; run "
              "python -m dart_core.bench.sections", file=sys.stderr)
        return 1
    print(f"{'updated' if changed else 'unchanged'} {args.page or 'the study READMEs'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
