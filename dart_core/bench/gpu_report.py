"""The GPU study's tables (bench/results/gpu/README.md), from a folder of results taken on a GPU machine:
``python -m dart_core.bench.gpu_report bench/results/gpu-h100``.

A borrowed GPU machine runs the benchmark tools one by one and sends their
JSON back; this renders them into the page's GPU block (between
:data:`START` and :data:`END`; text outside the markers is kept), so the
section holds exactly what the files say.  Files read from the folder, each
optional except one decoding run:

- ``pytest-gpu.log``: the output of ``pytest -m gpu`` there;
- ``decoding-<label>.json``: :mod:`dart_core.bench.decoding` runs (batch 1);
- ``step_profile-<label>.json``: :mod:`dart_core.bench.step_profile` runs (the floor);
- ``batching-<label>.json``: :mod:`dart_core.bench.batching` sweeps;
- ``serving-<label>.json``: :mod:`dart_core.bench.serving` sweeps over HTTP against ``serve run
  deployments/dart.yaml`` on that machine (``scripts/gpu_session/serve.sh``; the label says how the
  config differed from the shipped one, ``commands.md`` says it in full);
- ``structured-<label>.json``: :mod:`dart_core.bench.structured` in process (constrained
  decoding: validity, equality with constrained autoregressive decoding, τ, tokens/s);
- ``sdpa_probe.json``: ``scripts/gpu_session/sdpa_probe.py`` (milliseconds of one masked
  attention call per SDPA backend, at a new shape every call and at a fixed one);

(``<label>`` names the run, e.g. ``bf16`` or ``bf16-graphs``; a run made with
``--cuda-graphs`` says so in its heading.  Repeats of one configuration are labelled
``<label>-run1``, ``<label>-run2``, ...: each is shown, and a table gives the median
over them of every method's tokens/s and speed-up.)
- ``commands.md``: the commands that made them (quoted as is).
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

__all__ = ["render_gpu_section", "write_gpu_section", "main", "START", "END"]

START = "<!-- gpu-results:start -->"
END = "<!-- gpu-results:end -->"


def _load(folder: Path, prefix: str) -> list[tuple[str, dict]]:
    return [(p.stem.split("-", 1)[1], json.loads(p.read_text())) for p in sorted(folder.glob(f"{prefix}-*.json"))]


def _label(name: str, result: dict) -> str:
    """A result's heading: its file label, and whether verification ran as CUDA graphs."""
    return f"{name}, CUDA graphs" if result.get("config", {}).get("cuda_graphs") else name


def _run_group(label: str) -> str:
    """``bf16-graphs-run2`` -> ``bf16-graphs``; a label without a run suffix is its own group."""
    return re.sub(r"-run\d+$", "", label)


