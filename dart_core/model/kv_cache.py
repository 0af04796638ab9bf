"""Ragged, left-aligned KV caches for batched speculative decoding.

Layout (the target's Hugging Face ``DynamicCache`` layers and the draft
head's cache alike): keys/values are [B, H_kv, T, D] and sequence b's valid
entries are exactly positions [0, lengths[b]).  A step appends its new
tokens (a draft tree) at [T, T + N) for every sequence; the 4D attention
masks let sequence b see only its valid prefix plus its own tree.  After
verification, :func:`compact_` moves each sequence's accepted entries to
[lengths[b], lengths[b] + counts[b]) and crops T to the longest sequence, so
rejected nodes and padding never survive a step and nothing grows.

The target's layers are :class:`BufferedKVLayer` (in a :class:`BufferedKVCache`):
``keys``/``values`` are views of a buffer with spare capacity, so appending a
step writes in place instead of ``torch.cat`` copying the whole cache every
step (at batch 8 and a few hundred positions that copy was a third of an
autoregressive step on a CPU), and :func:`compact_` moves entries inside the
same buffer.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from dart_core import _kernels

__all__ = ["pad_cat", "compact_", "compaction_plan", "compaction_plan_host", "apply_compaction", "compact_layers",
           "compact_buffered", "HeadKVCache", "cache_mask", "BufferedKVLayer", "BufferedKVCache",
           "is_leading_view", "KVPool"]


def zero_pad(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` with dimension ``dim`` zero-padded at the end to length ``n`` (x itself when already n long)."""
    if x.shape[dim] >= n:
        return x
    shape = list(x.shape)
    shape[dim] = n - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def pad_cat(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenates along the batch (dim 0) after zero-padding dimension ``dim`` to the longer one."""
    n = max(a.shape[dim], b.shape[dim])
    return torch.cat([zero_pad(a, dim, n), zero_pad(b, dim, n)], dim=0)


def compaction_plan(lengths: torch.Tensor, src: torch.Tensor, counts: torch.Tensor
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, int]:
    """Where :func:`compact_` moves entries, computed once for every layer of a cache.

    Args: as :func:`compact_`.

    Returns:
        (moves, new_len): ``moves`` = (rows, dst, src) [M] int64 of the kept entries that are
        not already in place, None when every kept entry already is (an autoregressive step,
        or a chain whose accepted nodes follow the prefix in order: nothing to copy);
        ``new_len`` = max(lengths + counts).
    """
    b, a = src.shape
    new_len = int((lengths + counts).max()) if b else 0
    if not a:
        return None, new_len
    j = torch.arange(a, device=src.device)
    dst = lengths[:, None] + j[None, :]
    move = (j[None, :] < counts[:, None]) & (src != dst)  # [B, A]
    if not bool(move.any()):
        return None, new_len
    rows = torch.arange(b, device=src.device)[:, None].expand(b, a)[move]
    return (rows, dst[move], src[move]), new_len


def _flat_paths(paths, counts) -> tuple[np.ndarray, np.ndarray]:
    """(counts [B] int64, flat [Σ counts] int64) of per-row paths: a list of paths, or a padded
    [B, A] array with ``counts`` [B] giving each row's length."""
    if counts is None:
        counts = np.fromiter(map(len, paths), dtype=np.int64, count=len(paths))
        return counts, np.fromiter(itertools.chain.from_iterable(paths), dtype=np.int64, count=int(counts.sum()))
    paths, counts = np.asarray(paths, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    if paths.ndim != 2 or counts.shape != paths.shape[:1] or (len(counts) and counts.max() > paths.shape[1]):
        raise ValueError(f"paths {paths.shape} and counts {counts.shape} do not match")
    return counts, paths[np.arange(paths.shape[1])[None, :] < counts[:, None]]


def compaction_plan_host(lengths: list[int], offset: int, paths, device, counts: np.ndarray | None = None
                         ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, int]:
    """:func:`compaction_plan` from what the host already knows, with no read of a device tensor.

    Args:
        lengths: [B] valid prefix lengths before this step.
        offset: where this step's entries start in the cache (its padded length before the step).
        paths: per sequence, the entries to keep as offsets from ``offset``, in order (the accepted
            node indices of the step): a list of lists, or a padded [B, A] array with ``counts``.
        counts: with a padded ``paths``, [B] entries kept per row.

    Returns:
        as :func:`compaction_plan` (the index tensors on ``device``).

    Raises:
        ValueError: a padded ``paths`` whose shape does not match ``counts``.
    """
    counts, flat = _flat_paths(paths, counts)
    new_len = int((np.asarray(lengths, dtype=np.int64) + counts).max()) if len(counts) else 0
    total = int(counts.sum())
    rows = np.repeat(np.arange(len(counts)), counts)
    j = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)  # each entry's index in its path
    src = offset + flat
    dst = np.asarray(lengths, dtype=np.int64)[rows] + j
    move = src != dst
    if not move.any():
        return None, new_len
    idx = torch.from_numpy(np.stack([rows[move], dst[move], src[move]])).to(device)
    return (idx[0], idx[1], idx[2]), new_len


def compact_layers(layers, plan: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, int]) -> None:
    """:func:`apply_compaction` for every layer of a cache (objects with ``keys`` and ``values``
    [B, H_kv, T, D]), each layer's keys and values then cropped to the plan's new length.

    On a CPU the moves of every layer are one C++ call (``dart_core/csrc/kv_compact.cpp``: a
    memmove per layer, move and head, in place) instead of four indexing operators per layer;
    elsewhere (CUDA, a layer whose head dimension is strided, or moves that in-order copies
    would not reproduce, see below) each layer goes through :func:`apply_compaction`.  The
    entries are the same either way.

    In-order copies equal :func:`apply_compaction`'s gather-then-scatter when the moves are
    grouped by row, each row's sources increase and no destination is after its source: then
    no move overwrites an entry a later move reads.  :func:`compaction_plan_host` and
    :func:`compaction_plan` make such plans from increasing accepted paths (every engine path)."""
    moves, new_len = plan
    if moves is not None:
        tensors = [t for layer in layers for t in (layer.keys, layer.values)]
        if all(t.device.type == "cpu" and t.dim() == 4 and t.stride(3) == 1 for t in tensors):
            rows, dst, src = (x.numpy() for x in moves)
            same = rows[1:] == rows[:-1]
            if (dst <= src).all() and (rows[1:] >= rows[:-1]).all() and (src[1:][same] > src[:-1][same]).all():
                # bfloat16 / float16 entries move as their 16-bit patterns (numpy has no bfloat16)
                _kernels.compact_cache([(t.view(torch.int16) if t.element_size() == 2 else t).numpy()
                                        for t in tensors], rows, dst, src)
                moves = None
    for layer in layers:
        if moves is None and isinstance(layer, BufferedKVLayer) and layer.holds_last_commit():
            if layer.keys.shape[2] != new_len:  # cropped through the buffers: still the layer's own views
                layer.commit(new_len)
            continue
        layer.keys, layer.values = apply_compaction(layer.keys, layer.values, (moves, new_len))


