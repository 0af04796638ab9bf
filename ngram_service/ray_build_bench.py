"""The distributed trie build against the single-machine one, stage by stage:
``python -m ngram_service.ray_build_bench CORPUS... --max-tokens N``.

Two passes, each alternating its builds (the single-machine build, then ``--ray`` with each of
``--workers`` CPUs, rotated by repeat) in this one process:

- **texts**: every build reads and tokenises the corpus (``--max-tokens`` of it): the whole job
  as a user runs it.
- **tokens**: the corpus tokenised once beforehand and every build given the token documents,
  so a build is counting, merging and writing only: the stages the single-machine build runs
  on one thread.

Every file is compared with the single-machine build's (``SOURCE_DATE_EPOCH`` is fixed here, so
the bytes must be equal) and its SHA-256 recorded.  CPU-seconds are the tasks' own
(``time.process_time``) and the whole machine's (``/proc/stat``: Ray's processes, the driver and
the object store included).  The JSON goes to ``--out``; ``python -m dart_core.bench.sections``
renders it into the study's README.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from ngram_service.build import build_trie_from_texts
from ngram_service.build_common import tokenized
from ngram_service.corpus import iter_files
from ngram_service.tokenizer import load_trie_tokenizer


def machine_cpu_seconds() -> float:
    """Busy CPU-seconds of the whole machine since boot (``/proc/stat``: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name and the vector extensions that matter here (``/proc/cpuinfo``)."""
    name, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    shown = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX-512 VNNI"),
                                       ("amx_tile", "AMX"), ("avx2", "AVX2")) if flag in flags]
    return f"{name} ({', '.join(shown[:3]) if shown else 'no AVX2'})"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _self_cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_one(mode: str, workers: int, source: str, args, tok, docs, out: Path) -> dict:
    """One build; returns its summary with the machine's and this process's CPU-seconds."""
    import ray

    texts = iter_files(args.inputs, text_field=args.text_field) if source == "texts" else ()
    documents = docs if source == "tokens" else ()
    max_tokens = args.max_tokens if source == "texts" else None
    if mode == "ray":
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    m0, s0 = machine_cpu_seconds(), _self_cpu()
    if mode == "single":
        summary = build_trie_from_texts(texts, out, tok, order=args.order, memory_mb=args.memory_mb,
                                        max_tokens=max_tokens, documents=documents, progress=False,
                                        workers=args.single_workers if source == "texts" else 1)
    else:
        from ngram_service.ray_build import build_trie_ray

        summary = build_trie_ray(texts, out, tok, order=args.order, memory_mb=args.memory_mb, max_tokens=max_tokens,
                                 documents=documents, progress=False)
    row = {"mode": mode, "workers": workers, "source": source, **asdict(summary),
           "machine_cpu_seconds": round(machine_cpu_seconds() - m0, 2),
           "driver_cpu_seconds": round(_self_cpu() - s0, 2), "sha256": _sha256(out)}
    if mode == "ray":
        ray.shutdown()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ngram_service.ray_build_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("inputs", nargs="+", help="corpus files or folders (as the builder's)")
    p.add_argument("--max-tokens", type=int, default=None, help="corpus tokens per build [default: all]")
    p.add_argument("--order", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ray CPUs of each --ray build")
    p.add_argument("--single-workers", type=int, default=2, help="the single-machine build's tokeniser processes")
    p.add_argument("--memory-mb", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--passes", nargs="+", choices=("texts", "tokens"), default=["tokens", "texts"])
    p.add_argument("--text-field", default="text")
    p.add_argument("--tmp-dir", default=None)
    p.add_argument("--out", required=True, help="JSON file for the results")
    args = p.parse_args(argv)
    os.environ["SOURCE_DATE_EPOCH"] = "1700000000"  # the same header in every build: equal bytes expected
    tok = load_trie_tokenizer()
    docs = []
    if "tokens" in args.passes:
        t0 = time.perf_counter()
        docs = list(tokenized(iter_files(args.inputs, text_field=args.text_field), tok, 256, args.max_tokens,
                               progress=True, workers=2))
        print(f"tokenised {sum(len(d) for d in docs):,} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    builds = [("single", 0)] + [("ray", w) for w in args.workers]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ray-build-bench-", dir=args.tmp_dir) as tmp:
        for source in args.passes:
            for r in range(args.repeats):
                for mode, workers in builds[r % len(builds):] + builds[:r % len(builds)]:
                    row = run_one(mode, workers, source, args, tok, docs, Path(tmp) / f"{source}-{mode}-{workers}.trie")
                    row["repeat"] = r
                    rows.append(row)
                    print(f"{source} {mode} {workers}: {row['total_seconds']:.1f} s, machine "
                          f"{row['machine_cpu_seconds']:.1f} CPU-s", file=sys.stderr)
                    Path(row["path"]).unlink()
    hashes = {(r["source"]): set() for r in rows}
    for r in rows:
        hashes[r["source"]].add(r["sha256"])
    result = {"command": "python -m ngram_service.ray_build_bench " + " ".join(argv or sys.argv[1:]),
              "cpu": cpu_model(), "cores": os.cpu_count(), "order": args.order, "max_tokens": args.max_tokens,
              "identical": {k: len(v) == 1 for k, v in hashes.items()}, "rows": rows,
              "created_unix": int(time.time())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["identical"]))
    return 0 if all(result["identical"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
