"""The trie build on a Ray cluster: ``python -m ngram_service.build --ray``.

The same corpus sources, options and file as :mod:`ngram_service.build`, with the counting
spread over every CPU of a Ray cluster as a key-range partitioned sort (Ray Core tasks):

1. **Sample.**  The first shards (one per CPU, at least 4) are tokenised first, by every CPU
   at once; their token frequencies cut the vocabulary into ``partitions`` key ranges of about
   equal window counts.  N-grams are partitioned by their first token, so each partition's part
   of every trie level is contiguous in the final file.
2. **Map** (one task per shard of about ``shard_chars`` characters, on any node): tokenise with the
   target's tokenizer exactly as the single-machine build does, then sort and count the shard's
   windows in C++ (:func:`ngram_service._native.count_windows`) and return one sorted run per
   partition through Ray's object store (which spills to disk when full).
3. **Reduce** (one task per partition): merge the partition's runs, which Ray fetches to the
   task's node before it starts (rebuilding any lost with a node first), with the
   external-memory builder (memory bounded by ``memory_mb`` per task, sorted runs spilled to
   the node's temp folder) into the partition's level streams.  They go back to the driver,
   which keeps each finished partition in a scratch folder next to the output: a killed build
   run again with ``resume=True`` redoes only the partitions it had not finished.
4. **Write** (the driver): the partitions' levels are put end to end, child offsets shifted,
   and laid out by the same C++ writer as the single-machine build, checksummed and renamed
   into place.  With the same corpus, order and options the file is byte-identical to
   :func:`ngram_service.build.build_trie_from_texts`'s (set ``SOURCE_DATE_EPOCH`` for the
   header's creation time; tested).

Tasks that die (a worker process killed, a node lost) are retried by Ray, and lost map outputs
are rebuilt from their lineage.  The corpus is read by the driver and travels to the tasks
in the object store, so corpus files need not be on every node.

Ray Core tasks rather than Ray Data: the same build written with Ray Data's ``map_batches`` and
hash shuffle wrote the same bytes but ran slower, the shuffle of the counted runs costing the
difference (``bench/results/ray_trie_build/ray_data/``), and it has no per-partition checkpoint
for ``resume``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from ngram_service import _native
from ngram_service.build_common import (BuildError, BuildSummary, encoded_batches, reduce_like_reference, check_build_options,
                                 join_pieces, text_metadata, trie_metadata)
from ngram_service.tokenizer import TrieTokenizer
from ngram_service.trie import pack_ragged, write_checksums

logger = logging.getLogger(__name__)

__all__ = ["RayBuildError", "RayBuildSummary", "build_trie_ray"]

SHARD_CHARS = 8 << 20  # characters of text per map task (about 2 M tokens of English or code)
SHARD_TOKENS = 2 << 20  # tokens per map task of already-tokenised documents (live-corpus snapshots)
SAMPLE_SHARDS = 4  # shards tokenised first to place the partition boundaries (or one per CPU, if more)
MAX_RETRIES = 3  # per task, on a worker or node failure
_PART_FILES = ("tokens", "counts", "children")


class RayBuildError(BuildError):
    """A distributed build failed: a task that failed after its retries, a full disk or a memory
    cap on a named node, or a scratch folder that belongs to another build."""


@dataclass(frozen=True)
class RayBuildSummary(BuildSummary):
    """:class:`~ngram_service.build.BuildSummary` plus what the cluster did.  Here
    ``tokenize_seconds`` is the map stage's wall time, ``merge_seconds`` the reduce and write
    stages', ``count_seconds`` both, and ``peak_rss_mb`` the driver's."""

    partitions: int = 0
    resumed_partitions: int = 0  # finished by an earlier, interrupted run and not redone
    cluster_cpus: float = 0.0
    nodes: int = 0
    shards: int = 0
    # per stage (read, sample, map, reduce, write): wall seconds and CPU-seconds summed over its tasks
    # (the map's split into tokenising and counting; read: the driver waiting for the corpus)
    stages: dict = field(default_factory=dict)
    spilled_bytes: int = 0  # sorted runs the reduce tasks spilled to their nodes' disks
    peak_task_rss_mb: dict = field(default_factory=dict)  # per stage: the largest peak RSS of one task
    # reduce tasks' output bytes, by the address of the node that made them
    bytes_per_node_address: dict = field(default_factory=dict)
    map_output_bytes: int = 0  # the counted windows the map tasks sent through the object store
    tasks_per_node_address: dict = field(default_factory=dict)  # sample, map and reduce tasks, by node


# ---------------------------------------------------------------------------------------------
# tasks (run in Ray workers; Ray is imported there, not at module import)

_TOKENIZERS: dict[str, object] = {}


def _tokenizer(tokenizer_json: str, vocab_hash: str):
    """This worker's tokenizer, made once per vocabulary: single-threaded (tasks are the parallelism)."""
    if vocab_hash not in _TOKENIZERS:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer

        _TOKENIZERS[vocab_hash] = Tokenizer.from_str(tokenizer_json)
    return _TOKENIZERS[vocab_hash]


