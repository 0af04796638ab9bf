"""Where dart-serve keeps what it builds, converts or downloads once (tries,
converted GGUF models and tokenizers, evaluation prompts): ``$DART_SERVE_CACHE``,
default ``~/.cache/dart-serve``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The cache folder (not created here)."""
    return Path(os.environ.get("DART_SERVE_CACHE", Path.home() / ".cache" / "dart-serve"))
