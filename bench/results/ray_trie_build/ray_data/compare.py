"""Ray Core tasks (``python -m ngram_service.build --ray``) against the same build written with Ray
Data, on one corpus, with 1 and 2 CPUs: wall seconds, the machine's CPU-seconds, and whether both
files have the same bytes.

    pip install pandas pyarrow   # Ray Data's own dependencies, not dart-serve's
    python bench/results/ray_trie_build/ray_data/compare.py CORPUS... --max-tokens 30000000 --repeats 3 \
        --out bench/results/ray_trie_build/ray_data/results.json

The Ray Data build is the same algorithm as ``ngram_service.ray_build``: the same shards, the
same partition boundaries (first-token counts of the first shards), the same C++ counting
(``_native.count_windows``) and merging (``TrieBuilder``), and the same driver-side write.  What
changes is who moves the data: Ray Data's streaming executor runs the map (``map_batches``, one
shard per batch, one CPU per task), and its shuffle (``groupby("partition", num_partitions=...)
.map_groups``, one shuffle partition per key range) brings each partition's runs to one reduce call, instead of the driver submitting tasks and passing
ObjectRefs.  Builds alternate (core, data; the order rotated each repeat) in one process per CPU
count; ``SOURCE_DATE_EPOCH`` is fixed, so every file must equal the first core build's, and the
script exits non-zero if one does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ngram_service import _native
from ngram_service.build_common import text_metadata, trie_metadata
from ngram_service.corpus import iter_files
from ngram_service.ray_build import (SAMPLE_SHARDS, _RayBuild, _Scratch, _shard_documents, _text_shards,
                                     build_trie_ray, partition_boundaries)
from ngram_service.ray_build_bench import cpu_model, machine_cpu_seconds
from ngram_service.tokenizer import TrieTokenizer, load_trie_tokenizer
from ngram_service.trie import pack_ragged

_KINDS = ("tokens", "counts", "children")


def _tokenise(batch: dict, tokenizer_json: str, cfg: dict, sample_shards: int) -> dict:
    """One shard (a batch of one row): its documents packed, and its first-token counts when it is
    one of the sample's shards."""
    shard = int(batch["shard"][0])
    docs = _shard_documents({"texts": list(batch["texts"][0])}, tokenizer_json, cfg)
    flat, offsets = pack_ragged(docs) if docs else (np.zeros(0, np.int64), np.zeros(1, np.int64))
    flat = flat.astype(np.uint32)
    hist = (np.bincount(flat.astype(np.int64), minlength=cfg["vocab_size"]) if shard < sample_shards
            else np.zeros(0, np.int64))
    return {"shard": [shard], "flat": [flat.tobytes()], "offsets": [offsets.astype(np.int64).tobytes()],
            "documents": [len(docs)], "hist": [hist.tobytes()]}


def _count(batch: dict, cfg: dict, boundaries: np.ndarray) -> dict:
    """One tokenised shard's sorted, counted windows, one row per partition."""
    shard = int(batch["shard"][0])
    flat = np.frombuffer(batch["flat"][0], dtype=np.uint32)
    offsets = np.frombuffer(batch["offsets"][0], dtype=np.int64)
    parts = len(boundaries) + 1
    if len(flat):
        keys, counts, starts = _native.count_windows(cfg["order"], cfg["vocab_size"], flat, offsets, boundaries)
    else:
        keys, counts, starts = (np.zeros((0, cfg["order"]), np.uint32), np.zeros(0, np.uint32),
                                np.zeros(parts + 1, np.uint64))
    return {"partition": list(range(parts)), "shard": [shard] * parts,
            "keys": [keys[starts[p]:starts[p + 1]].tobytes() for p in range(parts)],
            "counts": [counts[starts[p]:starts[p + 1]].tobytes() for p in range(parts)]}


def _reduce(group: dict, cfg: dict) -> dict:
    """One partition's runs (every shard's, in shard order) merged into its level streams."""
    order = np.argsort(group["shard"], kind="stable")
    partition = int(group["partition"][0])
    with tempfile.TemporaryDirectory(prefix=f"dart-trie-data-part{partition}-") as tmp:
        builder = _native.TrieBuilder(cfg["order"], cfg["vocab_size"], tmp, int(cfg["memory_mb"] * (1 << 20)))
        for i in order:
            keys = np.frombuffer(group["keys"][i], dtype=np.uint32).reshape(-1, cfg["order"])
            builder.add_counted(np.ascontiguousarray(keys), np.frombuffer(group["counts"][i], dtype=np.uint32).copy())
        stats = builder.finish_levels(tmp + "/", cfg["min_count"])
        row = {"partition": [partition], "stats": [json.dumps(stats)]}
        for m in range(1, cfg["order"] + 1):
            for kind in _KINDS:
                path = Path(tmp) / f"level{m}.{kind}"
                row[f"level{m}.{kind}"] = [path.read_bytes() if path.exists() else b""]
    return row