def compact_buffered(layers, lengths: list[int], offset: int, paths, counts: np.ndarray | None = None) -> bool:
    """:func:`compact_layers` of :func:`compaction_plan_host`'s plan, planned and applied in one C++
    call (``_kernels.compact_paths``) on the layers' whole CPU buffers, when every layer is a
    :class:`BufferedKVLayer` still holding its last commit on the CPU; then each layer is cropped to
    the new length.  Returns False, touching nothing, where that does not hold.

    Args: as :func:`compaction_plan_host` (each path increasing, ``lengths[b] <= offset``).

    Raises:
        ValueError: a path that does not increase, or counts that do not match the paths."""
    if not layers or not all(isinstance(layer, BufferedKVLayer) and layer.holds_last_commit() for layer in layers) \
            or layers[0]._key_buffer.device.type != "cpu":  # holding its last commit: keys are views of it
        return False
    counts, flat = _flat_paths(paths, counts)
    lengths = np.asarray(lengths, dtype=np.int64)
    _kernels.compact_paths([a for layer in layers for a in layer.buffer_arrays()], lengths, offset, flat, counts)
    new_len = int((lengths + counts).max()) if len(counts) else 0
    for layer in layers:  # a layer already at that length (every row kept its one entry) keeps its views
        if layer.cached_length() != new_len:
            layer.commit(new_len, lazy=True)
    return True


