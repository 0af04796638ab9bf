"""Engine-side client of the n-gram tree-search service, with fallback.

:class:`GrpcTreeSearch` implements the engine's
:class:`~dart_core.tree_client.TreeSearchClient` over gRPC: one channel
reused for every call, a per-call timeout in milliseconds, bounded retries,
and **fallback** to the in-process logits-only search whenever the service
is unreachable, slow or refuses a call, so a decoding step never fails
because of the trie.  After a failure the service is skipped for
``cooldown_s`` (no timeout paid on every step while it is down); then the
next call tries it again, re-resolving its address when a resolver is given
(a restarted Ray actor may come back elsewhere).  Fallbacks are counted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from dart_core.tree_client import InProcessTreeSearch, TreeSearchClient
from ngram_service._proto import ngram_pb2, ngram_pb2_grpc
from ngram_service.server import OVERRIDE_FIELDS
from ngram_service.tree_search import DraftTree, SearchParams

logger = logging.getLogger(__name__)

__all__ = ["GrpcTreeSearch"]

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
        resolver: returns the current address (e.g. asks the Ray actor);
            called at start and after each cooldown.
        timeout_ms: deadline of one call.
        retries: extra attempts within one step (bounded; 0 = none).
        cooldown_s: how long to use the fallback after a failure before trying the service again.
        vocab_hash: the engine tokenizer's identity, checked by the service.
        auth_token: shared secret sent as ``authorization: Bearer <token>``.
        fallback: what answers when the service cannot (default: logits-only, in process).
    """

    def __init__(self, address: str | None = None, *, resolver: Callable[[], str] | None = None,
                 timeout_ms: float = 50.0, retries: int = 1, cooldown_s: float = 1.0, vocab_hash: str = "",
                 auth_token: str | None = None, fallback: TreeSearchClient | None = None) -> None:
        if address is None and resolver is None:
            raise ValueError("give the service address or a resolver")
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
        self._connect(address)

    @property
    def address(self) -> str | None:
        return self._address

    def _connect(self, address: str | None) -> None:
        if address is None:
            try:
                address = self.resolver()
            except Exception as e:  # noqa: BLE001 - the resolver may fail while the service restarts
                logger.warning("cannot resolve the n-gram service address: %s", e)
                return
        if address == self._address and self._channel is not None:
            return
        if self._channel is not None:
            self._channel.close()
        self._address = address
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = ngram_pb2_grpc.NgramTreeSearchStub(self._channel)

    def _request(self, topk_ids, topk_probs, contexts, params: SearchParams) -> ngram_pb2.TreeSearchRequest:
        b, d, k = topk_ids.shape
        return ngram_pb2.TreeSearchRequest(
            batch=b, depth=d, k=k, topk_ids=topk_ids.ravel().tolist(), topk_probs=topk_probs.ravel().tolist(),
            contexts=np.concatenate(contexts).tolist() if len(contexts) else [],
            context_lengths=[len(c) for c in contexts], vocab_hash=self.vocab_hash,
            params=ngram_pb2.SearchOverrides(**{f: getattr(params, f) for f in OVERRIDE_FIELDS}))

    def search(self, topk_ids: np.ndarray, topk_probs: np.ndarray, contexts: Sequence[np.ndarray],
               params: SearchParams) -> list[DraftTree]:
        topk_ids = np.asarray(topk_ids, dtype=np.int64)
        topk_probs = np.asarray(topk_probs, dtype=np.float32)
        contexts = [np.asarray(c, dtype=np.int64) for c in contexts]
        with self._lock:
            self.calls += 1
            cooling = time.monotonic() < self._skip_until
            if not cooling and self._skip_until and self.resolver is not None:
                self._connect(None)  # the service may have come back somewhere else
            stub = self._stub
        if cooling:
            return self._fall_back(topk_ids, topk_probs, contexts, params, None)
        if stub is None:
            return self._fall_back(topk_ids, topk_probs, contexts, params, "UNRESOLVED")
        request = self._request(topk_ids, topk_probs, contexts, params)
        code = None
        for _ in range(1 + self.retries):
            try:
                response = stub.TreeSearch(request, timeout=self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.PERMISSION_DENIED):
                    logger.error("n-gram service refused the call (%s): %s", code.name, e.details())
                    break  # retrying cannot help
                continue
            with self._lock:
                self._skip_until = 0.0
            return [DraftTree.from_parents(t.tokens, t.parents, t.depths, t.scores) for t in response.trees]
        return self._fall_back(topk_ids, topk_probs, contexts, params, code.name if code else "UNKNOWN")

    def _fall_back(self, topk_ids, topk_probs, contexts, params, error: str | None) -> list[DraftTree]:
        with self._lock:
            self.fallbacks += 1
            if error is not None:
                self.errors[error] = self.errors.get(error, 0) + 1
                if self._skip_until == 0.0:
                    logger.warning("n-gram service at %s failed (%s): logits-only tree search for %.1f s",
                                   self._address, error, self.cooldown_s)
                self._skip_until = time.monotonic() + self.cooldown_s
        return self.fallback.search(topk_ids, topk_probs, contexts, params)

    def info(self) -> ngram_pb2.InfoResponse:
        """The service's trie description (raises grpc.RpcError when unreachable)."""
        return self._stub.Info(ngram_pb2.InfoRequest(), timeout=max(self.timeout_s, 1.0), metadata=self.metadata)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
