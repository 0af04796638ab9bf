"""The n-gram tree-search service: a grpc.aio server around the C++ engine.

``python -m ngram_service.server --trie PATH --port 50051`` (or hosted by the
Ray actor of :mod:`ngram_service.ray_actor`).  The trie is memory-mapped
once; searches run on a thread pool (the C++ search releases the GIL),
sized to the cores given.  Standard gRPC health checking
(``grpc.health.v1``) and server reflection are on.  Every request is
validated before any work: token ids outside the vocabulary, array lengths
that disagree with the declared shape, k / beam / depth / budget beyond the
configured limits, or a tokenizer (vocabulary hash) other than the trie's
answer ``INVALID_ARGUMENT`` with a message saying what is wrong, and the
server keeps serving.  A request whose deadline has passed is dropped
before the search.  An optional shared secret (``authorization: Bearer
<token>`` metadata) protects clusters without network policies.

With a live corpus (``--learn-max-tokens``, :mod:`ngram_service.live`), ``Learn`` takes the
finished sequences engine replicas send, and every search weighs each sequence's continuation in
that corpus beside its own context chain (the longer match wins), so what one replica generated
drafts for all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ngram_service._proto import ngram_pb2, ngram_pb2_grpc
from ngram_service.client import OVERRIDE_FIELDS, read_chains, usable_cpus, write_chains
from ngram_service.live import CorruptSnapshot, LiveCorpus, prefer_longer_match
from ngram_service.tree_search import ContextChain, SearchParams, search_tree_batch, search_trees
from ngram_service.trie import NgramTrie, TrieInfo

logger = logging.getLogger(__name__)

__all__ = ["ServerLimits", "NgramServer", "SERVICE_NAME", "AUTH_TOKEN_ENV"]

SERVICE_NAME = ngram_pb2.DESCRIPTOR.services_by_name["NgramTreeSearch"].full_name
AUTH_TOKEN_ENV = "DART_NGRAM_AUTH_TOKEN"


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for."""

    max_batch: int = 512
    max_k: int = 64
    max_beam_width: int = 64
    max_depth: int = 16
    max_budget: int = 256
    max_context_tokens: int = 1 << 22  # summed over a request
    max_learn_tokens: int = 1 << 20  # tokens of one Learn call
    max_live_chain: int = 256  # tokens of one live continuation answered with a search (live_chain_length)
    max_message_bytes: int = 64 << 20


class _InvalidArgument(Exception):
    pass


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise _InvalidArgument(message)


