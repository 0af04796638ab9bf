"""What the single-machine and the Ray trie builds share (:mod:`ngram_service.build`,
:mod:`ngram_service.ray_build`): their summary and errors, option checks and header metadata,
the corpus tokenising (documents cut into pieces, batched, put back together) and the
reference-style pruning."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from ngram_service.convert import convert_reference_trie
from ngram_service.reference_format import read_levels, reduce_levels, write_reference_levels
from ngram_service.tokenizer import TrieTokenizer

__all__ = ["BuildError", "BuildSummary", "MAX_BATCH_CHARS", "MAX_PIECE_CHARS", "check_build_options",
           "encoded_batches", "join_pieces", "reduce_like_reference", "split_long", "text_metadata", "tokenized",
           "trie_metadata"]

class BuildError(RuntimeError):
    """A build that failed for a reason other than its input or a local file (a distributed
    build's failed task: :class:`ngram_service.ray_build.RayBuildError`)."""


@dataclass(frozen=True)
class BuildSummary:
    path: str
    order: int
    total_tokens: int
    num_nodes: int
    nodes_per_level: list[int]
    file_bytes: int
    bytes_per_node: float
    num_documents: int
    num_runs: int  # sorted runs spilled to disk (0: counted in memory)
    tokenize_seconds: float  # waiting for documents: reading + tokenising, where not overlapped with counting
    count_seconds: float  # counting + merging + writing, tokenisation excluded
    merge_seconds: float  # of which merging the runs and writing the file
    total_seconds: float
    count_tokens_per_s: float
    peak_rss_mb: float  # this process (tokeniser worker processes excluded)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def check_build_options(order: int, min_count: int, prune: str) -> None:
    """Raises ValueError on an order, ``min_count`` or ``prune`` :func:`build_trie` does not take."""
    if not 2 <= order <= 6:
        raise ValueError(f"order must be in 2..6, got {order}")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    if prune not in ("drop", "reference"):
        raise ValueError(f'prune must be "drop" or "reference", got {prune!r}')


def trie_metadata(*, tokenizer_name: str, vocab_hash: str, order: int, min_count: int, num_documents: int,
                  prune: str, metadata: dict | None) -> dict:
    """The metadata JSON object a built trie's header holds.  ``created_unix`` is
    ``$SOURCE_DATE_EPOCH`` when set (reproducible builds: two builds of one corpus are then
    byte-identical), else now."""
    return {
        "tokenizer": {"name": tokenizer_name, "vocab_hash": vocab_hash},
        "order": order,
        "min_count": min_count,
        "num_documents": num_documents,
        "created_unix": int(os.environ.get("SOURCE_DATE_EPOCH") or time.time()),
        **(metadata or {}),
        "prune": prune,
    }


def text_metadata(corpus_name: str, special_tokens: bool, eos_per_document: bool, max_tokens: int | None,
                  metadata: dict | None) -> dict:
    """What :func:`build_trie_from_texts` adds to a trie's metadata about its texts."""
    meta = {"corpus": corpus_name, "special_tokens": special_tokens, "eos_per_document": eos_per_document,
            **(metadata or {})}
    if max_tokens is not None:
        meta["max_tokens"] = max_tokens
    return meta


def reduce_like_reference(path: Path, tmp: Path, threshold: int, vocab_size: int, meta: dict) -> dict:
    """Rewrites the unpruned trie at ``path`` pruned as the reference's ``reduce(threshold)``."""
    reference = tmp / "reduced-reference.trie"
    write_reference_levels(reduce_levels(read_levels(path), threshold), reference, progress=False)
    summary = convert_reference_trie(reference, path, vocab_size=vocab_size,
                                     tokenizer_name=meta["tokenizer"]["name"], vocab_hash=meta["tokenizer"]["vocab_hash"],
                                     tmp_dir=tmp, progress=False, metadata=meta)
    reference.unlink()
    return {"total_tokens": summary.total_tokens, "num_nodes": summary.nodes,
            "nodes_per_level": summary.nodes_per_level, "file_bytes": summary.file_bytes}


MAX_PIECE_CHARS = 1 << 20  # longer documents are tokenised in pieces of at most this many characters
MAX_BATCH_CHARS = 4 << 20  # characters per tokenizer call (besides --batch-docs)


def split_long(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """Cuts a document longer than ``max_chars`` into pieces of at most that many characters,
    each cut just after a lone newline: one with a non-space character on either side.

    A byte-level BPE pre-tokenizer (GPT-2's rules: SmolLM2, Llama 3, Qwen) splits there
    anyway, so the pieces' ids, concatenated, are the whole document's (tested); the point
    is memory: a tokenizer holds ~100 bytes per token of its input while it encodes, and a
    generated 24 MB header is 11 M tokens.  A piece with no such newline in its second half
    is cut at ``max_chars`` exactly (its seam may then tokenise differently).
    """
    if len(text) <= max_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = text.rfind("\n", start + max_chars // 2, end - 1)
        while cut != -1 and (text[cut + 1].isspace() or text[cut - 1].isspace()):
            cut = text.rfind("\n", start + max_chars // 2, cut)
        cut = end if cut == -1 else cut + 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _piece_batches(texts: Iterable[str], batch_docs: int, split: bool) -> Iterable[list[tuple[str, bool]]]:
    """Batches of (piece, last piece of its document) of at most ``batch_docs`` pieces and about
    :data:`MAX_BATCH_CHARS` characters; with ``split``, long documents go in pieces (:func:`split_long`)."""
    batch: list[tuple[str, bool]] = []
    chars = 0
    for text in texts:
        parts = split_long(text) if split else [text]
        for j, part in enumerate(parts):
            batch.append((part, j == len(parts) - 1))
            chars += len(part)
            if len(batch) >= batch_docs or chars >= MAX_BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


_worker_tokenizer = None


def _worker_init(tokenizer_json: str) -> None:
    """Tokeniser worker start-up: one single-threaded tokenizer (the processes are the parallelism)."""
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _worker_encode(texts: list[str], special_tokens: bool) -> list[np.ndarray]:
    return [np.asarray(e.ids, dtype=np.uint32)
            for e in _worker_tokenizer.encode_batch(texts, add_special_tokens=special_tokens)]


def encoded_batches(texts: Iterable[str], tokenizer: TrieTokenizer, batch_docs: int, special_tokens: bool,
                    workers: int) -> Iterable[tuple[list[bool], list]]:
    """(last-piece flags, token ids) per batch of pieces, in corpus order.

    ``workers`` <= 1: encoded here, by the tokenizer's own thread pool.  More: that many
    spawned processes each encode whole batches single-threaded while this process reads
    the corpus and counts.  Memory stays bounded however large the corpus or its files:
    batches hold about :data:`MAX_BATCH_CHARS` characters, long documents go in pieces
    (not with ``special_tokens``, which are added per call), and at most ``2 * workers``
    batches are in flight.
    """
    batches = _piece_batches(texts, batch_docs, split=not special_tokens)
    if workers <= 1:
        for batch in batches:
            yield [last for _, last in batch], tokenizer.encode_batch([t for t, _ in batch],
                                                                      add_special_tokens=special_tokens)
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a process whose tokenizer threads may be running
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer.backend.to_str(),)) as pool:
        in_flight: deque = deque()
        for batch in batches:
            in_flight.append(([last for _, last in batch],
                              pool.apply_async(_worker_encode, ([t for t, _ in batch], special_tokens))))
            if len(in_flight) >= 2 * workers:
                flags, result = in_flight.popleft()
                yield flags, result.get()
        while in_flight:
            flags, result = in_flight.popleft()
            yield flags, result.get()


def join_pieces(batches: Iterable[tuple[list[bool], list]], eos_token_id: int | None) -> Iterable[np.ndarray]:
    """Whole documents (u32 ids) from encoded batches of pieces (:func:`encoded_batches`),
    each followed by ``eos_token_id`` when it is not None."""
    eos = [np.array([eos_token_id], dtype=np.uint32)] if eos_token_id is not None else []
    parts: list = []  # the pieces of the document being put back together
    for flags, encoded in batches:
        for last, ids in zip(flags, encoded):
            parts.append(np.asarray(ids, dtype=np.uint32))
            if not last:
                continue
            yield np.concatenate(parts + eos) if len(parts) + len(eos) > 1 else parts[0]
            parts = []


def tokenized(texts: Iterable[str], tokenizer: TrieTokenizer, batch_docs: int, max_tokens: int | None,
              progress: bool, special_tokens: bool = False, eos_per_document: bool = False,
              workers: int = 1) -> Iterable[Sequence[int] | np.ndarray]:
    """The texts as token documents (u32 ids, :func:`encoded_batches` + :func:`join_pieces`), in
    corpus order, stopping after the document that reaches ``max_tokens``; a tqdm bar of documents."""
    total = 0
    with tqdm(unit="doc", desc="tokenise+count", disable=not progress, smoothing=0.1) as bar:
        batches = encoded_batches(texts, tokenizer, batch_docs, special_tokens, workers)
        for doc in join_pieces(batches, tokenizer.eos_token_id if eos_per_document else None):
            yield doc
            total += len(doc)
            bar.update(1)
            if bar.n % 256 == 0:
                bar.set_postfix(tokens=f"{total / 1e6:.1f}M", refresh=False)
            if max_tokens is not None and total >= max_tokens:
                return
