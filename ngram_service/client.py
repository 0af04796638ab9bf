"""Where the engine gets its draft trees: one small interface, two implementations.

:class:`TreeSearchClient` builds one draft tree per sequence from the draft
head's top-k.  :class:`InProcessTreeSearch` runs the C++ search in the
calling process (the trie memory-mapped there, or none: the logits-only
search).  :class:`GrpcTreeSearch` asks the n-gram service over gRPC: one
channel reused for every call, a per-call timeout in milliseconds, bounded
retries, and **fallback** to the in-process logits-only search whenever the
service is unreachable, slow or refuses a call, so a decoding step never
fails because of the trie.  After a failure the service is skipped for
``cooldown_s`` (no timeout paid on every step while it is down); then the
next call tries it again.  With a resolver (a restarted Ray actor may come
back elsewhere), the address is looked up again on a background thread, never
in the caller's step.  Fallbacks are counted.  The engine takes any of them;
tests inject fakes.  This module needs neither torch nor the engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Callable, Sequence

import grpc
import numpy as np

from ngram_service._proto import ngram_pb2, ngram_pb2_grpc
from ngram_service.live import MAX_MATCH, LiveCorpus, with_live_chains
from ngram_service.tree_search import ContextChain, DraftTree, SearchParams, TreeBatch, search_tree_batch, search_trees
from ngram_service.trie import NgramTrie

logger = logging.getLogger(__name__)

__all__ = ["TreeSearchClient", "InProcessTreeSearch", "GrpcTreeSearch", "ColocatedTreeSearch", "LearnSender",
           "MAX_CONTEXT_TAIL", "usable_cpus", "write_chains", "read_chains"]

#: Context tokens sent per sequence before the service's trie order is known (orders go up to 6).
MAX_CONTEXT_TAIL = 8
#: SearchParams fields a request may override (the fields of the proto's SearchOverrides).  Defined
#: here, not in the server module, so a client needs neither grpcio-health-checking nor reflection.
OVERRIDE_FIELDS = tuple(f.name for f in ngram_pb2.SearchOverrides.DESCRIPTOR.fields)


class TreeSearchClient(ABC):
    """Builds one draft tree per sequence from the draft head's top-k."""

    @abstractmethod
    def search(self, topk_ids: np.ndarray, topk_probs: np.ndarray, contexts: Sequence[np.ndarray],
               params: SearchParams, chains: Sequence[ContextChain | None] | None = None) -> list[DraftTree]:
        """Args: topk_ids [B, d, k] int64 target ids; topk_probs [B, d, k] float32;
        contexts: B token arrays ending with each root (bonus) token (the search reads only
        the last order - 1); chains: None or B context continuations (used when
        ``params.context_weight`` > 0).
        Returns: B prefix-closed trees (node 0 = root).
        Raises: ValueError on bad shapes or ids (the in-process search; a remote one falls back)."""

    def search_batch(self, topk_ids: np.ndarray, topk_probs: np.ndarray, contexts: Sequence[np.ndarray],
                     params: SearchParams, chains: Sequence[ContextChain | None] | None = None) -> TreeBatch:
        """:meth:`search`'s trees as one padded :class:`~ngram_service.tree_search.TreeBatch` (what the
        engine's step reads).  This default packs :meth:`search`'s trees; the in-process search has the
        C++ search write the batch directly."""
        return TreeBatch.from_trees(self.search(topk_ids, topk_probs, contexts, params, chains))

    def chains(self, contexts: Sequence[Sequence[int]], chains: Sequence[ContextChain | None] | None,
               max_len: int) -> Sequence[ContextChain | None] | None:
        """Each sequence's chain: ``chains`` (the requests' own), or where this client keeps a live
        corpus in its process, the longer-matching of each and the corpus's continuation of
        ``contexts[b]`` (its tokens, the last ones read; :func:`~ngram_service.live.with_live_chains`).
        A lookup step asks it; this default returns ``chains`` as given."""
        return chains

    def learn(self, documents: Sequence[Sequence[int]]) -> int:  # noqa: B027 - optional hook
        """Sends finished sequences (token ids) to the live corpus, where there is one
        (:mod:`ngram_service.live`); returns the tokens it took (0: no live corpus here, or the
        call failed: learning never fails a request).  This default keeps none."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases resources (channels, threads)."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), the default search thread count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class InProcessTreeSearch(TreeSearchClient):
    """The C++ search in this process, with the trie memory-mapped here
    (``trie=None``: logits-only search, the service's fallback).

    Args:
        trie: the n-gram trie, or None.
        threads: search threads: a batch's sequences are searched on up to this many
            threads at once (``SearchParams.num_threads``; the output does not depend on
            it). None: the CPUs this process may use (:func:`usable_cpus`), as the gRPC
            service does. The search runs between the target's forwards; on a CPU target,
            PyTorch's OpenMP workers may still be spinning on the cores right after a
            forward, and the extra threads then gain little.

        live: a live corpus (:class:`~ngram_service.live.LiveCorpus`) that :meth:`learn` feeds and
            every search weighs beside the request's own context chain (the longer match wins); None: none.

    Raises:
        ValueError: ``threads`` < 1.
    """

    def __init__(self, trie: NgramTrie | None = None, *, threads: int | None = None,
                 live: LiveCorpus | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.trie = trie
        self.live = live
        self.threads = threads or usable_cpus()
        self._threaded: dict[tuple[SearchParams, int], SearchParams] = {}

    def search(self, topk_ids, topk_probs, contexts, params, chains=None):
        return search_trees(topk_ids, topk_probs, contexts, trie=self.trie, params=self._params(params, len(contexts)),
                            chains=self._chains(topk_ids, contexts, params, chains))

    def search_batch(self, topk_ids, topk_probs, contexts, params, chains=None):
        return search_tree_batch(topk_ids, topk_probs, contexts, trie=self.trie,
                                 params=self._params(params, len(contexts)),
                                 chains=self._chains(topk_ids, contexts, params, chains))

    def learn(self, documents):
        return self.live.add(documents) if self.live is not None else 0

    def chains(self, contexts, chains, max_len):
        return with_live_chains(self.live, contexts, chains, max_len) if self.live is not None else chains

    def _chains(self, topk_ids, contexts, params: SearchParams, chains):
        """The chains a search weighs (none with ``context_weight`` 0: the paper's search)."""
        return self.chains(contexts, chains, np.shape(topk_ids)[1]) if params.context_weight > 0 else chains

    def _params(self, params: SearchParams, batch: int) -> SearchParams:
        n = max(1, min(self.threads, batch))
        if params.num_threads != n:  # the same search on n threads (converted to C++ once per params)
            key = (params, n)
            if key not in self._threaded:
                if len(self._threaded) > 64:
                    self._threaded.clear()
                self._threaded[key] = replace(params, num_threads=n)
            params = self._threaded[key]
        return params


def _answer(response: ngram_pb2.TreeSearchResponse, batch: int, padded: bool) -> list[DraftTree] | TreeBatch:
    """The trees of a TreeSearch answer, as a list or (``padded``) one batch, checked.

    Raises:
        ValueError: a malformed tree, or not one tree per sequence."""
    if padded and response.HasField("batch"):
        a = response.batch
        trees = TreeBatch.checked(a.tokens, a.parents, a.depths, a.scores, a.probs, a.counts)
        if trees.num_nodes != a.num_nodes:
            raise ValueError(f"a batch of {a.num_nodes} nodes per tree came with arrays of {trees.num_nodes}")
    else:
        trees = [DraftTree.from_parents(t.tokens, t.parents, t.depths, t.scores, t.probs) for t in response.trees]
    if len(trees) != batch:
        raise ValueError(f"{len(trees)} trees for {batch} sequences")
    trees = TreeBatch.from_trees(trees) if padded and not isinstance(trees, TreeBatch) else trees
    if padded and len(response.live_lengths):
        object.__setattr__(trees, "live", _live_chains(response, batch))  # a batch built here, seen by no one yet
    return trees


def _live_chains(response: ngram_pb2.TreeSearchResponse, batch: int) -> tuple[ContextChain, ...]:
    """The live-corpus continuations of a TreeSearch answer, one per sequence, checked
    (:func:`read_chains`; raises ValueError)."""
    return tuple(read_chains(response, "live", batch)[0])


def write_chains(message, prefix: str, chains: Sequence[ContextChain | None], max_len: int | None = None) -> None:
    """Puts chains into a message's four chain fields, ``<prefix>_lengths``, ``_tokens``, ``_probs``
    and ``_match_lengths`` (a TreeSearchRequest's ``chain_*``, a TreeSearchResponse's ``live_*``):
    each chain's first ``max_len`` tokens (None: all), a None chain as an empty one."""
    chains = [ContextChain.empty() if c is None else c for c in chains]
    tokens = [c.tokens[:max_len] for c in chains]
    getattr(message, f"{prefix}_lengths").extend([len(t) for t in tokens])
    getattr(message, f"{prefix}_match_lengths").extend([int(c.match_length) for c in chains])
    if any(len(t) for t in tokens):
        getattr(message, f"{prefix}_tokens").extend(np.concatenate(tokens).tolist())
        getattr(message, f"{prefix}_probs").extend(
            np.concatenate([np.asarray(c.probs[:max_len], np.float32) for c in chains]).tolist())


def read_chains(message, prefix: str, batch: int) -> tuple[list[ContextChain], np.ndarray, np.ndarray]:
    """The chains :func:`write_chains` put into a message, one per sequence, with the flat token
    [sum L] int64 and probability [sum L] float32 arrays they are views of (for further checks).
    Absent match lengths read as 0 (a sender that predates them).

    Raises:
        ValueError: not one chain per sequence, or lengths that do not add up to the tokens and
            probabilities."""
    lengths = np.asarray(getattr(message, f"{prefix}_lengths"), dtype=np.int64)
    tokens = np.asarray(getattr(message, f"{prefix}_tokens"), dtype=np.int64)
    probs = np.asarray(getattr(message, f"{prefix}_probs"), dtype=np.float32)
    matched = list(getattr(message, f"{prefix}_match_lengths")) or [0] * batch
    if len(lengths) != batch or len(matched) != batch:
        raise ValueError(f"{prefix}_lengths and {prefix}_match_lengths need one entry per sequence of the batch "
                         f"of {batch}, not {len(lengths)} and {len(matched)}")
    if np.any(lengths < 0) or int(lengths.sum()) != tokens.size or probs.size != tokens.size:
        raise ValueError(f"{prefix}_tokens and {prefix}_probs must hold sum({prefix}_lengths) values")
    ends = np.cumsum(lengths)
    return ([ContextChain(tokens[e - n:e], probs[e - n:e], int(m)) for e, n, m in zip(ends, lengths, matched)],
            tokens, probs)


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),  # retries are ours, bounded
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.optimization_target", "latency"),
    ("grpc.enable_http_proxy", 0),  # loopback and cluster-internal addresses
]


