"""Benchmark of the reference-trie converter on a file larger than the memory it may use:
``python -m ngram_service.convert_bench``.

1. A dart-serve trie (default: the default trie) is written out in the DART reference's
   ``.trie`` format (:func:`write_reference_format`): the same nodes and counts, node ids
   level by level in a random order inside each level (as a reference build, whose ids follow
   insertion order, leaves them), each child list in id order (so not sorted by token).
2. Its pages are dropped from the page cache (``posix_fadvise(DONTNEED)``), so the converter
   reads it from disk.
3. The converter runs in a child process, optionally inside a fresh memory cgroup
   (``--memory-limit-mb``; cgroup v2 or v1, root only) whose limit, page cache included, is
   below the file's size: the machine a 43.5 GB file meets, at a size that fits here.
4. The result's levels are compared with the source trie's, array by array, and the figures
   (throughput, peak RSS, the cgroup's peak, bytes, open time) come out as JSON with a linear
   extrapolation to the published full reference trie (43.5 GB, about 1.3 B nodes).

No figure here comes from a real 43.5 GB file: the extrapolation assumes the converter's
cost stays linear in nodes (both passes are) and is stated as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ngram_service.trie import FIXED_HEADER_BYTES, NgramTrie

__all__ = ["read_levels", "write_reference_format", "main"]

#: The published full reference trie (the issue's figures): bytes on disk and nodes.
FULL_REFERENCE_BYTES = 43.5e9
FULL_REFERENCE_NODES = 1.3e9

_RECORD = np.dtype([("token", "<i4"), ("parent", "<u8"), ("freq", "<i4"), ("n_children", "<u8")])  # 24 B, packed
_CHILD = np.dtype([("token", "<i4"), ("index", "<u8")])  # 12 B, packed


def read_levels(path: str | os.PathLike[str]) -> list[dict[str, np.ndarray]]:
    """The arrays of a dart-serve trie, per level (level 1 first): ``tokens`` u32 [n],
    ``counts`` u64 [n] and, except on the last level, ``children`` u64 [n + 1] (CSR offsets
    into the next level).  Memory-mapped where the widths allow; layout in trie_format.hpp.

    Raises:
        TrieFormatError: not a readable trie (checked by opening it first).
    """
    NgramTrie(path)  # header, CRC and bounds checks
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    order = struct.unpack_from("<I", raw, 16)[0]
    levels = []
    for m in range(order):
        n, t_off, c_off, ch_off, cw, chw, _ = struct.unpack_from("<QQQQIIQ", raw, 64 + 48 * m)
        level = {"tokens": np.frombuffer(raw, "<u4", n, t_off),
                 "counts": np.frombuffer(raw, f"<u{cw}", n, c_off).astype(np.uint64)}
        if m < order - 1:
            level["children"] = np.frombuffer(raw, f"<u{chw}", n + 1, ch_off).astype(np.uint64)
        levels.append(level)
    return levels


def _preorder_ids(n_children: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Depth-first preorder ids (root 0) of every node, per level in lexicographic order, with
    each node's children visited in a random order."""
    order = len(n_children)
    subtree = [np.ones(len(n), np.int64) for n in n_children]  # nodes in each subtree, itself included
    for m in range(order - 2, -1, -1):
        parent_of = np.repeat(np.arange(len(n_children[m])), n_children[m])
        subtree[m] += np.bincount(parent_of, weights=subtree[m + 1], minlength=len(subtree[m])).astype(np.int64)
    ids, parent_ids = [], np.zeros(1, np.int64)
    counts = [np.array([len(n_children[0])], np.int64)] + n_children[:-1]
    for m in range(order):
        parent_of = np.repeat(np.arange(len(counts[m])), counts[m])
        visit = np.lexsort((rng.random(len(parent_of)), parent_of))  # siblings in a random order
        before = np.cumsum(subtree[m][visit]) - subtree[m][visit]  # nodes visited earlier, any parent
        group_start = np.repeat(np.cumsum(counts[m]) - counts[m], counts[m])
        level_ids = np.empty(len(parent_of), np.int64)
        level_ids[visit] = parent_ids[parent_of[visit]] + 1 + before - before[group_start]
        ids.append(level_ids)
        parent_ids = level_ids
    return ids