def build_with_ray_data(texts: list[str], output: Path, tok: TrieTokenizer, order: int, partitions: int,
                        cpus: int, shard_chars: int) -> dict:
    """The Ray Data build of ``texts`` into ``output``; returns its stage seconds."""
    import ray

    cfg = {"order": order, "min_count": 1, "prune": "drop", "vocab_size": tok.vocab_size,
           "vocab_hash": tok.vocab_hash, "special_tokens": False, "eos_per_document": False, "eos_token_id": None,
           "max_tokens": None, "batch_docs": 256, "memory_mb": 2048, "task_tmp_dir": None, "fault": None}
    scratch = _Scratch(output.parent / f".{output.name}.data-build")
    scratch.start({})
    t0 = time.perf_counter()
    rows = [{"shard": i, "texts": s["texts"]} for i, s in enumerate(_text_shards(texts, shard_chars))]
    sample = max(SAMPLE_SHARDS, cpus)
    tokenizer_json = tok.backend.to_str()
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    tokenised = ds.map_batches(_tokenise, batch_size=1, num_cpus=1, zero_copy_batch=True,
                               fn_kwargs={"tokenizer_json": tokenizer_json, "cfg": cfg,
                                          "sample_shards": sample}).materialize()
    t1 = time.perf_counter()
    hist = np.zeros(tok.vocab_size, np.int64)
    documents = 0
    for row in tokenised.select_columns(["documents", "hist"]).iter_rows():
        documents += int(row["documents"])
        if row["hist"]:
            hist += np.frombuffer(row["hist"], dtype=np.int64)
    boundaries = partition_boundaries(hist, partitions)
    merged = (tokenised.map_batches(_count, batch_size=1, num_cpus=1, fn_kwargs={"cfg": cfg, "boundaries": boundaries})
              .groupby("partition", num_partitions=partitions).map_groups(_reduce, num_cpus=1, fn_kwargs={"cfg": cfg}))
    parts = {}
    for row in merged.iter_rows():
        p = int(row["partition"])
        arrays = {}
        for m in range(1, order + 1):
            for kind in _KINDS:
                if kind != "children" or m < order:  # the last level has no child offsets
                    arrays[f"level{m}.{kind}"] = np.frombuffer(row[f"level{m}.{kind}"],
                                                               dtype=np.uint32 if kind == "tokens" else np.uint64)
        scratch.save(p, json.loads(row["stats"]), arrays)
        parts[p] = scratch.finished(p)
    t2 = time.perf_counter()
    meta = trie_metadata(tokenizer_name=tok.name, vocab_hash=tok.vocab_hash, order=order, min_count=1,
                         num_documents=documents, prune="drop",
                         metadata=text_metadata("", False, False, None, None))
    build = _RayBuild(ray, tok, cfg, scratch, progress=False)
    build.write([parts[p] for p in range(len(boundaries) + 1)], output, meta, None)
    return {"tokenise_s": t1 - t0, "count_merge_s": t2 - t1, "write_s": time.perf_counter() - t2}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", nargs="+")
    ap.add_argument("--max-tokens", type=int, default=30_000_000, help="documents kept until this many tokens")
    ap.add_argument("--order", type=int, default=3)
    ap.add_argument("--cpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-chars", type=int, default=8 << 20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1700000000")
    import ray

    tok = TrieTokenizer.wrap(load_trie_tokenizer(None))
    texts, tokens = [], 0
    for text in iter_files(args.corpus):  # the corpus in memory: both builds read it alike
        texts.append(text)
        tokens += len(tok.backend.encode(text, add_special_tokens=False).ids)
        if tokens >= args.max_tokens:
            break
    print(f"{len(texts)} documents, {tokens} tokens", file=sys.stderr)
    runs, reference = [], None
    work = Path(tempfile.mkdtemp(prefix="ray-data-compare-"))
    for cpus in args.cpus:
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        for r in range(args.repeats):
            for method in (("core", "data") if r % 2 == 0 else ("data", "core")):
                out = work / f"{method}-{cpus}-{r}.trie"
                c0, t0 = machine_cpu_seconds(), time.perf_counter()
                if method == "core":
                    s = build_trie_ray(texts, out, tok, order=args.order, partitions=4 * cpus, num_cpus=cpus,
                                       shard_chars=args.shard_chars, progress=False)
                    stages = {"tokenise_s": s.stages["sample"]["seconds"] + s.stages["map"]["seconds"],
                              "count_merge_s": s.stages["reduce"]["seconds"], "write_s": s.stages["write"]["seconds"]}
                else:
                    stages = build_with_ray_data(texts, out, tok, args.order, 4 * cpus, cpus, args.shard_chars)
                wall, cpu = time.perf_counter() - t0, machine_cpu_seconds() - c0
                sha = _sha(out)
                reference = reference or sha
                runs.append({"cpus": cpus, "repeat": r, "method": method, "wall_s": round(wall, 2),
                             "machine_cpu_s": round(cpu, 2), **{k: round(v, 2) for k, v in stages.items()},
                             "sha256": sha, "identical": sha == reference})
                print(json.dumps(runs[-1]), file=sys.stderr)
                out.unlink()
        ray.shutdown()
    summary = {}
    for cpus in args.cpus:
        for method in ("core", "data"):
            mine = [x for x in runs if x["cpus"] == cpus and x["method"] == method]
            summary[f"{method}@{cpus}"] = {k: statistics.median(x[k] for x in mine)
                                           for k in ("wall_s", "machine_cpu_s", "tokenise_s", "count_merge_s", "write_s")}
    result = {"command": " ".join(["python", "bench/results/ray_trie_build/ray_data/compare.py", *sys.argv[1:]]),
              "cpu": cpu_model(), "cores": os.cpu_count(), "ray": ray.__version__,
              "documents": len(texts), "tokens": tokens, "order": args.order, "runs": runs, "median": summary,
              "all_identical": all(x["identical"] for x in runs)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0 if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
