"""dart_core.model.allocator: glibc's thresholds set once, and left alone where the user or the platform decides."""

from __future__ import annotations

import platform

from dart_core.model import allocator


def test_keep_freed_memory_respects_the_switches(monkeypatch):
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc's own setting wins
    assert allocator.keep_freed_memory() is False
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    glibc = platform.libc_ver()[0] == "glibc"
    assert allocator.keep_freed_memory() is glibc  # set on glibc (this project's Linux images), else left alone
    assert allocator.keep_freed_memory() is glibc
