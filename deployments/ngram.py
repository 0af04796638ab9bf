"""The n-gram tree-search service as a Serve deployment (docs/design.md §1).

One replica runs :class:`ngram_service.server.NgramServer` on its node: it
memory-maps the trie (building it first from a named corpus when the file is
missing and a tokenizer is given), binds its threads to one NUMA node's CPUs,
and tells the engines its ``host:port`` through :meth:`NgramService.address`.
Engines then talk to it over gRPC directly — one batched call per decoding
step, never through a Serve handle.  Serve's health check calls
:meth:`check_health`; a dead or unhealthy replica is replaced, and engines
fall back to the logits-only search meanwhile.  On a cluster,
``ray_actor_options.resources`` asks for the ``ngram_host`` custom resource
so the replica lands on the large-RAM node.

With ``ngram.learn`` the server keeps the live corpus of the traffic
(:mod:`ngram_service.live`), and the replica exports its counters to Prometheus every
``LIVE_METRICS_S`` seconds (:class:`_LiveMetrics`).

It needs nothing model-side: a trie path (or ``auto``), and for a first
build a tokenizer and a corpus name.  Given a trie, or a ``tokenizer.json``
to build one, the n-gram node runs without torch and transformers.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import grpc
from ray import serve

from deployments.config import AppConfig, NgramConfig
from deployments.logs import route_library_logs
from deployments.metrics import StatsMetrics
from ngram_service.trie import TrieFormatError

logger = logging.getLogger("ray.serve")

LIVE_METRICS_S = 10.0  # how often the live corpus's counters go to Prometheus


class _LiveMetrics(StatsMetrics):
    """The live corpus's counters (:class:`ngram_service.live.LiveStats`) as Ray Serve metrics:
    gauges of the tokens and bytes held, counters of documents inserted, tokens evicted, chains
    asked for and chains that matched (the hit rate is hits / lookups)."""

    def __init__(self, live) -> None:
        super().__init__(lambda: dataclasses.asdict(live.stats()), "dart_ngram_live", gauges={
            "tokens": "tokens the live corpus holds", "bytes": "memory of the live corpus's index, bytes"},
            counters={"inserts": "documents added to the live corpus", "evicted": "tokens the live corpus evicted",
                      "lookups": "chains asked of the live corpus", "hits": "chains the live corpus matched"})
        self.live = live


def admin_error(status: int, message: str) -> dict:
    """An admin call's refusal, as the replicas hand it back to the ingress (HTTP ``status``)."""
    return {"error": {"status": status, "message": message}}


def resolve_ngram_config(cfg: AppConfig) -> NgramConfig:
    """The service's settings as the replica gets them: with ``trie: auto``, the tokenizer the
    trie is named after and built with defaults to the app's model (a name or path that the
    n-gram node resolves itself).  An explicit trie path is used as it is."""
    if cfg.ngram.trie != "auto" or cfg.ngram.tokenizer is not None:
        return cfg.ngram
    return cfg.ngram.model_copy(update={"tokenizer": cfg.model})


@serve.deployment(name="NgramService", num_replicas=1, max_ongoing_requests=64, health_check_period_s=5,
                  ray_actor_options={"num_cpus": 0.5})
