"""Keeps the CPU's freed tensor memory mapped, so the next step reuses it instead of faulting it in again.

PyTorch's CPU allocator takes every tensor from the C library's ``malloc``.  glibc serves a
request above its mmap threshold (at most 32 MiB by default, however it adapts) with a fresh
``mmap`` and returns it to the kernel on ``free``; the next step's tensor of the same size is
then a new mapping whose every page faults on first touch.  A decoding step allocates such
tensors every time: a batch of draft trees' logits (B · N rows of a 49,152-token vocabulary in
float32 is 53 MB at 16 trees of 17 nodes), the padded prefill's activations, each paying its
page faults again.  What keeping the memory changes in the engine: ``bench/results/cpu_memory/``.

:func:`keep_freed_memory` raises glibc's mmap threshold and trim threshold (``mallopt``) so
such blocks come from the heap and stay there after ``free``: the process keeps its peak
footprint (as PyTorch's CUDA caching allocator does on a GPU) instead of paying the page faults
again every step.  :meth:`DartModel.from_pretrained <dart_core.api.DartModel.from_pretrained>`
calls it for a CPU target.  It changes nothing where the C library is not glibc (musl, macOS, a
preloaded jemalloc or tcmalloc, which keep freed memory themselves), where the environment
already sets ``MALLOC_MMAP_THRESHOLD_`` (glibc's own setting wins), or with
``KernelConfig.keep_freed_memory`` False (for measurements; from_pretrained then does not call it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

__all__ = ["keep_freed_memory"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_done: bool | None = None


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 32) -> bool:
    """Sets glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (bytes) once per process, so
    freed blocks up to ``mmap_threshold`` are kept for reuse (module docstring).

    Returns:
        True when the thresholds are in effect (set now or by an earlier call), False when left
        alone: not glibc, ``MALLOC_MMAP_THRESHOLD_`` set (glibc's own setting), or ``mallopt``
        refused the values.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)))
    except (OSError, AttributeError) as e:  # no libc to load, or no mallopt in it
        logger.debug("mallopt unavailable: %s", e)
        return False
    if ok:
        logger.info("freed CPU memory kept for reuse (glibc mmap threshold %d MiB)", mmap_threshold >> 20)
    _done = ok
    return ok
