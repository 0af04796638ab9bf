"""Logging shared by the application's replicas (imports no torch)."""

from __future__ import annotations

import logging


def route_library_logs(names: tuple[str, ...] = ("dart_core", "ngram_service")) -> None:
    """Sends the libraries' INFO logs to the replica's log and the ``serve run`` console, through
    the handlers Ray Serve gives its own ``ray.serve`` logger: the engine's kernel and speculative
    config, the verification cost curve and the speculation calibration it logs at start-up, and
    the n-gram server's lines.  Without this a replica keeps only ``ray.serve``'s lines: Python's
    default drops INFO from other loggers.  Calling it again adds no handler twice.  Outside a
    Serve replica (a deployment class constructed in a user's own process) it does nothing: that
    process's logging stays its own."""
    from ray import serve

    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - Serve raises RayServeException outside a replica
        return
    serve_logger = logging.getLogger("ray.serve")
    for name in names:
        lib = logging.getLogger(name)
        lib.setLevel(logging.INFO)
        lib.propagate = False
        for handler in serve_logger.handlers:
            if handler not in lib.handlers:
                lib.addHandler(handler)
