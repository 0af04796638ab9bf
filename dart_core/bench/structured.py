"""Structured output with speculation, measured: ``python -m dart_core.bench.structured``.

Every schema of a JSON-schema set (default ``bench/schemas/json_schemas.jsonl``: 20 hand-written
schemas with a task prompt each) is asked for as a chat request whose user message is the task
followed by the schema, the output constrained to the schema (greedy, T = 0, up to
``--max-tokens`` tokens; ``strict`` off, so a keyword the grammar cannot enforce, such as
``uniqueItems``, is left to the model and validity shows whether it held).

In process (the default; shipped defaults of ``DartModel.from_pretrained``), three modes run one
after another per schema, ``--runs`` times:

- ``autoregressive``: constrained plain decoding (``speculative=False``);
- ``dart``: DART with grammar-aware drafting (forbidden draft nodes dropped, forced tokens
  chained);
- ``dart, trees as drafted``: DART without grammar-aware drafting (verification still masks).

Each DART mode keeps its own speculation gate and adaptive budget across passes, as a server
running only that workload would.

Reported: JSON validity (``json.loads`` then ``jsonschema``), whether each DART mode's tokens equal
the autoregressive ones on every schema, τ, output tokens/s (all schemas' tokens ÷ their wall time;
the median over runs) and its ratio to autoregressive decoding, and the grammar's cost: tree nodes
verified and token masks computed per emitted token, µs per mask, mask µs per verified node (masks
are computed only at the nodes the acceptance walk visits), and the share of decoding time spent
in masks.  A last
pass samples at T = 0.8 (seeded) and reports validity.

With ``--url`` (a running app, e.g. ``serve run deployments/dart.yaml``), the same requests go
through the OpenAI-compatible HTTP API with ``response_format`` json_schema, one at a time or
``--concurrency N`` in flight (the requests then share the engine's batch): DART against
``"speculative": false`` on the same server (alternating which goes first), the text compared,
validity checked, tokens/s per mode (a pass's tokens from ``usage`` over its wall time), and
validity at T = 0.8.

Writes ``structured.json`` (served: ``structured_served.json``, ``structured_served_cN.json`` for N
in flight) and its ``.md`` under ``--out``; ``--page BENCHMARKS.md`` also puts the tables of that
folder into the page's "Structured output" block.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

__all__ = ["load_schemas", "measure_in_process", "measure_served", "markdown_table", "main", "START", "END"]

START = "<!-- structured-output:start -->"
END = "<!-- structured-output:end -->"
HEADING = "## Structured output\n\n"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_SCHEMAS = REPO / "bench" / "schemas" / "json_schemas.jsonl"
MODES = ("autoregressive", "dart", "dart, trees as drafted")


def load_schemas(path: str | Path) -> list[dict]:
    """The schema set: one JSON object per line with ``name``, ``prompt`` and ``schema``.

    Raises:
        FileNotFoundError: no such file; ValueError: a line without those fields."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or any(not {"name", "prompt", "schema"} <= set(r) for r in rows):
        raise ValueError(f"{path}: every line needs name, prompt and schema")
    return rows


def user_message(row: dict) -> str:
    return f"{row['prompt']}\nReply with JSON that follows this schema: {json.dumps(row['schema'])}"