class GrpcTreeSearch(TreeSearchClient):
    """Tree search through the service (see module docstring).

    Args:
        address: ``host:port`` of the service, or None with ``resolver``.
        resolver: returns the current address (e.g. asks the Ray actor; may block for
            seconds); called on a background thread at start and after each failure's
            cooldown, never inside :meth:`search`.  Until it answers, searches fall back.
        timeout_ms: deadline of one call.
        retries: extra attempts within one step (bounded; 0 = none).
        cooldown_s: how long to use the fallback after a failure before trying the service again.
        vocab_hash: the engine tokenizer's identity, checked by the service.
        auth_token: shared secret sent as ``authorization: Bearer <token>``.
        fallback: what answers when the service cannot (default: logits-only, in process).
        live_chain_length: once the service said it keeps a live corpus (``Info``), each
            :meth:`search_batch` asks for every sequence's live-corpus continuation too, up to this
            many tokens (:attr:`TreeBatch.live <ngram_service.tree_search.TreeBatch>`), which the
            engine's lookup steps follow without another call (0: never).

    Raises:
        ValueError: neither an address nor a resolver, or a negative ``live_chain_length``.
    """

    def __init__(self, address: str | None = None, *, resolver: Callable[[], str] | None = None,
                 timeout_ms: float = 50.0, retries: int = 1, cooldown_s: float = 1.0, vocab_hash: str = "",
                 auth_token: str | None = None, fallback: TreeSearchClient | None = None,
                 live_chain_length: int = 0) -> None:
        if address is None and resolver is None:
            raise ValueError("give the service address or a resolver")
        if live_chain_length < 0:
            raise ValueError(f"live_chain_length must be >= 0, got {live_chain_length}")
        self.live_chain_length = live_chain_length
        self.service_live = False  # the service said it keeps a live corpus
        self.resolver = resolver
        self.timeout_s = timeout_ms / 1e3
        self.retries = retries
        self.cooldown_s = cooldown_s
        self.vocab_hash = vocab_hash
        self.metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self.fallback = fallback or InProcessTreeSearch(None)
        self.calls = 0
        self.fallbacks = 0
        self.errors: dict[str, int] = {}
        self._lock = threading.Lock()
        self._skip_until = 0.0
        self._address: str | None = None
        self._channel: grpc.Channel | None = None
        self._stub = None
        self._resolving = False
        self._closed = False
        self._tail: int | None = None
        self._connected = threading.Event()
        if address is not None:
            self._connect(address)
        else:
            self.resolve_in_background()

    @property
    def address(self) -> str | None:
        return self._address

    def _connect(self, address: str) -> None:
        """Points the client at ``address`` (a new channel when it changed; the cooldown, which was
        about the old address, ends); call with the lock held."""
        if self._closed or (address == self._address and self._channel is not None):
            return
        # the old channel is not closed here: a search on another thread may still be using it;
        # it closes when the last reference goes
        self._skip_until = 0.0
        self._address = address
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = ngram_pb2_grpc.NgramTreeSearchStub(self._channel)
        self._tail, self.service_live = None, False
        self._learn_tail(self._stub)
        self._connected.set()

    def wait_resolved(self, timeout_s: float | None = None) -> bool:
        """Blocks until an address is known (the first resolution answered); False on timeout.
        Never needed for correctness (searches fall back meanwhile); for callers that want the
        service from the first step on."""
        return self._connected.wait(timeout_s)

    def resolve_in_background(self) -> None:
        """Asks the resolver for the service's address again, on a daemon thread (one call at a time;
        a call while one runs does nothing); a new address takes effect at the next search.  The
        client calls it itself after a failure; a caller that learns the service moved (as
        :class:`ColocatedTreeSearch` does from ``locate``) calls it too.  Without a resolver, or
        once closed, it does nothing."""
        with self._lock:
            if self._resolving or self._closed or self.resolver is None:
                return
            self._resolving = True

        def run() -> None:
            try:
                address = self.resolver()
            except Exception as e:  # noqa: BLE001 - the resolver may fail while the service restarts
                logger.warning("cannot resolve the n-gram service address: %s", e)
                address = None
            with self._lock:
                self._resolving = False
                if address is not None:
                    self._connect(address)

        threading.Thread(target=run, name="ngram-resolve", daemon=True).start()

    @property
    def context_tail(self) -> int:
        """Tokens of each context sent: the trie's order - 1 (or, with a live corpus, the longest match
        it measures, :data:`~ngram_service.live.MAX_MATCH`, if more) once the service said it
        (``Info``), until then :data:`MAX_CONTEXT_TAIL` (enough for any supported order)."""
        return self._tail or MAX_CONTEXT_TAIL

    def _learn_tail(self, stub) -> None:
        """Asks the service for its trie order (on a daemon thread: never in a search)."""
        def run() -> None:
            try:
                info = stub.Info(ngram_pb2.InfoRequest(), timeout=max(self.timeout_s, 2.0), metadata=self.metadata)
            except (grpc.RpcError, ValueError):
                return  # keep sending the longer tail; asked again after the next connection
            with self._lock:
                if self._stub is stub:  # not an answer from an address the client has left since
                    # a logits-only service (order 0) needs the root only; a live corpus measures matches up to MAX_MATCH
                    self._tail = max(info.order - 1, MAX_MATCH if info.HasField("live") else 0, 1)
                    self.service_live = info.HasField("live")

        threading.Thread(target=run, name="ngram-info", daemon=True).start()

    def _request(self, topk_ids, topk_probs, contexts, params: SearchParams, chains) -> ngram_pb2.TreeSearchRequest:
        b, d, k = topk_ids.shape
        tail = self.context_tail
        contexts = [c[-tail:] for c in contexts]  # the search reads no further back
        request = ngram_pb2.TreeSearchRequest(
            batch=b, depth=d, k=k, topk_ids=topk_ids.ravel().tolist(), topk_probs=topk_probs.ravel().tolist(),
            contexts=np.concatenate(contexts).tolist() if len(contexts) else [],
            context_lengths=[len(c) for c in contexts], vocab_hash=self.vocab_hash,
            params=ngram_pb2.SearchOverrides(**{f: getattr(params, f) for f in OVERRIDE_FIELDS}))
        if chains is not None and params.context_weight > 0:
            write_chains(request, "chain", chains)
        return request

    def search(self, topk_ids: np.ndarray, topk_probs: np.ndarray, contexts: Sequence[np.ndarray],
               params: SearchParams, chains: Sequence[ContextChain | None] | None = None) -> list[DraftTree]:
        return self._search(topk_ids, topk_probs, contexts, params, chains, padded=False)

    def search_batch(self, topk_ids: np.ndarray, topk_probs: np.ndarray, contexts: Sequence[np.ndarray],
                     params: SearchParams, chains: Sequence[ContextChain | None] | None = None) -> TreeBatch:
        """:meth:`search` answered as one padded batch (the request's ``padded``: a few flat arrays on
        the wire instead of a message per tree); a service that predates it answers trees, packed here."""
        return self._search(topk_ids, topk_probs, contexts, params, chains, padded=True)

    def _search(self, topk_ids, topk_probs, contexts, params, chains, padded: bool):
        topk_ids = np.asarray(topk_ids, dtype=np.int64)
        topk_probs = np.asarray(topk_probs, dtype=np.float32)
        contexts = [np.asarray(c, dtype=np.int64) for c in contexts]
        with self._lock:
            self.calls += 1
            cooling = time.monotonic() < self._skip_until
            stub, address = self._stub, self._address
            resolving = self._resolving
            retry_after_failure = not cooling and self._skip_until > 0
        if retry_after_failure:
            self.resolve_in_background()  # the service may have come back somewhere else
        if cooling:
            return self._fall_back(topk_ids, topk_probs, contexts, params, chains, None, padded=padded)
        if stub is None:  # no address yet: waiting for the resolver is no failure, its failing is
            return self._fall_back(topk_ids, topk_probs, contexts, params, chains, None if resolving else "UNRESOLVED",
                                   padded=padded)
        request = self._request(topk_ids, topk_probs, contexts, params, chains)
        request.padded = padded
        if padded and self.service_live:
            request.live_chain_length = self.live_chain_length
        code = None
        for _ in range(1 + self.retries):
            try:
                response = stub.TreeSearch(request, timeout=self.timeout_s, metadata=self.metadata)
            except ValueError:  # the channel was closed under this call (close() from another thread)
                code = grpc.StatusCode.CANCELLED
                break
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.PERMISSION_DENIED):
                    logger.error("n-gram service refused the call (%s): %s", code.name, e.details())
                    break  # retrying cannot help
                continue
            try:
                trees = _answer(response, len(contexts), padded)
            except ValueError as e:  # a malformed answer (another version of the service?) is a failure
                logger.error("n-gram service answered a malformed tree: %s", e)
                code = grpc.StatusCode.INTERNAL
                break
            with self._lock:
                self._skip_until = 0.0
            return trees
        return self._fall_back(topk_ids, topk_probs, contexts, params, chains, code.name if code else "UNKNOWN",
                               address, padded=padded)

    def _fall_back(self, topk_ids, topk_probs, contexts, params, chains, error: str | None,
                   address: str | None = None, padded: bool = False) -> list[DraftTree] | TreeBatch:
        """Answers in process; an ``error`` at ``address`` starts the cooldown, unless the client has
        moved to another address meanwhile (the failure was the old one's)."""
        with self._lock:
            self.fallbacks += 1
            if error is not None:
                self.errors[error] = self.errors.get(error, 0) + 1
                if address is None or address == self._address:
                    if self._skip_until == 0.0:
                        logger.warning("n-gram service at %s failed (%s): logits-only tree search for %.1f s",
                                       self._address, error, self.cooldown_s)
                    self._skip_until = time.monotonic() + self.cooldown_s
        if padded:
            return self.fallback.search_batch(topk_ids, topk_probs, contexts, params, chains)
        return self.fallback.search(topk_ids, topk_probs, contexts, params, chains)

    def info(self) -> ngram_pb2.InfoResponse:
        """The service's trie description (raises grpc.RpcError when unreachable)."""
        return self._stub.Info(ngram_pb2.InfoRequest(), timeout=max(self.timeout_s, 1.0), metadata=self.metadata)

    def learn(self, documents: Sequence[Sequence[int]]) -> int:
        """One ``Learn`` call with every document (token ids); returns the tokens the service took,
        0 where it keeps no live corpus, is skipped after a failure, or refuses or fails the call
        (counted in :attr:`errors`, logged at most once per error kind).  Blocks for up to ten
        times the search timeout: call it off the decoding path."""
        docs = [np.asarray(d, dtype=np.int64).reshape(-1) for d in documents]
        docs = [d for d in docs if d.size]
        stub = self._stub
        if not docs or stub is None or time.monotonic() < self._skip_until:
            return 0
        request = ngram_pb2.LearnRequest(tokens=np.concatenate(docs).tolist(), lengths=[d.size for d in docs],
                                         vocab_hash=self.vocab_hash)
        try:
            return int(stub.Learn(request, timeout=10 * self.timeout_s, metadata=self.metadata).tokens_added)
        except grpc.RpcError as e:
            kind = f"learn-{e.code().name}"
            with self._lock:
                self.errors[kind] = self.errors.get(kind, 0) + 1
                first = self.errors[kind] == 1
            if first:
                logger.warning("n-gram service did not take the learned sequences (%s): %s", e.code().name,
                               e.details())
            return 0

    def close(self) -> None:
        """Closes the channel; a resolver still running is ignored when it returns."""
        with self._lock:
            self._closed = True
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None