class _Servicer(ngram_pb2_grpc.NgramTreeSearchServicer):
    def __init__(self, trie: NgramTrie | None, params: SearchParams, limits: ServerLimits,
                 executor: ThreadPoolExecutor, auth_token: str | None, live: LiveCorpus | None = None) -> None:
        self.trie = trie
        self.live = live
        self.params = params
        self.limits = limits
        self.executor = executor
        self.auth_token = auth_token
        self.vocab_size = trie.vocab_size if trie is not None else None
        self.inline_batch = 1

    # -- checks ---------------------------------------------------------------

    async def _guard(self, context) -> None:
        if self.auth_token is not None:
            got = dict(context.invocation_metadata() or ()).get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.auth_token}".encode()):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the search started")

    def _check_vocab_hash(self, vocab_hash: str) -> None:
        if self.trie is not None and vocab_hash:
            _require(vocab_hash == self.trie.info.vocab_hash,
                     f"tokenizer mismatch: the request's vocabulary hash {vocab_hash[:12]}… is not the trie's "
                     f"{self.trie.info.vocab_hash[:12]}… ({self.trie.info.tokenizer_name})")

    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        if len(ids) == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        _require(lo >= 0, f"{what} has a negative token id ({lo})")
        if self.vocab_size is not None:
            _require(hi < self.vocab_size, f"{what} has token id {hi} outside the vocabulary of {self.vocab_size}")

    def _contexts(self, contexts, lengths, batch: int) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.asarray(lengths, dtype=np.int64)
        _require(len(lengths) == batch, f"context_lengths has {len(lengths)} entries for batch {batch}")
        _require(bool(np.all(lengths >= 1)), "every context needs at least its root token")
        flat = np.asarray(contexts, dtype=np.int64)
        _require(int(lengths.sum()) == len(flat), f"context_lengths sum to {int(lengths.sum())} but contexts has "
                                                  f"{len(flat)} tokens")
        _require(len(flat) <= self.limits.max_context_tokens,
                 f"{len(flat)} context tokens exceed the limit of {self.limits.max_context_tokens}")
        self._check_ids(flat, "contexts")
        offsets = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return flat, offsets

    def _chains(self, request, batch: int) -> list[ContextChain] | None:
        """The request's context continuations (None when it sends none)."""
        if not request.chain_lengths and not request.chain_tokens:
            return None
        try:
            chains, tokens, probs = read_chains(request, "chain", batch)
        except ValueError as e:
            raise _InvalidArgument(str(e)) from None
        _require(max((len(c.tokens) for c in chains), default=0) <= self.limits.max_depth,
                 f"a chain is longer than the depth limit of {self.limits.max_depth}")
        self._check_ids(tokens, "chain_tokens")
        _require(bool(np.all((probs >= 0) & (probs <= 1))), "chain_probs must lie in [0, 1]")
        return chains

    def _params(self, overrides) -> SearchParams:
        changes = {f: getattr(overrides, f) for f in OVERRIDE_FIELDS if overrides.HasField(f)}
        try:
            params = replace(self.params, **changes) if changes else self.params
        except ValueError as e:
            raise _InvalidArgument(str(e)) from None
        lim = self.limits
        _require(params.top_k <= lim.max_k, f"top_k {params.top_k} exceeds the limit of {lim.max_k}")
        _require(params.beam_width <= lim.max_beam_width,
                 f"beam_width {params.beam_width} exceeds the limit of {lim.max_beam_width}")
        _require(params.max_depth <= lim.max_depth, f"max_depth {params.max_depth} exceeds the limit of {lim.max_depth}")
        _require(params.budget <= lim.max_budget, f"budget {params.budget} exceeds the limit of {lim.max_budget}")
        return params

    # -- RPCs -----------------------------------------------------------------

    async def TreeSearch(self, request, context):
        await self._guard(context)
        lim = self.limits
        try:
            b, d, k = request.batch, request.depth, request.k
            _require(1 <= b <= lim.max_batch, f"batch must be in 1..{lim.max_batch}, got {b}")
            _require(1 <= d <= lim.max_depth, f"depth must be in 1..{lim.max_depth}, got {d}")
            _require(1 <= k <= lim.max_k, f"k must be in 1..{lim.max_k}, got {k}")
            n = b * d * k
            _require(len(request.topk_ids) == n, f"topk_ids has {len(request.topk_ids)} values, [batch, depth, k] "
                                                 f"= [{b}, {d}, {k}] needs {n}")
            _require(len(request.topk_probs) == n, f"topk_probs has {len(request.topk_probs)} values, needs {n}")
            self._check_vocab_hash(request.vocab_hash)
            ids = np.asarray(request.topk_ids, dtype=np.int64)
            self._check_ids(ids, "topk_ids")
            probs = np.asarray(request.topk_probs, dtype=np.float32)
            _require(bool(np.all((probs >= 0) & (probs <= 1))), "topk_probs must lie in [0, 1]")
            flat, offsets = self._contexts(request.contexts, request.context_lengths, b)
            params = self._params(request.params)
            chains = self._chains(request, b)
            hint = request.live_chain_length
            _require(0 <= hint <= lim.max_live_chain,
                     f"live_chain_length must be in 0..{lim.max_live_chain}, got {hint}")
        except _InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        contexts = [flat[offsets[i]:offsets[i + 1]] for i in range(b)]
        live = None  # the live corpus's continuations, when the search weighs them or the client asked for them
        if self.live is not None and (params.context_weight > 0 or hint):
            live = [self.live.chain(c, max(d, hint)) for c in contexts]
            if params.context_weight > 0:
                chains = prefer_longer_match(chains, live, d)

        search = search_tree_batch if request.padded else search_trees

        trie = self.trie  # one trie for the whole call: a swap (NgramServer.swap_trie) waits for no one

        def run():
            t0 = time.perf_counter()
            out = search(ids.reshape(b, d, k), probs.reshape(b, d, k), contexts, trie=trie, params=params,
                         chains=chains)
            return out, 1e3 * (time.perf_counter() - t0)

        if b <= self.inline_batch:  # a small search costs less than a hop to the pool and back
            trees, search_ms = run()
        else:
            trees, search_ms = await asyncio.get_running_loop().run_in_executor(self.executor, run)
        if request.padded:
            response = ngram_pb2.TreeSearchResponse(
                batch=ngram_pb2.TreeBatch(num_nodes=trees.num_nodes, counts=trees.counts.tolist(),
                                          tokens=trees.tokens.ravel().tolist(), parents=trees.parents.ravel().tolist(),
                                          depths=trees.depths.ravel().tolist(), scores=trees.scores.ravel().tolist(),
                                          probs=trees.probs.ravel().tolist()),
                search_ms=search_ms)
        else:
            response = ngram_pb2.TreeSearchResponse(
                trees=[ngram_pb2.DraftTree(tokens=t.tokens.tolist(), parents=t.parents.tolist(),
                                           depths=t.depths.tolist(), scores=t.scores.tolist(), probs=t.probs.tolist())
                       for t in trees],
                search_ms=search_ms)
        if hint and live is not None:
            write_chains(response, "live", live, hint)
        return response

    async def Lookup(self, request, context):
        await self._guard(context)
        try:
            _require(self.trie is not None, "this service runs without a trie (logits-only)")
            b = len(request.context_lengths)
            _require(1 <= b <= self.limits.max_batch, f"batch must be in 1..{self.limits.max_batch}, got {b}")
            m = request.num_tokens
            _require(m >= 1 and len(request.tokens) == b * m,
                     f"tokens has {len(request.tokens)} values, [batch, num_tokens] = [{b}, {m}] needs {b * m}")
            self._check_vocab_hash(request.vocab_hash)
            tokens = np.asarray(request.tokens, dtype=np.int64)
            self._check_ids(tokens, "tokens")
            flat, offsets = self._contexts(request.contexts, request.context_lengths, b)
        except _InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        contexts = [flat[offsets[i]:offsets[i + 1]] for i in range(b)]
        loop = asyncio.get_running_loop()
        trie = self.trie
        probs = await loop.run_in_executor(self.executor, lambda: trie.probability_batch(contexts, tokens.reshape(b, m)))
        return ngram_pb2.LookupResponse(probabilities=probs.ravel().tolist())

    async def Learn(self, request, context):
        await self._guard(context)
        if self.live is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this service keeps no live corpus (started without --learn-max-tokens)")
        try:
            lengths = np.asarray(request.lengths, dtype=np.int64)
            _require(bool(np.all(lengths >= 0)) and int(lengths.sum()) == len(request.tokens),
                     f"lengths sum to {int(lengths.sum())} but tokens has {len(request.tokens)} values")
            _require(len(request.tokens) <= self.limits.max_learn_tokens,
                     f"{len(request.tokens)} tokens exceed the limit of {self.limits.max_learn_tokens} per call")
            self._check_vocab_hash(request.vocab_hash)
            known = self.live.vocab_hash
            _require(not (known and request.vocab_hash) or request.vocab_hash == known,
                     f"tokenizer mismatch: the request's vocabulary hash {request.vocab_hash[:12]}… is not the live "
                     f"corpus's {known[:12]}…")
            tokens = np.asarray(request.tokens, dtype=np.int64)
            self._check_ids(tokens, "tokens")
        except _InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ends = np.cumsum(lengths)
        docs = [tokens[e - n:e] for e, n in zip(ends, lengths)]
        if not self.live.vocab_hash and request.vocab_hash:  # a logits-only service learns its tokenizer here
            self.live.vocab_hash = request.vocab_hash
        added = await asyncio.get_running_loop().run_in_executor(self.executor, self.live.add, docs)
        return ngram_pb2.LearnResponse(tokens_added=added, tokens_held=len(self.live))

    def _live_info(self) -> ngram_pb2.LiveCorpusInfo | None:
        if self.live is None:
            return None
        st = self.live.stats()
        return ngram_pb2.LiveCorpusInfo(max_context=self.live.max_context, tokens=st.tokens, max_tokens=st.max_tokens,
                                        bytes=st.bytes, inserts=st.inserts, evicted=st.evicted, lookups=st.lookups,
                                        hits=st.hits)

    async def Info(self, request, context):
        await self._guard(context)
        lim = self.limits
        if self.trie is None:
            return ngram_pb2.InfoResponse(max_batch=lim.max_batch, max_k=lim.max_k, max_depth=lim.max_depth,
                                          max_budget=lim.max_budget, live=self._live_info())
        i = self.trie.info
        return ngram_pb2.InfoResponse(
            order=i.order, vocab_size=i.vocab_size, num_nodes=i.num_nodes, nodes_per_level=list(i.nodes_per_level),
            total_tokens=i.total_tokens, tokenizer_name=i.tokenizer_name, vocab_hash=i.vocab_hash,
            metadata_json=json.dumps(i.metadata, sort_keys=True), max_batch=lim.max_batch, max_k=lim.max_k,
            max_depth=lim.max_depth, max_budget=lim.max_budget, live=self._live_info())


