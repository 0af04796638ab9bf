"""The "GGUF-native target" study's tables (bench/results/gguf_native/README.md), from a folder of CPU runs:
``python -m dart_core.bench.cpu_report bench/results/gguf_native``.

The folder holds ``decoding-<label>.json`` files of the decoding benchmark
(:mod:`dart_core.bench.decoding`: the 4-bit target's autoregressive decoding
and DART, the same model's float32 weights, llama.cpp on the same GGUF),
optionally ``serving-<label>.json`` files of the serving benchmark against
``serve run deployments/dart.yaml``, ``verify_curve.json`` (verification
cost against query tokens, :mod:`dart_core.bench.verify_curve`) and
``commands.md``, the commands that made them. The block between :data:`START` and :data:`END` is replaced (text
outside the markers is kept; appended under its heading when absent).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["render_cpu_section", "write_cpu_section", "main", "START", "END"]

START = "<!-- gguf-native-results:start -->"
END = "<!-- gguf-native-results:end -->"
HEADING = "## GGUF-native target (CPU)\n\n"


def ratio_table(result: dict, baseline: str = "llama-cpp") -> str:
    """Per dataset, each method's median tokens/s over the passes ÷ ``baseline``'s in the same pass
    (the acceptance figures of the 4-bit target: autoregressive and DART against llama.cpp)."""
    import statistics

    from dart_core.bench.decoding import pass_ratios

    rows = result["rows"]
    by = {(r["dataset"], r["method"]): r for r in rows}
    lines = [f"| dataset | method | tokens/s (median) | ÷ {baseline} (median of per-pass ratios) |",
             "|---|---|---:|---:|"]
    for r in rows:
        base = by.get((r["dataset"], baseline))
        if base is None or r["method"] == baseline:
            continue
        ratios = pass_ratios(result, r["dataset"], r["method"], baseline)
        lines.append(f"| {r['dataset']} ({r['prompts']}) | {r['method']} | {r['tokens_per_s']:.1f} | "
                     f"{statistics.median(ratios):.2f}× |")
    return "\n".join(lines) + "\n"


def render_cpu_section(folder: str | Path, page: str | Path) -> str:
    """The block between the markers for ``page``, from the files in ``folder``.

    Raises:
        FileNotFoundError: ``folder`` holds no ``decoding-*.json``.
    """
    from dart_core.bench import decoding, serving
    from dart_core.bench.gpu_report import _load, section_start

    folder = Path(folder)
    dec, rel, lines = section_start(folder, page, "dart_core.bench.cpu_report", START)
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
    curve = folder / "verify_curve.json"
    if curve.is_file():
        from dart_core.bench import verify_curve

        c = json.loads(curve.read_text())
        lines += ["### Verification cost against query tokens", "",
                  f"**CPU**: {decoding.hardware_line(c['hardware'])}. One target forward of n query tokens after a "
                  "256-token prefix, batch 1, median of "
                  f"{c['config']['repeats']} passes (`python -m dart_core.bench.verify_curve`): the curve the "
                  "adaptive budget measures at start-up and prices trees with.", "",
                  verify_curve.markdown_table(c), ""]
    for label, r in _load(folder, "serving"):
        lines += [f"### Serving, {label} (`serve run deployments/dart.yaml`)", "",
                  f"{r['seconds']:.0f} s. The serving client records no hardware (the server may run "
                  "elsewhere): the server's machine and command are under Commands.", "",
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
    from dart_core.bench.report import section_main

    return section_main(argv, "python -m dart_core.bench.cpu_report", __doc__.split("\n\n")[0], write_cpu_section,
                        "bench/results/gguf_native/README.md")


if __name__ == "__main__":
    raise SystemExit(main())
