"""Benchmarks (issue 7): decoding (``python -m dart_core.bench``), serving
(``python -m dart_core.bench.serving``) and the results page that both feed
(``python -m dart_core.bench.report``).  See BENCHMARKS.md."""

from __future__ import annotations

import dataclasses
import json
import sys


def run_cli(config_cls, args, run, save, table) -> int:
    """The shared tail of the benchmark CLIs: builds ``config_cls`` from the parsed
    ``args`` fields, runs, saves under ``args.out``, prints the table and the paths.
    Returns 2 with a one-line error for bad input, a missing dataset or an absent server."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    cfg = config_cls(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        result = run(cfg, progress=not args.no_progress)
    except (ValueError, RuntimeError, OSError) as e:  # OSError: FileNotFoundError, ConnectionError
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = save(result, args.out)
    print(table(result))
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0
