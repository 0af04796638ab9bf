"""The n-gram tree-search service as a Serve deployment (DESIGN.md §1).

One replica runs :class:`ngram_service.server.NgramServer` on its node: it
memory-maps the trie (building the default one on first start), binds its
threads to one NUMA node's CPUs, and tells the engines its ``host:port``
through :meth:`NgramService.address`.  Engines then talk to it over gRPC
directly — one batched call per decoding step, never through a Serve handle.
Serve's health check calls :meth:`check_health`; a dead or unhealthy replica is
replaced, and engines fall back to the logits-only search meanwhile.  On a
cluster, ``ray_actor_options.resources`` asks for the ``ngram_host`` custom
resource so the replica lands on the large-RAM node.
"""

from __future__ import annotations

import logging
import os

import grpc
from ray import serve

from deployments.config import NgramConfig

logger = logging.getLogger("ray.serve")


@serve.deployment(name="NgramService", num_replicas=1, max_ongoing_requests=64, health_check_period_s=5,
                  ray_actor_options={"num_cpus": 0.5})
class NgramService:
    def __init__(self, config: dict, model: str | None = None) -> None:
        import ray

        from ngram_service.build import ensure_default_trie
        from ngram_service.ray_actor import start_pinned_server

        cfg = NgramConfig.model_validate(config)
        trie = str(ensure_default_trie(model)) if cfg.trie == "auto" else cfg.trie
        self.host = ray.util.get_node_ip_address()
        self.server, _ = start_pinned_server(trie, port=cfg.port, threads=cfg.threads, numa_node=cfg.numa_node,
                                             auth_token=os.environ.get(cfg.auth_token_env) or None)
        logger.info("n-gram service on %s:%d (trie %s, %d threads)", self.host, self.server.port, trie,
                    self.server.threads)

    def address(self) -> str:
        """``host:port`` of the gRPC tree-search server."""
        return f"{self.host}:{self.server.port}"

    def check_health(self) -> None:
        """Serve's health check: the gRPC server must answer its health service."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.server.port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"n-gram server reports {status}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(grace_s=0.5)
