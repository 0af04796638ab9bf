"""The generated blocks of the one-off studies' READMEs (``bench/results/<study>/README.md``),
rendered from their result files: ``python -m dart_core.bench.sections`` (``--check`` exits 1 where
a README is not what the files give).

Eleven studies hold results that are not re-measured by the report itself:

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
  :func:`render_speculation_ceiling`);
- "The trie build on Ray": ``bench/results/ray_trie_build/*.json`` (``python -m ngram_service.ray_build_bench``,
  :func:`render_ray_trie_build`);
- "The default GGUF kernel (CPU)": ``bench/results/kernel_default/`` (:mod:`dart_core.bench.verify_curve`
  per qmm kernel and :mod:`dart_core.bench.decoding` with each, :func:`render_kernel_default`);
- "The trie build on Ray", its comparison with Ray Data: ``bench/results/ray_trie_build/ray_data/results.json``
  (``bench/results/ray_trie_build/ray_data/compare.py``, :func:`render_ray_data_build`).

Each is written between its own markers in its study's README (:data:`SECTION_FOLDERS`); the text
around them (what the figures mean)
cites the tables and copies none of their numbers. Derived rows (per-core capacity, the
extrapolations) are computed here from the measured figures, with the formula beside them.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
from pathlib import Path

__all__ = ["SECTION_FOLDERS", "render_batching", "render_reference_import", "render_billion_trie", "render_serving_threads",
           "render_gate_replay", "render_cpu_memory", "render_stream_interval", "render_draft_weights",
           "render_speculation_ceiling", "render_ray_trie_build", "render_kernel_default", "render_ray_data_build",
           "KERNEL_DEFAULT_VARIANTS",
           "CEILING_KERNELS", "GATE_LOGS",
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
    each, and the n-gram host's capacity.

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
    lines += ["", "The time and resources a 100 GB order-5 trie needs are estimated in \"The trie build on Ray\" "
              "(`bench/results/ray_trie_build/`), from the distributed build's measured rates."]
    return "\n".join(lines)


def _order5_tokens(results: Path, target_bytes: float) -> tuple[float, float] | None:
    """(nodes, corpus tokens) of an order-5 trie of ``target_bytes``, from the order-5 reference
    import's bytes per node and nodes per token (``convert_reference_*.json``), or None without it."""
    files = sorted(results.glob("convert_reference_*.json"))
    if not files:
        return None
    c = json.loads(files[0].read_text())["convert"]
    nodes = target_bytes / (c["file_bytes"] / c["nodes"])
    return nodes, nodes / (c["nodes"] / c["total_tokens"])


def _ray_stage_rows(rows: list[dict]) -> dict[str, dict]:
    """Per build (``single``, ``ray-<workers>``) of one pass: median wall seconds and CPU-seconds of
    counting, merging+writing and tokenising, the whole build and the machine's CPU-seconds."""
    out: dict[str, dict] = {}
    for key in sorted({(r["mode"], r["workers"]) for r in rows}):
        runs = [r for r in rows if (r["mode"], r["workers"]) == key]

        def med(fn):
            return statistics.median(fn(r) for r in runs)

        if key[0] == "single":  # one counting thread: its wall seconds are CPU-seconds
            count = med(lambda r: r["count_seconds"] - r["merge_seconds"])
            stages = {"count": (count, count), "merge": (med(lambda r: r["merge_seconds"]),) * 2,
                      "tokenise": (med(lambda r: r["tokenize_seconds"]),
                                   med(lambda r: r["driver_cpu_seconds"] - r["count_seconds"]))}
        else:
            st = lambda r, k: r["stages"][k]  # noqa: E731
            stages = {"count": (med(lambda r: st(r, "map")["seconds"]), med(lambda r: st(r, "map")["count_cpu_seconds"])),
                      "merge": (med(lambda r: st(r, "reduce")["seconds"] + st(r, "write")["seconds"]),
                                med(lambda r: st(r, "reduce")["cpu_seconds"] + st(r, "write")["cpu_seconds"])),
                      "reduce": (med(lambda r: st(r, "reduce")["seconds"]), med(lambda r: st(r, "reduce")["cpu_seconds"])),
                      "write": (med(lambda r: st(r, "write")["seconds"]), med(lambda r: st(r, "write")["cpu_seconds"])),
                      "tokenise": (med(lambda r: st(r, "sample")["seconds"] + st(r, "map")["seconds"]),
                                   med(lambda r: st(r, "sample")["cpu_seconds"] + st(r, "map")["tokenise_cpu_seconds"]))}
        out["single" if key[0] == "single" else f"ray-{key[1]}"] = {
            **stages, "total": med(lambda r: r["total_seconds"]), "machine": med(lambda r: r["machine_cpu_seconds"]),
            "tokens": runs[0]["total_tokens"], "runs": len(runs)}
    return out


