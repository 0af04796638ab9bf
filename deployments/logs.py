"""Logging shared by the application's replicas (imports no torch)."""

from __future__ import annotations

import logging


def route_library_logs(names: tuple[str, ...] = ("dart_core", "ngram_service")) -> None:
    """Sends the libraries' INFO logs to the replica's log and the ``serve run`` console, through
    the handlers Ray Serve gives its own ``ray.serve`` logger: the engine's kernel and speculative
    config, the verification cost curve and the speculation calibration it logs at start-up, and
    the n-gram server's lines.  Without this a replica keeps only ``ray.serve``'s lines: Python's
    default drops INFO from other loggers.  The libraries' level is the one Serve's
    ``logging_config.log_level`` gives its logger (INFO unless the config says otherwise), so
    ``log_level: DEBUG`` on the engine deployment also logs each gated step
    (:data:`dart_core.step.engine.GATE_LOG`, which :mod:`dart_core.bench.gate_replay` reads).
    Calling it again adds no handler twice.  Outside a Serve replica (a deployment class
    constructed in a user's own process) it does nothing: that process's logging stays its own."""
    from ray import serve

    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - Serve raises RayServeException outside a replica
        return
    serve_logger = logging.getLogger("ray.serve")
    level = serve_logger.getEffectiveLevel()
    for name in names:
        lib = logging.getLogger(name)
        lib.setLevel(level if level != logging.NOTSET else logging.INFO)
        lib.propagate = False
        for handler in serve_logger.handlers:
            if handler not in lib.handlers:
                lib.addHandler(handler)