def apply_compaction(keys: torch.Tensor, values: torch.Tensor,
                     plan: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies a :func:`compaction_plan` to one layer's keys, values [B, H_kv, T, D] (in place, then cropped).

    Entries already in place are not touched; the moved ones are gathered before they are
    written, so a destination that is also a source is read first.
    """
    moves, new_len = plan
    if moves is not None:
        rows, dst, srcs = moves
        keys[rows, :, dst] = keys[rows, :, srcs]
        values[rows, :, dst] = values[rows, :, srcs]
    return keys[:, :, :new_len], values[:, :, :new_len]


def compact_(keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor,
             counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps accepted entries, contiguous after each sequence's prefix.

    Args:
        keys, values: [B, H_kv, T, D].
        lengths: [B] valid prefix lengths before this step.
        src: [B, A] positions (in T) of the entries to keep, in order; padded
            rows may hold anything where j >= counts[b].
        counts: [B] entries kept per sequence.

    Returns:
        (keys, values) cropped to [B, H_kv, max(lengths + counts), D].
    """
    return apply_compaction(keys, values, compaction_plan(lengths, src, counts))


def cache_mask(lengths: torch.Tensor, cache_len: int, tree_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask for N new tokens appended after a ragged cache.

    Args:
        lengths: [B] valid cache entries per sequence.
        cache_len: T, the cache's (padded) length.
        tree_mask: [B, N, N] bool, True where new token i may attend to new token j.

    Returns:
        [B, 1, N, T + N] with 0 where attention is allowed and the dtype's minimum elsewhere.
    """
    b, n, _ = tree_mask.shape
    device = lengths.device
    zero, low = torch.zeros((), dtype=dtype, device=device), torch.full((), torch.finfo(dtype).min, dtype=dtype,
                                                                        device=device)
    mask = torch.empty(b, n, cache_len + n, dtype=dtype, device=device)
    prefix = torch.arange(cache_len, device=device)[None, None, :] < lengths[:, None, None]  # [B, 1, T]
    mask[:, :, :cache_len] = torch.where(prefix, zero, low)
    mask[:, :, cache_len:] = torch.where(tree_mask, zero, low)
    return mask[:, None]


class HeadKVCache:
    """The draft head's KV cache (real positions only), same layout as above."""

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, *, device, dtype) -> None:
        self.keys = torch.zeros(batch, num_kv_heads, 0, head_dim, device=device, dtype=dtype)  # [B, Hkv, T, D]
        self.values = torch.zeros_like(self.keys)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]

    def append(self, new_k: torch.Tensor, new_v: torch.Tensor, counts: torch.Tensor) -> None:
        """Adds the first counts[b] of new_k/new_v [B, Hkv, A, D] after each sequence's prefix."""
        t = self.keys.shape[2]
        keys = torch.cat([self.keys, new_k], dim=2)
        values = torch.cat([self.values, new_v], dim=2)
        src = t + torch.arange(new_k.shape[2], device=keys.device).expand(keys.shape[0], -1)
        self.keys, self.values = compact_(keys, values, self.lengths, src, counts)
        self.lengths = self.lengths + counts

    def extend(self, new_k: torch.Tensor, new_v: torch.Tensor, counts: torch.Tensor, max_length: int) -> None:
        """As :meth:`append`, with no read of a device tensor: ``max_length`` is a host-side bound
        on every row's length after it (the buffers are cut to it).  Row b's entries j >= counts[b]
        land past its valid length, where they are padding.

        Args:
            new_k, new_v: [B, Hkv, A, D]; counts: [B] int64 (0 <= counts[b] <= A)."""
        b, a = new_k.shape[0], new_k.shape[2]
        keys = zero_pad(self.keys, 2, self.keys.shape[2] + a)
        values = zero_pad(self.values, 2, self.values.shape[2] + a)
        rows = torch.arange(b, device=keys.device)[:, None]
        dst = self.lengths[:, None] + torch.arange(a, device=keys.device)[None, :]  # [B, A], < T + A
        keys[rows, :, dst] = new_k.transpose(1, 2)  # advanced indices first: [B, A, Hkv, D]
        values[rows, :, dst] = new_v.transpose(1, 2)
        self.keys, self.values = keys[:, :, :max_length], values[:, :, :max_length]
        self.lengths = self.lengths + counts

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the given batch rows (finished sequences leave)."""
        self.keys, self.values, self.lengths = self.keys[rows], self.values[rows], self.lengths[rows]
        t = int(self.lengths.max()) if len(rows) else 0
        self.keys, self.values = self.keys[:, :, :t], self.values[:, :, :t]


def is_leading_view(x: torch.Tensor, buf: torch.Tensor, rows: int) -> bool:
    """Whether ``x`` is ``buf[:rows, :, :T]`` for some T, i.e. the same first element, strides and
    heads (``_base`` is not tracked in inference mode, so the addresses are compared instead; ``buf``
    may itself be a view, e.g. one layer's slice of a KV pool)."""
    return (x.shape[0] == rows and x.shape[1] == buf.shape[1] and x.stride() == buf.stride()
            and x.dtype == buf.dtype and x.data_ptr() == buf.data_ptr())


class KVPool:
    """Every layer's static key and value buffers as views of one tensor, so a KV compaction is
    one gather and one scatter for all layers instead of four indexing operators per layer.

    Args:
        pool: [L, 2, Bb, H_kv, C, D]: layer l's key buffer is ``pool[l, 0]``, its value buffer
            ``pool[l, 1]`` (:class:`~dart_core.model.cuda_graphs.StaticVerifier` allocates one per batch bucket).
    """

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self._bound: tuple[int, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None

    def layer_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, its (key buffer, value buffer) [Bb, H_kv, C, D], views of the pool."""
        return [(kv[0], kv[1]) for kv in self.pool.unbind(0)]

    def bind(self, layers, rows: int, length: int) -> None:
        """Sets every layer's keys and values to its buffers' first ``rows`` rows and ``length``
        positions ([rows, H_kv, length, D] views) and remembers them (:meth:`holds`)."""
        keys, values = [], []
        for layer, kv in zip(layers, self.pool[:, :, :rows, :, :length].unbind(0)):
            layer.keys, layer.values = kv.unbind(0)
            keys.append(layer.keys)
            values.append(layer.values)
        self._bound = (rows, tuple(keys), tuple(values))

    def holds(self, layers) -> bool:
        """Whether the layers still hold the views :meth:`bind` set (nothing replaced them since)."""
        if self._bound is None or len(layers) != len(self._bound[1]):
            return False
        _, keys, values = self._bound
        return all(layer.keys is k and layer.values is v for layer, k, v in zip(layers, keys, values))

    def compact(self, layers, plan: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, int]) -> None:
        """:func:`apply_compaction` for every layer at once (the layers must :meth:`hold` the pool):
        the moved entries of all layers are gathered, then written, then every layer is cropped to
        the plan's new length."""
        moves, new_len = plan
        if moves is not None:
            rows, dst, src = moves
            self.pool[:, :, rows, :, dst] = self.pool[:, :, rows, :, src]
        self.bind(layers, self._bound[0], new_len)


class _CommittedView:
    """A :class:`BufferedKVLayer`'s ``keys`` or ``values`` (held as ``_keys_`` / ``_values_``): a
    lazy commit's views are made before the attribute is read or set."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}_"

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        if layer._pending is not None:
            layer._make_views()
        return getattr(layer, self.slot)

    def __set__(self, layer, value) -> None:
        if layer._pending is not None:
            layer._make_views()
        setattr(layer, self.slot, value)


class BufferedKVLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into preallocated capacity instead of concatenating.

    ``keys``/``values`` stay [B, H_kv, T, D] views (the first T positions of a
    [B, H_kv, capacity, D] buffer), so everything that reads or crops them
    (attention, :func:`compact_`, ``TargetCache``) works unchanged.  When
    ``keys`` is replaced by a tensor that is not a view of the buffer (rows
    selected or merged by continuous batching), the next append copies it
    into a fresh buffer once.  Capacity grows to twice the needed length,
    rounded up to a multiple of ``granule`` positions, so appends copy the
    cache O(log T) times per buffer instead of every step.  Values are
    bit-identical to ``DynamicLayer``'s.
    """

    granule = 64
    #: [N] int64 positions set by :class:`~dart_core.model.cuda_graphs.StaticVerifier` around its forwards:
    #: an update then writes there in the bound static buffers and returns their first
    #: ``static_window`` positions (the attention window the verifier chose for that forward)
    static_write_index: torch.Tensor | None = None
    static_window: int | None = None  # None: the whole buffers

    _views: tuple[torch.Tensor, torch.Tensor] | None = None  # what the last commit set keys/values to

    _arrays: tuple[np.ndarray, np.ndarray] | None = None  # numpy views of the buffers (buffer_arrays)

    #: a lazy commit's length whose views are not made yet (commit(..., lazy=True)): the first read or
    #: write of keys/values makes them
    _pending: int | None = None
    _keys_: torch.Tensor | None = None
    _values_: torch.Tensor | None = None
    keys = _CommittedView()
    values = _CommittedView()

    def _make_views(self) -> None:
        length, self._pending = self._pending, None
        self._keys_ = self._key_buffer[:, :, :length]
        self._values_ = self._value_buffer[:, :, :length]
        self._views = (self._keys_, self._values_)

    def cached_length(self) -> int:
        """The cache's length T (positions), without making a lazy commit's views."""
        if self._pending is not None:
            return self._pending
        return self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._pending = None
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None
        self._arrays = None
        self._views = None

    def _backed(self) -> bool:
        """Whether keys/values are still leading views of the buffers, all their rows."""
        return all(buf is not None and is_leading_view(x, buf, buf.shape[0])
                   for x, buf in ((self.keys, self._key_buffer), (self.values, self._value_buffer)))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends key/value states [B, H_kv, N, D]; returns the [B, H_kv, T + N, D] views
        (with ``static_write_index`` set: writes at those positions and returns the first
        ``static_window`` positions of the [B, H_kv, capacity, D] buffers, all of them when that is
        None; ``keys``/``values`` left for the caller to set)."""
        if self.static_write_index is not None:
            self._key_buffer.index_copy_(2, self.static_write_index, key_states)
            self._value_buffer.index_copy_(2, self.static_write_index, value_states)
            w = self.static_window
            if w is None:
                return self._key_buffer, self._value_buffer
            return self._key_buffer[:, :, :w], self._value_buffer[:, :, :w]
        b, h, n, d = key_states.shape
        kb, vb, t = self.reserve(b, h, n, d, value_states.shape[-1], key_states.dtype, key_states.device)
        kb[:, :, t:t + n] = key_states
        vb[:, :, t:t + n] = value_states
        return self.commit(t + n)

    def reserve(self, batch: int, heads: int, n: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``n`` more positions: returns (key buffer, value buffer, T), buffers
        [B, H_kv, ≥ T + n, D] whose first T positions hold the cache; the caller writes positions
        T .. T + n - 1 of every row, then calls :meth:`commit` with T + n (what :meth:`update` does).
        Grows the buffers as :meth:`update` does (the class docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(torch.empty(batch, heads, 0, key_dim, dtype=dtype, device=device),
                                     torch.empty(batch, heads, 0, value_dim, dtype=dtype, device=device))
        t = self.cached_length()
        if not (self.holds_last_commit() or self._backed()) or t + n > self._key_buffer.shape[2]:
            cap = -(-2 * (t + n) // self.granule) * self.granule
            kb = torch.empty(batch, heads, cap, key_dim, dtype=dtype, device=device)
            vb = torch.empty(batch, heads, cap, value_dim, dtype=dtype, device=device)
            if t:
                kb[:, :, :t] = self.keys
                vb[:, :, :t] = self.values
            self._key_buffer, self._value_buffer = kb, vb
            self._arrays = None
        return self._key_buffer, self._value_buffer, t

    def buffer_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """numpy views of the whole key and value buffers [B, H_kv, capacity, D] (CPU; 2-byte dtypes
        as their int16 patterns, numpy having no bfloat16), made once per buffer: what the C++
        compaction (:func:`compact_buffered`) writes through."""
        if self._arrays is None:
            self._arrays = tuple((b.view(torch.int16) if b.element_size() == 2 else b).numpy()
                                 for b in (self._key_buffer, self._value_buffer))
        return self._arrays

    def holds_last_commit(self) -> bool:
        """Whether ``keys``/``values`` are still the views the last :meth:`commit` set (an identity
        test, cheaper than :meth:`_backed`'s: nothing replaced or cropped them since)."""
        if self._pending is not None:  # nothing replaced keys/values since the lazy commit
            return True
        return self._views is not None and self._views[0] is self._keys_ and self._views[1] is self._values_

    def commit(self, length: int, lazy: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After :meth:`reserve`: the cache is the first ``length`` positions of the buffers; returns the
        [B, H_kv, length, D] key and value views.  With ``lazy``, returns None and makes the views
        when ``keys`` or ``values`` is next read or set (a step that only reserves, writes through
        the buffers and commits never makes them: 2 tensor views a layer a step saved)."""
        if lazy:
            self._pending = length
            return None
        self._pending = None  # an earlier lazy commit's views are not needed
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def reset(self) -> None:
        self._pending = None
        self._key_buffer = self._value_buffer = None
        self._views = self._arrays = None
        super().reset()


class BufferedKVCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`BufferedKVLayer`."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=BufferedKVLayer)

    def layer(self, index: int) -> BufferedKVLayer:
        """Layer ``index``'s cache, created (with those before it) when missing, as ``update`` does."""
        while len(self.layers) <= index:
            self.layers.append(BufferedKVLayer())
        return self.layers[index]