class _Encoder:
    """The tokenizer's encode_batch under the name :func:`ngram_service.build.encoded_batches` calls."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]


def _shard_documents(payload: dict, tokenizer_json: str, cfg: dict) -> list[np.ndarray]:
    """A shard's documents as u32 ids: its texts tokenised as the single-machine build does, or its
    token documents as given; at most ``payload["max_docs"]`` of them."""
    limit = payload.get("max_docs")
    if "texts" in payload:
        encoder = _Encoder(_tokenizer(tokenizer_json, cfg["vocab_hash"]))
        texts = payload["texts"][:limit] if limit is not None else payload["texts"]
        batches = encoded_batches(texts, encoder, cfg["batch_docs"], cfg["special_tokens"], workers=1)
        return list(join_pieces(batches, cfg["eos_token_id"]))
    docs = payload["docs"]
    return [np.asarray(d, dtype=np.uint32) for d in (docs[:limit] if limit is not None else docs)]


def _start() -> tuple[float, float]:
    """A task's start: (wall clock, CPU clock); the process's peak RSS is reset where Linux allows
    (``/proc/self/clear_refs``), so that :func:`_usage` reports this task's own peak although Ray
    reuses worker processes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return time.perf_counter(), time.process_time()


def _peak_rss_mb() -> float:
    """This process's peak RSS since :func:`_start` (``VmHWM``), else since it started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _usage(t0: float, c0: float) -> dict:
    import ray

    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "rss_mb": _peak_rss_mb(), "node": ray.util.get_node_ip_address()}


def _sample_task(payload: dict, tokenizer_json: str, cfg: dict):
    """Tokenises a shard; returns (its documents packed, first-token histogram [vocab], usage)."""
    t0, c0 = _start()
    docs = _shard_documents(payload, tokenizer_json, cfg)
    flat, offsets = pack_ragged(docs) if docs else (np.zeros(0, np.int64), np.zeros(1, np.int64))
    hist = np.bincount(flat.astype(np.int64), minlength=cfg["vocab_size"])
    return {"docs": docs}, hist, _usage(t0, c0)


def _map_task(payload: dict, tokenizer_json: str, cfg: dict, boundaries: np.ndarray, needed: list[bool]):
    """One shard's sorted, counted windows cut into partitions: returns one (keys [n, order] u32,
    counts [n] u32) per partition (None where ``needed`` is False), then the shard's statistics."""
    t0, c0 = _start()
    docs = _shard_documents(payload, tokenizer_json, cfg)
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    c1 = time.process_time()
    if docs:
        flat, offsets = pack_ragged(docs)
        keys, counts, starts = _native.count_windows(cfg["order"], cfg["vocab_size"], flat.astype(np.uint32),
                                                      offsets, boundaries)
    else:
        keys, counts = np.zeros((0, cfg["order"]), np.uint32), np.zeros(0, np.uint32)
        starts = np.zeros(len(needed) + 1, np.uint64)
    # views: Ray serialises a contiguous slice by its own bytes, so no copy is needed
    runs = [(keys[starts[p]:starts[p + 1]], counts[starts[p]:starts[p + 1]]) if needed[p] else None
            for p in range(len(needed))]
    return (*runs, {"lengths": lengths, "tokenise_cpu_seconds": c1 - c0, "count_cpu_seconds": time.process_time() - c1,
                    "output_bytes": sum(k.nbytes + c.nbytes for k, c in filter(None, runs)), **_usage(t0, c0)})


