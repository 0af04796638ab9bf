"""The DART engine deployment: a thin Ray Serve shell around
:class:`dart_core.serve.batcher.ContinuousBatcher` (docs/design.md §1).

One replica loads the target model and its draft head
(:meth:`dart_core.DartModel.from_pretrained`), points the engine's tree search
at the n-gram service over gRPC (:class:`ngram_service.client.GrpcTreeSearch`,
which falls back to the in-process logits-only search whenever the service is
away — a request never fails because of the trie) or, on the service's own
node, at the same trie file in its own process with a mirror of the service's
live corpus (:class:`ngram_service.client.ColocatedTreeSearch`,
``ngram.local_search``), and hands everything else
to the batcher: queueing, admission, cancellation, detokenisation, stop
strings.  What this class adds is Serve's: the handle method
:meth:`DartEngineDeployment.generate` streaming lists of
:class:`~dart_core.serve.request.GenerationChunk` s, Prometheus metrics fed by the
batcher's observer hooks, and the health check.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from ray import serve
from ray.serve import metrics

from dart_core.serve.request import GenerationChunk, GenerationRequest
from deployments.config import AppConfig, NgramConfig
from deployments.logs import route_library_logs
from deployments.metrics import StatsMetrics

logger = logging.getLogger("ray.serve")


# Ray exports a histogram's _sum from bucket midpoints, so the buckets are fine enough
# for sum/count to be a usable mean per phase (at most about 20 % off inside a bucket)
_MS_BUCKETS = [0.5, 1, 1.5, 2, 3, 4, 5, 7, 10, 14, 20, 28, 40, 56, 80, 110, 150, 200, 280, 400, 560, 800, 1100,
               1500, 2000, 3000, 5000]


class _Metrics:
    """The batcher's observer hooks (:class:`dart_core.serve.batcher.BatcherObserver`) as Ray Serve
    metrics, exported to Prometheus.  (This module imports no torch: the ingress imports it too.)"""

    def __init__(self, tree_search=None, learner=None, learn_prompts: bool = False, prefix_cache=None) -> None:
        self.tree_search = tree_search
        self.learner, self.learn_prompts = learner, learn_prompts  # a LearnSender, or None: nothing is learned
        self.tokens = metrics.Counter("dart_generated_tokens", description="tokens generated")
        self.tau = metrics.Histogram("dart_tau", description="acceptance length (tau) per request",
                                     boundaries=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0])
        self.phase = metrics.Histogram("dart_step_phase_ms", description="per-step latency by phase, ms",
                                       boundaries=_MS_BUCKETS, tag_keys=("phase",))
        self.fallbacks = metrics.Counter("dart_ngram_fallbacks",
                                         description="tree searches answered by the in-process fallback")
        self.batch = metrics.Gauge("dart_batch_size", description="sequences in the running batch")
        self.steps = metrics.Counter("dart_steps", description="decoding steps by mode: speculative (a draft tree "
                                     "verified) or autoregressive (speculation off, opted out, batch too large, "
                                     "or the speculation gate found it slower)", tag_keys=("mode",))
        self.verified = metrics.Histogram("dart_verified_tokens", description="query tokens a speculative step "
                                          "verifies, all sequences (draft nodes + one root each): the budget used",
                                          boundaries=[2, 4, 8, 16, 32, 64, 128, 256, 512])
        self.accepted = metrics.Histogram("dart_accepted_tokens", description="tokens a speculative step emits, "
                                          "all sequences (accepted draft tokens + bonus tokens)",
                                          boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256])
        self.padding = metrics.Histogram("dart_padding_share", description="share of a speculative step's padded "
                                         "tree layout (sequences x largest tree) that holds no node",
                                         boundaries=[0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
        self.queue = metrics.Gauge("dart_queue_length", description="requests waiting to join the batch")
        self.wait = metrics.Histogram("dart_queue_wait_ms", description="time from arrival to joining the batch",
                                      boundaries=_MS_BUCKETS)
        # the figures of the engine's PrefixCache (dart_core.model.prefix_cache), where it has one
        self.prefix_metrics = None if prefix_cache is None else StatsMetrics(
            prefix_cache.stats, "dart_prefix_cache", gauges={
            "tokens": "prompt positions the prefix cache holds (its cap: prefix_cache_tokens)",
            "bytes": "memory of the prefix cache's KV entries and taps, bytes"}, counters={
            "lookups": "prompts looked up in the prefix cache", "hits": "prompts that found a stored prefix",
            "hit_tokens": "prompt tokens not prefilled: read from the prefix cache",
            "evictions": "prompts evicted from the prefix cache"})
        self._fallbacks_seen = 0
        self.flush_s = 1.0  # seconds between hand-overs of the summed counters (on_step)
        self._flushed = time.monotonic()
        self._pending_tokens = 0
        self._pending_steps = [0, 0]  # autoregressive, speculative steps not yet counted
        self._batch_size: int | None = None  # the last step's, not yet set

    def on_admit(self, wait_ms: float, queued: int) -> None:
        self.wait.observe(wait_ms)
        self.queue.set(queued)

    def on_step(self, step, prefill: bool) -> None:
        """Histograms observe every step; the counters and the batch-size gauge are summed here and
        handed to Ray at most once per ``flush_s`` and at every request's end (:meth:`flush`): every
        Ray metric call is Python work on the engine thread, between two decoding steps (a served
        step's profile on a CPU found them a visible share of it).  An autoregressive step has no
        draft or tree-search phase to observe."""
        self._pending_tokens += sum(len(t) for t in step.new_tokens)
        if not prefill:
            self._batch_size = len(step.seq_ids)
            if step.speculated:
                self._pending_steps[1] += 1
                self.verified.observe(step.verified_tokens)
                self.accepted.observe(sum(step.accepted_lengths))
                self.padding.observe(1 - step.verified_tokens / max(1, step.padded_tokens))
                self.phase.observe(step.draft_ms, tags={"phase": "draft"})
                self.phase.observe(step.tree_search_ms, tags={"phase": "tree_search"})
            else:
                self._pending_steps[0] += 1
            self.phase.observe(step.verify_ms, tags={"phase": "verify"})
            self.phase.observe(step.step_ms, tags={"phase": "step"})
        if time.monotonic() - self._flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Hands the summed counters, the last batch size and new n-gram fallbacks to Ray."""
        self._flushed = time.monotonic()
        if self._pending_tokens:
            self.tokens.inc(self._pending_tokens)
            self._pending_tokens = 0
        for i, mode in enumerate(("autoregressive", "speculative")):
            if self._pending_steps[i]:
                self.steps.inc(self._pending_steps[i], tags={"mode": mode})
                self._pending_steps[i] = 0
        if self._batch_size is not None:
            self.batch.set(self._batch_size)
            self._batch_size = None
        if self.prefix_metrics is not None:
            self.prefix_metrics.update()
        fallbacks = getattr(self.tree_search, "fallbacks", 0)
        if fallbacks > self._fallbacks_seen:
            self.fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks

    def on_finish(self, chunk: GenerationChunk) -> None:
        if chunk.tau is not None:
            self.tau.observe(chunk.tau)
        self.flush()

    def on_sequence(self, prompt: list[int], output: list[int]) -> None:
        if self.learner is not None:
            self.learner.put(prompt + output if self.learn_prompts else output)


def grpc_tree_search(cfg: NgramConfig, resolver, vocab_hash: str, auth_token: str | None, live_chain_length: int = 0):
    """The engine's tree-search client for the n-gram service (address from ``resolver``, asked
    on a background thread, ``auth_token`` sent as ``authorization: Bearer <token>``), falling
    back to the in-process logits-only search.  With ``ngram.learn``, each search also asks for the
    live corpus's continuations, up to ``live_chain_length`` tokens (the engine passes twice its
    lookup length: enough for two lookup steps after one search), which the lookup steps follow."""
    from ngram_service.client import GrpcTreeSearch

    return GrpcTreeSearch(resolver=resolver, timeout_ms=cfg.timeout_ms, vocab_hash=vocab_hash, auth_token=auth_token,
                          live_chain_length=live_chain_length if cfg.learn else 0)


@serve.deployment(name="DartEngine", max_ongoing_requests=32, max_queued_requests=64, health_check_period_s=10,
                  ray_actor_options={"num_cpus": 1})
class DartEngineDeployment:
    """Target + draft head + continuous batching on one replica (GPU nodes; CPU works).

    Args:
        config: the application's :class:`~deployments.config.AppConfig` as a dict.
        ngram: a handle of the ``NgramService`` deployment, or None for the logits-only search.
        ngram_auth_token: the bearer token the service requires (:func:`deployments.app.build_app`
            gives the application's), None for a service without one.
    """

    def __init__(self, config: dict, ngram=None, ngram_auth_token: str | None = None) -> None:
        import torch

        from dart_core.api import DartModel
        from dart_core.serve.batcher import BatcherConfig, ContinuousBatcher, load_in_own_thread
        from dart_core.model.tokenizer import tokenizer_identity
        from ngram_service.client import LearnSender

        route_library_logs()
        self.cfg = cfg = AppConfig.model_validate(config)
        self._ngram = ngram if cfg.ngram.enabled else None
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        # with the service the trie lives on the n-gram node (mapped here too when this is that node);
        # without it the search is logits-only
        # loaded on a thread that ends, so that the batcher's engine thread owns the only OpenMP pool
        self.model = load_in_own_thread(lambda: DartModel.from_pretrained(
            cfg.model, head=cfg.head, trie=None, dtype=dtype, weights=cfg.weights,
            gguf_kernel=cfg.gguf_kernel, draft_weights=cfg.draft_weights,
            speculative_config=cfg.speculative_config(), eagle3_head=cfg.eagle3_head))
        self.tree_search = self.learner = None
        if self._ngram is not None:
            self.tree_search = grpc_tree_search(cfg.ngram, self._resolve_ngram,
                                                tokenizer_identity(self.model.tokenizer)[1], ngram_auth_token,
                                                2 * getattr(self.model.engine.drafter, "lookup_length", 0))
            if cfg.ngram.local_search:  # in this process while the service's trie is on this node
                import ray

                from ngram_service.client import ColocatedTreeSearch

                self.tree_search = ColocatedTreeSearch(self.tree_search, self._locate_ngram,
                                                       ray.get_runtime_context().get_node_id())
            self.model.engine.tree_search = self.tree_search
            if cfg.ngram.learn:  # finished requests go to the service's live corpus, off the decoding path
                self.learner = LearnSender(self.tree_search)
        self.name = cfg.served_model_name or getattr(self.model.tokenizer, "dart_model_name", "model")
        self.batcher = ContinuousBatcher(self.model.engine, self.model.tokenizer, BatcherConfig(
            max_batch_size=cfg.max_batch_size, max_speculative_batch=cfg.max_speculative_batch,
            speculative=cfg.speculative, default_max_tokens=cfg.default_max_tokens,
            max_tokens_limit=cfg.max_tokens_limit, grammar_timeout_s=cfg.grammar_timeout_s,
            max_grammar_chars=cfg.max_grammar_chars, recalibrate_after_s=cfg.recalibrate_after_s),
            observer=_Metrics(self.tree_search, self.learner, cfg.ngram.learn_prompts,
                              self.model.engine.prefix_cache)).start()
        logger.info("DART engine ready: %s, head %s, methods %s, speculative %s, max batch %d", self.name,
                    "none" if self.model.engine.head is None else "loaded", ", ".join(self.batcher.methods),
                    cfg.speculative, cfg.max_batch_size)

    def _resolve_ngram(self) -> str:
        """The service's address, asked of its replica (on the client's background thread)."""
        return self._ngram.address.remote().result(timeout_s=5)

    def _locate_ngram(self, since: int) -> dict:
        """The service's node, trie file and live-corpus tokens since ``since`` (on the colocated
        client's background thread)."""
        return self._ngram.locate.remote(since).result(timeout_s=5)

    def model_name(self) -> str:
        return self.name

    def methods(self) -> list[str]:
        """The drafters a request's ``"method"`` may name here, ``"none"`` included (ContinuousBatcher.methods)."""
        return list(self.batcher.methods)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[GenerationChunk]]:
        """Streams one completion as lists of chunks: the first chunk alone and at once, then the
        chunks of each ``stream_interval_ms`` together, that interval growing with the open streams
        beyond ``stream_items_per_s`` lists per second (see
        :meth:`ContinuousBatcher.agenerate_batches`), so that the Serve stream carries one object
        per interval rather than one per decoding step.

        Raises:
            InvalidRequest: before the first list, for any invalid field.
        """
        async for batch in self.batcher.agenerate_batches(request, self.cfg.stream_interval_ms / 1000.0,
                                                          self.cfg.stream_items_per_s):
            yield batch

    async def add_corpus(self, documents: list[str], token_ids: list[list[int]]) -> dict:
        """The admin route's corpus: ``documents`` encoded with the model's tokenizer (no special
        tokens) and ``token_ids`` as they are, checked against the vocabulary, into the n-gram
        service's live corpus (:meth:`NgramService.add_corpus <deployments.ngram.NgramService.add_corpus>`,
        whose answer it returns).  Refusals come back as ``{"error": {"status", "message"}}``."""
        from deployments.ngram import admin_error

        if self._ngram is None:
            return admin_error(409, "this application runs without the n-gram service (ngram.enabled: false)")
        vocab = self.model.engine.target.config.vocab_size
        for i, ids in enumerate(token_ids):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                return admin_error(400, f"token_ids[{i}]: id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        encoded = [self.model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in documents]
        return await self._ngram.add_corpus.remote(encoded + [list(ids) for ids in token_ids])

    async def swap_trie(self, path: str) -> dict:
        """The admin route's trie swap, on the n-gram service (:meth:`NgramService.swap_trie
        <deployments.ngram.NgramService.swap_trie>`, whose answer it returns)."""
        from deployments.ngram import admin_error

        if self._ngram is None:
            return admin_error(409, "this application runs without the n-gram service (ngram.enabled: false)")
        return await self._ngram.swap_trie.remote(path)

    def stats(self) -> dict:
        """Counters for tests and operators: running and queued requests, steps by mode, the
        adaptive budget's and the speculation gate's live state (``AdaptiveBudget.state``,
        ``SpeculationGate.state``; None without them), n-gram calls and fallbacks, the service's
        current address, whether searches run in this process (``ngram_local``, with
        ``ngram_mirror_tokens`` in its mirror of the live corpus), and the tokens
        sent to its live corpus (and the sequences dropped because its queue was full)."""
        g, lr = self.tree_search, self.learner
        budget, gate = self.model.engine.budget, self.model.engine.gate
        return self.batcher.stats() | {"budget": budget.state() if budget is not None else None,
                                       "gate": gate.state() if gate is not None else None,
                                       "ngram_calls": g.calls if g else 0, "ngram_fallbacks": g.fallbacks if g else 0,
                                       "ngram_address": g.address if g else None,
                                       "ngram_local": bool(getattr(g, "local", False)),
                                       "ngram_mirror_tokens": getattr(g, "mirror_tokens", 0),
                                       "learned_tokens": lr.sent if lr else 0, "learn_dropped": lr.dropped if lr else 0}

    def check_health(self) -> None:
        if not self.batcher.alive:
            raise RuntimeError("the engine thread died")

    def __del__(self) -> None:
        for name in ("batcher", "learner", "tree_search"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