def median_table(runs: list[tuple[str, dict]]) -> str:
    """Median over repeated decoding runs (labels ``<group>-runN``): per group, dataset and method,
    the median tokens/s, speed-up over the same run's autoregressive decoding, and τ."""
    groups: dict[str, list[dict]] = {}
    for label, d in runs:
        groups.setdefault(_run_group(label), []).append(d)
    lines = ["| run | dataset | method | runs | tokens/s (median) | speed-up (median) | speed-ups | τ (median) |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    for group, ds in groups.items():
        if len(ds) < 2:
            continue
        keys = list(dict.fromkeys((r["dataset"], r["method"]) for d in ds for r in d["rows"]))
        for dataset, method in keys:
            rows = [r for d in ds for r in d["rows"] if (r["dataset"], r["method"]) == (dataset, method)]
            ups = [r["speedup"] for r in rows]
            taus = [r["tau"] for r in rows if r.get("tau") is not None]
            lines.append(f"| {group} | {dataset} | {method} | {len(rows)} | "
                         f"{statistics.median(r['tokens_per_s'] for r in rows):.1f} | {statistics.median(ups):.2f}× | "
                         f"{', '.join(f'{u:.2f}' for u in ups)} | "
                         f"{f'{statistics.median(taus):.2f}' if taus else '–'} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def probe_table(probe: dict) -> str:
    """``sdpa_probe.json`` as a table: ms per masked attention call by shape and SDPA backend."""
    lines = [f"{probe['device']}, torch {probe['torch']}, cuDNN {probe['cudnn']}; bf16, additive mask, "
             "median of 40 calls.", "",
             "| shape | backend | ms per call, a new key length each call | ms per call, one key length |",
             "|---|---|---:|---:|"]
    for r in probe["results"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['backend']} | refused: {r['error']} | |")
        else:
            lines.append(f"| {r['shape']} | {r['backend']} | {r['new_shape_ms']:.3f} | {r['same_shape_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def section_start(folder: Path, page: str | Path, module: str, start: str) -> tuple[list, str, list[str]]:
    """What a section rendered from a results folder begins with: the folder's decoding runs
    [(label, result)], the folder's path relative to the page, and the block's first lines.

    Raises:
        FileNotFoundError: ``folder`` holds no ``decoding-*.json``."""
    dec = _load(folder, "decoding")
    if not dec:
        raise FileNotFoundError(f"no decoding-*.json in {folder}: nothing to report")
    rel = os.path.relpath(folder, Path(page).parent)
    return dec, rel, [start, "", f"_Rendered by `python -m {module} {rel}` from the files in `{rel}/`._", ""]


def render_gpu_section(folder: str | Path, page: str | Path) -> str:
    """The block between the markers for ``page``, from the files in ``folder``.

    Raises:
        FileNotFoundError: ``folder`` holds no ``decoding-*.json``.
    """
    from dart_core.bench import batching, decoding, serving, step_profile, structured

    folder = Path(folder)
    dec, rel, lines = section_start(folder, page, "dart_core.bench.gpu_report", START)
    hw = dec[0][1]["hardware"]
    lines += [f"**GPU**: {hw.get('gpu', '?')}. **Host**: {decoding.hardware_line(hw)}.", ""]
    log = folder / "pytest-gpu.log"
    if log.is_file():
        lines += ["### Correctness", "", "`pytest -m gpu` there (greedy DART equals autoregressive decoding on a "
                  "tiny random target, fp32 on CUDA):", "", "```", log.read_text().strip(), "```", "",
                  "On SmolLM2 the `lossless` column of each decoding table below compares every method's tokens "
                  "with the engine's autoregressive ones (`hf-generate` is transformers' own `generate`).", ""]
    probe = folder / "sdpa_probe.json"
    if probe.is_file():
        lines += ["### Attention backend", "",
                  "One masked attention call per SDPA backend (`scripts/gpu_session/sdpa_probe.py`): `default` is "
                  "PyTorch's own choice, `auto` the engine's (`dart_core.model.attention`).", "",
                  probe_table(json.loads(probe.read_text())), ""]
    lines += ["### Decoding (batch 1)", ""]
    medians = median_table(dec)
    if medians:
        lines += ["Median over repeated runs of one configuration (each run's speed-up is against the "
                  "autoregressive decoding of the same run):", "", medians, ""]
    for dtype, d in dec:
        c = d["config"]
        lines += [f"**{_label(dtype, d)}**: {', '.join(c['datasets'])}, "
                  f"first {c['num_prompts']} prompts, {c['max_new_tokens']} new tokens, {c['repeats']} timed "
                  f"pass(es), budget `{c['budget']}`, {d['seconds']:.0f} s.", "", decoding.markdown_table(d), ""]
    prof = _load(folder, "step_profile")
    if prof:
        lines += ["### One step against the physical limit", "",
                  "Floor = the target's weights ÷ the measured copy bandwidth (one read of every weight per "
                  "step); kernel ms = device time of the step's kernels (torch.profiler); host share = the part of "
                  "the step during which no kernel runs.", ""]
        for dtype, p in prof:
            c = p["config"]
            batch = f", stepped {c['batch_size']} at a time" if c.get("batch_size", 1) > 1 else ""
            budget = f", a fixed budget of {c['budget']} draft nodes" if c.get("budget", "auto") != "auto" else ""
            lines += [f"**{_label(dtype, p)}** ({c['num_prompts']} MT-Bench prompt(s){batch}, {c['max_new_tokens']} "
                      f"new tokens{budget}):", "",
                      step_profile.markdown_table(p), ""]
    for dtype, b in _load(folder, "batching"):
        b = {**b, "server": b.get("server") or {"model": "SmolLM2-135M-Instruct", "url": "in process"}}
        c = b.get("config", {})
        lines += [f"### Continuous batching ({_label(dtype, b)}, `python -m dart_core.bench.batching`)", "",
                  f"Speculation allowed up to {c.get('max_speculative_batch')} running sequences, the speculation "
                  f"gate {'on' if c.get('gate', True) else 'off'}.", "", serving.markdown_table(b), ""]
        if any("steps" in r for r in b["rows"]):
            lines += [batching.step_table(b), ""]
    for label, r in _load(folder, "structured"):
        c = r["config"]
        lines += [f"### Structured output ({_label(label, r)}, `python -m dart_core.bench.structured`)", "",
                  f"{r['schemas']} JSON schemas of `bench/schemas/{c['schemas']}`, greedy, at most {c['max_tokens']} "
                  f"tokens, {c['runs']} timed pass(es) per mode, one request at a time.", "",
                  structured.markdown_table(r), ""]
    served = _load(folder, "serving")
    if served:
        lines += ["### Ray Serve on the GPU machine (`serve run deployments/dart.yaml`)", "",
                  "The main job where the design puts it: the engine replica on the GPU, the n-gram service "
                  "replica beside it (the tree search over gRPC), HTTP clients of `python -m "
                  "dart_core.bench.serving` (DART and `\"speculative\": false` on the same server).", ""]
        for label, r in served:
            lines += [f"**{label}** ({r['seconds']:.0f} s):", "", serving.markdown_table(r), ""]
    cmds = folder / "commands.md"
    if cmds.is_file():
        lines += ["### Commands", "", cmds.read_text().strip(), ""]
    files = sorted(p.name for p in folder.iterdir() if p.suffix in (".json", ".log"))
    lines += ["Raw results: " + ", ".join(f"`{rel}/{f}`" for f in files) + ".", "", END]
    return "\n".join(lines)


def write_gpu_section(folder: str | Path, page: str | Path) -> Path:
    """Replaces the block between the markers in ``page`` (appends it under ``## GPU`` when absent)."""
    from dart_core.bench.report import _write_page

    page = Path(page)
    _write_page(page, render_gpu_section(folder, page), START, END, heading="## GPU\n\n")
    return page


def main(argv=None) -> int:
    from dart_core.bench.report import section_main

    return section_main(argv, "python -m dart_core.bench.gpu_report", __doc__.split("\n\n")[0], write_gpu_section,
                        "bench/results/gpu/README.md")


if __name__ == "__main__":
    raise SystemExit(main())
