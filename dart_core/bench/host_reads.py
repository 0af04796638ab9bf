"""Counting a decoding step's host reads of tensors.

On a GPU every read of a device tensor's value by the host (``item``,
``tolist``, ``cpu``, ``bool`` / ``int`` / ``float`` of a tensor)
waits for the device: a sync that CUDA graphs cannot remove.  The engine's
step aims at one such read per autoregressive step and two per speculative
step (the draft's top-k out, the accepted paths out; on a CPU a greedy
speculative step reads once, its trees walked over host arrays by
``verify.accept_greedy_cpu``).  :func:`count_host_reads`
counts them on any device, CPU included, by wrapping those tensor methods for
the duration of a ``with`` block; tensors the host built itself count the
same (the engine should not read values back at all inside a step).

Used by ``python -m dart_core.bench.step_profile`` (per-step counts) and the
test that guards the counts.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch

__all__ = ["count_host_reads", "READS"]

#: the tensor methods counted as host reads
#: (``numpy`` is not among them: it refuses a device tensor, so the ``cpu()`` before it is the read)
READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads(where: Counter | None = None) -> Iterator[Counter]:
    """A :class:`collections.Counter` of host reads by method name, filled while the block runs
    (and, given ``where``, of the calling ``file:line`` of each read, for finding them).

    Not thread-safe: it patches ``torch.Tensor`` for every thread while it is active.
    """
    import traceback

    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            if where is not None:
                frame = traceback.extract_stack(limit=2)[0]
                where[f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {name}"] += 1
            return fn(self, *args, **kwargs)
        return counted

    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