def render_ray_trie_build(results: Path = RESULTS) -> str:
    """The distributed trie build against the single-machine one (``ray_trie_build/scaling.json``
    from :mod:`ngram_service.ray_build_bench`), its byte-identity checks (``identity*.json``), the
    billion-token corpus rebuilt with ``--ray`` (``billion_ray*.json``, one per order), and the 100 GB order-5
    trie estimated from the measured per-CPU-second rates.

    Raises:
        FileNotFoundError: no ``ray_trie_build/scaling.json``.
    """
    folder = results / "ray_trie_build"
    s = json.loads((folder / "scaling.json").read_text())
    by_pass = {p: _ray_stage_rows([r for r in s["rows"] if r["source"] == p]) for p in ("tokens", "texts")}
    names = sorted(by_pass["tokens"], key=lambda n: (n != "single", n))
    label = {"single": "single machine"} | {n: f"`--ray`, {n.split('-')[1]} CPU{'s' if n != 'ray-1' else ''}"
                                             for n in names if n != "single"}
    t, x = by_pass["tokens"], by_pass["texts"]
    tokens = t[names[0]]["tokens"]
    head = "| | " + " | ".join(label[n] for n in names) + " | 2 CPUs ÷ 1 (wall) |"
    rule = "|---|" + "---:|" * (len(names) + 1)

    def cell(d: dict, stage: str, name: str) -> str:
        if name == "single" and stage != "tokenise":
            return "one thread"
        wall, cpu = d[stage]
        return f"{wall:.1f} s ({d['tokens'] / max(cpu, 1e-9) / 1e6:.1f} M/CPU-s)"

    def both(d: dict, name: str) -> str:
        wall = d[name]["count"][0] + d[name]["merge"][0]
        return f"{wall:.1f} s ({d[name]['tokens'] / max(d[name]['count'][1] + d[name]['merge'][1], 1e-9) / 1e6:.1f} M/CPU-s)"

    def ratio(d: dict, fn) -> str:
        return f"{fn(d['ray-1']) / fn(d['ray-2']):.2f}×" if "ray-1" in d and "ray-2" in d else ""

    lines = [f"Machine: {s['cpu']}, {s['cores']} cores. Command: `{s['command']}`; order {s['order']}; "
             f"median of {t[names[0]]['runs']} runs per build, the builds alternating; each stage as wall seconds "
             "(corpus tokens per CPU-second of that stage's own work).", "",
             f"**Counting, merging and writing** ({_n(tokens)} tokens, tokenised beforehand: every build is given "
             "the token documents):", "", head, rule,
             "| counting (the map tasks' sort) | "
             + " | ".join(cell(t[n], "count", n) for n in names) + f" | {ratio(t, lambda d: d['count'][0])} |",
             "| merging (the reduce tasks; the driver keeping each finished partition) | "
             + " | ".join(cell(t[n], "reduce", n) for n in names) + f" | {ratio(t, lambda d: d['reduce'][0])} |",
             "| writing (the driver, serial) | "
             + " | ".join(cell(t[n], "write", n) for n in names) + f" | {ratio(t, lambda d: d['write'][0])} |",
             "| counting + merging + writing | " + " | ".join(both(t, n) for n in names)
             + f" | {ratio(t, lambda d: d['count'][0] + d['merge'][0])} |",
             "| whole build (Ray's start excluded), s | " + " | ".join(f"{t[n]['total']:.1f}" for n in names)
             + f" | {ratio(t, lambda d: d['total'])} |",
             "| the machine's CPU-seconds (Ray's processes included) | " + " | ".join(f"{t[n]['machine']:.1f}"
                                                                             for n in names) + " | |", "",
             f"**The whole job** ({_n(x[names[0]]['tokens'])} tokens read and tokenised by every build; single "
             f"machine with `--workers 2`):", "", head, rule,
             "| reading and tokenising (single machine: time not overlapped with counting) | "
             + " | ".join(cell(x[n], "tokenise", n) for n in names) + f" | {ratio(x, lambda d: d['tokenise'][0])} |",
             "| whole build, s | " + " | ".join(f"{x[n]['total']:.1f}" for n in names)
             + f" | {ratio(x, lambda d: d['total'])} |",
             "| the machine's CPU-seconds | " + " | ".join(f"{x[n]['machine']:.1f}" for n in names) + " | |"]

    checks = [(s, "scaling.json")] + [(json.loads(f.read_text()), f.name) for f in sorted(folder.glob("identity*.json"))]
    lines += ["", "**The same bytes** (`SOURCE_DATE_EPOCH` fixed; every `--ray` file against the single-machine "
              "build's):", "", "| file | corpus tokens | order | builds compared | SHA-256 | identical |",
              "|---|---:|---:|---:|---|---|"]
    for d, name in checks:
        for source in sorted({r["source"] for r in d["rows"]}):
            rows = [r for r in d["rows"] if r["source"] == source]
            hashes = {r["sha256"] for r in rows}
            lines.append(f"| `{name}`, {source} | {_n(rows[0]['total_tokens'])} | {d['order']} | {len(rows)} | "
                         f"`{sorted(hashes)[0][:16]}…` | {'yes' if len(hashes) == 1 else '**no**'} |")

    # the billion-token corpus rebuilt with --ray, one file per order (billion_ray*.json), lowest order first
    billions = sorted((json.loads(f.read_text()) for f in folder.glob("billion_ray*.json")),
                      key=lambda b: b["summary"]["order"])
    write_rate = r = None
    trie_rows, tau_rows, tau_setups = [], [], []
    for b in billions:
        r = b["summary"]
        st = r["stages"]
        write_rate = r["file_bytes"] / st["write"]["seconds"]
        lines += ["", f"**The billion-token corpus, rebuilt with `--ray` at order {r['order']}** (`{b['command']}`; "
                  f"{b['cpu']}, {b['cores']} cores; {_n(r['total_tokens'])} tokens, {_n(r['num_documents'])} "
                  f"documents, order {r['order']}, {r['partitions']} partitions, {r['shards']} shards"
                  f"{'; ' + b['note'] if b.get('note') else ''}):", "",
                  "| stage | wall s | CPU-s of its tasks | corpus tokens per CPU-second |", "|---|---:|---:|---:|"]
        rows = (("reading (the driver)", st["read"]["seconds"], None),
                ("tokenising (the sample's and the map's tasks)", st["sample"]["seconds"] + st["map"]["seconds"],
                 st["sample"]["cpu_seconds"] + st["map"]["tokenise_cpu_seconds"]),
                ("counting (the map's sort)", None, st["map"]["count_cpu_seconds"]),
                ("merging (reduce)", st["reduce"]["seconds"], st["reduce"]["cpu_seconds"]),
                ("writing (the driver)", st["write"]["seconds"], st["write"]["cpu_seconds"]))
        tokens_b = r["total_tokens"]
        for name, wall, cpu in rows:
            wall_cell = "(in the map)" if wall is None else f"{wall:,.0f}"
            cpu_cell = "" if cpu is None else f"{cpu:,.0f}"
            rate_cell = "" if not cpu else f"{tokens_b / cpu / 1e6:.2f} M"
            lines.append(f"| {name} | {wall_cell} | {cpu_cell} | {rate_cell} |")
        lines += [f"| total | {r['total_seconds']:,.0f} | | |", "",
                  f"Sorted runs spilled by the reduce tasks: {r['num_runs']} ({r['spilled_bytes'] / 1e9:.2f} GB); map "
                  f"outputs {r['map_output_bytes'] / 1e9:.2f} GB through the object store; peak RSS "
                  f"({b.get('peak_rss_scope', 'of one task')}): map {_n(r['peak_task_rss_mb']['map'])} MB, reduce "
                  f"{_n(r['peak_task_rss_mb']['reduce'])} MB; the driver {_n(r['peak_rss_mb'])} MB."]
        trie_rows.append(f"| billion-token, order {r['order']} | `--ray`, {b['cpu']}, {b['cores']} cores | "
                         f"{_n(r['total_seconds'])} | {' / '.join(_n(v) for v in r['nodes_per_level'])} | "
                         f"{_n(r['file_bytes'])} | {r['bytes_per_node']:.2f} |")
        if "tau" in b:
            tau_rows += [f"| {row['trie']} | {row['mt-bench']:.3f} | {row['humaneval']:.3f} |" for row in b["tau"]["rows"]]
            if b["tau"]["setup"] not in tau_setups:
                tau_setups.append(b["tau"]["setup"])
    if billions:
        lines += ["", "**The billion-token tries side by side:**", "",
                  "| trie | built | seconds | nodes per level | file bytes | B per node |", "|---|---|---:|---|---:|---:|",
                  *trie_rows]
        if (results / "billion_trie.json").exists():  # the single-machine build of the billion-token study
            one = json.loads((results / "billion_trie.json").read_text())
            ob, ot = one["build"], one["bench"]["billion"]["trie"]
            lines.append(f"| billion-token, order {len(ot['nodes_per_level'])} | single machine, {one['machine']['cpu']} "
                         f"(\"The trie at a billion tokens\") | {_n(ob['total_seconds'])} | "
                         f"{' / '.join(_n(v) for v in ot['nodes_per_level'])} | {_n(ot['file_bytes'])} | "
                         f"{ot['bytes_per_node']:.2f} |")
        if tau_rows:
            lines += ["", f"τ with them ({'; '.join(tau_setups)}):", "", "| trie | MT-Bench τ | HumanEval τ |",
                      "|---|---:|---:|", *tau_rows]

    # the 100 GB order-5 trie, from the rates above
    target = 100e9
    order5 = _order5_tokens(results, target)
    if order5 is not None and "ray-2" in t and "ray-2" in x:
        nodes5, tokens5 = order5
        tok_rate = x["ray-2"]["tokens"] / x["ray-2"]["tokenise"][1]
        count_rate = t["ray-2"]["tokens"] / t["ray-2"]["count"][1]
        merge_rate = t["ray-2"]["tokens"] / t["ray-2"]["merge"][1]
        widen = (4 * 5 + 4) / (4 * s["order"] + 4)  # an order-5 window record against this study's order
        cpu_s = tokens5 / tok_rate + widen * (tokens5 / count_rate + tokens5 / merge_rate)
        if write_rate is None:
            write_rate = max(r["file_bytes"] / r["stages"]["write"]["seconds"] for r in s["rows"] if r["mode"] == "ray")
        write_s = target / write_rate
        map_bytes = 24 * tokens5  # every window distinct: the most the map outputs can hold at order 5
        if r is not None:  # measured on the highest-order rebuild: map-output bytes per token, as order-5 records
            map_bytes = tokens5 * r["map_output_bytes"] / r["total_tokens"] * 24 / (4 * r["order"] + 4)
        lines += ["", "**A 100 GB order-5 trie, estimated** from the per-CPU-second rates of the 2-CPU builds above "
                  "(the estimate's assumptions are listed under the table):", "",
                  "| nodes of 64 cores | tokenise + count + merge, min | write (the driver), min | total, min | "
                  "object store and spill per node, GB | into the driver's node, GB |", "|---:|---:|---:|---:|---:|---:|"]
        for n in (1, 4, 16):
            work = cpu_s / (64 * n) / 60
            lines.append(f"| {n} | {work:,.1f} | {write_s / 60:,.1f} | {work + write_s / 60:,.1f} | "
                         f"{map_bytes / n / 1e9:,.0f} | {1.5 * target / 1e9:,.0f} |")
        lines += ["", f"Assumptions: {nodes5 / 1e9:.1f} B nodes and at least {tokens5 / 1e9:.1f} B corpus tokens for "
                  "100 GB at order 5 (the order-5 reference import's bytes per node and nodes per token); "
                  f"tokenising at {tok_rate / 1e6:.2f} M tokens per CPU-second, counting at {count_rate / 1e6:.1f} M "
                  f"and merging + writing at {merge_rate / 1e6:.1f} M (this machine, order {s['order']}), counting and "
                  f"merging {widen:.1f}× slower per token at order 5 (its window records are that much larger); the "
                  f"write stage serial on the driver at {write_rate / 1e6:.0f} MB/s, the rate of the largest `--ray` "
                  "build here; every core busy (no stragglers, no Ray overhead beyond what the CPU-seconds above "
                  f"hold); map outputs {map_bytes / tokens5:.1f} bytes per corpus token (measured on the billion-token "
                  "rebuild where there is one, widened to order-5 records; else 24, every window distinct), spread "
                  "over the nodes; the "
                  "partitions' level streams (8-byte counts and offsets before narrowing) into the driver's node, "
                  "about 1.5× the trie."]
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


