"""Continuous batching around a :class:`~dart_core.step.engine.DartEngine`, without Ray.

The serving core: requests come in from any thread (or asyncio task), join
the running batch at the next decoding step, leave it when they finish or
are cancelled, and get their tokens back step by step as
:class:`~dart_core.serve.request.GenerationChunk` s.  One background thread owns the
engine and runs its single decode loop (:meth:`DartEngine.generate_stream`
with ``admit`` and ``cancelled``); the Serve deployment is a thin shell
around this class, and benchmarks and tests drive it directly
(``python -m dart_core.bench.batching``).

Per request, in the caller's thread (:meth:`ContinuousBatcher.submit`): the
prompt is encoded (chat template for messages), checked against the context
window and the server's ``max_tokens`` limit, and turned into
:class:`~dart_core.step.sampling.SamplingParams`; any problem raises
:class:`~dart_core.serve.request.InvalidRequest` before anything is queued.

Per step, in the engine thread: each sequence's new tokens go through its
:class:`~dart_core.serve.detokenizer.IncrementalDetokenizer` (UTF-8 hold-back, stop
strings); a stop string ends the request at once (finish reason ``"stop"``)
and the engine drops the sequence at its next step.  Steps with more than
``max_speculative_batch`` running sequences, and every step while a request
that opted out of speculation runs, are autoregressive; the engine's
speculation gate (when it has one) decides the rest.

Observability goes through an optional :class:`BatcherObserver` (the Serve
deployment feeds Ray's Prometheus metrics from it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Iterator, TypeVar

from dart_core.serve.detokenizer import IncrementalDetokenizer
from dart_core.spec.budget import CalibrationInterrupted
from dart_core.step.engine import DartEngine, NewSequence, StepOutput, TokenLogprobs
from dart_core.step.grammar import Grammar, GrammarCompiler, GrammarError
from dart_core.serve.request import GenerationChunk, GenerationRequest, InvalidRequest, TokenLogprob
from dart_core.step.sampling import SamplingParams

logger = logging.getLogger(__name__)

_RECALIBRATE_TRIES = 5  # idle seconds in which a re-measurement of the verification cost curve is started

__all__ = ["BatcherConfig", "BatcherObserver", "ContinuousBatcher", "RequestHandle", "encode_prompt", "load_in_own_thread"]


@dataclass(frozen=True)
class BatcherConfig:
    """Batching limits (the Serve app's ``args`` set them; see ``deployments.config``)."""

    max_batch_size: int = 16  # sequences decoded together
    max_speculative_batch: int | None = 8  # above this many running sequences a step is autoregressive
    speculative: bool = True  # False: every step autoregressive (the baseline)
    default_max_tokens: int = 256  # when a request gives none
    max_tokens_limit: int = 2048  # the largest a request may ask for
    grammar_timeout_s: float = 10.0  # structured output: a grammar that takes longer to compile is refused
    max_grammar_chars: int = 65536  # structured output: longer schemas / regexes / choice lists are refused
    # with an adaptive budget: the verification cost curve is measured again once, on the first idle
    # second at least this long after start (AdaptiveBudget.remeasure); None: never
    recalibrate_after_s: float | None = 30.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.default_max_tokens < 1 or self.max_tokens_limit < 1:
            raise ValueError("max_batch_size, default_max_tokens and max_tokens_limit must be >= 1")
        if self.max_speculative_batch is not None and self.max_speculative_batch < 1:
            raise ValueError("max_speculative_batch must be None or >= 1")
        if not self.grammar_timeout_s > 0 or self.max_grammar_chars < 1:
            raise ValueError("grammar_timeout_s must be > 0 and max_grammar_chars >= 1")
        if self.recalibrate_after_s is not None and self.recalibrate_after_s < 0:
            raise ValueError("recalibrate_after_s must be None or >= 0")


class BatcherObserver:
    """Hooks called from the engine thread (keep them cheap); the defaults do nothing."""

    def on_admit(self, wait_ms: float, queued: int) -> None:
        """A request joined the batch after ``wait_ms`` in the queue; ``queued`` still wait."""

    def on_step(self, step: StepOutput, prefill: bool) -> None:
        """A decoding step (or a prefill) finished."""

    def on_finish(self, chunk: GenerationChunk) -> None:
        """A request ended (its last chunk; not called for cancelled ones)."""

    def on_sequence(self, prompt: list[int], output: list[int]) -> None:
        """A request that allows learning (``GenerationRequest.learn``) ended, not cancelled: its
        prompt and generated token ids (what a live corpus may learn from)."""


_T = TypeVar("_T")


def load_in_own_thread(build: Callable[[], _T]) -> _T:
    """``build()`` run on a short-lived thread of its own: its result returned, its exception raised.

    Load the model that a :class:`ContinuousBatcher` will serve this way (the Serve deployment and
    ``python -m dart_core.bench.batching`` do). PyTorch's CPU kernels run on OpenMP, and GNU OpenMP
    keeps a pool of worker threads for every thread that has run a parallel kernel, for as long as
    that thread lives. A model loaded on a thread that stays (a Serve replica's, a script's main
    thread) leaves such a pool behind, the batcher's engine thread starts a second one, and once
    the process holds more OpenMP threads than CPUs, GNU OpenMP stops spinning between parallel
    regions: every parallel kernel of every step then waits for sleeping workers to wake, and a
    small model's served steps run far slower than the same steps on the loading thread
    (``bench/results/serving_threads/``). A thread that ends frees its pool, so the engine thread's
    pool is the only one. Nothing else changes: on CUDA, or with another OpenMP runtime, this is
    just a function call on another thread.

    Raises:
        whatever ``build`` raises.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dart-load") as pool:
        return pool.submit(build).result()  # leaving the block joins the thread, which ends


def encode_prompt(tokenizer, request: GenerationRequest) -> list[int]:
    """Token ids of a request: token ids as they are, a text prompt as is, messages through the
    chat template.

    Raises:
        InvalidRequest: the chat template refuses the messages, the prompt encodes to nothing,
            or a prompt token id is outside the vocabulary.
    """
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
        vocab = len(tokenizer)
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary of {vocab}")
    elif request.messages is not None:
        try:
            ids = list(tokenizer.apply_chat_template(request.chat(), add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise InvalidRequest(f"messages cannot be rendered with the chat template: {e}") from None
    else:
        ids = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InvalidRequest("the prompt is empty")
    return ids


Sink = Callable[["GenerationChunk | BaseException"], None]


@dataclass
class _Request:
    ids: list[int]
    sampling: SamplingParams
    speculative: bool
    detok: IncrementalDetokenizer
    sink: Sink
    learn: bool = True
    method: str | None = None  # the drafter named by the request (None: the engine's default)
    output: list[int] = field(default_factory=list)  # generated token ids so far (kept when ``learn``)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    done: bool = False
    completion_tokens: int = 0
    steps: int = 0
    step_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def _send(req: _Request, item: "GenerationChunk | BaseException") -> None:
    """Hands an item to the request's sink; a sink that fails (its event loop closed: the
    client went away) cancels its own request and nothing else."""
    try:
        req.sink(item)
    except Exception:  # noqa: BLE001
        logger.debug("a request's sink failed; cancelling the request", exc_info=True)
        req.cancelled = True


class RequestHandle:
    """A submitted request: :meth:`cancel` drops it at the next step (nothing more is sent)."""

    def __init__(self, req: _Request, prompt_tokens: int) -> None:
        self._req = req
        self.prompt_tokens = prompt_tokens

    def cancel(self) -> None:
        self._req.cancelled = True

    @property
    def done(self) -> bool:
        return self._req.done


@contextmanager
def _cancel_unless_done(handle: RequestHandle):
    """Cancels the request when its consumer leaves before the last chunk (closed, cancelled, failed)."""
    try:
        yield handle
    finally:
        if not handle.done:
            handle.cancel()


def _ends(item: GenerationChunk | BaseException) -> bool:
    """The last item a request's sink receives: its final chunk, or an exception."""
    return isinstance(item, BaseException) or item.finish_reason is not None


