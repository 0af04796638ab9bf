"""Benchmark of the reference-trie converter on a file larger than the memory it may use:
``python -m ngram_service.convert_bench``.

1. A dart-serve trie (default: the default trie) is written out in the DART reference's
   ``.trie`` format (:func:`ngram_service.reference_format.write_reference_format`): the same
   nodes and counts, node ids depth-first as a reference merge appends them (``--id-order
   dfs``) or level by level, shuffled inside each level, as one reference build's insertion
   order leaves them (``level``), each child list in id order (so not sorted by token).
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ngram_service.reference_format import read_levels, write_reference_format

__all__ = ["main"]

#: The published full reference trie (the issue's figures): bytes on disk and nodes.
FULL_REFERENCE_BYTES = 43.5e9
FULL_REFERENCE_NODES = 1.3e9


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
        try:
            cgroup = MemoryCgroup(args.memory_limit_mb << 20) if args.memory_limit_mb else None
        except RuntimeError as e:
            print(f"error: --memory-limit-mb: {e}", file=sys.stderr)
            return 2
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