def write_reference_format(trie_path: str | os.PathLike[str], out: str | os.PathLike[str], *, id_order: str = "dfs",
                           seed: int = 0, chunk: int = 1 << 19, progress: bool = True) -> dict:
    """Writes the nodes of a dart-serve trie as a reference ``TrieNgram.save`` file.

    Node ids (the root is 0): ``"dfs"``, depth-first preorder with each node's children in a
    random order (the layout a reference merge writes); ``"level"``, level 1, level 2, ...
    with a random order inside each level (closer to a fresh reference build, whose ids follow
    insertion order, and the worst case for the converter's depth-first walk).  Either way
    every parent precedes its children and a record lists its children in id order, so not by
    token.  The root's freq is the level-1 total.  Returns {"nodes", "bytes", "seconds"}.

    Raises:
        ValueError: a count does not fit the reference's i32 freq, or an unknown id_order.
    """
    t0 = time.perf_counter()
    levels = read_levels(trie_path)
    order = len(levels)
    rng = np.random.default_rng(seed)
    sizes = [len(lv["tokens"]) for lv in levels]
    if any(int(lv["counts"].max(initial=0)) >= 2**31 for lv in levels):
        raise ValueError("a count does not fit the reference format's i32 freq")
    n_children = [np.diff(lv["children"].astype(np.int64)) if "children" in lv
                  else np.zeros(len(lv["tokens"]), np.int64) for lv in levels]
    if id_order == "level":
        base = np.cumsum([1] + sizes[:-1], dtype=np.int64)  # id of the first node of each level
        ids = [b + rng.permutation(n).astype(np.int64) for b, n in zip(base, sizes)]  # lexicographic index -> id
    elif id_order == "dfs":
        ids = _preorder_ids(n_children, rng)
    else:
        raise ValueError(f'id_order must be "dfs" or "level", got {id_order!r}')
    # record sizes in id order: 24 + 12 * n_children
    rec_bytes = np.empty(1 + sum(sizes), np.int64)
    rec_bytes[0] = 24 + 12 * sizes[0]
    for m in range(order):
        rec_bytes[ids[m]] = 24 + 12 * n_children[m]
    offsets = np.empty_like(rec_bytes)
    offsets[0] = 16
    np.cumsum(rec_bytes[:-1], out=offsets[1:])
    offsets[1:] += 16
    total = int(offsets[-1] + rec_bytes[-1])
    del rec_bytes
    out = Path(out)
    buf = np.memmap(out, dtype=np.uint8, mode="w+", shape=(total,))
    buf[:16] = np.frombuffer(struct.pack("<QQ", order, 1 + sum(sizes)), np.uint8)
    bar = tqdm(total=1 + sum(sizes), unit="node", unit_scale=True, desc="writing reference format",
               disable=not progress)

    def put(at: np.ndarray, items: np.ndarray) -> None:  # packed records at byte offsets `at`
        width = items.dtype.itemsize
        buf[(at[:, None] + np.arange(width, dtype=np.int64)).ravel()] = items.view(np.uint8).ravel()

    def put_children(parent_at: np.ndarray, child_ids: np.ndarray, child_tokens: np.ndarray,
                     count: np.ndarray) -> None:
        # children of each parent in id order, at parent_at + 24 + 12 * rank
        parent_of = np.repeat(np.arange(len(count)), count)
        order_ = np.lexsort((child_ids, parent_of))
        rank = np.arange(len(order_), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        entries = np.empty(len(order_), _CHILD)
        entries["token"] = child_tokens[order_]
        entries["index"] = child_ids[order_]
        put(parent_at[parent_of] + 24 + 12 * rank, entries)

    root = np.zeros(1, _RECORD)
    root["freq"] = int(levels[0]["counts"].sum()) if int(levels[0]["counts"].sum()) < 2**31 else -1
    root["n_children"] = sizes[0]
    put(offsets[:1], root)
    put_children(offsets[:1], ids[0], levels[0]["tokens"].astype(np.int32), np.array([sizes[0]], np.int64))
    bar.update(1)
    for m in range(order):
        lv = levels[m]
        parent_ids = None
        if m > 0:  # parent id of every node of this level, from the previous level's CSR offsets
            parent_ids = np.repeat(ids[m - 1], n_children[m - 1])
        for lo in range(0, sizes[m], chunk):
            hi = min(sizes[m], lo + chunk)
            rec = np.empty(hi - lo, _RECORD)
            rec["token"] = lv["tokens"][lo:hi]
            rec["parent"] = 0 if m == 0 else parent_ids[lo:hi]
            rec["freq"] = lv["counts"][lo:hi]
            rec["n_children"] = n_children[m][lo:hi]
            at = offsets[ids[m][lo:hi]]
            put(at, rec)
            if m < order - 1:
                c_lo, c_hi = int(lv["children"][lo]), int(lv["children"][hi])
                put_children(at, ids[m + 1][c_lo:c_hi], levels[m + 1]["tokens"][c_lo:c_hi].astype(np.int32),
                             n_children[m][lo:hi])
            bar.update(hi - lo)
    bar.close()
    buf.flush()
    del buf
    return {"nodes": 1 + sum(sizes), "bytes": total, "seconds": round(time.perf_counter() - t0, 2)}


def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Asks the kernel to drop a file's clean cached pages (after an fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class MemoryCgroup:
    """A fresh memory cgroup with a hard limit (page cache included), for one child process.

    cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``); root only.

    Raises:
        RuntimeError: no writable memory cgroup hierarchy on this machine.
    """

    def __init__(self, limit_bytes: int) -> None:
        candidates = [(Path("/sys/fs/cgroup"), "memory.max", "memory.peak"),
                      (Path("/sys/fs/cgroup/unified"), "memory.max", "memory.peak"),
                      (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.max_usage_in_bytes")]
        for root, limit_file, peak_file in candidates:
            if not (root / "cgroup.procs").is_file():
                continue
            path = root / f"dart-convert-bench-{os.getpid()}"
            try:
                path.mkdir()
                (path / limit_file).write_text(str(limit_bytes))
            except OSError:
                try:
                    path.rmdir()
                except OSError:
                    pass
                continue
            self.path, self.peak_file = path, peak_file
            return
        raise RuntimeError("no writable memory cgroup (needs root and cgroup v1 or v2 with the memory controller)")

    def preexec(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        f = self.path / self.peak_file
        return int(f.read_text()) if f.is_file() else None

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    from ngram_service.cache import default_trie_path
    from ngram_service.tokenizer import resolve_model

    ap = argparse.ArgumentParser(prog="python -m ngram_service.convert_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trie", default=None, help="dart-serve trie whose nodes make the reference file [default trie]")
    ap.add_argument("--work-dir", default=None, help="folder for the reference file and the result [a temp folder]")
    ap.add_argument("--memory-limit-mb", type=int, default=None,
                    help="run the converter in a memory cgroup with this limit, page cache included (root only)")
    ap.add_argument("--id-order", choices=("dfs", "level"), default="dfs",
                    help="node ids of the reference file: dfs = depth-first, as a reference merge writes; "
                         "level = level by level, shuffled inside each (a fresh build's insertion order; "
                         "the converter's worst case)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random orders")
    ap.add_argument("--runs", type=int, default=3, help="conversions of the same file (median reported)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still removes its cgroup and child
    trie = Path(args.trie) if args.trie else default_trie_path(resolve_model(None).name, "default", 3)
    if not trie.is_file():
        print(f"error: trie not found: {trie} (build it with python -m ngram_service.build)", file=sys.stderr)
        return 2
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="dart-convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ref, dst = work / "reference.trie", work / "converted.trie"
    written = write_reference_format(trie, ref, id_order=args.id_order, seed=args.seed, progress=not args.quiet)
    cmd = [sys.executable, "-m", "ngram_service.convert", str(ref), str(dst), "--tmp-dir", str(work), "-q"]
    runs = []
    for _ in range(max(1, args.runs)):
        drop_from_page_cache(ref)
        cgroup = MemoryCgroup(args.memory_limit_mb << 20) if args.memory_limit_mb else None
        try:
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cgroup.preexec if cgroup else None)
            wall = time.perf_counter() - t0
            peak = cgroup.peak_bytes() if cgroup else None
        finally:
            if cgroup:
                cgroup.remove()
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        run = json.loads(proc.stdout)
        run["process_wall_s"] = round(wall, 2)
        run["cgroup_peak_mb"] = round(peak / 2**20, 1) if peak else None
        runs.append(run)
        if not args.quiet:
            print(f"run {len(runs)}: {run['seconds']} s, peak RSS {run['peak_rss_mb']} MB, cgroup peak "
                  f"{run['cgroup_peak_mb']} MB", file=sys.stderr)
    summary = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]  # the median run
    same = all(np.array_equal(a[k], b[k]) for a, b in zip(read_levels(trie), read_levels(dst)) for k in a)
    per_node_s = summary["seconds"] / written["nodes"]
    report = {
        "source": {"trie": str(trie), "reference_bytes": written["bytes"], "nodes": written["nodes"],
                   "id_order": args.id_order, "write_seconds": written["seconds"]},
        "memory_limit_mb": args.memory_limit_mb,
        "limit_vs_source": round((args.memory_limit_mb << 20) / written["bytes"], 3) if args.memory_limit_mb else None,
        "convert": summary,  # the median run
        "runs": [{k: r[k] for k in ("seconds", "process_wall_s", "peak_rss_mb", "cgroup_peak_mb", "open_ms")}
                 for r in runs],
        "levels_identical_to_source": same,
        "extrapolated_to_full_reference": {
            "bytes": FULL_REFERENCE_BYTES, "nodes": FULL_REFERENCE_NODES,
            "seconds": round(per_node_s * FULL_REFERENCE_NODES, 0),
            "output_bytes": round(summary["file_bytes"] / written["nodes"] * FULL_REFERENCE_NODES, -6),
            "temp_index_bytes": 8 * FULL_REFERENCE_NODES,
            "visited_bits_bytes": FULL_REFERENCE_NODES / 8,
        },
    }
    print(json.dumps(report, indent=2))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