def _verify_curves(paths: dict[str, Path]) -> dict[str, dict]:
    """Each kernel's :mod:`dart_core.bench.verify_curve` result (``paths``: kernel -> its
    ``verify_curve.json``), read, in the order given.

    Raises:
        FileNotFoundError: a kernel without its result file (named)."""
    runs = {}
    for k, path in paths.items():
        if not path.is_file():
            raise FileNotFoundError(f"no results {path}")
        runs[k] = json.loads(path.read_text())
    return runs


def _verify_command(first: dict) -> str:
    """The ``verify_curve`` command of a per-kernel run (its config and thread count), kernel left as ``<kernel>``."""
    c = first["config"]
    return (f"`python -m dart_core.bench.verify_curve --weights gguf-native --gguf-kernel <kernel> "
            f"--nodes {' '.join(map(str, c['node_counts']))} --batch-sizes {' '.join(map(str, c['batch_sizes']))} "
            f"--threads {first['hardware']['threads']} --repeats {c['repeats']}`")


def _curve_tables(runs: dict[str, dict], allow: str) -> list[str]:
    """Per kernel its verification timings (:func:`dart_core.bench.verify_curve.markdown_table`), then
    ``allow`` and one :func:`~dart_core.bench.verify_curve.ceiling_table` over every kernel."""
    from dart_core.bench import verify_curve

    lines = []
    for k, r in runs.items():
        lines += [f"**{k}** ({r['curves']['gguf-native']['format']}):", "", verify_curve.markdown_table(r)]
    lines += [allow, "",
              verify_curve.ceiling_table({"curves": {k: r["curves"]["gguf-native"] for k, r in runs.items()}})
              .rstrip("\n")]
    return lines