def _reduce_task(partition: int, cfg: dict, *runs: tuple):
    """Merges one partition's runs (one (keys, counts) per shard; Ray fetches them before the task
    starts, rebuilding any lost with a node from their lineage) into its level streams: returns
    (stats, {level file name: array}, usage).  Raises RayBuildError naming the node and folder
    when its disk fills."""
    import ray

    t0, c0 = _start()
    scratch_root = cfg.get("task_tmp_dir") or tempfile.gettempdir()
    try:
        with tempfile.TemporaryDirectory(prefix=f"dart-trie-part{partition}-", dir=scratch_root) as tmp:
            builder = _native.TrieBuilder(cfg["order"], cfg["vocab_size"], tmp, int(cfg["memory_mb"] * (1 << 20)))
            for i, (keys, counts) in enumerate(runs):
                builder.add_counted(keys, counts)
                if i == 0:
                    _maybe_fault(cfg, partition)
            stats = builder.finish_levels(tmp + "/", cfg["min_count"])
            arrays = {}
            for m in range(1, cfg["order"] + 1):
                for kind in _PART_FILES:
                    path = Path(tmp) / f"level{m}.{kind}"
                    if path.exists():
                        arrays[path.name] = np.fromfile(path, dtype=np.uint32 if kind == "tokens" else np.uint64)
    except (OSError, RuntimeError) as e:  # the C++ builder's I/O errors are RuntimeErrors
        free = shutil.disk_usage(scratch_root).free if os.path.isdir(scratch_root) else -1
        raise RayBuildError(f"partition {partition} on node {socket.gethostname()} "
                            f"({ray.util.get_node_ip_address()}): {e} (scratch folder "
                            f"{scratch_root}, {free / 2**30:.1f} GiB free; --memory-mb {cfg['memory_mb']})") from e
    return stats, arrays, _usage(t0, c0)


def _maybe_fault(cfg: dict, partition: int) -> None:
    """Test hook: the first attempt at partition ``cfg["fault"]["partition"]`` kills its own worker
    process, once per marker file (tests/ngram_service/test_ray_build.py)."""
    fault = cfg.get("fault")
    if fault and fault["partition"] == partition and not os.path.exists(fault["marker"]):
        Path(fault["marker"]).write_text(str(os.getpid()))
        os._exit(1)


# ---------------------------------------------------------------------------------------------
# the driver


def _text_shards(texts: Iterable[str], shard_chars: int) -> Iterator[dict]:
    """Payloads of whole texts, about ``shard_chars`` characters each."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= shard_chars:
            yield {"texts": batch}
            batch, size = [], 0
    if batch:
        yield {"texts": batch}


def _doc_shards(documents: Iterable) -> Iterator[dict]:
    """Payloads of whole token documents, about :data:`SHARD_TOKENS` tokens each."""
    batch: list[np.ndarray] = []
    size = 0
    for doc in documents:
        batch.append(np.asarray(doc, dtype=np.uint32))
        size += len(batch[-1])
        if size >= SHARD_TOKENS:
            yield {"docs": batch}
            batch, size = [], 0
    if batch:
        yield {"docs": batch}


def partition_boundaries(histogram: np.ndarray, partitions: int) -> np.ndarray:
    """First-token boundaries (ascending u32, at most ``partitions - 1``) that cut a token-frequency
    histogram [vocab] into key ranges of about equal mass; partition p holds first tokens in
    [boundaries[p-1], boundaries[p]).  A single token heavier than a share stays whole."""
    total = float(histogram.sum())
    if partitions <= 1 or total == 0:
        return np.zeros(0, np.uint32)
    cum = np.cumsum(histogram, dtype=np.float64)
    cuts = np.searchsorted(cum, total * np.arange(1, partitions) / partitions, side="left") + 1
    cuts = np.unique(np.clip(cuts, 1, len(histogram) - 1))
    return cuts.astype(np.uint32)


def _fingerprint(cfg: dict, source_id: str) -> str:
    keys = ("order", "min_count", "prune", "vocab_hash", "special_tokens", "eos_per_document", "max_tokens")
    return hashlib.sha256(json.dumps({**{k: cfg[k] for k in keys}, "source": source_id},
                                     sort_keys=True).encode()).hexdigest()


class _Scratch:
    """The build's folder next to the output: manifest.json (the build's fingerprint and partition
    boundaries) and one folder per finished partition (its level streams and done.json)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def manifest(self) -> dict | None:
        try:
            return json.loads((self.root / "manifest.json").read_text())
        except (OSError, ValueError):
            return None

    def start(self, manifest: dict) -> None:
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)
        _write_atomic(self.root / "manifest.json", json.dumps(manifest))

    def part(self, p: int) -> Path:
        return self.root / f"part-{p:05d}"

    def finished(self, p: int) -> dict | None:
        """Partition ``p``'s statistics when it was kept whole (done.json written last, and every
        level file of the size its node counts give), else None: to be built again."""
        try:
            stats = json.loads((self.part(p) / "done.json").read_text())
        except (OSError, ValueError):
            return None
        order = len(stats["nodes_per_level"])
        for m, nodes in enumerate(stats["nodes_per_level"], start=1):
            for kind, width in (("tokens", 4), ("counts", 8), ("children", 8)):
                path = self.part(p) / f"level{m}.{kind}"
                want = 0 if kind == "children" and m == order else nodes * width
                have = path.stat().st_size if path.exists() else 0
                if have != want:
                    logger.warning("partition %d of %s is damaged (%s: %d bytes, %d expected); building it again",
                                   p, self.root, path.name, have, want)
                    return None
        return stats

    def save(self, p: int, stats: dict, arrays: dict) -> None:
        folder = self.part(p)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        for name, array in arrays.items():
            array.tofile(folder / name)
        _write_atomic(folder / "done.json", json.dumps(stats))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _init_ray(address: str | None, num_cpus: int | None):
    import ray

    if not ray.is_initialized():
        kwargs = {"address": address} if address else {"num_cpus": num_cpus, "include_dashboard": False}
        ray.init(logging_level=logging.WARNING, log_to_driver=False, **kwargs)
    return ray