class ColocatedTreeSearch(TreeSearchClient):
    """The n-gram service's tree search run in the engine's own process when the service's trie
    file is on the engine's node, with a mirror of the service's live corpus; otherwise the service
    itself over gRPC.

    A search through the service pays its round trip and a second process's wake-up on every
    step; on a one-node deployment of a few cores that is several times the search itself.  Where
    ``locate`` says the service runs on ``node_id`` (this process's node) and its trie file is
    readable here, this client maps the same file and searches in process
    (:class:`InProcessTreeSearch`), weighing a mirror of the service's live corpus: a daemon
    thread asks ``locate`` every ``interval_s`` for the tokens the corpus took since the last answer
    (every replica's learned sequences and the admin route's corpora) and for the trie served now
    (a swapped trie is mapped on the next answer).  Learning still goes to the service
    (:meth:`learn`), which every replica shares; an engine's own sequences reach its mirror on the
    next answer.  Until the first answer, on another node, without a readable file, with a trie
    of another tokenizer, or while ``locate`` fails, every search goes to ``remote``.  Output never
    depends on which search answered (verification decides every token).

    Args:
        remote: the service's gRPC client (its fallback included); also sends :meth:`learn`.
        locate: ``since -> dict``, the service's answer (``NgramService.locate`` in
            ``deployments/ngram.py``): ``{"node_id", "address", "trie", "trie_mtime_ns", "live"}``, ``live``
            None or ``{"stream", "position", "reset", "tokens", "max_tokens", "max_context", "min_match",
            "vocab_hash"}``
            (``stream``: the corpus's :attr:`~ngram_service.live.LiveCorpus.stream_id`; a new one, as
            after the service restarted, starts the mirror over).
            It may block (a Ray call); it is called on the daemon thread only.
        node_id: this process's node.
        interval_s: seconds between two ``locate`` calls.
        threads: the in-process search's threads (:class:`InProcessTreeSearch`).

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(self, remote: GrpcTreeSearch, locate: Callable[[int], dict], node_id: str, *,
                 interval_s: float = 0.5, threads: int | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.remote, self.locate, self.node_id = remote, locate, node_id
        self.interval_s, self.threads = interval_s, threads
        self.local_calls = 0
        self._local: InProcessTreeSearch | None = None
        self._trie_key: tuple | None = None
        self._live: LiveCorpus | None = None
        self._since, self._stream = -1, None  # the mirror's place in the service's corpus
        self._why = "not located yet"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ngram-colocate", daemon=True)
        self._thread.start()

    # the service's counters, for the engine's stats and metrics
    calls = property(lambda self: self.remote.calls + self.local_calls)
    fallbacks = property(lambda self: self.remote.fallbacks)
    errors = property(lambda self: self.remote.errors)
    address = property(lambda self: self.remote.address)

    @property
    def local(self) -> bool:
        """Whether searches run in this process now."""
        return self._local is not None

    @property
    def mirror_tokens(self) -> int:
        """Tokens the live corpus's mirror holds (0: none)."""
        live = self._live
        return len(live) if live is not None else 0

    @property
    def why_remote(self) -> str | None:
        """Why searches go to the service (None: they run here)."""
        return None if self._local is not None else self._why

    def _client(self) -> TreeSearchClient:
        local = self._local
        if local is None:
            return self.remote
        self.local_calls += 1
        return local

    def search(self, topk_ids, topk_probs, contexts, params, chains=None):
        return self._client().search(topk_ids, topk_probs, contexts, params, chains)

    def search_batch(self, topk_ids, topk_probs, contexts, params, chains=None):
        return self._client().search_batch(topk_ids, topk_probs, contexts, params, chains)

    def chains(self, contexts, chains, max_len):
        local = self._local
        return chains if local is None else local.chains(contexts, chains, max_len)

    def learn(self, documents):
        return self.remote.learn(documents)

    def refresh(self) -> None:
        """One ``locate`` call and what follows from it (the daemon thread's step; tests call it).

        Raises:
            whatever ``locate`` raises."""
        answer = self.locate(self._since)
        if answer.get("address") and answer["address"] != self.remote.address:
            self.remote.resolve_in_background()  # a new service (restarted elsewhere): its gRPC client follows
        path = answer.get("trie")
        if answer.get("node_id") != self.node_id or not path or not os.access(path, os.R_OK):
            why = ("the service runs on another node" if answer.get("node_id") != self.node_id else
                   "the service has no trie" if not path else f"its trie {path} is not readable here")
            self._go_remote(why)
            return
        key = (path, answer.get("trie_mtime_ns"))
        trie = self._local.trie if self._local is not None and key == self._trie_key else None
        if trie is None:
            try:
                trie = NgramTrie(path)
                if self.remote.vocab_hash:
                    trie.check_tokenizer(self.remote.vocab_hash)
            except (OSError, ValueError) as e:  # TrieFormatError and TokenizerMismatchError are ValueErrors
                self._go_remote(f"its trie cannot be searched here: {e}")
                return
        live = answer.get("live")
        if live is None:
            self._live, self._since, self._stream = None, -1, None
        elif live.get("stream") != self._stream and not live["reset"]:
            self._since, self._stream = -1, live.get("stream")  # another corpus: all of it on the next answer
        else:
            if self._live is None or live["reset"] or self._live.max_tokens != live["max_tokens"]:
                self._live = LiveCorpus(live["max_tokens"], live["max_context"], live["vocab_hash"],
                                        min_match=live["min_match"])
            self._live.extend(live["tokens"])
            self._since, self._stream = live["position"], live.get("stream")
        if self._local is None or self._local.trie is not trie or self._local.live is not self._live:
            self._local = InProcessTreeSearch(trie, threads=self.threads, live=self._live)
            if key != self._trie_key:
                logger.info("tree search in this process over %s (the n-gram service's trie, on this node)%s",
                            path, ", with a mirror of its live corpus" if self._live is not None else "")
        self._trie_key = key

    def _go_remote(self, why: str) -> None:
        if self._local is not None or self._why != why:
            logger.info("tree search through the n-gram service: %s", why)
        self._local, self._trie_key, self._live, self._why = None, None, None, why
        self._since, self._stream = -1, None

    def _run(self) -> None:
        failed = False
        while not self._stop.is_set():
            try:
                self.refresh()
                failed = False
            except Exception as e:  # noqa: BLE001 - the service may be restarting; searches go to it meanwhile
                if not failed:
                    logger.warning("cannot locate the n-gram service (%s): searching through it", e)
                failed = True
                self._go_remote("the service cannot be located")
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 5)
        self.remote.close()