def render_speculation_ceiling(results: Path = RESULTS) -> str:
    """Per kernel of :data:`CEILING_KERNELS`: the verification timings by query tokens per sequence and
    batch size, then :func:`dart_core.bench.verify_curve.ceiling_table` (plain decoding's ms per token,
    a draft node's cost, the break-even acceptance and the best speed-up of drafts accepted at a given
    rate, drafting free), from ``speculation_ceiling/<kernel>/verify_curve.json``.

    Raises:
        FileNotFoundError: a kernel without its result file.
    """
    from dart_core.bench import decoding

    runs = _verify_curves({k: results / "speculation_ceiling" / k / "verify_curve.json" for k in CEILING_KERNELS})
    first = runs[CEILING_KERNELS[0]]
    lines = [f"Measured on {decoding.hardware_line(first['hardware'])}; {_verify_command(first)}, one run per "
             "kernel, one after the other. One target forward of n query tokens per sequence after a 256-token "
             "prefix (each sequence its own), ms, median of the passes.", ""]
    lines += _curve_tables(runs, "What those timings allow, per kernel and batch size (`verify_curve.ceiling_table`; "
                                 "drafting, tree search and host time counted as free, so a real step does worse):")
    return "\n".join(lines)


#: the kernels of "The default GGUF kernel (CPU)", in table order: (file prefix, heading)
KERNEL_DEFAULT_VARIANTS = (("qmm", "qmm (float32 activations)"), ("auto", "qmm-a8 (the new default here)"))


