"""Build an n-gram trie from a corpus: ``python -m ngram_service.build --help``.

Pipeline: documents (corpus files or a named corpus, see
:mod:`ngram_service.corpus`) → batched tokenisation with the target's fast
tokenizer → the C++ external-memory counter (sorted runs spilled to disk
when ``--memory-mb`` is full, k-way merged) → the memory-mapped trie format
of :mod:`ngram_service.trie`.  The file is written next to its destination
and renamed into place once its checksums are in, so a reader never sees a
half-written trie.  The summary (tokens, nodes per level, bytes per node,
seconds, counting throughput) goes to stdout as JSON.

Examples::

    python -m ngram_service.build                       # default corpus, default model, order 3
    python -m ngram_service.build docs/ notes.jsonl -o my.trie --order 4 --min-count 2
    python -m ngram_service.build --snapshot live.snap -o nightly.trie   # default corpus + what was learned
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ngram_service import _native
from ngram_service.build_common import (BuildError, BuildSummary, check_build_options, reduce_like_reference,
                                        text_metadata, tokenized, trie_metadata)
from ngram_service.cache import create_once, default_trie_path
from ngram_service.corpus import NAMED_CORPORA, iter_corpus, iter_files
from ngram_service.live import SnapshotMismatch, read_snapshot
from ngram_service.ray_build import build_trie_ray
from ngram_service.tokenizer import TrieTokenizer, load_trie_tokenizer, resolve_model
from ngram_service.trie import NgramTrie, pack_ragged, write_checksums

logger = logging.getLogger(__name__)

__all__ = ["BuildError", "BuildSummary", "build_trie", "build_trie_from_texts", "default_trie_path", "ensure_trie",
           "ensure_default_trie", "snapshot_documents", "main"]

_TOKENS_PER_ADD = 1 << 20


class _Counter:
    """Feeds token documents to the C++ builder in chunks of ~1 M tokens."""

    def __init__(self, builder: _native.TrieBuilder) -> None:
        self.builder = builder
        self.chunks: list[np.ndarray] = []
        self.pending = 0
        self.seconds = 0.0
        self.tokens = 0
        self.documents = 0

    def add(self, doc: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(doc, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError("a document must be a 1-D sequence of token ids")
        if len(arr) and arr.min() < 0:
            raise ValueError(f"negative token id {int(arr.min())} in document {self.documents}")
        self.chunks.append(arr)
        self.pending += len(arr)
        self.documents += 1
        if self.pending >= _TOKENS_PER_ADD:
            self.flush()

    def flush(self) -> None:
        if not self.chunks:
            return
        flat, offsets = pack_ragged(self.chunks)
        big = flat >= np.iinfo(np.uint32).max
        if big.any():
            raise ValueError(f"token id {int(flat[big][0])} does not fit the trie format")
        t0 = time.perf_counter()
        self.builder.add_documents(flat.astype(np.uint32), offsets)
        self.seconds += time.perf_counter() - t0
        self.tokens += len(flat)
        self.chunks, self.pending = [], 0


def build_trie(
    documents: Iterable[Sequence[int] | np.ndarray],
    output: str | os.PathLike[str],
    *,
    vocab_size: int,
    order: int = 3,
    min_count: int = 1,
    memory_mb: int = 2048,
    tmp_dir: str | os.PathLike[str] | None = None,
    tokenizer_name: str = "",
    vocab_hash: str = "",
    metadata: dict | None = None,
    prune: str = "drop",
) -> BuildSummary:
    """Counts token documents into a trie file.

    Args:
        documents: token-id sequences; n-grams never cross documents.
        output: destination path (parent folders are created).
        vocab_size: every token id must be below it.
        order: n-gram order, 2..6 (the paper uses 3).
        min_count: drop n-grams seen fewer times.
        prune: how ``min_count`` prunes.  ``"drop"``: the n-grams go and every other count
            stays as counted (the default).  ``"reference"``: as the DART reference's
            ``reduce``, each kept n-gram's count also loses the counts of the pruned n-grams
            under it, down to 0 or less (:func:`ngram_service.reference_format.reduce_levels`;
            the file is written through the reference format and the converter, whose rule
            for such counts is in docs/ngram.md).
        memory_mb: buffer for windows before a sorted run is spilled to disk.
        tmp_dir: where runs and level files go (default: next to ``output``).
        tokenizer_name, vocab_hash: tokenizer identity stored in the header.
        metadata: extra JSON-serialisable build information.

    Raises:
        ValueError: bad order, token ids or arguments.
        OSError: the output or temporary files cannot be written.
    """
    start = time.perf_counter()
    check_build_options(order, min_count, prune)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tmp_dir) if tmp_dir is not None else output.parent
    with tempfile.TemporaryDirectory(prefix=".dart-trie-", dir=tmp_root) as tmp:
        builder = _native.TrieBuilder(order, vocab_size, tmp, memory_mb << 20)
        counter = _Counter(builder)
        tokenize_seconds = 0.0
        it = iter(documents)
        while True:
            t0 = time.perf_counter()
            doc = next(it, None)  # time spent producing documents = tokenisation
            tokenize_seconds += time.perf_counter() - t0
            if doc is None:
                break
            counter.add(doc)
        counter.flush()
        meta = trie_metadata(tokenizer_name=tokenizer_name, vocab_hash=vocab_hash, order=order, min_count=min_count,
                             num_documents=counter.documents, prune=prune, metadata=metadata)
        partial = Path(tmp) / output.name
        t0 = time.perf_counter()
        like_reference = prune == "reference" and min_count > 1
        stats = builder.finish(str(partial), json.dumps(meta, sort_keys=True), 1 if like_reference else min_count)
        write_checksums(partial)
        if like_reference:
            stats = {**reduce_like_reference(partial, Path(tmp), min_count, vocab_size, meta),
                     "num_runs": stats["num_runs"]}
        merge_seconds = time.perf_counter() - t0
        count_seconds = counter.seconds + merge_seconds
        os.replace(partial, output)
    total = time.perf_counter() - start
    return BuildSummary(
        path=str(output),
        order=order,
        total_tokens=stats["total_tokens"],
        num_nodes=stats["num_nodes"],
        nodes_per_level=list(stats["nodes_per_level"]),
        file_bytes=stats["file_bytes"],
        bytes_per_node=stats["file_bytes"] / max(stats["num_nodes"], 1),
        num_documents=counter.documents,
        num_runs=stats["num_runs"],
        tokenize_seconds=round(tokenize_seconds, 3),
        count_seconds=round(count_seconds, 3),
        merge_seconds=round(merge_seconds, 3),
        total_seconds=round(total, 3),
        count_tokens_per_s=round(stats["total_tokens"] / max(count_seconds, 1e-9), 1),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )


def build_trie_from_texts(
    texts: Iterable[str],
    output: str | os.PathLike[str],
    tokenizer,
    *,
    corpus_name: str = "",
    batch_docs: int = 256,
    max_tokens: int | None = None,
    progress: bool = True,
    special_tokens: bool = False,
    eos_per_document: bool = False,
    workers: int = 1,
    documents: Iterable[Sequence[int] | np.ndarray] = (),
    **kwargs,
) -> BuildSummary:
    """Tokenises ``texts`` in batches and builds the trie; keyword arguments as :func:`build_trie`.

    Args:
        tokenizer: a :class:`~ngram_service.tokenizer.TrieTokenizer`, or a Hugging Face fast
            tokenizer (its ``tokenizers`` backend does the work: the same ids either way).
        special_tokens: encode documents with the tokenizer's special tokens (BOS and the
            like, where its post-processor adds them), as the DART reference's builder does;
            default off, as the engine encodes plain text.
        eos_per_document: end every document with the EOS token, as the reference's builder
            does (n-grams then learn where documents end).
        workers: tokeniser processes.  1 (default): this process, with the tokenizer's own
            thread pool; N > 1: N processes encode batches while this one reads and counts
            (the same ids, so the same trie).
        documents: token-id documents counted after the texts, already in this tokenizer's ids
            (a live corpus's snapshots: :func:`snapshot_documents`).

    Raises:
        ValueError: ``eos_per_document`` with a tokenizer whose EOS token is unknown.
    """
    tok = TrieTokenizer.wrap(tokenizer)
    if eos_per_document and tok.eos_token_id is None:
        raise ValueError(f"eos_per_document: the tokenizer {tok.name!r} names no EOS token "
                         "(no eos_token in its tokenizer_config.json)")
    meta = text_metadata(corpus_name, special_tokens, eos_per_document, max_tokens, kwargs.pop("metadata", {}))
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return build_trie(
        itertools.chain(tokenized(texts, tok, batch_docs, max_tokens, progress, special_tokens, eos_per_document,
                                   workers), documents), output,
        vocab_size=tok.vocab_size, tokenizer_name=tok.name, vocab_hash=tok.vocab_hash, metadata=meta, **kwargs)


def snapshot_documents(paths: Sequence[str | os.PathLike[str]], tokenizer: TrieTokenizer) -> tuple[list, int]:
    """The documents of live-corpus snapshots (:mod:`ngram_service.live`: what a service learned
    from its traffic), checked against ``tokenizer``; returns (documents, tokens).

    Raises:
        FileNotFoundError: a missing file; CorruptSnapshot: a file that is not a sound snapshot;
        SnapshotMismatch: a snapshot written for another tokenizer (vocabulary hash)."""
    docs, tokens = [], 0
    for path in paths:
        snap = read_snapshot(path)
        if snap.vocab_hash and snap.vocab_hash != tokenizer.vocab_hash:
            raise SnapshotMismatch(f"{path}: learned with another tokenizer (vocabulary hash {snap.vocab_hash[:12]}…) "
                                   f"than {tokenizer.name} ({tokenizer.vocab_hash[:12]}…)")
        for d in snap.documents():
            if d.size and int(d.max()) >= tokenizer.vocab_size:
                raise SnapshotMismatch(f"{path}: token id {int(d.max())} is outside {tokenizer.name}'s vocabulary")
            docs.append(d)
            tokens += d.size
    return docs, tokens


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ngram_service.build",
        description="Count the n-grams of a corpus with the target tokenizer into a memory-mapped DART trie.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("inputs", nargs="*", help="corpus files or folders (.jsonl/.json: --text-field; other files: "
                   "one document each, .gz decompressed, binary files skipped); when none, --corpus is used")
    p.add_argument("--corpus", choices=NAMED_CORPORA, default=None,
                   help="named corpus (default = ShareGPT assistant turns + CPython stdlib); counted before the "
                        "inputs when both are given [default: default, when no inputs are given]")
    p.add_argument("-o", "--output", help="trie file [default: $DART_SERVE_CACHE/tries/<model>-<corpus>-<order>gram.trie]")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (or a folder holding one), or the model whose "
                   "tokenizer to use: a local HF folder or .gguf file [default: the embedded SmolLM2-135M-Instruct]")
    p.add_argument("--order", type=int, default=3, choices=range(2, 7), metavar="{2..6}", help="n-gram order")
    p.add_argument("--min-count", type=int, default=1, help="drop n-grams seen fewer times")
    p.add_argument("--prune", choices=("drop", "reference"), default="drop",
                   help="how --min-count prunes: drop keeps every other count as counted; reference subtracts "
                        "the pruned counts from their ancestors, as the DART reference's reduce()")
    p.add_argument("--memory-mb", type=int, default=2048, help="window buffer before spilling a sorted run to disk")
    p.add_argument("--tmp-dir", default=None, help="folder for sorted runs [default: next to the output]")
    p.add_argument("--batch-docs", type=int, default=256, help="documents per tokenizer call")
    p.add_argument("--workers", type=int, default=None, help="tokeniser processes: 1 = this process with the "
                   "tokenizer's own threads; N > 1 = N single-threaded processes beside the counting one; with "
                   "--ray and no --address: the local Ray cluster's CPUs [default: 1; with --ray, every core]")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many corpus tokens")
    p.add_argument("--special-tokens", action="store_true", help="encode documents with the tokenizer's special "
                   "tokens, as the DART reference's builder does")
    p.add_argument("--eos-per-document", action="store_true", help="end every document with the EOS token, as the "
                   "DART reference's builder does")
    p.add_argument("--reference-tokenisation", action="store_true",
                   help="both of the above: tokenise exactly as the DART reference's builder")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.json inputs")
    p.add_argument("--snapshot", action="append", default=[], metavar="FILE",
                   help="a live-corpus snapshot (ngram.learn_snapshot: what the service learned from its traffic) "
                        "counted after the corpus; repeat for several; a snapshot of another tokenizer is refused")
    ray = p.add_argument_group("distributed build (Ray)")
    ray.add_argument("--ray", action="store_true", help="count on a Ray cluster: map tasks tokenise and sort shards, "
                     "one reduce task per key range merges (the same file as without --ray)")
    ray.add_argument("--address", default=None, help="the Ray cluster to join (auto, ray://host:10001) [default: "
                     "a local one with --workers CPUs]; implies --ray")
    ray.add_argument("--partitions", type=int, default=None, help="key ranges, one reduce task each "
                     "[default: 4 per CPU of the cluster]")
    ray.add_argument("--shard-chars", type=int, default=8 << 20, help="characters of text per map task")
    ray.add_argument("--resume", action="store_true", help="continue an interrupted --ray build of the same output "
                     "and options from its finished partitions")
    ray.add_argument("--task-tmp-dir", default=None, help="where reduce tasks spill sorted runs on their nodes "
                     "[default: each node's temp folder]")
    p.add_argument("--verify", action="store_true", help="re-open the result and check its checksums and structure")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def ensure_trie(path: str | os.PathLike[str], tokenizer: TrieTokenizer | Callable[[], TrieTokenizer], *,
                corpus: str = "default", order: int = 3, progress: bool = True) -> Path:
    """``path`` as it is when the file exists, else the trie of a named corpus built there first.

    Concurrent callers on one machine wait for a single build (file lock); the
    file appears atomically, so a half-written trie is never opened.

    Args:
        tokenizer: the tokenizer to build with, or a function returning it (called only to build).
        corpus: a name of :data:`~ngram_service.corpus.NAMED_CORPORA`.

    Raises:
        ValueError: an unknown corpus name.
    """
    path = Path(path).expanduser()
    if path.is_file():  # the usual case: no tokenizer to load
        return path
    if corpus not in NAMED_CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {', '.join(NAMED_CORPORA)}")

    def build() -> None:
        tok = tokenizer if isinstance(tokenizer, TrieTokenizer) else tokenizer()
        partial = path.with_suffix(".partial")
        logger.info("building the %s trie %s (first start only; a few minutes)", corpus, path)
        build_trie_from_texts(iter_corpus(corpus), partial, tok, corpus_name=corpus, order=order, progress=progress)
        os.replace(partial, path)

    return create_once(path, build)


def ensure_default_trie(model: str | None = None, *, order: int = 3, progress: bool = True) -> Path:
    """The default trie of a model (``default`` corpus, in the cache), built on first use
    (:func:`ensure_trie`) with the model's tokenizer (:func:`~ngram_service.tokenizer.load_trie_tokenizer`)."""
    path = default_trie_path(resolve_model(model).name, "default", order)
    return ensure_trie(path, lambda: load_trie_tokenizer(model), corpus="default", order=order, progress=progress)


def _source_id(named: str | None, paths: Sequence[str]) -> str:
    """What a resumed build checks it is reading again: the named corpus and every input file's
    path, size and modification time."""
    files = []
    for path in paths:
        for f in sorted(Path(path).rglob("*")) if Path(path).is_dir() else [Path(path)]:
            if f.is_file():
                st = f.stat()
                files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return json.dumps({"corpus": named, "files": files})


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        missing = [p for p in args.inputs + args.snapshot if not Path(p).exists()]
        if missing:  # before the tokenizer takes seconds to load
            raise FileNotFoundError(f"corpus file not found: {missing[0]}")
        tokenizer = load_trie_tokenizer(args.tokenizer)
        learned, learned_tokens = snapshot_documents(args.snapshot, tokenizer)
        named = args.corpus or ("default" if not args.inputs else None)
        corpus = "+".join(([named] if named else []) + (["files"] if args.inputs else [])
                          + (["snapshots"] if args.snapshot else []))
        output = Path(args.output) if args.output else default_trie_path(tokenizer.name, corpus, args.order)
        skipped: list[Path] = []
        texts = itertools.chain(iter_corpus(named) if named else (),
                                iter_files(args.inputs, text_field=args.text_field, skipped=skipped))
        options = dict(
            corpus_name=corpus, batch_docs=args.batch_docs, max_tokens=args.max_tokens, progress=not args.quiet,
            order=args.order, min_count=args.min_count, memory_mb=args.memory_mb, tmp_dir=args.tmp_dir,
            prune=args.prune, special_tokens=args.special_tokens or args.reference_tokenisation,
            eos_per_document=args.eos_per_document or args.reference_tokenisation, documents=learned,
            metadata={"snapshots": [str(p) for p in args.snapshot], "snapshot_tokens": learned_tokens}
            if args.snapshot else {})
        if args.ray or args.address or args.resume:
            summary = build_trie_ray(texts, output, tokenizer, address=args.address, num_cpus=args.workers,
                                     partitions=args.partitions, resume=args.resume, task_tmp_dir=args.task_tmp_dir,
                                     shard_chars=args.shard_chars,
                                     source_id=_source_id(named, args.inputs + args.snapshot), **options)
        else:
            summary = build_trie_from_texts(texts, output, tokenizer,
                                            workers=1 if args.workers is None else args.workers, **options)
        if skipped:
            logger.info("skipped %d binary files (a NUL byte in their first 8 KiB), e.g. %s", len(skipped), skipped[0])
        if summary.total_tokens == 0:
            raise ValueError("the corpus produced no tokens")
        if args.verify:
            NgramTrie(output, verify=True)
    except (FileNotFoundError, ValueError, OSError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logger.info("wrote %s: %s tokens, %s nodes (%s per level), %.2f bytes/node, %.1f s (%.2f M tokens/s counting)",
                summary.path, f"{summary.total_tokens:,}", f"{summary.num_nodes:,}",
                "/".join(f"{n:,}" for n in summary.nodes_per_level), summary.bytes_per_node,
                summary.total_seconds, summary.count_tokens_per_s / 1e6)
    print(summary.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
