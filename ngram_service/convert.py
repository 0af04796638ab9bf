"""Convert the DART reference implementation's n-gram model (``.trie`` as written by
its ``TrieNgram.save``) into a dart-serve trie: ``python -m ngram_service.convert SRC DST``.

The reference file is a raw dump of nodes with unsorted child lists and no index,
checksum or vocabulary size.  The converter (C++, ``csrc/reference_trie.hpp``)
validates it in one sequential pass, then walks it depth-first with each node's
children sorted by token, which yields every level of the sorted trie format in
order, streamed to disk: memory is bounded by the walk's stack and one bit per
node, plus the page cache over the source (read through mmap, reclaimable), so a
file larger than the machine's RAM converts.  The result is written next to its
destination and renamed into place once its checksums are in: a failed conversion
leaves nothing behind.

Probabilities equal the reference's ``get_probability`` wherever the file's counts
are consistent.  Pruned reference files (its ``reduce``) are not: pruning subtracts
each pruned subtree's counts from every kept ancestor, leaving counts of 0 or below
and counts below a kept child's, where the reference answers NaN (0/0), infinity,
negative values, values above 1, or 0 without backing off.  Rule used here: every
node is kept with its count, a count <= 0 stored as 0, and the file is flagged so
that its reader treats a count of 0 as no evidence (the query backs off past that
context or child to a shorter context) and clamps a ratio above 1 to 1.  Every
probability the reference computes in (0, 1] is unchanged, and every query gets a
finite probability in [0, 1].

Example::

    python -m ngram_service.convert small.trie small-dart.trie --tokenizer Qwen3-8B/
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from tqdm import tqdm

from ngram_service import _native
from ngram_service.cache import cache_root, create_once
from ngram_service.tokenizer import TrieTokenizer, load_trie_tokenizer
from ngram_service.trie import MAGIC, NgramTrie, write_checksums

logger = logging.getLogger(__name__)

__all__ = ["ReferenceTrieError", "ConvertSummary", "convert_reference_trie", "read_reference_header",
           "resolve_ngram_model", "main"]

#: A reference file that is truncated, inconsistent or otherwise cannot be right (a ValueError).
ReferenceTrieError = _native.ReferenceFormatError


@dataclass(frozen=True)
class ConvertSummary:
    source: str
    path: str
    order: int
    source_bytes: int
    source_nodes: int  # records in the reference file, its root included
    nodes: int  # nodes written: all but the root (which our format does not store)
    zero_count_nodes: int  # of those, count <= 0 in the source (pruned files): stored as 0, "no evidence"
    above_parent: int  # nodes whose count exceeds their parent's (pruned files): ratio clamped to 1
    flags: int  # header flags: 1 when either of the two above is non-zero
    nodes_per_level: list[int]
    total_tokens: int  # sum of the level-1 counts
    file_bytes: int
    bytes_ratio: float  # file_bytes / source_bytes
    seconds: float
    source_mb_per_s: float
    nodes_per_s: float
    peak_rss_mb: float  # of this process (ru_maxrss), the source's mapped pages included
    open_ms: float  # opening the result (mmap and header checks)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def read_reference_header(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(order, node_count) from a reference file's 16-byte header.

    Raises:
        ReferenceTrieError: the file is shorter than the header.
    """
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) < 16:
        raise ReferenceTrieError(f"truncated: {len(head)} bytes, shorter than the 16-byte header")
    return struct.unpack("<QQ", head)