def render_kernel_default(results: Path = RESULTS) -> str:
    """The two qmm kernels side by side: per kernel the verification timings and what they allow
    (as :func:`render_speculation_ceiling`, from ``kernel_default/verify_curve-<kernel>/verify_curve.json``),
    then the decoding benchmark at the shipped defaults with ``--gguf-kernel qmm`` and ``auto`` in
    alternating runs: per kernel and dataset the median over runs of autoregressive and DART tokens/s,
    of DART ÷ autoregressive (each run's own ratio), of τ and of the draft's and the whole step's ms,
    and whether every run was lossless (``kernel_default/<prefix>-r<run>.json``,
    :mod:`dart_core.bench.decoding` results).

    Raises:
        FileNotFoundError: a kernel without its result files.
    """
    from dart_core.bench import decoding

    folder = results / "kernel_default"
    curves = _verify_curves({k: folder / f"verify_curve-{k}" / "verify_curve.json" for k in ("qmm", "qmm-a8")})
    prefixes = [p for p, _ in KERNEL_DEFAULT_VARIANTS]
    runs = _variant_runs(folder, prefixes, "{prefix}-r[0-9]*.json")
    first = curves["qmm"]
    lines = [f"Measured on {decoding.hardware_line(first['hardware'])}.", "",
             f"**Verification** ({_verify_command(first)}, one run per kernel, one after the other): one target "
             "forward of n query tokens per sequence after a 256-token prefix, ms, median of the passes.", ""]
    lines += _curve_tables(curves, "What those timings allow (`verify_curve.ceiling_table`; drafting, tree search "
                                   "and host time counted as free):") + [""]
    d = runs[prefixes[0]][0]["config"]
    lines += [f"**Decoding** (`python -m dart_core.bench --datasets {' '.join(d['datasets'])} --num-prompts "
              f"{d['num_prompts']} --max-new-tokens {d['max_new_tokens']} --repeats {d['repeats']} --threads "
              f"{d['threads']} --methods autoregressive dart-context --gguf-kernel <kernel>`, budget `{d['budget']}`, "
              f"the shipped head and trie; runs per kernel: "
              f"{', '.join(f'{p} {len(runs[p])}' for p in prefixes)}, alternating; medians over runs):", "",
              "| kernel | dataset | autoregressive tokens/s | DART tokens/s | DART ÷ autoregressive | τ "
              "| draft ms per step | step ms | lossless in every run |", "|---|---|---:|---:|---:|---:|---:|---:|:---:|"]

    def row(run: dict, dataset: str, method: str) -> dict:
        return next(r for r in run["rows"] if r["dataset"] == dataset and r["method"] == method)

    for prefix, heading in KERNEL_DEFAULT_VARIANTS:
        rs = runs[prefix]
        for ds in rs[0]["config"]["datasets"]:
            def med(method: str, key) -> float:
                return statistics.median(key(row(r, ds, method)) for r in rs)

            lossless = all(row(r, ds, "dart-context")["lossless"] for r in rs)
            lines.append(f"| {heading} | {ds} | {med('autoregressive', lambda x: x['tokens_per_s']):.1f} | "
                         f"{med('dart-context', lambda x: x['tokens_per_s']):.1f} | "
                         f"{med('dart-context', lambda x: x['speedup']):.2f}× | "
                         f"{med('dart-context', lambda x: x['tau']):.2f} | "
                         f"{med('dart-context', lambda x: x['ms_per_step']['draft']):.2f} | "
                         f"{med('dart-context', lambda x: x['ms_per_step']['total']):.2f} | "
                         f"{'yes' if lossless else '**NO**'} |")
    return "\n".join(lines)


