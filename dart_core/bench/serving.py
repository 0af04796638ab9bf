"""Serving benchmark: a concurrency sweep against a running dart-serve app over
HTTP with the official ``openai`` client (``python -m dart_core.bench.serving``).

For each concurrency level C (default 1, 4, 16, 64) and each mode — ``dart``
and ``no-speculation`` (the same server, requests sent with the dart-serve
extension ``"speculative": false``, so both modes run in one run on one
deployment), and with ``--modes dart eagle3 no-speculation`` ``eagle3`` (requests
naming ``"method": "eagle3"``, on a deployment that loads an EAGLE-3 head beside
the DART head: ``eagle3_head``) — C client threads each send ``requests_per_client`` streaming
chat completions back to back (MT-Bench first turns, T = 0).  The modes
alternate their order (as given, then reversed) from level to level.  ``--repeats N`` runs each
level N times, still alternating (:func:`run_sweep`), and reports each
(level, mode)'s median pass, with every pass's tokens/s.

Reported per (level, mode): output tokens/s (completion tokens of all
requests ÷ wall time of the level), requests/s, errors, time to first token
(TTFT, request sent → first content chunk) p50/p99, inter-token latency (ITL,
per request: (last chunk − first chunk) ÷ (completion tokens − 1), the
definition of vLLM's TPOT) p50/p99, and the server's mean τ.

Every request carries the dart-serve extension ``"learn": false`` unless ``--learn``: the passes
repeat the same prompts, and a server that learns from its traffic (the live corpus, on by
default, and the prefix cache) would draft a repeat from the earlier answer and skip its prefill,
which measures memory, not speculation on new requests (``python -m dart_core.bench.traffic``
measures that on purpose).

``--in-process`` also loads the engine in the benchmark's own process
(``DartModel.from_pretrained``, the embedded default unless
``--in-process-model``) and, right after each 1-client pass, decodes the same
requests through it one at a time in the same mode (streamed and
detokenised, as the server does): the table then gives served ÷ in-process
tokens/s per mode, what the serving path (HTTP, Ray Serve's handles, the
replica's batcher, the n-gram service's gRPC hop, processes sharing the
cores) costs against the engine alone (modes ``dart`` and ``no-speculation``; not ``eagle3``).

With ``--repeats N`` (N > 1) the table also gives each level's **paired** ratio: the median over
the N repeats of DART's pass ÷ the no-speculation pass that ran next to it (the two run back to
back, so a drift of the machine between repeats cancels), beside the ratio of the two medians.

``--engine-app NAME`` reads the engine's step counters (``DartEngine.stats`` of the Serve
application NAME, on the Ray cluster of this machine: :func:`dart_core.bench.traffic.engine_stats`)
after every pass, so each (level, mode) also reports how many of its decoding steps speculated
(over all its passes).  Where the gate kept every DART step autoregressive, both modes ran the
same steps, and their ratio is the machine's spread, not speculation's cost.  The counters are
the whole replica's: they are exact only while the benchmark is its sole client.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

__all__ = ["ServingConfig", "MODES", "SERVING_MODES", "run_serving", "run_sweep", "markdown_table", "plot_serving",
           "save"]

MODES = ("dart", "no-speculation")  # the default modes, and the batching benchmark's
# every mode of the serving sweep: "eagle3" sends "method": "eagle3" to a deployment that loads an EAGLE-3 head
SERVING_MODES = ("dart", "eagle3", "no-speculation")
# the engine's decoding steps by kind, as --engine-app counts them per pass (DartEngine.stats)
_STEP_KINDS = ("speculative", "autoregressive")


@dataclass
class ServingConfig:
    url: str = "http://localhost:8000/v1"
    model: str | None = None  # None: the first of /v1/models
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    requests_per_client: int = 2
    max_tokens: int = 128
    modes: list[str] = field(default_factory=lambda: list(MODES))
    dataset: str = "mt-bench"
    api_key: str | None = None  # default: $DART_API_KEY, else a placeholder
    timeout_s: float = 900.0
    repeats: int = 1  # passes per level; each (level, mode) reports its median pass (run_sweep)
    # after each 1-client pass, the same requests through DartModel.from_pretrained(in_process_model) in
    # this process, one at a time (streamed, detokenised): the served path against the engine alone
    in_process: bool = False
    in_process_model: str | None = None  # None: the embedded default model, which deployments/dart.yaml serves
    # the dart-serve extension "learn" of every request: False (the default) keeps the requests out of the
    # live corpus and the prefix cache, so the passes, which repeat the same prompts, stay first-seen traffic
    learn: bool = False
    # a Serve application on this machine's Ray cluster whose engine's step counters are read after every
    # pass (DartEngine.stats): each (level, mode) then reports its speculative and autoregressive steps
    engine_app: str | None = None


def run_sweep(levels: list[int], modes: list[str], repeats: int, run_level, bar) -> list[dict]:
    """Every level ``repeats`` times in each mode; returns one row per (level, mode).

    Within a level the passes run back to back and alternate which mode goes first (from one
    level to the next as well), so a drift of the machine weighs on both modes alike. A (level,
    mode) row is its pass with the median tokens/s (the lower middle one for an even count), with
    every pass's tokens/s in ``tokens_per_s_runs``, in the order run, and, where every pass
    counted the engine's decoding steps (``engine_steps``: ``{"speculative": n, "autoregressive":
    n}``), their sums over the passes in ``engine_steps_all``.

    Args:
        run_level: ``(concurrency, mode) -> row`` (:func:`level_row`'s dict); ``bar``: a tqdm bar
            advanced once per pass.

    Raises:
        ValueError: ``repeats`` below 1.
    """
    if repeats < 1:
        raise ValueError("repeats must be ≥ 1")
    rows, k = [], 0
    for c in levels:
        passes: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode in (modes if k % 2 == 0 else list(reversed(modes))):
                passes[mode].append(run_level(c, mode))
                bar.update()
            k += 1
        for mode, runs in passes.items():
            median = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
            row = {**median, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}
            if all(r.get("engine_steps") for r in runs):
                row["engine_steps_all"] = {k: sum(r["engine_steps"][k] for r in runs) for k in _STEP_KINDS}
            rows.append(row)
    rows.sort(key=lambda r: (r["concurrency"], SERVING_MODES.index(r["mode"])))
    return rows


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of ``xs``, rounded to 0.01; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def new_record() -> dict:
    """What the client threads of one level collect (see :func:`level_row`)."""
    return {"tokens": 0, "requests": 0, "errors": [], "ttft": [], "itl": [], "tau": []}


def add_request(rec: dict, t0: float, first: float | None, last: float | None, tokens: int,
                tau: float | None) -> None:
    """Adds one finished request to a level's record (the caller holds the level's lock): sent at
    ``t0``, first and last content at ``first`` / ``last`` (perf_counter seconds)."""
    rec["requests"] += 1
    rec["tokens"] += tokens
    if first is not None:
        rec["ttft"].append(1e3 * (first - t0))
        if tokens > 1 and last > first:
            rec["itl"].append(1e3 * (last - first) / (tokens - 1))
    if tau is not None:
        rec["tau"].append(tau)


def level_row(concurrency: int, speculative: bool, wall_s: float, rec: dict, mode: str | None = None) -> dict:
    """One row of the results: a level's record summarised (tokens/s, TTFT, ITL, τ); ``mode``: its
    name (default ``"dart"`` or ``"no-speculation"`` by ``speculative``)."""
    return {"concurrency": concurrency, "mode": mode or ("dart" if speculative else "no-speculation"),
            "seconds": round(wall_s, 2), "requests": rec["requests"], "errors": len(rec["errors"]),
            "error_samples": rec["errors"][:3], "completion_tokens": rec["tokens"],
            "tokens_per_s": round(rec["tokens"] / wall_s, 2), "requests_per_s": round(rec["requests"] / wall_s, 3),
            "ttft_ms": {"p50": percentile(rec["ttft"], 0.5), "p99": percentile(rec["ttft"], 0.99)},
            "itl_ms": {"p50": percentile(rec["itl"], 0.5), "p99": percentile(rec["itl"], 0.99)},
            "tau_mean": round(statistics.mean(rec["tau"]), 3) if rec["tau"] else None}


def run_clients(concurrency: int, worker) -> float:
    """Runs ``worker(client_id)`` on ``concurrency`` threads at once; returns the wall seconds."""
    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def _level(client, model: str, prompts: list[str], concurrency: int, mode: str, cfg: ServingConfig) -> dict:
    lock = threading.Lock()
    rec = new_record()
    # "dart" leaves the drafter to the deployment (its method); "eagle3" names it
    extra = {"speculative": mode != "no-speculation", "learn": cfg.learn} | (
        {"method": "eagle3"} if mode == "eagle3" else {})

    def worker(cid: int) -> None:
        for k in range(cfg.requests_per_client):
            prompt = prompts[(cid + k * concurrency) % len(prompts)]
            t0 = time.perf_counter()
            first = last = None
            usage = None
            try:
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=cfg.max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body=extra)
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        last = time.perf_counter()
                        first = first or last
                    if chunk.usage is not None:
                        usage = chunk.usage
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    rec["errors"].append(repr(e)[:200])
                continue
            dart = ((usage.model_extra or {}).get("dart") or {}) if usage is not None else {}
            with lock:
                add_request(rec, t0, first, last, usage.completion_tokens if usage is not None else 0,
                            dart.get("tau"))

    return level_row(concurrency, mode != "no-speculation", run_clients(concurrency, worker), rec, mode=mode)


def in_process_pass(model, prompts: list[str], cfg: ServingConfig, speculative: bool) -> float:
    """The 1-client level's requests (``prompts[k]``, k < ``requests_per_client``) decoded one at a
    time by ``model`` (a :class:`~dart_core.api.DartModel`) in this process, each streamed and
    detokenised as the server does, T = 0; returns output tokens/s (tokens ÷ wall seconds of the
    pass, chat templating included)."""
    tokens, t0 = 0, time.perf_counter()
    for k in range(cfg.requests_per_client):
        messages = [{"role": "user", "content": prompts[k % len(prompts)]}]
        for chunk in model.generate(messages, max_new_tokens=cfg.max_tokens, stream=True, speculative=speculative):
            tokens += len(chunk.token_ids)
    return round(tokens / (time.perf_counter() - t0), 2)


def _step_counters(app_name: str) -> dict | None:
    """The engine's decoding steps so far, ``{"speculative": n, "autoregressive": n}``, of the Serve
    application ``app_name`` (:func:`dart_core.bench.traffic.engine_stats`); None where they cannot
    be read (logged there)."""
    from dart_core.bench.traffic import engine_stats

    st = engine_stats(app_name)
    if not st or "speculative_steps" not in st:
        return None
    return {"speculative": st["speculative_steps"], "autoregressive": st["autoregressive_steps"]}


def run_serving(cfg: ServingConfig, *, progress: bool = True) -> dict:
    """Runs the sweep against ``cfg.url``; returns ``{"config", "server", "rows", "seconds"}``.

    Raises:
        ValueError: an unknown mode or a concurrency below 1; mode ``eagle3`` against a server that
            loads no EAGLE-3 head (its ``/v1/models`` entry's ``"methods"``).
        ConnectionError: no server answers ``/v1/models`` at ``cfg.url``, or it
            answers with an error (e.g. 404 while Serve is still deploying the app).
        RuntimeError: ``cfg.engine_app`` is set and that application's engine counters cannot be
            read before the first pass (no Ray cluster on this machine, another application name).
    """
    from openai import APIConnectionError, APIStatusError, OpenAI
    from tqdm import tqdm

    from dart_core.bench.datasets import load_prompts

    if set(cfg.modes) - set(SERVING_MODES) or not cfg.modes:
        raise ValueError(f"modes must be among {', '.join(SERVING_MODES)}")
    if min(cfg.concurrency) < 1:
        raise ValueError("concurrency levels must be ≥ 1")
    if cfg.repeats < 1:
        raise ValueError("repeats must be ≥ 1")
    started = time.perf_counter()
    key = cfg.api_key or os.environ.get("DART_API_KEY") or "unused"
    client = OpenAI(base_url=cfg.url, api_key=key, max_retries=0, timeout=cfg.timeout_s)
    try:
        listed = client.models.list().data[0]
        model = cfg.model or listed.id
    except APIConnectionError:
        raise ConnectionError(f"no dart-serve app answers at {cfg.url} (start one: serve run "
                              f"deployments/dart.yaml)") from None
    except APIStatusError as e:
        raise ConnectionError(f"{cfg.url}/models answered HTTP {e.status_code}: not a ready dart-serve app "
                              "(still deploying? wait for GET /health to answer ok)") from None
    methods = (listed.model_extra or {}).get("methods") or []
    if "eagle3" in cfg.modes and "eagle3" not in methods:
        raise ValueError(f"mode eagle3 needs a server that loads an EAGLE-3 head (eagle3_head in the app's args); "
                         f"{cfg.url} lists the methods: {', '.join(methods) or 'none given'}")
    last_counters = _step_counters(cfg.engine_app) if cfg.engine_app else None
    if cfg.engine_app and last_counters is None:  # asked for: fail now, not after a sweep without them
        raise RuntimeError(f"cannot read the step counters of the engine of Serve application {cfg.engine_app!r} "
                           "(--engine-app): run the benchmark on a node of the application's Ray cluster, and name "
                           "the application as its Serve config does (deployments/dart.yaml: dart)")
    prompts = load_prompts(cfg.dataset)
    local = None
    if cfg.in_process and 1 in cfg.concurrency:
        from dart_core.api import DartModel
        from dart_core.bench import bench_kernel_config

        local = DartModel.from_pretrained(cfg.in_process_model, kernel_config=bench_kernel_config())
        in_process_pass(local, prompts[:1], replace(cfg, requests_per_client=1, max_tokens=8), True)  # warm-up

    def run_level(c: int, mode: str) -> dict:
        nonlocal last_counters
        row = _level(client, model, prompts, c, mode, cfg)
        if cfg.engine_app:  # read before the in-process pass: that one runs no step of the replica's
            before, last_counters = last_counters, _step_counters(cfg.engine_app)
            row["engine_steps"] = None if before is None or last_counters is None else {
                k: last_counters[k] - before[k] for k in _STEP_KINDS}
        if local is not None and c == 1 and mode != "eagle3":  # right after the served pass: the same drift
            row["in_process_tokens_per_s"] = in_process_pass(local, prompts, cfg, mode == "dart")
        return row

    bar = tqdm(total=len(cfg.concurrency) * len(cfg.modes) * cfg.repeats, desc="serving benchmark", unit="level",
               disable=not progress)
    rows = run_sweep(cfg.concurrency, list(cfg.modes), cfg.repeats, run_level, bar)
    bar.close()
    return {"config": asdict(cfg) | {"api_key": None}, "server": {"url": cfg.url, "model": model},
            "rows": rows, "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"{result['server']['model']} at {result['server']['url']}: streaming chat, T = 0, "
             f"{cfg['max_tokens']} max tokens, {cfg['requests_per_client']} requests per client"
             + ("" if cfg.get("learn", True) else ', every request with "learn": false (nothing kept in the live '
                'corpus or the prefix cache)'),
             ""]
    base = {r["concurrency"]: r["tokens_per_s"] for r in result["rows"] if r["mode"] == "no-speculation"}
    base_runs = {r["concurrency"]: r.get("tokens_per_s_runs") for r in result["rows"] if r["mode"] == "no-speculation"}
    paired = cfg.get("repeats", 1) > 1
    steps = any(r.get("engine_steps_all") for r in result["rows"])
    if paired:
        lines[0] += (f"; the median of {cfg['repeats']} passes per level (tokens/s of each pass below); paired: the "
                     "median of each repeat's ratio to the no-speculation pass run next to it")
    if steps:
        lines[0] += ("; speculative steps: the engine's decoding steps that speculated, of all its steps in the "
                     "level's passes of that mode")
    columns = (["clients", "mode", "tokens/s", "vs no-spec"] + ["paired"] * paired
               + ["requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "τ"]
               + ["speculative steps"] * steps)
    lines += ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if c == "mode" else "---:" for c in columns) + "|"]

    def f(x):
        return "–" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"

    for r in result["rows"]:
        ratio = "–" if not base.get(r["concurrency"]) else f"{r['tokens_per_s'] / base[r['concurrency']]:.2f}×"
        tau = "–" if r["tau_mean"] is None else f"{r['tau_mean']:.2f}"
        cells = [str(r["concurrency"]), r["mode"], f"{r['tokens_per_s']:.1f}", ratio]
        if paired:
            cells.append(_paired_ratio(r.get("tokens_per_s_runs"), base_runs.get(r["concurrency"])))
        cells += [str(r["requests"]), str(r["errors"]), f(r["ttft_ms"]["p50"]), f(r["ttft_ms"]["p99"]),
                  f(r["itl_ms"]["p50"]), f(r["itl_ms"]["p99"]), tau]
        if steps:
            n = r.get("engine_steps_all")
            cells.append("–" if not n else f"{n['speculative']} of {n['speculative'] + n['autoregressive']}")
        lines.append("| " + " | ".join(cells) + " |")
    pairs = [(d, e) for d in result["rows"] for e in result["rows"]
             if d["mode"] == "dart" and e["mode"] == "eagle3" and d["concurrency"] == e["concurrency"]]
    if pairs:
        lines += ["", "DART against EAGLE-3 on the same server (each its median pass):", "",
                  "| clients | DART ÷ EAGLE-3 tokens/s | τ DART | τ EAGLE-3 |", "|---:|---:|---:|---:|"]
        lines += [f"| {d['concurrency']} | {d['tokens_per_s'] / e['tokens_per_s']:.2f}× | {d['tau_mean'] or 0:.2f} | "
                  f"{e['tau_mean'] or 0:.2f} |" for d, e in pairs if e["tokens_per_s"]]
    local = [r for r in result["rows"] if r.get("in_process_tokens_per_s")]
    if local:
        lines += ["", "Served against in process (the same requests one at a time through `DartModel` in the "
                  "benchmark's process, right after each served pass; the median served pass and its pair):", "",
                  "| clients | mode | served tokens/s | in-process tokens/s | served ÷ in process |",
                  "|---:|---|---:|---:|---:|"]
        lines += [f"| 1 | {r['mode']} | {r['tokens_per_s']:.1f} | {r['in_process_tokens_per_s']:.1f} | "
                  f"{r['tokens_per_s'] / r['in_process_tokens_per_s']:.2f}× |" for r in local]
    if cfg.get("repeats", 1) > 1:
        lines += ["", "| clients | mode | tokens/s per pass, in the order run |", "|---:|---|---|"]
        lines += [f"| {r['concurrency']} | {r['mode']} | {', '.join(f'{x:.1f}' for x in r['tokens_per_s_runs'])} |"
                  for r in result["rows"]]
    return "\n".join(lines) + "\n"


def _paired_ratio(runs: list[float] | None, base_runs: list[float] | None) -> str:
    """The median over repeats of ``runs[i] / base_runs[i]`` (a mode's pass ÷ the no-speculation
    pass of the same repeat, run next to it), as ``"0.98×"``; "–" without both."""
    pairs = [a / b for a, b in zip(runs or [], base_runs or []) if b]
    return f"{statistics.median(pairs):.2f}×" if pairs and len(runs) == len(base_runs) else "–"


def plot_serving(result: dict, path: str | Path, title: str = "") -> None:
    """Throughput, TTFT p99 and ITL p99 against concurrency, one line per mode (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = (("tokens/s (all clients)", lambda r: r["tokens_per_s"]),
              ("TTFT p99 (ms)", lambda r: r["ttft_ms"]["p99"]),
              ("ITL p99 (ms)", lambda r: r["itl_ms"]["p99"]))
    for ax, (label, get) in zip(axes, panels):
        for mode in SERVING_MODES:
            rows = [r for r in result["rows"] if r["mode"] == mode and get(r) is not None]
            if rows:
                ax.plot([r["concurrency"] for r in rows], [get(r) for r in rows], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["config"]["concurrency"], [str(c) for c in result["config"]["concurrency"]])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or f"Serving sweep, {result['server']['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: dict, out_dir: str | Path, stem: str = "serving", title: str = "") -> dict[str, Path | None]:
    """Writes ``<stem>.json`` and ``<stem>.md``, then ``<stem>.png`` (None without matplotlib) into ``out_dir``."""
    from dart_core.bench import save_plot

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["md"].write_text(markdown_table(result))
    paths["png"] = save_plot(lambda r, p: plot_serving(r, p, title), out / f"{stem}.png", result)
    return paths


def add_sweep_arguments(ap, defaults, modes: tuple[str, ...] = MODES) -> None:
    """The sweep's options (levels, requests, tokens, ``modes`` to choose from, prompts), shared with the
    batching benchmark."""
    ap.add_argument("--concurrency", type=int, nargs="+", default=defaults.concurrency)
    ap.add_argument("--requests-per-client", type=int, default=defaults.requests_per_client)
    ap.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    ap.add_argument("--modes", nargs="+", default=defaults.modes, choices=modes)
    ap.add_argument("--dataset", default=defaults.dataset, help="mt-bench, humaneval, alpacaeval or a JSONL file")
    ap.add_argument("--repeats", type=int, default=defaults.repeats,
                    help="passes per level, alternating which mode goes first; the median pass is reported")


def main(argv=None) -> int:
    import argparse

    from dart_core.bench import run_cli

    d = ServingConfig()
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=d.url)
    ap.add_argument("--model", default=d.model, help="served model name [the first of /v1/models]")
    add_sweep_arguments(ap, d, SERVING_MODES)
    ap.add_argument("--api-key", default=None, help="[$DART_API_KEY]")
    ap.add_argument("--in-process", action="store_true",
                    help="after each 1-client pass, the same requests through the engine in this process")
    ap.add_argument("--in-process-model", default=d.in_process_model,
                    help="model of the in-process engine [the embedded default, which deployments/dart.yaml serves]")
    ap.add_argument("--learn", action="store_true",
                    help='send "learn": true: let the live corpus and the prefix cache keep the requests (the passes '
                         'repeat the same prompts, so DART then drafts repeats from earlier answers) [false]')
    ap.add_argument("--engine-app", default=d.engine_app, metavar="NAME",
                    help="read the engine's step counters of this Serve application (on this machine's Ray cluster) "
                         "after every pass: each row then says how many of its steps speculated [not read]")
    ap.add_argument("--out", default="bench/results", help="folder for serving.json/.md/.png")
    ap.add_argument("--no-progress", action="store_true")
    return run_cli(ServingConfig, ap.parse_args(argv), run_serving, save, markdown_table, requires=("openai",))


if __name__ == "__main__":
    raise SystemExit(main())