def build_trie_ray(
    texts: Iterable[str],
    output: str | os.PathLike[str],
    tokenizer,
    *,
    corpus_name: str = "",
    order: int = 3,
    min_count: int = 1,
    prune: str = "drop",
    memory_mb: float = 2048,
    tmp_dir: str | os.PathLike[str] | None = None,
    task_tmp_dir: str | None = None,
    batch_docs: int = 256,
    max_tokens: int | None = None,
    special_tokens: bool = False,
    eos_per_document: bool = False,
    documents: Iterable[Sequence[int] | np.ndarray] = (),
    metadata: dict | None = None,
    source_id: str = "",
    partitions: int | None = None,
    shard_chars: int = SHARD_CHARS,
    address: str | None = None,
    num_cpus: int | None = None,
    resume: bool = False,
    progress: bool = True,
    _fault: dict | None = None,
) -> RayBuildSummary:
    """Builds the trie of :func:`ngram_service.build.build_trie_from_texts` (same arguments, same
    bytes) with Ray tasks; see the module docstring for the stages.

    Args:
        tmp_dir: where the driver keeps finished partitions and lays out the file (default: next
            to ``output``); it needs about twice the trie's size.
        task_tmp_dir: where reduce tasks spill sorted runs, on their own nodes (default: each
            node's temp folder).
        memory_mb: window buffer of each reduce task before it spills a sorted run.
        source_id: names the corpus (file paths, sizes, times) for ``resume``; a scratch folder
            from another corpus or other options is never resumed.
        partitions: key ranges (default: 4 per CPU of the cluster).
        shard_chars: characters of text per map task.
        address: a Ray cluster to join (``auto``, ``ray://host:10001``); default: the running one,
            else a local one with ``num_cpus`` CPUs.
        resume: continue the interrupted build of the same output, options and ``source_id``:
            its finished partitions are kept, the rest redone.  Without it a leftover scratch
            folder is cleared.

    Raises:
        ValueError: bad options (as build_trie), ``eos_per_document`` without an EOS token.
        RayBuildError: a task failed after its retries, or a node's disk filled.
    """
    start = time.perf_counter()
    check_build_options(order, min_count, prune)
    for name, value in (("num_cpus", num_cpus), ("partitions", partitions)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if memory_mb <= 0 or shard_chars < 1:
        raise ValueError(f"memory_mb and shard_chars must be positive, got {memory_mb} and {shard_chars}")
    tok = TrieTokenizer.wrap(tokenizer)
    if eos_per_document and tok.eos_token_id is None:
        raise ValueError(f"eos_per_document: the tokenizer {tok.name!r} names no EOS token")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = _Scratch(Path(tmp_dir or output.parent) / f".{output.name}.ray-build")
    cfg = {"order": order, "min_count": min_count if prune == "drop" else 1, "prune": prune,
           "vocab_size": tok.vocab_size, "vocab_hash": tok.vocab_hash, "special_tokens": special_tokens,
           "eos_per_document": eos_per_document, "eos_token_id": tok.eos_token_id if eos_per_document else None,
           "max_tokens": max_tokens, "batch_docs": batch_docs, "memory_mb": memory_mb,
           "task_tmp_dir": task_tmp_dir, "fault": _fault}
    ray = _init_ray(address, num_cpus)
    cluster_cpus = float(ray.cluster_resources().get("CPU", 0))
    if cluster_cpus < 1:
        raise RayBuildError(f"the Ray cluster at {address or 'this machine'} has no CPU for the build's tasks")
    fingerprint = _fingerprint({**cfg, "min_count": min_count}, source_id)
    manifest = scratch.manifest()
    resumed = resume and manifest is not None and manifest.get("fingerprint") == fingerprint
    if resume and manifest is not None and not resumed:
        raise RayBuildError(f"{scratch.root} holds a build of another corpus or other options; "
                            "delete it or run without --resume")
    if not resume and manifest is not None:
        logger.warning("clearing the unfinished build in %s (run with --resume to continue it)", scratch.root)

    build = _RayBuild(ray, tok, cfg, scratch, progress)
    shards = _ShardSource(_text_shards(texts, shard_chars), _doc_shards(documents), build.timed_next)
    with build.bar:  # the build's one progress bar, closed however the build ends
        try:
            if resumed:
                boundaries = np.asarray(manifest["boundaries"], dtype=np.uint32)
            else:
                boundaries = build.sample(shards, partitions or max(1, int(4 * cluster_cpus)),
                                          max(SAMPLE_SHARDS, int(cluster_cpus)))
                manifest = {"fingerprint": fingerprint, "boundaries": boundaries.tolist(), "output": str(output)}
                scratch.start(manifest)
            num_parts = len(boundaries) + 1
            done = {p: s for p in range(num_parts) if (s := scratch.finished(p)) is not None}
            build.partitions = [len(done), num_parts]
            needed = [p not in done for p in range(num_parts)]
            if done:
                logger.info("resuming %s: %d of %d partitions already built", output, len(done), num_parts)
            if not any(needed) and "num_documents" in manifest:  # killed while writing: nothing to map again
                shard_runs, num_documents = [], manifest["num_documents"]
            else:
                shard_runs, num_documents = build.map(shards, boundaries, needed, max(2, int(2 * cluster_cpus)))
            manifest["num_documents"] = num_documents
            _write_atomic(scratch.root / "manifest.json", json.dumps(manifest))
            build.reduce(shard_runs, needed, done)
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
            raise RayBuildError(f"the distributed build of {output} failed (finished partitions are kept in "
                                f"{scratch.root}; rerun with --resume): {cause}") from e
        except ray.exceptions.OutOfMemoryError as e:  # Ray's memory monitor killed a task: its message names the node
            raise RayBuildError(f"the distributed build of {output} ran a node out of memory (each reduce task holds "
                                f"--memory-mb {memory_mb} of windows plus its partition's level streams: lower "
                                f"--memory-mb or raise --partitions; finished partitions "
                                f"are kept in {scratch.root}; rerun with --resume): {e}") from e
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as e:
            raise RayBuildError(f"the distributed build of {output} lost a task after {MAX_RETRIES} retries "
                                f"(finished partitions are kept in {scratch.root}; rerun with --resume): {e}") from e

        meta = trie_metadata(tokenizer_name=tok.name, vocab_hash=tok.vocab_hash, order=order, min_count=min_count,
                             num_documents=num_documents, prune=prune,
                             metadata=text_metadata(corpus_name, special_tokens, eos_per_document, max_tokens,
                                                    metadata))
        parts = [done[p] for p in range(num_parts)]
        stats = build.write(parts, output, meta, min_count if prune == "reference" and min_count > 1 else None)
    count_seconds = build.stages["reduce"]["seconds"] + build.stages["write"]["seconds"]
    return RayBuildSummary(
        path=str(output), order=order, total_tokens=stats["total_tokens"], num_nodes=stats["num_nodes"],
        nodes_per_level=list(stats["nodes_per_level"]), file_bytes=stats["file_bytes"],
        bytes_per_node=stats["file_bytes"] / max(stats["num_nodes"], 1), num_documents=num_documents,
        num_runs=sum(p["num_runs"] for p in parts), tokenize_seconds=round(build.stages["map"]["seconds"], 3),
        count_seconds=round(count_seconds, 3), merge_seconds=round(count_seconds, 3),
        total_seconds=round(time.perf_counter() - start, 3),
        count_tokens_per_s=round(stats["total_tokens"] / max(count_seconds, 1e-9), 1),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        partitions=num_parts, resumed_partitions=num_parts - sum(needed), cluster_cpus=cluster_cpus,
        nodes=sum(1 for n in ray.nodes() if n.get("Alive")), shards=build.shards_mapped,
        stages={k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in build.stages.items()},
        spilled_bytes=build.spilled_bytes, peak_task_rss_mb={k: round(v, 1) for k, v in build.peak.items()},
        bytes_per_node_address=build.output_by_node, map_output_bytes=build.map_output_bytes,
        tasks_per_node_address=build.tasks_per_node)


class _ShardSource:
    """The shards in corpus order: the sample's (already tokenised, as ObjectRefs), then the
    texts', then the token documents'.  Each item is (payload or its ref, "texts" | "docs")."""

    def __init__(self, texts: Iterator[dict], docs: Iterator[dict], next_of) -> None:
        self.sampled: list[tuple] = []
        self.texts, self.docs, self.next_of = texts, docs, next_of

    def next(self) -> tuple | None:
        if self.sampled:
            return self.sampled.pop(0)
        if (payload := self.next_of(self.texts)) is not None:
            return payload, "texts"
        if (payload := self.next_of(self.docs)) is not None:
            return payload, "docs"
        return None

    def drop_texts(self) -> None:
        """After a ``--max-tokens`` cut: no more text shards; token documents still follow."""
        self.sampled = [item for item in self.sampled if item[1] != "texts"]
        self.texts = iter(())


class _RayBuild:
    """The driver's side of one distributed build: submits each stage's tasks and keeps what
    they report (wall and CPU-seconds per stage, peak RSS, bytes)."""

    def __init__(self, ray, tok: TrieTokenizer, cfg: dict, scratch: _Scratch, progress: bool) -> None:
        self.ray, self.tok, self.cfg, self.scratch, self.progress = ray, tok, cfg, scratch, progress
        # one bar for the whole build, across the cluster: documents mapped (its count), tokens and
        # partitions done (its postfix), the stage in its description
        self.bar = tqdm(desc="ray build: map", unit="doc", disable=not progress, smoothing=0.1,
                        bar_format="{desc}{n_fmt} documents [{elapsed}, {rate_fmt}{postfix}]")
        self.tokens = 0  # tokens mapped
        self.partitions = [0, 0]  # done, total (build_trie_ray sets them once the partitions are known)
        self.stages: dict[str, dict] = {s: {"seconds": 0.0, "cpu_seconds": 0.0}
                                        for s in ("read", "sample", "map", "reduce", "write")}
        self.stages["map"].update(tokenise_cpu_seconds=0.0, count_cpu_seconds=0.0)
        self.peak = {"sample": 0.0, "map": 0.0, "reduce": 0.0}
        self.map_output_bytes = self.spilled_bytes = self.shards_mapped = 0
        self.output_by_node: dict[str, int] = {}
        self.tasks_per_node: dict[str, int] = {}
        self.tokenizer_ref = ray.put(tok.backend.to_str())
        # Ray's default placement (not SPREAD: tasks re-run after a node was lost stayed pending under it)
        task = dict(num_cpus=1, max_retries=MAX_RETRIES)
        self.sample_task = ray.remote(**task)(_sample_task)
        self.map_task = ray.remote(**task)(_map_task)
        self.reduce_task = ray.remote(**task)(_reduce_task)

    def show(self, stage: str | None = None) -> None:
        """Refreshes the build's bar: ``stage`` (map, reduce, write) in its description, tokens
        and partitions done in its postfix."""
        if stage is not None:
            self.bar.set_description(f"ray build: {stage}", refresh=False)
        self.bar.set_postfix(tokens=tqdm.format_sizeof(self.tokens), partitions="{}/{}".format(*self.partitions))

    def account(self, stage: str, usage: dict) -> None:
        self.tasks_per_node[usage["node"]] = self.tasks_per_node.get(usage["node"], 0) + 1
        self.map_output_bytes += usage.get("output_bytes", 0)
        self.stages[stage]["cpu_seconds"] += usage["cpu_seconds"]
        for key in ("tokenise_cpu_seconds", "count_cpu_seconds"):
            if key in usage:
                self.stages[stage][key] += usage[key]
        self.peak[stage] = max(self.peak[stage], usage["rss_mb"])

    def timed_next(self, it: Iterator[dict]) -> dict | None:
        t0 = time.perf_counter()
        item = next(it, None)
        self.stages["read"]["seconds"] += time.perf_counter() - t0
        return item

    def sample(self, shards: _ShardSource, partitions: int, num_shards: int) -> np.ndarray:
        """Tokenises the first ``num_shards`` shards; returns the partition boundaries their first-token counts
        give (:func:`partition_boundaries`) and queues the tokenised shards for the map."""
        t0 = time.perf_counter()
        pending = []
        while len(pending) < num_shards and (item := shards.next()) is not None:
            refs = self.sample_task.options(num_returns=3).remote(item[0], self.tokenizer_ref, self.cfg)
            pending.append((refs, item[1]))
        hist = np.zeros(self.tok.vocab_size, np.int64)
        for (docs_ref, hist_ref, usage_ref), kind in pending:
            hist += self.ray.get(hist_ref)
            self.account("sample", self.ray.get(usage_ref))
            shards.sampled.append((docs_ref, kind))
        self.stages["sample"]["seconds"] = time.perf_counter() - t0
        return partition_boundaries(hist, partitions)

    def map(self, shards: _ShardSource, boundaries: np.ndarray, needed: list[bool],
            max_in_flight: int) -> tuple[list[list], int]:
        """Maps every shard, at most ``max_in_flight`` at a time, and reads their statistics in
        corpus order (for the ``max_tokens`` cut); returns (per shard: its partition runs as
        ObjectRefs, documents counted)."""
        ray, max_tokens = self.ray, self.cfg["max_tokens"]
        t0 = time.perf_counter()
        runs: list[list] = []  # per shard: its partition runs
        stats_refs: list = []  # per shard: the ref of its statistics
        payloads: list = []  # per shard: (its payload ref while a --max-tokens cut may need it, kind)
        running: set = set()  # statistics refs of the map tasks not finished
        documents = text_tokens = 0

        def submit(payload, kind: str, slot: int | None = None) -> None:
            ref = payload if isinstance(payload, ray.ObjectRef) else ray.put(payload)
            out = self.map_task.options(num_returns=len(needed) + 1).remote(ref, self.tokenizer_ref, self.cfg,
                                                                           boundaries, needed)
            out = out if isinstance(out, list) else [out]
            if slot is None:
                runs.append(out[:-1])
                stats_refs.append(out[-1])
                payloads.append((ref if max_tokens is not None else None, kind))
                running.add(out[-1])
            else:
                runs[slot], stats_refs[slot] = out[:-1], out[-1]

        self.show("map")
        while True:
            while len(running) < max_in_flight and (item := shards.next()) is not None:
                submit(*item)
            i = self.shards_mapped
            if i == len(stats_refs):
                break
            if stats_refs[i] in running:  # wait for any task, so that a slow shard leaves no CPU idle
                ready, _ = ray.wait(list(running), num_returns=1)
                running.difference_update(ready)
                continue
            stats = ray.get(stats_refs[i])
            self.account("map", stats)
            ref, kind = payloads[i]
            lengths = stats["lengths"]
            if max_tokens is not None and kind == "texts" and text_tokens + int(lengths.sum()) >= max_tokens:
                # the single-machine build stops after the document that reaches max_tokens
                keep = int(np.searchsorted(np.cumsum(lengths) + text_tokens, max_tokens, side="left")) + 1
                if keep < len(lengths):
                    submit(dict(ray.get(ref), max_docs=keep), kind, slot=i)
                    stats = ray.get(stats_refs[i])
                    self.account("map", stats)
                    lengths = stats["lengths"]
                # later text shards are dropped, not cancelled: ray.cancel racing a task that is just
                # finishing aborts the driver in Ray's task manager (RAY_CHECK "Tried to complete task
                # that was not pending", hit here by a --max-tokens build in CI). The tasks already
                # submitted (at most max_in_flight) run to their end; their outputs are freed with the refs.
                later = {j for j in range(i + 1, len(stats_refs)) if payloads[j][1] == "texts"}
                running.difference_update(stats_refs[j] for j in later)
                kept = [j for j in range(len(stats_refs)) if j not in later]
                runs[:] = [runs[j] for j in kept]
                stats_refs[:] = [stats_refs[j] for j in kept]
                payloads[:] = [payloads[j] for j in kept]
                shards.drop_texts()
            text_tokens += int(lengths.sum()) if kind == "texts" else 0
            payloads[i] = (None, kind)
            documents += len(lengths)
            self.tokens += int(lengths.sum())
            self.shards_mapped += 1
            self.bar.update(len(lengths))
            self.show()
        self.stages["map"]["seconds"] = time.perf_counter() - t0
        return runs, documents

    def reduce(self, shard_runs: list[list], needed: list[bool], done: dict[int, dict]) -> None:
        """One task per partition still ``needed``; each finished one is kept in the scratch
        folder and added to ``done``."""
        ray = self.ray
        t0 = time.perf_counter()
        futures = {self.reduce_task.remote(p, self.cfg, *[runs[p] for runs in shard_runs]): p
                   for p in range(len(needed)) if needed[p]}
        shard_runs.clear()  # each reduce task now holds its own runs
        self.show("reduce")
        while futures:
            ready, _ = ray.wait(list(futures), num_returns=1)
            p = futures.pop(ready[0])
            stats, arrays, usage = ray.get(ready[0])
            self.account("reduce", usage)
            self.spilled_bytes += stats["spilled_bytes"]
            node = usage["node"]
            self.output_by_node[node] = self.output_by_node.get(node, 0) + sum(a.nbytes for a in arrays.values())
            self.scratch.save(p, {**stats, "node": node}, arrays)
            done[p] = self.scratch.finished(p)
            self.partitions[0] += 1
            self.show()
        self.stages["reduce"]["seconds"] = time.perf_counter() - t0

    def write(self, parts: list[dict], output: Path, meta: dict, reference_threshold: int | None) -> dict:
        """Lays out the file from the partitions, checksums it, prunes it as the reference's
        ``reduce`` when asked, renames it into place and clears the scratch folder."""
        t0, c0 = time.perf_counter(), time.process_time()
        self.show("write")
        partial = self.scratch.root / output.name
        stats = _stitch(self.scratch, parts, partial, self.cfg["order"], self.tok.vocab_size, meta)
        write_checksums(partial)
        if reference_threshold is not None:
            stats = reduce_like_reference(partial, self.scratch.root, reference_threshold, self.tok.vocab_size, meta)
        os.replace(partial, output)
        shutil.rmtree(self.scratch.root)
        self.stages["write"] = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
        return stats


def _stitch(scratch: _Scratch, parts: list[dict], path: Path, order: int, vocab_size: int, meta: dict) -> dict:
    """Writes the trie file at ``path`` from the finished partitions' level streams (checksums zero)."""
    prefixes, nodes, largest = [], [], []
    chunk = 1 << 22
    for m in range(1, order + 1):
        prefix = scratch.root / f"all-level{m}"
        prefixes.append(str(prefix))
        nodes.append(sum(p["nodes_per_level"][m - 1] for p in parts))
        largest.append(max((p["max_count_per_level"][m - 1] for p in parts), default=0))
        for kind in _PART_FILES if m < order else _PART_FILES[:2]:
            with open(f"{prefix}.{kind}", "wb") as out:
                shift = 0  # next-level nodes of the partitions before this one
                for p, part in enumerate(parts):
                    src = scratch.part(p) / f"level{m}.{kind}"
                    if kind != "children":
                        with open(src, "rb") as f:
                            shutil.copyfileobj(f, out, 1 << 22)
                        continue
                    offsets = np.memmap(src, dtype=np.uint64, mode="r") if src.stat().st_size else np.zeros(0, np.uint64)
                    for i in range(0, len(offsets), chunk):
                        (offsets[i:i + chunk] + np.uint64(shift)).tofile(out)
                    shift += part["nodes_per_level"][m]
    total_tokens = sum(p["total_tokens"] for p in parts)
    stats = _native.write_levels_from_files(str(path), json.dumps(meta, sort_keys=True), order, vocab_size,
                                            total_tokens, prefixes, nodes, largest)
    for prefix in prefixes:
        for kind in _PART_FILES:
            Path(f"{prefix}.{kind}").unlink(missing_ok=True)
    return stats


def summary_json(summary: RayBuildSummary) -> str:
    return json.dumps(asdict(summary), indent=2)
