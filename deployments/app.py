"""The DART Serve application: ``import_path: deployments.app:build_app``.

Three deployments (docs/design.md §1): :class:`~deployments.ingress.OpenAIIngress`
(HTTP + gRPC) → :class:`~deployments.engine.DartEngineDeployment` (target +
draft head, continuous batching) → :class:`~deployments.ngram.NgramService`
(the trie and its C++ tree search, on the n-gram host).  ``args`` of the
config are validated by :class:`deployments.config.AppConfig`; per-deployment
resources, replicas and autoscaling come from the ``deployments:`` section of
the Serve config (``deployments/dart.yaml``).

The n-gram service is never open: its bearer token is the value of
``ngram.auth_token_env`` (``DART_NGRAM_AUTH_TOKEN``) where the application is
built, or else one generated here, and it reaches the service and every
engine replica as a bound argument of their deployments, never through a
file or a log line.
"""

from __future__ import annotations

import os
import secrets

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
    if not cfg.ngram.enabled:
        return OpenAIIngress.bind(DartEngineDeployment.bind(config, None), config)
    token = ngram_auth_token(cfg.ngram.auth_token_env)
    ngram = NgramService.bind(resolve_ngram_config(cfg).model_dump(), auth_token=token)
    engine = DartEngineDeployment.bind(config, ngram, ngram_auth_token=token)
    return OpenAIIngress.bind(engine, config)


def ngram_auth_token(env: str) -> str:
    """The bearer token between the engines and the n-gram service: the variable ``env`` where
    the application is built (an operator's explicit token, which engines outside the app can
    use too), else 32 random bytes, URL-safe, new at every build."""
    return os.environ.get(env) or secrets.token_urlsafe(32)