#: (title, log files under bench/results) of the gate replays: one engine debug log set per machine
GATE_LOGS = (("CPU: 2-core AMD EPYC with AVX512-BF16, the 4-bit target, AlpacaEval instructions (the tuning set), one "
              "client (`python -m dart_core.bench.batching --concurrency 1 --requests-per-client 4 --max-tokens 128 "
              "--dataset alpacaeval --threads 2 --modes dart --log-level debug`, two runs, the engine of 2026-11-28)", "gate/cpu-*.log"),
             ("GPU: one H200, bf16, CUDA graphs, the same kind of run (`scripts/gpu_session/bench.sh gate-bf16-graphs`)",
              "gpu-h200-7/gate-bf16-graphs.log"),
             ("CPU: 2-core Intel Xeon with AVX-512 VNNI (no BF16), the 4-bit target, **served** (`serve run "
              "deployments/dart.yaml`, one client, 16 AlpacaEval instructions (the tuning set), 128 tokens: "
              "`gate/served-xeon-trace.sh`, three fresh servers, the engine of 2026-11-30)", "gate/served-xeon-*.log"))


def render_gate_replay(results: Path = RESULTS) -> str:
    """The speculation gate replayed over the measured steps of each log set of :data:`GATE_LOGS`
    (:mod:`dart_core.bench.gate_replay`).

    Raises:
        FileNotFoundError: a set has no log; ValueError: a log without gated steps.
    """
    sets = []
    for title, pattern in GATE_LOGS:
        logs = sorted(results.glob(pattern))
        if not logs:
            raise FileNotFoundError(f"no gate logs {results / pattern}")
        sets.append((title, tuple((str(p), st.st_mtime_ns, st.st_size) for p, st in ((p, p.stat()) for p in logs))))
    return _gate_replay_text(tuple(sets))


