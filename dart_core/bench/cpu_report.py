"""The "GGUF-native target" section of BENCHMARKS.md, from a results folder of CPU runs:
``python -m dart_core.bench.cpu_report bench/results/gguf_native``.

The folder holds ``decoding-<label>.json`` files of the decoding benchmark
(:mod:`dart_core.bench.decoding`: the 4-bit target's autoregressive decoding
and DART, the same model's float32 weights, llama.cpp on the same GGUF),
optionally ``serving-<label>.json`` files of the serving benchmark against
``serve run deployments/dart.yaml``, and ``commands.md``, the commands that
made them. The block between :data:`START` and :data:`END` is replaced (text
outside the markers is kept; appended under its heading when absent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["render_cpu_section", "write_cpu_section", "main", "START", "END"]

START = "<!-- gguf-native-results:start -->"
END = "<!-- gguf-native-results:end -->"
HEADING = "## GGUF-native target (CPU)\n\n"


def _load(folder: Path, prefix: str) -> list[tuple[str, dict]]:
    return [(p.stem.split("-", 1)[1], json.loads(p.read_text())) for p in sorted(folder.glob(f"{prefix}-*.json"))]


def ratio_table(result: dict, baseline: str = "llama-cpp") -> str:
    """Per dataset, each method's median tokens/s over the passes ÷ ``baseline``'s in the same pass
    (the acceptance figures of the 4-bit target: autoregressive and DART against llama.cpp)."""
    import statistics

    rows = result["rows"]
    by = {(r["dataset"], r["method"]): r for r in rows}
    lines = [f"| dataset | method | tokens/s (median) | ÷ {baseline} (median of per-pass ratios) |",
             "|---|---|---:|---:|"]
    for r in rows:
        base = by.get((r["dataset"], baseline))
        if base is None or r["method"] == baseline:
            continue
        # per pass: tokens/s = speedup × the pass's autoregressive tokens/s, so the ratio of two methods
        # in one pass is the ratio of their speed-ups in that pass
        ratios = [a / b for a, b in zip(r["speedup_per_pass"], base["speedup_per_pass"])]
        lines.append(f"| {r['dataset']} ({r['prompts']}) | {r['method']} | {r['tokens_per_s']:.1f} | "
                     f"{statistics.median(ratios):.2f}× |")
    return "\n".join(lines) + "\n"


def render_cpu_section(folder: str | Path, page: str | Path) -> str:
    """The block between the markers for ``page``, from the files in ``folder``.

    Raises:
        FileNotFoundError: ``folder`` holds no ``decoding-*.json``.
    """
    from dart_core.bench import decoding, serving

    folder, page = Path(folder), Path(page)
    dec = _load(folder, "decoding")
    if not dec:
        raise FileNotFoundError(f"no decoding-*.json in {folder}: nothing to report")
    rel = os.path.relpath(folder, page.parent)
    lines = [START, "", f"_Rendered by `python -m dart_core.bench.cpu_report {rel}` from the files in `{rel}/`._", ""]
    for label, d in dec:
        c = d["config"]
        lines += [f"### Decoding, {label} (batch 1)", "",
                  f"**CPU**: {decoding.hardware_line(d['hardware'])}. **Target**: {d.get('weights', 'dense')}. "
                  f"{', '.join(c['datasets'])}, first {c['num_prompts']} prompts, {c['max_new_tokens']} new tokens, "
                  f"{c['repeats']} timed passes, budget `{c['budget']}`, {d['seconds']:.0f} s.", "",
                  decoding.markdown_table(d), ""]
        if any(r["method"] == "llama-cpp" for r in d["rows"]):
            lines += ["Against llama.cpp's plain decoding of the same GGUF in the same passes:", "",
                      ratio_table(d), ""]
    for label, r in _load(folder, "serving"):
        lines += [f"### Serving, {label} (`serve run deployments/dart.yaml`)", "",
                  f"**CPU**: {decoding.hardware_line(r['hardware'])} ({r['seconds']:.0f} s).", "",
                  serving.markdown_table(r), ""]
    cmds = folder / "commands.md"
    if cmds.is_file():
        lines += ["### Commands", "", cmds.read_text().strip(), ""]
    files = sorted(p.name for p in folder.iterdir() if p.suffix == ".json")
    lines += ["Raw results: " + ", ".join(f"`{rel}/{f}`" for f in files) + ".", "", END]
    return "\n".join(lines)


def write_cpu_section(folder: str | Path, page: str | Path) -> Path:
    """Replaces the block between the markers in ``page`` (appended under its heading when absent)."""
    from dart_core.bench.report import _write_page

    page = Path(page)
    _write_page(page, render_cpu_section(folder, page), START, END, heading=HEADING)
    return page


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.cpu_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="results folder (decoding-*.json, serving-*.json, commands.md)")
    ap.add_argument("--page", default="BENCHMARKS.md")
    args = ap.parse_args(argv)
    try:
        print(write_cpu_section(args.folder, args.page))
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