def _unwrap(item: "GenerationChunk | BaseException") -> GenerationChunk:
    if isinstance(item, BaseException):
        raise item
    return item


class _Cancelled:
    """``seq_id in cancelled`` for the engine loop: asks the request behind the id."""

    def __init__(self, by_seq: dict[int, _Request]) -> None:
        self.by_seq = by_seq

    def __contains__(self, sid: int) -> bool:
        req = self.by_seq.get(sid)
        return req is not None and req.cancelled


class ContinuousBatcher:
    """Continuous batching of requests over one engine (see the module docstring).

    Args:
        engine: the decoding engine (its draft head, tree search, budget and gate as configured).
        tokenizer: the target's Hugging Face tokenizer (chat template, decoding).
        config: batching limits.
        observer: metric hooks (a :class:`BatcherObserver`, or any object with its methods; ``on_sequence``
            is optional, and without it no request's tokens are kept).

    Use ``start()`` (or a ``with`` block) before submitting, ``close()`` at the end.
    """

    def __init__(self, engine: DartEngine, tokenizer, config: BatcherConfig | None = None,
                 observer: BatcherObserver | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or BatcherConfig()
        self.observer = observer or BatcherObserver()
        # optional: an observer written before the hook (duck-typed) has none, and then nothing is collected
        self._on_sequence = getattr(self.observer, "on_sequence", None)
        self.max_context = engine.target.max_context
        self.running = 0
        self.steps = {"speculative": 0, "autoregressive": 0}
        self._incoming: queue.Queue[_Request] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._started = time.monotonic()
        self._recalibrate_tries = 0
        self._open_streams = 0  # agenerate_batches streams open (on any event loop)
        self._streams_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> "ContinuousBatcher":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dart-batcher", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the engine thread after the current step; requests still running get an error."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def __enter__(self) -> "ContinuousBatcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queued(self) -> int:
        return self._incoming.qsize()

    # -- requests -------------------------------------------------------------------

    def sampling_params(self, request: GenerationRequest, prompt_tokens: int) -> SamplingParams:
        """The request's sampling parameters under this server's limits.

        Raises:
            InvalidRequest: no room left in the context, or ``max_tokens`` above the limit.
        """
        cfg = self.config
        room = self.max_context - prompt_tokens
        if room < 1:
            raise InvalidRequest(f"the prompt has {prompt_tokens} tokens; the model's context is {self.max_context}")
        max_tokens = request.max_tokens or min(cfg.default_max_tokens, cfg.max_tokens_limit)
        if max_tokens > cfg.max_tokens_limit:
            raise InvalidRequest(f"max_tokens {max_tokens} is above this server's limit of {cfg.max_tokens_limit}")
        if request.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens {request.min_tokens} is above max_tokens ({max_tokens})")
        try:
            eos = self.tokenizer.eos_token_id
            stop_ids = tuple(dict.fromkeys(([] if eos is None or request.ignore_eos else [int(eos)])
                                           + list(request.stop_token_ids)))
            return SamplingParams(max_new_tokens=min(max_tokens, room), temperature=request.temperature,
                                  top_p=request.top_p, top_k=request.top_k, seed=request.seed,
                                  logprobs=request.logprobs, stop_token_ids=stop_ids, min_tokens=request.min_tokens)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def grammar(self, request: GenerationRequest) -> Grammar | None:
        """The request's compiled grammar (structured output; cached by spec), None without one.

        Raises:
            InvalidRequest: the grammar does not compile, is over ``max_grammar_chars`` or took
                over ``grammar_timeout_s`` to compile, or llguidance is not installed.
        """
        if request.grammar is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    self._grammars = GrammarCompiler(self.tokenizer, self.engine.target.config.vocab_size,
                                                     timeout_s=self.config.grammar_timeout_s,
                                                     max_spec_chars=self.config.max_grammar_chars)
                except ImportError:
                    raise InvalidRequest("structured output needs llguidance on the server "
                                         "(pip install llguidance)") from None
                except GrammarError as e:
                    raise InvalidRequest(str(e)) from None
        try:
            return self._grammars.compile(request.grammar)
        except GrammarError as e:
            raise InvalidRequest(str(e)) from None

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods a request may name: the engine's drafters (:attr:`DartEngine.methods`) and
        ``"none"`` (no speculation for that request)."""
        return tuple(getattr(self.engine, "methods", ())) + ("none",)

    def submit(self, request: GenerationRequest, sink: Sink) -> RequestHandle:
        """Queues a request; ``sink`` then receives its chunks, or one exception, from the engine thread.

        Raises:
            InvalidRequest: before anything is queued (see :meth:`sampling_params`, :func:`encode_prompt`);
                a ``method`` this engine does not hold (:attr:`methods`).
            RuntimeError: the batcher is not running.
        """
        if not self.alive or self._stop.is_set():
            raise RuntimeError("the batcher is not running (call start())")
        if request.method is not None and request.method not in self.methods:
            raise InvalidRequest(f"method {request.method} is not loaded by this deployment (loaded: "
                                 f"{', '.join(self.methods)})")
        ids = encode_prompt(self.tokenizer, request)
        sampling = replace(self.sampling_params(request, len(ids)), grammar=self.grammar(request))
        detok = IncrementalDetokenizer(self.tokenizer, request.stop, skip_special_tokens=request.skip_special_tokens,
                                       include_stop=request.include_stop_str_in_output)
        method = None if request.method == "none" else request.method  # "none": as speculative false
        req = _Request(ids, sampling, request.speculative and request.method != "none", detok, sink,
                       learn=request.learn, method=method)
        self._incoming.put(req)
        return RequestHandle(req, len(ids))

    def generate(self, request: GenerationRequest, timeout_s: float | None = None) -> Iterator[GenerationChunk]:
        """The request's chunks, blocking (closing the iterator early cancels the request).

        Raises:
            InvalidRequest: before the first chunk.
            RuntimeError: the generation failed in the engine.
            queue.Empty: no chunk within ``timeout_s``.
        """
        box: queue.Queue = queue.Queue()
        with _cancel_unless_done(self.submit(request, box.put)):
            while True:
                chunk = _unwrap(box.get(timeout=timeout_s))
                yield chunk
                if chunk.finish_reason is not None:
                    return

    async def agenerate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """:meth:`generate` for asyncio: the chunks arrive on the running event loop; a
        consumer that stops early (or is cancelled) cancels the request."""
        async for batch in self.agenerate_batches(request):
            for chunk in batch:
                yield chunk

    async def agenerate_batches(self, request: GenerationRequest, interval_s: float = 0.0,
                                items_per_s: float | None = None) -> AsyncIterator[list[GenerationChunk]]:
        """:meth:`agenerate`, with the chunks grouped into lists for a consumer that pays per
        message (a Ray Serve stream pays one object per item, in the sending and in every
        receiving process): the first chunk goes out alone at once (time to first token is not
        delayed); after that, each list holds the chunks that arrive until the stream's interval
        (:meth:`stream_interval`) has passed since the previous list went out, and the last chunk
        goes out as soon as it arrives.  The interval is ``interval_s`` seconds, or, with
        ``items_per_s`` (a cap on the lists per second over all of this batcher's open streams),
        open streams ÷ ``items_per_s`` where that is longer, so that the cost per item stays
        bounded as streams multiply.  With an interval of 0 a list holds what is already queued
        when the consumer asks (nothing waits).  Ray Serve LLM groups its streamed responses the
        same way (``stream_batching_interval_ms``, a fixed interval).  Every chunk keeps its own
        step figures.

        Raises:
            InvalidRequest: before the first list.
            RuntimeError: the generation failed in the engine (after the chunks before the failure).
        """
        loop = asyncio.get_running_loop()
        if request.grammar is not None:  # compiled off the event loop (then cached for submit)
            await asyncio.to_thread(self.grammar, request)
        box: asyncio.Queue = asyncio.Queue()
        with _cancel_unless_done(self.submit(request, lambda item: loop.call_soon_threadsafe(box.put_nowait, item))), \
                self._stream_open():
            sent_at = float("-inf")
            while True:
                items = [await box.get()]
                deadline = sent_at + self.stream_interval(interval_s, items_per_s)
                # the first chunk goes out alone, even when the next one is already queued
                while sent_at != float("-inf") and not _ends(items[-1]):
                    if not box.empty():
                        items.append(box.get_nowait())
                        continue
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        items.append(await asyncio.wait_for(box.get(), remaining))
                    except asyncio.TimeoutError:
                        break
                chunks = [c for c in items if not isinstance(c, BaseException)]
                if chunks:
                    yield chunks
                    sent_at = loop.time()
                _unwrap(items[-1])
                if _ends(items[-1]):
                    return

    def stream_interval(self, interval_s: float, items_per_s: float | None) -> float:
        """Seconds between two lists of one :meth:`agenerate_batches` stream now: ``interval_s``,
        or the streams open ÷ ``items_per_s`` where that is longer (None or 0: no cap)."""
        if not items_per_s:
            return interval_s
        return max(interval_s, self._open_streams / items_per_s)

    @contextmanager
    def _stream_open(self) -> Iterator[None]:
        with self._streams_lock:
            self._open_streams += 1
        try:
            yield
        finally:
            with self._streams_lock:
                self._open_streams -= 1

    def stats(self) -> dict:
        """Running and queued requests, decoding steps by mode, and the engine's prefix cache
        (:meth:`PrefixCache.stats <dart_core.model.prefix_cache.PrefixCache.stats>`, keys prefixed
        ``prefix_cache_``; none without one)."""
        pc = getattr(self.engine, "prefix_cache", None)  # an engine without one (a test double): none
        return {"running": self.running, "queued": self.queued, "speculative_steps": self.steps["speculative"],
                "autoregressive_steps": self.steps["autoregressive"]} | (
            {f"prefix_cache_{k}": v for k, v in pc.stats().items()} if pc is not None else {})

    # -- the engine thread ------------------------------------------------------------

    def _take(self, limit: int, block: bool) -> list[_Request]:
        out: list[_Request] = []
        while len(out) < limit:
            try:
                req = self._incoming.get(block=block and not out, timeout=0.5 if block and not out else None)
            except queue.Empty:
                break
            if not req.cancelled:
                out.append(req)
        return out

    def _idle(self, since: float) -> None:
        """Called on the engine thread after each empty wait for work (``since``: when the engine
        last had none).  Once, on the first whole idle second at least ``recalibrate_after_s``
        after start, the adaptive budget re-measures its verification cost curve
        (:meth:`dart_core.spec.budget.AdaptiveBudget.remeasure`): the start-up measurement ran
        while the node's other processes were starting.  A request arriving meanwhile stops it
        at the next forward, and it is tried again at the next idle second (up to
        ``_RECALIBRATE_TRIES`` times)."""
        after = self.config.recalibrate_after_s
        remeasure = getattr(getattr(self.engine, "budget", None), "remeasure", None)
        if (after is None or remeasure is None or self._recalibrate_tries >= _RECALIBRATE_TRIES
                or time.monotonic() - self._started < after or time.monotonic() - since < 1.0):
            return
        self._recalibrate_tries += 1
        try:
            remeasure(self.engine.target, should_stop=lambda: not self._incoming.empty() or self._stop.is_set())
            self._recalibrate_tries = _RECALIBRATE_TRIES  # done
        except CalibrationInterrupted:
            logger.info("verification cost re-measurement stopped by a request; tried again when idle")
        except Exception:  # noqa: BLE001 - the start-up curve stays; serving goes on
            logger.exception("verification cost re-measurement failed; the start-up curve stays")
            self._recalibrate_tries = _RECALIBRATE_TRIES

    def _loop(self) -> None:
        cfg = self.config
        idle_since = time.monotonic()
        while not self._stop.is_set():
            first = self._take(cfg.max_batch_size, block=True)
            if not first:
                self._idle(idle_since)
                continue
            by_seq: dict[int, _Request] = {}
            order: list[_Request] = []

            def admit() -> list[NewSequence]:  # the first call brings the first batch
                if self._stop.is_set():
                    return []
                joining = first + self._take(cfg.max_batch_size - self.running - len(first), block=False)
                first.clear()
                return self._register(joining, by_seq, order)

            try:
                for step in self.engine.generate_stream(
                        [], [], admit=admit, cancelled=_Cancelled(by_seq), speculative=cfg.speculative,
                        max_speculative_batch=cfg.max_speculative_batch):
                    self._publish(step, by_seq)
                    if self._stop.is_set():
                        raise RuntimeError("the server is shutting down")
            except Exception as e:  # noqa: BLE001 - fail the batch's requests, keep serving the next ones
                if not self._stop.is_set():
                    logger.exception("engine step failed")
                for req in by_seq.values():
                    if not req.done:
                        req.done = True
                        _send(req, RuntimeError(f"generation failed: {e}"))
                self.running = 0
            idle_since = time.monotonic()
        while True:  # closed: nobody will serve what is still queued
            try:
                req = self._incoming.get_nowait()
            except queue.Empty:
                break
            req.done = True
            _send(req, RuntimeError("the server is shutting down"))

    def _register(self, reqs: list[_Request], by_seq: dict[int, _Request], order: list[_Request]) -> list[NewSequence]:
        now = time.perf_counter()
        for r in reqs:
            by_seq[len(order)] = r
            order.append(r)
            self.observer.on_admit(1e3 * (now - r.arrived), self.queued)
        self.running += len(reqs)
        # a request that opted out of learning leaves nothing behind: its prompt is not prefix-cached either
        return [NewSequence(r.ids, r.sampling, r.speculative, cache_prefix=r.learn, method=r.method) for r in reqs]

    def _publish(self, step: StepOutput, by_seq: dict[int, _Request]) -> None:
        prefill = not any(step.accepted_lengths)
        if not prefill:
            self.steps["speculative" if step.speculated else "autoregressive"] += 1
        logprobs = step.logprobs or [None] * len(step.seq_ids)
        for sid, toks, reason, lp, acc_len, nodes in zip(step.seq_ids, step.new_tokens, step.finish_reasons,
                                                         logprobs, step.accepted_lengths, step.draft_nodes):
            req = by_seq[sid]
            if reason is not None:
                self.running -= 1
                del by_seq[sid]
            if req.done:
                continue  # a stop string ended it already; the engine drops it now
            if reason == "cancelled":
                req.done = True
                continue
            chunk = self._chunk(req, toks, reason, prefill, lp, acc_len, nodes)
            if req.learn and self._on_sequence is not None:
                req.output.extend(toks)
            if chunk.finish_reason is not None:
                req.done = True
                req.cancelled = True  # a stop string: the engine drops the sequence at its next step
                self.observer.on_finish(chunk)
                if req.learn and self._on_sequence is not None:
                    self._on_sequence(req.ids, req.output)
            _send(req, chunk)
        self.observer.on_step(step, prefill)

    def _chunk(self, req: _Request, toks: list[int], reason: str | None, prefill: bool,
               lp: TokenLogprobs | None, acc_len: int, draft_nodes: int) -> GenerationChunk:
        # a step emits acc_len - 1 accepted draft tokens and then the target's own token, unless the
        # sequence ended first; that last token is called the bonus token only after a draft tree
        ends_with_target_token = not prefill and len(toks) == acc_len > 0
        bonus = ends_with_target_token and draft_nodes > 0
        text = req.detok.add(toks[:-1] if bonus else toks)
        bonus_text = req.detok.add(toks[-1:]) if bonus else ""
        if req.detok.stopped:
            reason = "stop"
        elif reason is not None:
            bonus_text += req.detok.finish()  # the held-back tail ends with the last token's text
        text += bonus_text
        bonus_chars = len(bonus_text) if bonus else 0
        req.completion_tokens += len(toks)
        accepted = 0
        if not prefill and toks:
            req.steps += 1
            req.step_tokens += len(toks)
            accepted = len(toks) - 1 if ends_with_target_token else len(toks)
            req.accepted_tokens += accepted
            req.draft_tokens += draft_nodes
        logprobs = None
        if lp is not None:
            decode = self.tokenizer.decode
            logprobs = tuple(TokenLogprob(t, decode([t]), p, tuple((i, decode([i]), q) for i, q in zip(ids, qs)))
                             for t, p, ids, qs in zip(toks, lp.logprobs, lp.top_ids, lp.top_logprobs))
        return GenerationChunk(text=text, token_ids=tuple(toks), finish_reason=reason,
                               prompt_tokens=len(req.ids), completion_tokens=req.completion_tokens,
                               steps=req.steps, step_tokens=req.step_tokens, logprobs=logprobs,
                               accepted=accepted, draft_nodes=draft_nodes,
                               bonus_chars=bonus_chars, draft_tokens=req.draft_tokens,
                               accepted_tokens=req.accepted_tokens)