class NgramService:
    """Args: config: a :class:`~deployments.config.NgramConfig`; auth_token: the bearer token every
    call must carry (``authorization: Bearer <token>`` metadata; :func:`deployments.app.build_app`
    gives the application's), None for an open service (tests of the service alone).

    ``trie: auto`` is ``<tokenizer name>-<corpus>-3gram.trie`` in this node's cache, built there
    from the named corpus on first start with ``tokenizer`` (None: the default model's).  A given
    trie path that is missing is built only when ``tokenizer`` is given too.  A DART reference
    ``.trie`` file, or a reference n-gram folder (its ``full.trie``), is converted once on this
    node with ``tokenizer`` into its cache and served from there.

    Raises:
        FileNotFoundError: no trie file, and nothing to build it with.
        ImportError: the trie must be built with a GGUF model's tokenizer that was never
            converted, and transformers is not installed on this node.
    """

    def __init__(self, config: dict, auth_token: str | None = None) -> None:
        import ray

        from ngram_service.build import ensure_trie
        from ngram_service.cache import default_trie_path
        from ngram_service.convert import resolve_ngram_model
        from ngram_service.ray_actor import start_pinned_server
        from ngram_service.tokenizer import load_trie_tokenizer, source_name

        route_library_logs()
        cfg = NgramConfig.model_validate(config)
        auto = cfg.trie == "auto"
        trie = default_trie_path(source_name(cfg.tokenizer), cfg.corpus, 3) if auto else Path(cfg.trie).expanduser()
        if trie.exists() and not auto:  # ours as it is; the reference's file or folder converted once
            trie = resolve_ngram_model(trie, lambda: load_trie_tokenizer(cfg.tokenizer))
        if not trie.is_file():
            if not auto and cfg.tokenizer is None:
                raise FileNotFoundError(f"no trie at {trie} on this node, and no tokenizer to build it with "
                                        "(set ngram.tokenizer, or copy a trie built with python -m "
                                        "ngram_service.build there)")
            trie = ensure_trie(trie, lambda: load_trie_tokenizer(cfg.tokenizer), corpus=cfg.corpus)
        trie = str(trie)
        node = ray.util.get_node_ip_address()
        self.host = node if cfg.host in (None, "0.0.0.0") else cfg.host  # what the engines are told
        self.server, _ = start_pinned_server(trie, port=cfg.port, threads=cfg.threads, numa_node=cfg.numa_node,
                                             auth_token=auth_token, host=cfg.host or node,
                                             learn_max_tokens=cfg.learn_max_tokens if cfg.learn else None,
                                             learn_snapshot=cfg.learn_snapshot)
        self._local = "127.0.0.1" if cfg.host == "0.0.0.0" else self.host  # where the health check calls
        logger.info("n-gram service on %s:%d (trie %s, %d threads, live corpus %s)", self.host, self.server.port,
                    trie, self.server.threads, f"of {cfg.learn_max_tokens} tokens" if cfg.learn else "off")
        self._stop = threading.Event()
        if self.server.live is not None:
            live = _LiveMetrics(self.server.live)

            def export() -> None:
                while not self._stop.wait(LIVE_METRICS_S):
                    live.update()

            threading.Thread(target=export, name="ngram-live-metrics", daemon=True).start()

    def address(self) -> str:
        """``host:port`` of the gRPC tree-search server."""
        return f"{self.host}:{self.server.port}"

    def locate(self, since: int = -1) -> dict:
        """Where this service's trie is, for an engine that searches in its own process when it runs
        on the same node (:class:`~ngram_service.client.ColocatedTreeSearch`): ``{"node_id",
        "address"}`` and :meth:`NgramServer.location <ngram_service.server.NgramServer.location>`'s
        ``{"trie", "trie_mtime_ns", "live"}`` (the live corpus's tokens after stream position ``since``)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "address": self.address()} | \
            self.server.location(since)

    def add_corpus(self, documents: list[list[int]]) -> dict:
        """The admin route's corpus (token-id documents, already checked by the engine) into the live
        corpus.  Returns ``{"documents", "tokens_added", "tokens_held"}``, or ``{"error": {"status",
        "message"}}`` (409: no live corpus here), so that no exception crosses the handle."""
        live = self.server.live
        if live is None:
            return admin_error(409, "the n-gram service keeps no live corpus (ngram.learn: false)")
        try:
            added = live.add(documents)
        except ValueError as e:
            return admin_error(400, str(e))
        return {"documents": len(documents), "tokens_added": added, "tokens_held": len(live)}

    def swap_trie(self, path: str) -> dict:
        """Serves the trie file at ``path`` (on this node) from now on
        (:meth:`NgramServer.swap_trie <ngram_service.server.NgramServer.swap_trie>`: in-flight searches
        finish on the old one).  Returns the new trie's ``{"trie", "order", "num_nodes", "tokenizer"}``,
        or ``{"error": {"status", "message"}}`` (400: no such file, not a sound trie, another
        tokenizer; the old trie is served on)."""
        try:
            info = self.server.swap_trie(path)
        except (OSError, ValueError, TrieFormatError) as e:
            logger.warning("trie swap to %s refused: %s", path, e)
            return admin_error(400, f"trie not swapped, the old one is served on: {e}")
        return {"trie": info.path, "order": info.order, "num_nodes": info.num_nodes, "tokenizer": info.tokenizer_name}

    def check_health(self) -> None:
        """Serve's health check: the gRPC server must answer its health service."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"{self._local}:{self.server.port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"n-gram server reports {status}")

    def __del__(self) -> None:
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(grace_s=0.5)