def convert_reference_trie(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, vocab_size: int,
                           tokenizer_name: str = "", vocab_hash: str = "", tmp_dir: str | os.PathLike[str] | None = None,
                           progress: bool = True, metadata: dict | None = None) -> ConvertSummary:
    """Converts a reference ``.trie`` into a trie file at ``dst``.

    Args:
        src: the reference file (``TrieNgram.save``; merged and pruned files included).
        dst: destination (parent folders are created; replaced only on success).
        vocab_size: the tokenizer's vocabulary size (the reference file does not store it);
            every token id must be below it.
        tokenizer_name, vocab_hash: the tokenizer identity stored in the header, checked
            when the engine opens the trie.
        tmp_dir: where the record index and level files go (default: next to ``dst``);
            needs about 8 bytes per source node plus the output's size.
        metadata: extra JSON-serialisable information for the header.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ReferenceTrieError: the source is truncated or inconsistent (nothing is written).
        OSError: the output or temporary files cannot be written.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"reference trie not found: {src}")
    order, nodes = read_reference_header(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": {"name": tokenizer_name, "vocab_hash": vocab_hash}, "order": int(order),
            "converted_from": {"format": "DART reference TrieNgram.save", "file": src.name,
                               "bytes": src.stat().st_size},
            "created_unix": int(time.time()), **(metadata or {})}
    start = time.perf_counter()
    bar = tqdm(total=2 * nodes, unit="node", unit_scale=True, desc=f"converting {src.name}",
               disable=not progress)
    done = [0]

    def report(n: int) -> None:
        bar.update(n - done[0])
        done[0] = n

    with tempfile.TemporaryDirectory(prefix=".dart-convert-", dir=tmp_dir or dst.parent) as tmp:
        partial = Path(tmp) / dst.name
        try:
            stats = _native.convert_reference_trie(str(src), str(partial), vocab_size, json.dumps(meta, sort_keys=True),
                                                   tmp, report)
        finally:
            bar.close()
        write_checksums(partial)
        os.replace(partial, dst)
    seconds = time.perf_counter() - start
    t0 = time.perf_counter()
    NgramTrie(dst)
    open_ms = 1e3 * (time.perf_counter() - t0)
    return ConvertSummary(
        source=str(src), path=str(dst), order=stats["order"], source_bytes=stats["source_bytes"],
        source_nodes=stats["source_nodes"], nodes=stats["nodes"], zero_count_nodes=stats["zero_count_nodes"],
        above_parent=stats["above_parent"], flags=stats["flags"],
        nodes_per_level=list(stats["nodes_per_level"]), total_tokens=stats["total_tokens"],
        file_bytes=stats["file_bytes"], bytes_ratio=round(stats["file_bytes"] / max(stats["source_bytes"], 1), 4),
        seconds=round(seconds, 3), source_mb_per_s=round(stats["source_bytes"] / 2**20 / max(seconds, 1e-9), 2),
        nodes_per_s=round(stats["source_nodes"] / max(seconds, 1e-9), 1),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), open_ms=round(open_ms, 3))


def resolve_ngram_model(path: str | os.PathLike[str], tokenizer: TrieTokenizer | Callable[[], TrieTokenizer], *,
                        small: bool = False, progress: bool = True) -> Path:
    """A dart-serve trie for an n-gram model given the way the DART reference takes it.

    ``path`` may be a dart-serve trie (returned as it is), a reference ``.trie`` file, or a
    folder holding the reference's ``full.trie`` (``small.trie`` with ``small``), as the
    reference's ``ngram_model_name_or_path``.  A reference file is converted once into
    ``$DART_SERVE_CACHE/tries/converted/`` (keyed by its path, size and mtime; concurrent
    callers wait for one conversion) and the converted file is returned, to be opened by mmap.

    Args:
        tokenizer: the tokenizer the reference trie was built with (the target's), or a
            function returning it (called only when a conversion is needed).

    Raises:
        FileNotFoundError: nothing at ``path``, or a folder without the expected file (names
            are local: nothing is downloaded).
        ReferenceTrieError: a reference file that is truncated or inconsistent.
    """
    import hashlib

    path = Path(path).expanduser()
    if path.is_dir():
        name = "small.trie" if small else "full.trie"
        if not (path / name).is_file():
            found = sorted(p.name for p in path.glob("*.trie"))
            raise FileNotFoundError(f"no {name} in the n-gram model folder {path} (it holds: "
                                    f"{', '.join(found) or 'no .trie file'}); a reference n-gram folder holds "
                                    "full.trie and small.trie (small=True / is_small_ngram=True picks the latter)")
        path = path / name
    if not path.is_file():
        raise FileNotFoundError(f"n-gram model not found: {path} (a local file or folder; nothing is downloaded)")
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) == MAGIC:
            return path
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    dst = cache_root() / "tries" / "converted" / f"{path.stem}-{key}.trie"

    def convert() -> None:  # convert_reference_trie renames its result into place
        tok = tokenizer if isinstance(tokenizer, TrieTokenizer) else tokenizer()
        logger.info("converting the reference n-gram model %s into %s (once)", path, dst)
        summary = convert_reference_trie(path, dst, vocab_size=tok.vocab_size, tokenizer_name=tok.name,
                                         vocab_hash=tok.vocab_hash, progress=progress)
        logger.info("converted %s: %d nodes, %.1f MB (%.2fx the reference's bytes) in %.1f s", path.name,
                    summary.nodes, summary.file_bytes / 1e6, summary.bytes_ratio, summary.seconds)

    return create_once(dst, convert)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ngram_service.convert", description=(
        "Convert a DART reference n-gram model (.trie from its TrieNgram.save) into a dart-serve trie."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("src", help="the reference .trie")
    p.add_argument("dst", help="the dart-serve trie to write")
    p.add_argument("--tokenizer", default=None, help="the tokenizer the reference trie was built with: a "
                   "tokenizer.json, a model folder or .gguf [default: the embedded SmolLM2-135M-Instruct]")
    p.add_argument("--tmp-dir", default=None, help="folder for the record index and level files [next to dst]")
    p.add_argument("--verify", action="store_true", help="re-open the result and check its checksums and structure")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if not Path(args.src).is_file():  # before the tokenizer takes seconds to load
            raise FileNotFoundError(f"reference trie not found: {args.src}")
        tok = load_trie_tokenizer(args.tokenizer)
        summary = convert_reference_trie(args.src, args.dst, vocab_size=tok.vocab_size, tokenizer_name=tok.name,
                                         vocab_hash=tok.vocab_hash, tmp_dir=args.tmp_dir, progress=not args.quiet)
        if args.verify:
            NgramTrie(args.dst, verify=True)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