@functools.lru_cache(maxsize=4)
def _gate_replay_text(sets: tuple) -> str:
    """render_gate_replay's text for its log sets, each log named with its modification time and
    size: the replay (seeded, several seconds) runs once per process for the same files."""
    from dart_core.bench.gate_replay import render

    return "\n\n".join(f"**{title}**\n\n{render([Path(p) for p, _, _ in logs], seeds=12, num_steps=1500)}"
                         for title, logs in sets)


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


def render_ray_data_build(results: Path = RESULTS) -> str:
    """``--ray``'s Ray Core tasks against the same build written with Ray Data, from
    ``ray_trie_build/ray_data/results.json`` (``bench/results/ray_trie_build/ray_data/compare.py``): per CPU count and
    method the median over repeats of the whole build's wall seconds, the machine's CPU-seconds and
    each stage's seconds, Ray Data ÷ Ray Core, and whether every file had the same bytes.

    Raises:
        FileNotFoundError: no result file.
    """
    path = results / "ray_trie_build" / "ray_data" / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"no results {path}")
    d = json.loads(path.read_text())
    cpus = sorted({r["cpus"] for r in d["runs"]})
    repeats = len({r["repeat"] for r in d["runs"]})

    def med(method: str, n: int, key: str) -> float:
        return statistics.median(r[key] for r in d["runs"] if r["method"] == method and r["cpus"] == n)

    lines = [f"Machine: {d['cpu']}, {d['cores']} cores; Ray {d['ray']}. Command: `{d['command']}`; "
             f"{d['documents']:,} documents, {d['tokens']:,} tokens, order {d['order']}; median of {repeats} "
             "runs per build, the two methods alternating.", "",
             "| CPUs | method | whole build, s | the machine's CPU-seconds | first stage, s | second stage, s | "
             "writing, s |", "|---:|---|---:|---:|---:|---:|---:|"]
    names = {"core": "Ray Core tasks (`--ray`)", "data": "Ray Data"}
    for n in cpus:
        for method in ("core", "data"):
            lines.append(f"| {n} | {names[method]} | {med(method, n, 'wall_s'):.1f} | "
                         f"{med(method, n, 'machine_cpu_s'):.1f} | {med(method, n, 'tokenise_s'):.1f} | "
                         f"{med(method, n, 'count_merge_s'):.2f} | {med(method, n, 'write_s'):.2f} |")
    lines += ["", "First stage: Ray Core tokenises and counts each shard in one task (with the sample of the "
              "first shards before it); Ray Data tokenises each shard (`map_batches`) and materialises the tokens. "
              "Second stage: Ray Core merges each key range in its own reduce task; Ray Data counts each shard "
              "(`map_batches`), shuffles the runs by key range (`groupby(...).map_groups`) and merges there. "
              "Writing: the driver, the same code in both."]
    lines += ["", "| CPUs | Ray Data ÷ Ray Core, whole build (wall) | the same, machine CPU-seconds |", "|---:|---:|---:|"]
    for n in cpus:
        lines.append(f"| {n} | {med('data', n, 'wall_s') / med('core', n, 'wall_s'):.2f}× | "
                     f"{med('data', n, 'machine_cpu_s') / med('core', n, 'machine_cpu_s'):.2f}× |")
    shas = {r["sha256"] for r in d["runs"]}
    lines += ["", f"The same bytes: {len(d['runs'])} builds, "
              f"{'every one' if d['all_identical'] else 'NOT every one'} identical to the first "
              f"(SHA-256 {', '.join(sorted(s[:16] + '…' for s in shas))})."]
    return "\n".join(lines)