class NgramServer:
    """A running tree-search server (grpc.aio on its own event-loop thread).

    Args:
        trie_path: trie to memory-map; None serves the logits-only search.
        host, port: bind address; port 0 picks a free port (see :attr:`port`).
        threads: search threads (default: the CPUs this process may use): one call searches
            its sequences on up to this many threads (``SearchParams.num_threads``), and up to
            this many calls run at once.
        params: default search parameters (reference defaults); their ``num_threads`` is ``threads``.
        auth_token: shared secret required as ``authorization: Bearer <token>``.
        learn_max_tokens: keep a live corpus of served sequences (``Learn``) of at most this many
            tokens (:class:`~ngram_service.live.LiveCorpus`); None: none.
        learn_snapshot: with a live corpus, a snapshot file: loaded at start (a missing one is
            fine; a corrupt one is logged and the service starts empty), written every
            ``snapshot_every_s`` seconds when the corpus changed, and at :meth:`stop`.
    """

    def __init__(self, trie_path: str | None, *, host: str = "127.0.0.1", port: int = 0, threads: int | None = None,
                 params: SearchParams | None = None, limits: ServerLimits | None = None,
                 auth_token: str | None = None, learn_max_tokens: int | None = None,
                 learn_snapshot: str | None = None, snapshot_every_s: float = 60.0) -> None:
        self.trie = NgramTrie(trie_path) if trie_path else None
        self.live = (LiveCorpus(learn_max_tokens, vocab_hash=self.trie.info.vocab_hash if self.trie else "")
                     if learn_max_tokens else None)
        self.snapshot = learn_snapshot if self.live is not None else None
        self.snapshot_every_s = snapshot_every_s
        self._saved_inserts = 0
        self._stop_snapshots = threading.Event()
        if self.snapshot is not None and os.path.exists(self.snapshot):
            try:
                n = self.live.load(self.snapshot)
                logger.info("live corpus: %d tokens reloaded from %s", n, self.snapshot)
            except (CorruptSnapshot, OSError) as e:
                logger.error("live corpus snapshot refused, starting empty: %s", e)
        self.host = host
        self.requested_port = port
        self.threads = threads or usable_cpus()
        self.params = replace(params or SearchParams(), num_threads=self.threads)
        self.limits = limits or ServerLimits()
        self.auth_token = auth_token
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="tree-search")
        self._servicer: _Servicer | None = None
        self._swap_lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _start(self) -> None:
        opts = [("grpc.max_receive_message_length", self.limits.max_message_bytes),
                ("grpc.max_send_message_length", self.limits.max_message_bytes),
                ("grpc.so_reuseport", 0), ("grpc.optimization_target", "latency")]
        server = grpc.aio.server(options=opts)
        self._servicer = _Servicer(self.trie, self.params, self.limits, self._executor, self.auth_token, self.live)
        ngram_pb2_grpc.add_NgramTreeSearchServicer_to_server(self._servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        port = server.add_insecure_port(f"{self.host}:{self.requested_port}")
        if port == 0:
            raise OSError(f"cannot bind {self.host}:{self.requested_port}")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port

    def start(self) -> "NgramServer":
        """Starts serving on a background thread; returns once the port is bound."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._start())
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                errors.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="ngram-grpc", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        logger.info("n-gram tree-search service on %s (%s, %d search threads)", self.address,
                    self.trie or "logits-only", self.threads)
        if self.snapshot is not None:
            threading.Thread(target=self._snapshots, name="ngram-live-snapshot", daemon=True).start()
        return self

    def swap_trie(self, path: str | os.PathLike[str]) -> TrieInfo:
        """Serves the trie at ``path`` from now on, in place of the one served: the new file is
        opened and checked first, then one reference is replaced, so a search already running
        finishes on the old trie, whose mapping is released when the last such search ends.  The new
        trie must name the tokenizer of the old one (or, for a logits-only service, of its live
        corpus, where that is known).  Clients learn the new trie's order from ``Info`` when they
        next connect; until then they send the context the old one needed.

        Returns: the new trie's :class:`~ngram_service.trie.TrieInfo`.

        Raises:
            FileNotFoundError / OSError: no readable file; TrieFormatError: not a sound trie;
            TokenizerMismatchError: a trie of another tokenizer.  The old trie is served on."""
        new = NgramTrie(path)
        with self._swap_lock:
            old = self.trie
            expected = old.info.vocab_hash if old is not None else (self.live.vocab_hash if self.live else "")
            if expected:
                new.check_tokenizer(expected)
            self.trie = new
            if self._servicer is not None:
                self._servicer.trie = new
            if self.live is not None and not self.live.vocab_hash:
                self.live.vocab_hash = new.info.vocab_hash
        logger.info("n-gram trie swapped: %s -> %s (order %d, %d nodes)", old.path if old else "logits-only",
                    new.path, new.info.order, new.info.num_nodes)
        return new.info

    def location(self, since: int = -1) -> dict:
        """What an engine on this server's node needs to search in its own process
        (:class:`~ngram_service.client.ColocatedTreeSearch`): ``{"trie"`` (the file served now; None:
        logits-only), ``"trie_mtime_ns"`` (0 without one or where the file is gone), ``"live"}``;
        ``live`` is None without a live corpus, else ``{"stream", "position", "reset", "tokens",
        "max_tokens", "max_context", "min_match", "vocab_hash"}`` with the tokens appended after
        stream position ``since`` (:meth:`LiveCorpus.tokens_since
        <ngram_service.live.LiveCorpus.tokens_since>`: [T] int64, document boundaries included).
        The Serve deployment adds its node and address."""
        trie = self.trie
        path = None if trie is None else str(trie.path)
        try:
            mtime = os.stat(path).st_mtime_ns if path else 0
        except OSError:  # removed under the mapping: an engine finds the path unreadable and searches through us
            mtime = 0
        out = {"trie": path, "trie_mtime_ns": mtime, "live": None}
        live = self.live
        if live is not None:
            position, reset, tokens = live.tokens_since(since)
            out["live"] = {"stream": live.stream_id, "position": position, "reset": reset, "tokens": tokens,
                           "max_tokens": live.max_tokens, "max_context": live.max_context, "min_match": live.min_match,
                           "vocab_hash": live.vocab_hash}
        return out

    def save_snapshot(self) -> bool:
        """Writes the live corpus's snapshot when it changed since the last one; False when there
        was nothing to write (or no snapshot file), or the write failed (logged)."""
        if self.snapshot is None:
            return False
        inserts = self.live.stats().inserts
        if inserts == self._saved_inserts:
            return False
        try:
            self.live.save(self.snapshot)
        except OSError as e:
            logger.error("live corpus snapshot %s not written: %s", self.snapshot, e)
            return False
        self._saved_inserts = inserts
        logger.info("live corpus: %d tokens written to the snapshot %s", len(self.live), self.snapshot)
        return True

    def _snapshots(self) -> None:
        while not self._stop_snapshots.wait(self.snapshot_every_s):
            self.save_snapshot()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving (in-flight calls get ``grace_s`` seconds), ends the loop thread, and writes
        the live corpus's snapshot (where it has one)."""
        self._stop_snapshots.set()
        if self._server is not None and self._loop is not None:
            async def shutdown() -> None:
                await self._server.stop(grace_s)
                self._loop.stop()

            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(shutdown()))
            self._thread.join(timeout=grace_s + 5)
            self._server = None
        self._executor.shutdown(wait=False)
        self.save_snapshot()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ngram_service.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trie", help="trie file; without it the service does logits-only searches")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--threads", type=int, default=None, help="search threads [CPUs available]")
    ap.add_argument("--learn-max-tokens", type=int, default=0,
                    help="keep a live corpus of served sequences of at most this many tokens (0: none)")
    ap.add_argument("--learn-snapshot", default=None,
                    help="the live corpus's snapshot file: reloaded at start, written every minute and at exit")
    ap.add_argument("--auth-token-env", default=AUTH_TOKEN_ENV,
                    help="environment variable holding the shared secret (unset: no auth)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = NgramServer(args.trie, host=args.host, port=args.port, threads=args.threads,
                         auth_token=os.environ.get(args.auth_token_env) or None,
                         learn_max_tokens=args.learn_max_tokens or None,
                         learn_snapshot=args.learn_snapshot).start()
    print(f"serving on {server.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