def valid(text: str, schema: dict) -> bool:
    """Whether ``text`` parses as JSON and validates against ``schema``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


class _Recording:
    """A compiled grammar whose sequence states are kept, so their mask counts can be read."""

    def __init__(self, grammar) -> None:
        self.grammar, self.states = grammar, []

    def start(self):
        state = self.grammar.start()
        self.states.append(state)
        return state


def measure_in_process(schemas_path: str | Path = DEFAULT_SCHEMAS, *, model: str | None = None,
                       head: str | None = None, max_tokens: int = 256, runs: int = 3, progress: bool = True,
                       device: str | None = None, dtype: str | None = None, cuda_graphs: bool = False) -> dict:
    """{"config", "hardware", "modes": {mode: {...}}, "sampled": {...}, "per_schema": [...]}
    (see the module docstring).

    Raises:
        FileNotFoundError, ValueError: as :func:`load_schemas`; GrammarError for a schema that
            does not compile."""
    import torch
    from tqdm import tqdm

    from dart_core.api import DartModel
    from dart_core.bench import bench_kernel_config
    from dart_core.bench.decoding import _weights, hardware
    from dart_core.step.grammar import GrammarSpec

    rows = load_schemas(schemas_path)
    m = DartModel.from_pretrained(model, head=head, device=device, cuda_graphs=cuda_graphs,
                                  dtype=getattr(torch, dtype) if dtype else None, kernel_config=bench_kernel_config())
    engine = m.engine
    prompts = [m.tokenizer.apply_chat_template([{"role": "user", "content": user_message(r)}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)
               ["input_ids"] for r in rows]
    grammars = [m.compile_grammar(GrammarSpec.json_schema(r["schema"], strict=False)) for r in rows]
    eos = m.tokenizer.eos_token_id
    per_schema = [{"name": r["name"], "compile_ms": round(g.compile_ms, 2)} for r, g in zip(rows, grammars)]
    runs_of = {mode: [] for mode in MODES}
    tokens_of: dict[str, list] = {}
    # each DART mode learns its own speculation gate and budget, as a server running only that
    # workload would (shared, the ablation's unprofitable drafts would switch the gate off for both)
    learned = {mode: copy.deepcopy((engine.gate, engine.budget)) for mode in MODES if mode != "autoregressive"}
    bar = tqdm(total=runs * len(MODES) * len(rows), desc="structured", disable=not progress)
    for run in range(runs):
        for mode in (MODES if run % 2 == 0 else MODES[::-1]):
            engine.grammar_drafting = mode == "dart"
            if mode in learned:
                engine.gate, engine.budget = learned[mode]
            tokens = wall = steps_tokens = steps = nodes = 0
            masks = mask_ms = 0.0
            outs = []
            for ids, g in zip(prompts, grammars):
                rec = _Recording(g)
                sp = m.sampling_params(max_new_tokens=max_tokens, grammar=rec)
                t0 = time.perf_counter()
                res = engine.generate([ids], sp, speculative=mode != "autoregressive")
                wall += time.perf_counter() - t0
                tokens += len(res.token_ids[0])
                steps_tokens += res.emitted_after_prefill
                steps += res.sequence_steps
                nodes += res.verified_nodes
                masks += sum(s.masks for s in rec.states)
                mask_ms += sum(s.mask_ms for s in rec.states)
                outs.append(res.token_ids[0])
                bar.update()
            tokens_of[mode] = outs
            runs_of[mode].append({"tokens": tokens, "seconds": wall, "tau": steps_tokens / max(steps, 1),
                                  "masks": masks, "mask_ms": mask_ms, "verified_nodes": nodes})
    bar.close()
    engine.grammar_drafting = True
    engine.gate, engine.budget = learned["dart"]
    texts = {mode: [m.tokenizer.decode([t for t in o if t != eos]) for o in outs] for mode, outs in tokens_of.items()}
    for i, row in enumerate(per_schema):
        row["valid"] = valid(texts["dart"][i], rows[i]["schema"])
        row["tokens"] = len(tokens_of["dart"][i])
        row["equal"] = all(tokens_of[mode][i] == tokens_of["autoregressive"][i] for mode in MODES)
    ar_tps = statistics.median(r["tokens"] / r["seconds"] for r in runs_of["autoregressive"])
    modes = {}
    for mode, rs in runs_of.items():
        tps = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        last = rs[-1]
        modes[mode] = {
            "tokens_per_s": round(tps, 2), "ratio": round(tps / ar_tps, 3),
            "tau": round(statistics.median(r["tau"] for r in rs), 3) if mode != "autoregressive" else 1.0,
            "valid": sum(valid(t, r["schema"]) for t, r in zip(texts[mode], rows)),
            "equal_to_autoregressive": sum(a == b for a, b in zip(tokens_of[mode], tokens_of["autoregressive"])),
            "masks_per_token": round(last["masks"] / max(last["tokens"], 1), 3),
            "mask_us": round(1e3 * last["mask_ms"] / max(last["masks"], 1), 1),
            "mask_us_per_verified_node": round(1e3 * last["mask_ms"] / max(last["verified_nodes"], 1), 1),
            "verified_nodes_per_token": round(last["verified_nodes"] / max(last["tokens"], 1), 2),
            "mask_share": round(last["mask_ms"] / (1e3 * last["seconds"]), 4),
        }
    sampled = []
    for i, (ids, g) in enumerate(zip(prompts, grammars)):
        res = engine.generate([ids], m.sampling_params(max_new_tokens=max_tokens, grammar=g, temperature=0.8,
                                                       seed=i))
        text = m.tokenizer.decode([t for t in res.token_ids[0] if t != eos])
        sampled.append({"name": rows[i]["name"], "valid": valid(text, rows[i]["schema"]),
                        "finish_reason": res.finish_reasons[0]})
    return {"config": {"schemas": str(Path(schemas_path).name), "model": model, "head": head,
                       "max_tokens": max_tokens, "runs": runs, "weights": _weights(engine.target),
                       "cuda_graphs": cuda_graphs,
                       "dtype": str(engine.target.dtype).removeprefix("torch.")},
            "hardware": hardware(engine.target.device), "schemas": len(rows), "modes": modes,
            "sampled": {"temperature": 0.8, "valid": sum(s["valid"] for s in sampled), "rows": sampled},
            "per_schema": per_schema}


def measure_served(url: str, schemas_path: str | Path = DEFAULT_SCHEMAS, *, max_tokens: int = 256, runs: int = 3,
                   api_key: str | None = None, model: str | None = None, progress: bool = True,
                   concurrency: int = 1) -> dict:
    """The same requests through a running app's HTTP API (module docstring), ``concurrency`` at a
    time: a mode's tokens/s is its tokens over the wall time of its pass over the schemas.

    Raises:
        httpx.HTTPError: the server cannot be reached; ValueError: ``concurrency`` < 1."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from tqdm import tqdm

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    rows = load_schemas(schemas_path)
    key = api_key or os.environ.get("DART_API_KEY") or "none"
    headers = {"authorization": f"Bearer {key}"}
    base = url.rstrip("/")
    limits = httpx.Limits(max_connections=concurrency + 1)
    with httpx.Client(base_url=base, headers=headers, timeout=900, limits=limits) as http, \
            ThreadPoolExecutor(concurrency) as pool:
        name = model or http.get("/models").raise_for_status().json()["data"][0]["id"]

        def ask(row: dict, speculative: bool, temperature: float = 0.0, seed: int | None = None) -> dict:
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": row["schema"], "strict": False}}
            body = {"model": name, "messages": [{"role": "user", "content": user_message(row)}],
                    "max_tokens": max_tokens, "temperature": temperature, "response_format": fmt,
                    "speculative": speculative, "seed": seed}
            r = http.post("/chat/completions", json=body)
            if r.status_code != 200:
                return {"error": f"{r.status_code}: {r.text[:200]}", "tokens": 0, "text": ""}
            out = r.json()
            return {"text": out["choices"][0]["message"]["content"], "tokens": out["usage"]["completion_tokens"],
                    "tau": out["usage"]["dart"]["tau"]}

        def one(args):
            out = ask(*args)
            bar.update()
            return out

        runs_of: dict[str, list] = {"dart": [], "no-speculation": []}  # (outputs, wall seconds) per pass
        bar = tqdm(total=2 * runs * len(rows) + len(rows), desc="structured (served)", disable=not progress)
        for run in range(runs):
            order = (True, False) if run % 2 == 0 else (False, True)
            for speculative in order:
                t0 = time.perf_counter()
                outs = list(pool.map(one, [(row, speculative) for row in rows]))
                runs_of["dart" if speculative else "no-speculation"].append((outs, time.perf_counter() - t0))
        sampled = list(pool.map(one, [(row, True, 0.8, i) for i, row in enumerate(rows)]))
        bar.close()
    modes = {}
    tps_of = {mode: statistics.median(sum(o["tokens"] for o in rs) / wall for rs, wall in passes)
              for mode, passes in runs_of.items()}
    ar_tps = tps_of["no-speculation"]
    last = {mode: passes[-1][0] for mode, passes in runs_of.items()}  # the texts compared and validated
    for mode, tps in tps_of.items():
        outs = last[mode]
        taus = [o["tau"] for o in outs if o.get("tau")]
        modes[mode] = {"tokens_per_s": round(tps, 2), "ratio": round(tps / ar_tps, 3),
                       "tau": round(statistics.median(taus), 3) if taus else None,
                       "valid": sum(valid(o["text"], r["schema"]) for o, r in zip(outs, rows)),
                       "errors": [o["error"] for o in outs if "error" in o]}
    equal = sum(a["text"] == b["text"] for a, b in zip(last["dart"], last["no-speculation"]))
    from dart_core.bench.decoding import hardware

    return {"config": {"url": url, "schemas": str(Path(schemas_path).name), "max_tokens": max_tokens,
                       "runs": runs, "model": name, "concurrency": concurrency},
            "hardware": hardware("cpu"),  # the client's machine (the server's too when it is local)
            "schemas": len(rows), "modes": modes, "equal": equal,
            "sampled": {"temperature": 0.8, "valid": sum(valid(o["text"], r["schema"]) for o, r in zip(sampled, rows)),
                        "errors": [o["error"] for o in sampled if "error" in o]}}


