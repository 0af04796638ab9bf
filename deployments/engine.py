"""The DART engine deployment: one :class:`dart_core.DartEngine` per replica,
fed by continuous batching (DESIGN.md §1).

A background thread owns the engine and runs its generator loop
(:meth:`DartEngine.generate_stream` with ``admit``): a request that arrives
joins the running batch at the next step (up to ``max_batch_size``), a
finished, stopped or abandoned one leaves it.  Requests talk to the thread
through a queue; each request gets its tokens back step by step on its own
asyncio queue.  Steps with more than ``max_speculative_batch`` sequences are
plain autoregressive steps.  Tree search goes to the n-gram service over gRPC
(:class:`ngram_service.client.GrpcTreeSearch`), which falls back to the
in-process logits-only search whenever the service is away — a request never
fails because of the trie.

Tokenisation, the chat template, validation and incremental detokenisation
(with stop strings) happen here too, so the ingress stays thin.  Invalid
requests raise :class:`InvalidRequest` before the first token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from ray import serve
from ray.serve import metrics

from deployments.config import AppConfig

logger = logging.getLogger("ray.serve")


class InvalidRequest(ValueError):
    """A request the engine refuses (the ingress answers 400 with this message)."""


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: object  # dart_core.SamplingParams
    speculative: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    done: bool = False

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class _Cancelled:
    """``seq_id in cancelled`` for the engine loop: asks the request behind the id."""

    def __init__(self, by_seq: dict[int, _Request]) -> None:
        self.by_seq = by_seq

    def __contains__(self, sid: int) -> bool:
        req = self.by_seq.get(sid)
        return req is not None and req.cancelled


@serve.deployment(name="DartEngine", max_ongoing_requests=32, max_queued_requests=64, health_check_period_s=10,
                  ray_actor_options={"num_cpus": 1})
class DartEngineDeployment:
    def __init__(self, config: dict, ngram=None) -> None:
        import torch

        from dart_core.api import DartModel
        from dart_core.tokenizer import tokenizer_identity
        from ngram_service.tree_search import SearchParams

        self.cfg = AppConfig.model_validate(config)
        cfg = self.cfg
        params = SearchParams()
        params.top_k, params.beam_width = cfg.top_k, cfg.beam_width
        if isinstance(cfg.budget, int):
            params.budget = cfg.budget
        self._ngram = ngram if cfg.ngram.enabled else None
        self._grpc = None
        tree_search = None
        if self._ngram is not None:
            from ngram_service.client import GrpcTreeSearch

            # built at the first search, when self.tokenizer is loaded
            tree_search = _LazyGrpcSearch(lambda: GrpcTreeSearch(
                resolver=self._resolve_ngram, timeout_ms=cfg.ngram.timeout_ms,
                vocab_hash=tokenizer_identity(self.tokenizer)[1],
                auth_token=os.environ.get(cfg.ngram.auth_token_env) or None))
            self._grpc = tree_search
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        self.model = DartModel.from_pretrained(cfg.model, head=cfg.head, trie="auto", dtype=dtype,
                                               budget=cfg.budget, search_params=params, tree_search=tree_search)
        self.tokenizer = self.model.tokenizer
        self.engine = self.model.engine
        self.name = cfg.served_model_name or getattr(self.tokenizer, "dart_model_name", "model")
        self.max_context = self.engine.target.max_context
        self._incoming: queue.Queue[_Request] = queue.Queue()
        self._stop = threading.Event()
        self._running = 0
        self._init_metrics()
        self._thread = threading.Thread(target=self._loop, name="dart-engine", daemon=True)
        self._thread.start()
        logger.info("DART engine ready: %s, head %s, speculative %s, max batch %d", self.name,
                    "none" if self.engine.head is None else "loaded", cfg.speculative, cfg.max_batch_size)

    # -- requests ---------------------------------------------------------------

    def model_name(self) -> str:
        return self.name

    def _resolve_ngram(self) -> str:
        return self._ngram.address.remote().result(timeout_s=5)

    def _encode(self, request: dict) -> list[int]:
        """Token ids as :meth:`DartModel.encode` makes them (chat template for messages, text as is)."""
        if request.get("messages") is not None:
            try:
                return self.model.encode(request["messages"])
            except Exception as e:  # noqa: BLE001 - a template error is the caller's input
                raise InvalidRequest(f"messages cannot be rendered with the chat template: {e}") from None
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("give a prompt (text) or messages")
        return self.model.encode(prompt)

    def _sampling(self, request: dict, prompt_len: int):
        cfg = self.cfg
        room = self.max_context - prompt_len
        if room < 1:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; the model's context is {self.max_context}")
        max_tokens = request.get("max_tokens") or min(cfg.default_max_tokens, cfg.max_tokens_limit)
        if max_tokens > cfg.max_tokens_limit:
            raise InvalidRequest(f"max_tokens {max_tokens} is above this server's limit of {cfg.max_tokens_limit}")
        try:  # stop at the model's EOS, as DartModel.generate does
            return self.model._sampling(min(max_tokens, room), request.get("temperature", 0.0) or 0.0,
                                        request.get("top_p") or 1.0, request.get("top_k") or 0,
                                        request.get("seed"), None)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    async def generate(self, request: dict):
        """Streams one completion.

        Args:
            request: ``prompt`` (text) or ``messages`` (chat), ``max_tokens``,
                ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (strings),
                ``speculative`` (default true; false decodes without speculation, and
                while the request runs its whole batch steps autoregressively).

        Yields:
            first ``{"prompt_tokens": n}``, then per step ``{"text": delta,
            "token_ids": [...], "finish_reason": None | "stop" | "length",
            "tau": ..., "steps": ...}`` until a finish reason.

        Raises:
            InvalidRequest: before the first item, for any invalid field.
        """
        ids = self._encode(request)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        sampling = self._sampling(request, len(ids))
        stops = [s for s in (request.get("stop") or []) if s]
        hold = max((len(s) for s in stops), default=1) - 1
        loop = asyncio.get_running_loop()
        speculative = request.get("speculative", True)
        if not isinstance(speculative, bool):
            raise InvalidRequest("speculative must be true or false")
        req = _Request(ids, sampling, speculative, loop, asyncio.Queue())
        self._incoming.put(req)
        self.m_queue.set(self._incoming.qsize())
        yield {"prompt_tokens": len(ids)}
        generated: list[int] = []
        text = ""
        accepted = steps = 0
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, Exception):
                    raise item
                toks, reason = item
                generated += toks
                if toks and reason != "prefill":
                    steps += 1
                    accepted += len(toks)
                full = self.tokenizer.decode(generated, skip_special_tokens=True)
                if full.endswith("\ufffd") and reason is None:
                    continue  # an incomplete UTF-8 sequence: wait for the next step
                stop_at = _find_stop(full, stops, len(text))
                if stop_at is not None:
                    full, reason = full[:stop_at], "stop"
                    req.cancelled = True
                done = reason not in (None, "prefill")
                # hold back a tail that could be the start of a stop string still to come
                end = len(full) if done else max(len(text), len(full) - hold)
                delta = full[len(text):end]
                text += delta
                yield {"text": delta, "token_ids": list(toks), "finish_reason": reason if done else None,
                       "completion_tokens": len(generated), "tau": round(accepted / max(steps, 1), 3),
                       "steps": steps}
                if done:
                    req.done = True
                    self.m_tau.observe(accepted / max(steps, 1))
                    return
        finally:
            if not req.done:
                req.cancelled = True  # the client went away: leave the batch at the next step

    # -- the engine thread --------------------------------------------------------

    def _take(self, limit: int, block: bool) -> list[_Request]:
        out = []
        while len(out) < limit:
            try:
                req = self._incoming.get(block=block and not out, timeout=0.5 if block and not out else None)
            except queue.Empty:
                break
            if not req.cancelled:
                out.append(req)
        return out

    def _loop(self) -> None:
        cfg = self.cfg
        while not self._stop.is_set():
            first = self._take(cfg.max_batch_size, block=True)
            if not first:
                continue
            by_seq: dict[int, _Request] = {}
            order: list[_Request] = []

            def admit():  # -> list[dart_core.engine.NewSequence]; the first call brings the first batch
                joining = first + self._take(cfg.max_batch_size - self._running - len(first), block=False)
                first.clear()
                return self._register(joining, by_seq, order)

            try:
                for step in self.engine.generate_stream(
                        [], [], admit=admit, cancelled=_Cancelled(by_seq), speculative=cfg.speculative,
                        max_speculative_batch=cfg.max_speculative_batch):
                    self._publish(step, by_seq)
            except Exception as e:  # noqa: BLE001 - fail the batch's requests, keep the replica serving
                logger.exception("engine step failed")
                for req in by_seq.values():
                    if not req.done:
                        req.push(RuntimeError(f"generation failed: {e}"))
                self._running = 0

    def _register(self, reqs: list[_Request], by_seq: dict, order: list) -> list:
        from dart_core.engine import NewSequence

        for r in reqs:
            by_seq[len(order)] = r
            order.append(r)
            self.m_wait.observe(1e3 * (time.perf_counter() - r.arrived))
        self._running += len(reqs)
        self.m_queue.set(self._incoming.qsize())
        return [NewSequence(r.prompt_ids, r.sampling, r.speculative) for r in reqs]

    def _publish(self, step, by_seq: dict[int, _Request]) -> None:
        prefill = not any(step.accepted_lengths)
        for sid, toks, reason in zip(step.seq_ids, step.new_tokens, step.finish_reasons):
            req = by_seq[sid]
            if reason is not None:
                self._running -= 1
                del by_seq[sid]
                if reason == "cancelled":
                    continue
            req.push((toks, reason if reason else ("prefill" if prefill else None)))
            self.m_tokens.inc(len(toks))
        if not prefill:
            self.m_batch.set(len(step.seq_ids))
            mode = "speculative" if max(step.draft_nodes, default=0) > 0 else "autoregressive"
            self._steps[mode] += 1
            self.m_steps.inc(tags={"mode": mode})
            for name, ms in (("draft", step.draft_ms), ("tree_search", step.tree_search_ms),
                             ("verify", step.verify_ms), ("step", step.step_ms)):
                self.m_phase.observe(ms, tags={"phase": name})
        fallbacks = self._grpc.fallbacks if self._grpc is not None else 0
        if fallbacks > self._fallbacks_seen:
            self.m_fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks

    def _init_metrics(self) -> None:
        # Ray exports a histogram's _sum from bucket midpoints, so the buckets are fine enough
        # for sum/count to be a usable mean per phase (at most about 20 % off inside a bucket)
        ms_buckets = [0.5, 1, 1.5, 2, 3, 4, 5, 7, 10, 14, 20, 28, 40, 56, 80, 110, 150, 200, 280, 400,
                      560, 800, 1100, 1500, 2000, 3000, 5000]
        self.m_tokens = metrics.Counter("dart_generated_tokens", description="tokens generated")
        self.m_tau = metrics.Histogram("dart_tau", description="acceptance length (tau) per request",
                                       boundaries=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0])
        self.m_phase = metrics.Histogram("dart_step_phase_ms", description="per-step latency by phase, ms",
                                         boundaries=ms_buckets, tag_keys=("phase",))
        self.m_fallbacks = metrics.Counter("dart_ngram_fallbacks", description="tree searches answered by the "
                                                                               "in-process fallback")
        self.m_batch = metrics.Gauge("dart_batch_size", description="sequences in the running batch")
        self.m_steps = metrics.Counter("dart_steps", description="decoding steps by mode: speculative (a draft tree "
                                       "verified) or autoregressive (speculation off, opted out, batch too large, "
                                       "or the speculation gate found it slower)", tag_keys=("mode",))
        self._steps = {"speculative": 0, "autoregressive": 0}
        self.m_queue = metrics.Gauge("dart_queue_length", description="requests waiting to join the batch")
        self.m_wait = metrics.Histogram("dart_queue_wait_ms", description="time from arrival to joining the batch",
                                        boundaries=ms_buckets)
        self._fallbacks_seen = 0

    def stats(self) -> dict:
        """Counters for tests and operators: n-gram calls and fallbacks, running sequences, steps by mode."""
        g = self._grpc.client if self._grpc is not None else None
        return {"running": self._running, "queued": self._incoming.qsize(),
                "speculative_steps": self._steps["speculative"], "autoregressive_steps": self._steps["autoregressive"],
                "ngram_calls": g.calls if g else 0, "ngram_fallbacks": g.fallbacks if g else 0,
                "ngram_address": g.address if g else None}

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread died")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index where the earliest stop string begins, searching text that may end in new characters."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


class _LazyGrpcSearch:
    """Builds the gRPC client on first use, in the engine thread (its resolver calls a Serve handle,
    which must not block the replica's event loop)."""

    def __init__(self, factory) -> None:
        self._factory = factory
        self.client = None

    @property
    def fallbacks(self) -> int:
        return self.client.fallbacks if self.client is not None else 0

    def search(self, *args, **kwargs):
        if self.client is None:
            self.client = self._factory()
        return self.client.search(*args, **kwargs)
