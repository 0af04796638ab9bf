"""The DART Serve application: ``import_path: deployments.app:build_app``.

Three deployments (docs/design.md §1): :class:`~deployments.ingress.OpenAIIngress`
(HTTP + gRPC) → :class:`~deployments.engine.DartEngineDeployment` (target +
draft head, continuous batching) → :class:`~deployments.ngram.NgramService`
(the trie and its C++ tree search, on the n-gram host).  ``args`` of the
config are validated by :class:`deployments.config.AppConfig`; per-deployment
resources, replicas and autoscaling come from the ``deployments:`` section of
the Serve config (``deployments/dart.yaml``).
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppConfig
from deployments.engine import DartEngineDeployment
from deployments.ingress import OpenAIIngress
from deployments.ngram import NgramService, resolve_ngram_config


def build_app(args: dict) -> Application:
    """Serve application builder (``serve run deployments/dart.yaml`` calls it with ``args``).

    Raises:
        pydantic.ValidationError: unknown or invalid arguments (reported by ``serve run``).
        FileNotFoundError: the model cannot be found.
    """
    cfg = AppConfig.model_validate(args or {})
    config = cfg.model_dump()
    ngram = NgramService.bind(resolve_ngram_config(cfg).model_dump()) if cfg.ngram.enabled else None
    engine = DartEngineDeployment.bind(config, ngram)
    return OpenAIIngress.bind(engine, config)
