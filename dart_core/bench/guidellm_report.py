"""A guidellm run against dart-serve, rendered into BENCHMARKS.md:
``python -m dart_core.bench.guidellm_report GUIDELLM_JSON [--page BENCHMARKS.md]``.

guidellm (the vLLM project's load generator, ``pip install guidellm``; it is not a dependency of
dart-serve) writes every request of a run to one large JSON file.  This keeps, per benchmark
(one concurrency level): requests completed, errored and incomplete, output tokens per second
(output tokens of completed requests ÷ the benchmark's duration), and the medians of time to first
token, inter-token latency and request latency, in ``guidellm.json`` / ``guidellm.md`` under
``--out``; ``--page`` also writes the table into that page's "guidellm" block.

The run behind BENCHMARKS.md (``bench/guidellm/dart-serve.json`` is its scenario: synthetic
prompts of 128 tokens, 64 output tokens fixed with ``ignore_eos``, 8 requests per level, 1 and 4
concurrent streams), against ``serve run deployments/dart.yaml``::

    guidellm run --config bench/guidellm/dart-serve.json \\
        --tokenizer kind=huggingface_auto,model=<the model's tokenizer folder> \\
        --output kind=json,path=guidellm-out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["summarize", "markdown_table", "main", "START", "END"]

START = "<!-- guidellm:start -->"
END = "<!-- guidellm:end -->"
HEADING = "## guidellm (the vLLM project's load generator) against `serve run deployments/dart.yaml`\n\n"


def _median(metric: dict) -> float | None:
    ok = (metric or {}).get("successful") or {}
    return round(ok["median"], 1) if ok.get("count") else None


def summarize(report: dict) -> dict:
    """The compact figures of a guidellm JSON report (module docstring).

    Raises:
        KeyError: the file is not a guidellm benchmark report."""
    rows = []
    for b in report["benchmarks"]:
        strategy = b["config"]["strategy"]
        totals = b["metrics"]["request_totals"]
        out_tokens = b["metrics"]["output_token_count"]["successful"]["total_sum"]
        rows.append({"strategy": strategy["type_"], "streams": strategy.get("streams"),
                     "completed": totals["successful"], "errored": totals["errored"],
                     "incomplete": totals["incomplete"], "duration_s": round(b["duration"], 1),
                     "output_tokens_per_s": round(out_tokens / b["duration"], 2) if b["duration"] else None,
                     "ttft_ms_median": _median(b["metrics"]["time_to_first_token_ms"]),
                     "itl_ms_median": _median(b["metrics"]["inter_token_latency_ms"]),
                     "latency_s_median": _median(b["metrics"]["request_latency"])})
    backend = report["benchmarks"][0]["config"]["backend"]
    return {"guidellm": report.get("metadata", {}).get("guidellm_version"), "target": backend.get("target"),
            "model": backend.get("model"), "route": backend.get("request_format"), "rows": rows}


def markdown_table(summary: dict) -> str:
    lines = ["| concurrent streams | completed | errored | incomplete | output tokens/s | TTFT ms (median) "
             "| ITL ms (median) | request latency s (median) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['streams']} | {r['completed']} | {r['errored']} | {r['incomplete']} | "
                     f"{r['output_tokens_per_s']} | {r['ttft_ms_median']} | {r['itl_ms_median']} | "
                     f"{r['latency_s_median']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.guidellm_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="guidellm's JSON output (--output kind=json,path=...)")
    ap.add_argument("--out", default="bench/results/guidellm", help="folder for guidellm.json/.md")
    ap.add_argument("--page", default=None, help="also write the table into this page's block (BENCHMARKS.md)")
    ap.add_argument("--machine", default="", help="a line naming the machine the app ran on")
    args = ap.parse_args(argv)
    try:
        summary = summarize(json.loads(Path(args.report).read_text()))
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"error: {args.report} is not a guidellm report: {e}", file=sys.stderr)
        return 2
    summary["machine"] = args.machine
    from dart_core.bench.report import _write_page, save_table

    table = markdown_table(summary)
    save_table(args.out, "guidellm", summary, table)
    if args.page:
        text = (f"guidellm {summary['guidellm'] or ''} against {summary['target']} ({summary['route']}, model "
                f"{summary['model']}), the scenario `bench/guidellm/dart-serve.json`"
                f"{'; ' + args.machine if args.machine else ''}. Rendered by `python -m "
                f"dart_core.bench.guidellm_report`.")
        _write_page(Path(args.page), "\n".join([START, "", text, "", table, END]), START, END, heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