class LearnSender:
    """Sends finished sequences to the live corpus off the decoding path: :meth:`put` only queues
    (the batcher's engine thread calls it), and a daemon thread sends what has queued every
    ``interval_s``, or sooner once ``batch_tokens`` wait, in one :meth:`TreeSearchClient.learn`
    call.  The queue holds at most ``max_queued_tokens``; past it new sequences are dropped and
    counted (a slow or absent service never grows the engine's memory, and never delays a request).

    Args:
        client: the tree-search client whose :meth:`~TreeSearchClient.learn` sends.
        interval_s: the longest a sequence waits before it is sent.
        batch_tokens: queued tokens that trigger a send before the interval ends.
        max_queued_tokens: the most tokens waiting; more are dropped.
    """

    def __init__(self, client: TreeSearchClient, *, interval_s: float = 0.5, batch_tokens: int = 16384,
                 max_queued_tokens: int = 1 << 20) -> None:
        self.client, self.interval_s = client, interval_s
        self.batch_tokens, self.max_queued_tokens = batch_tokens, max_queued_tokens
        self.sent = self.dropped = self.sends = 0  # tokens sent, sequences dropped, calls made
        self._queue: list[list[int]] = []
        self._queued = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ngram-learn", daemon=True)
        self._thread.start()

    def put(self, tokens: Sequence[int]) -> None:
        """Queues one sequence (token ids); never blocks on the service."""
        tokens = list(tokens)
        if not tokens:
            return
        with self._cv:
            if self._closed or self._queued + len(tokens) > self.max_queued_tokens:
                self.dropped += 1
                return
            self._queue.append(tokens)
            self._queued += len(tokens)
            if self._queued >= self.batch_tokens:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._queued >= self.batch_tokens, timeout=self.interval_s)
                batch, self._queue, self._queued = self._queue, [], 0
                closed = self._closed
            if batch:
                try:
                    self.sent += self.client.learn(batch)
                except Exception:  # noqa: BLE001 - learning never fails serving
                    logger.exception("sending learned sequences failed")
                self.sends += 1
            if closed:
                return

    def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (waiting at most ``timeout_s``) and stops the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout_s)