#: (marker name, renderer) of every section this module writes
SECTIONS = (("batching-cpu", render_batching), ("reference-import", render_reference_import),
            ("billion-trie", render_billion_trie), ("serving-threads", render_serving_threads),
            ("gate-replay", render_gate_replay), ("cpu-memory", render_cpu_memory),
            ("stream-interval", render_stream_interval), ("draft-weights", render_draft_weights),
            ("speculation-ceiling", render_speculation_ceiling), ("ray-trie-build", render_ray_trie_build),
            ("kernel-default", render_kernel_default),
            ("ray-data-build", render_ray_data_build))


def _block(name: str, body: str) -> str:
    return (f"<!-- {name}:start -->\n\n_Rendered by `python -m dart_core.bench.sections` from the files in "
            f"`bench/results/`._\n\n{body}\n\n<!-- {name}:end -->")


#: the study folder whose README holds each section's block (bench/results/<folder>/README.md)
SECTION_FOLDERS = {"batching-cpu": "batching_cpu", "reference-import": "reference_import",
                   "billion-trie": "billion_trie", "serving-threads": "serving_threads", "gate-replay": "gate",
                   "cpu-memory": "cpu_memory", "stream-interval": "stream_interval", "draft-weights": "draft_weights",
                   "speculation-ceiling": "speculation_ceiling", "ray-trie-build": "ray_trie_build",
                   "kernel-default": "kernel_default",
                   "ray-data-build": "ray_trie_build"}


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