def markdown_table(result: dict) -> str:
    """One row per mode, and the T = 0.8 validity line."""
    n = result["schemas"]
    served = "url" in result["config"]
    if served:
        clients = result["config"].get("concurrency", 1)
        lines = [f"| mode (served, {clients} client{'s' if clients > 1 else ''}) | valid JSON | tokens/s | "
                 "÷ no speculation | τ |",
                 "|---|---:|---:|---:|---:|"]
        for mode, r in result["modes"].items():
            lines.append(f"| {mode} | {r['valid']} of {n} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}× | "
                         f"{'–' if r['tau'] is None else format(r['tau'], '.2f')} |")
        tail = [f"DART text equal to `\"speculative\": false` on {result['equal']} of {n} schemas."]
    else:
        lines = ["| mode (in process) | valid JSON | equal to autoregressive | tokens/s | ÷ autoregressive | τ "
                 "| verified nodes per token | masks per token | µs per mask | mask µs per verified node "
                 "| share of time in masks |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for mode, r in result["modes"].items():
            lines.append(f"| {mode} | {r['valid']} of {n} | {r['equal_to_autoregressive']} of {n} | "
                         f"{r['tokens_per_s']:.1f} | {r['ratio']:.2f}× | {r['tau']:.2f} | "
                         f"{r['verified_nodes_per_token']:.2f} | {r['masks_per_token']:.2f} | {r['mask_us']:.0f} | "
                         f"{r['mask_us_per_verified_node']:.0f} | {100 * r['mask_share']:.1f} % |")
        tail = []
    s = result["sampled"]
    tail.append(f"At T = {s['temperature']} (DART, seeded): {s['valid']} of {n} valid.")
    cut = [f"{r['name']} ({r['tokens']} tokens)" for r in result.get("per_schema", ()) if not r["valid"]]
    if cut:
        tail.append(f"Not valid at T = 0: {', '.join(cut)}.")
    odd = [f"{r['name']} (finish reason {r['finish_reason']})" for r in s.get("rows", ()) if not r["valid"]]
    if odd:
        tail.append(f"Not valid at T = {s['temperature']}: {', '.join(odd)}.")
    return "\n".join(lines) + "\n\n" + "\n".join(tail) + "\n"


def render_section(results: list[tuple[dict, str]]) -> str:
    """The page block (markers included): per result, the machine, the command and the table."""
    from dart_core.bench.decoding import hardware_line

    parts = [START, ""]
    for result, command in results:
        c = result["config"]
        at_once = c.get("concurrency", 1)
        where = (f"Served by the app at {c['url']} (`serve run deployments/dart.yaml`, shipped defaults), "
                 f"{'one request' if at_once == 1 else f'{at_once} requests'} at a time; client machine: {hardware_line(result['hardware']) if 'hardware' in result else '?'}"
                 if "url" in c else f"{hardware_line(result['hardware'])}; target {c['model'] or 'SmolLM2-135M-Instruct'}"
                 f" ({c.get('weights', '?')}, {c.get('dtype', '?')}), head {c['head'] or 'shipped'}")
        parts += [f"_Generated by `{command}`._", "",
                  f"{where}. {c['schemas']}, {result['schemas']} schemas, greedy, up to {c['max_tokens']} tokens, "
                  f"tokens/s the median of {c['runs']} runs.", "", markdown_table(result)]
    return "\n".join(parts + [END])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", default=str(DEFAULT_SCHEMAS), help="JSONL: name, prompt, schema")
    ap.add_argument("--model", default=None, help="model folder or .gguf [embedded default]")
    ap.add_argument("--head", default=None, help="draft-head folder, or random [the shipped head]")
    ap.add_argument("--url", default=None, help="a running app's /v1 URL: measure through its HTTP API instead")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3, help="timed passes per mode (the median is reported)")
    ap.add_argument("--device", default=None, help="in process: the target's device [cuda if available, else cpu]")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="in process: the target's dtype [bfloat16 on CUDA, float32 on the CPU]")
    ap.add_argument("--cuda-graphs", action="store_true", help="in process, CUDA only: graph-captured verification")
    ap.add_argument("--concurrency", type=int, default=1, help="with --url: requests in flight at once")
    ap.add_argument("--out", default="bench/results/structured",
                    help="folder for structured[_served[_cN]].json/.md (N: the concurrency, when above 1)")
    ap.add_argument("--page", default=None, help="also write the tables into this page's block (BENCHMARKS.md)")
    args = ap.parse_args(argv)
    from dart_core.bench.report import _reused, _write_page, save_table

    try:
        if args.url:
            result = measure_served(args.url, args.schemas, max_tokens=args.max_tokens, runs=args.runs,
                                    concurrency=args.concurrency)
        else:
            result = measure_in_process(args.schemas, model=args.model, head=args.head, max_tokens=args.max_tokens,
                                        runs=args.runs, device=args.device, dtype=args.dtype,
                                        cuda_graphs=args.cuda_graphs)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python -m dart_core.bench.structured " + " ".join(argv if argv is not None else sys.argv[1:])
    result["command"] = command.strip()
    name = "structured" if not args.url else \
        "structured_served" if args.concurrency == 1 else f"structured_served_c{args.concurrency}"
    save_table(args.out, name, result, markdown_table(result))
    if args.page:
        results = []
        out = Path(args.out)  # every table of the folder, whichever this run made
        paths = [out / "structured.json", out / "structured_served.json",
                 *sorted(out.glob("structured_served_c*.json"), key=lambda p: int(p.stem.rsplit("_c", 1)[1]))]
        for path in paths:
            if path.exists():
                r = _reused(path, "--page")
                if r is not None:
                    results.append((r, r.get("command", "")))
        _write_page(Path(args.page), render_section(results), START, END, heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
