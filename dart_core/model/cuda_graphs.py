"""Verification forwards replayed as CUDA graphs over a static KV cache.

On a GPU a step of a small target is bound by the host: in the first GPU run
(``bench/results/gpu/``) the kernels of a SmolLM2 step took a small part of
it, over a thousand kernel launches issued one by one from Python.  A CUDA graph records those launches once and replays them in one
call.  A graph replays fixed shapes at fixed addresses, so this module gives
the target's forward (tree verification and the plain one-token step, which
is a tree of one node) exactly that:

- **Padded tree sizes**: a forward of N query tokens runs at the smallest
  size bucket Nb ≥ N (1, 2, 4, ..., 64 by default); the Nb - N padding
  nodes attend only to themselves and their outputs are dropped.
- **Padded batch sizes**: a batch of B sequences runs at the smallest
  batch bucket Bb ≥ B (1, 2, 4, ..., 64), its padding rows attending only
  to themselves, so a continuous batch that moves through every size from
  1 to 64 needs 7 sets of buffers and graphs per tree size, not 64
  (SmolLM2 in bf16 at capacity 2,048: 47 MB of KV buffers per row, 6 GB
  for every bucket up to 64).
- **A static KV cache**: per batch bucket Bb one [Bb, H_kv, capacity, D] key
  and value buffer per layer.  The cache's layers
  (:class:`~dart_core.model.kv_cache.BufferedKVLayer`) are bound to those buffers,
  their ``keys`` / ``values`` views of the first B rows and T positions, so
  the engine's compaction and cropping work unchanged; a forward writes its
  Nb new entries at [T, T + Nb) through an index tensor
  (``BufferedKVLayer.static_write_index``) and attends over the buffer's
  first Wb positions, the 4D mask hiding every position the engine's mask
  does not allow.  A cache whose layers hold other tensors (prefill, a
  batch that gained or lost sequences) is copied into the buffers once.
- **Attention windows**: Wb is the smallest window bucket ≥ T + Nb
  (256, 512, 1024, ... up to the capacity by default), so a step reads
  the keys and values its sequences have, rounded up, instead of the
  whole capacity: the attention and the key/value traffic of a step grow
  with the context, not with the capacity.  ``KernelConfig.static_windows``
  False (the target's :attr:`~dart_core.model.target.TargetModel.kernels`) attends
  over the whole capacity (one window), for measurements.
- **Static inputs and outputs**: token ids, positions and the
  [Bb, 1, Nb, Wb] mask are copied into fixed tensors before each
  replay; logits and taps are returned as views of the graph's outputs,
  valid until the next forward (the engine reads them within the step).

Graphs are captured lazily, one per (Bb, Nb, Wb), the first time that shape is
verified (warm-up runs, then capture, on a side stream, as PyTorch's CUDA
graph documentation prescribes).  A forward that does not fit (more than the
largest buckets, or past the capacity) runs eagerly on the same cache.

Without CUDA (``use_graphs=False``) the same static path runs eagerly: that
is how the CPU tests check it equal to the ordinary forward; only the
capture and replay themselves need a GPU (the ``gpu``-marked test).
The draft head's forward has its own static path, :class:`StaticDrafter`, built the same
way over a static head KV cache.  Prefill stays eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dart_core.model.kv_cache import KVPool, is_leading_view

logger = logging.getLogger(__name__)

__all__ = ["StaticVerifier", "StaticDrafter", "DEFAULT_BUCKETS", "DEFAULT_BATCH_BUCKETS", "DEFAULT_DRAFT_WIDTHS"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def default_windows(capacity: int, smallest: int = 256, windowed: bool = True) -> tuple[int, ...]:
    """The attention windows of a static cache of ``capacity`` positions: ``smallest``, doubling,
    then the capacity itself (only the capacity when not ``windowed``: ``KernelConfig.static_windows``
    False, for measurements)."""
    if not windowed:
        return (capacity,)
    windows, w = [], smallest
    while w < capacity:
        windows.append(w)
        w *= 2
    return (*windows, capacity)


def _check_settings(what: str, device: torch.device, use_graphs: bool | None, **sizes: tuple[int, ...]) -> bool:
    """Whether to capture graphs (default: on CUDA); raises ValueError for graphs off CUDA or
    bucket sizes that are not positive and ascending."""
    if use_graphs is None:
        use_graphs = device.type == "cuda"
    if use_graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, the {what} is on {device}")
    for name, values in sizes.items():
        if not values or list(values) != sorted(set(values)) or values[0] < 1:
            raise ValueError(f"{name} must be positive and ascending, got {values}")
    return use_graphs


@dataclass
class _Shape:
    """The static tensors of one (Bb, Nb) shape and its graph (None without CUDA graphs)."""

    ids: torch.Tensor  # [Bb, Nb] int64
    pos: torch.Tensor  # [Bb, Nb] int64
    mask: torch.Tensor  # [Bb, 1, Nb, Wb] additive, target dtype
    write_index: torch.Tensor  # [Nb] int64: where the Nb new entries go in the buffers
    window: int  # Wb: the forward attends over the buffers' first Wb positions
    logits: torch.Tensor | None = None  # [Bb, Nb, V] float32 (graph output)
    taps: torch.Tensor | None = None  # [Bb, Nb, 3H]
    graph: "torch.cuda.CUDAGraph | None" = None


class StaticVerifier:
    """Runs :meth:`TargetModel.forward <dart_core.model.target.TargetModel.forward>` over a static
    KV cache, as CUDA graphs on a GPU (module docstring).

    Args:
        target: the :class:`~dart_core.model.target.TargetModel` (its ``forward`` calls :meth:`forward`).
        capacity: KV positions per sequence in the static buffers; a forward whose cache plus
            padded tree exceeds it runs eagerly.
        buckets: the padded query sizes, ascending; larger forwards run eagerly.
        batch_buckets: the padded batch sizes, ascending; larger batches run eagerly.
        windows: the attention windows, ascending, the last one the capacity (default
            :func:`default_windows`, windowed as the target's ``kernels.static_windows`` says): a
            forward attends over the smallest that holds its cache and padded tree.
        use_graphs: capture and replay CUDA graphs (default: on a CUDA device); False runs the
            static path eagerly (tests, or to compare).

    Raises:
        ValueError: ``use_graphs=True`` off CUDA, a capacity below the largest bucket, buckets
            (of any kind) that are not positive and ascending, or windows that do not end at the
            capacity.
    """

    def __init__(self, target, *, capacity: int = 2048, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS, windows: tuple[int, ...] | None = None,
                 use_graphs: bool | None = None) -> None:
        if windows is None:
            kernels = getattr(target, "kernels", None)
            windows = default_windows(capacity, windowed=kernels is None or kernels.static_windows)
        windows = tuple(windows)
        use_graphs = _check_settings("target", target.device, use_graphs, buckets=buckets, batch_buckets=batch_buckets,
                                     windows=windows)
        if capacity < buckets[-1]:
            raise ValueError(f"capacity {capacity} is below the largest bucket {buckets[-1]}")
        if windows[-1] != capacity:
            raise ValueError(f"the last window must be the capacity {capacity}, got {windows}")
        self.target = target
        self.capacity = capacity
        self.buckets = tuple(buckets)
        self.batch_buckets = tuple(batch_buckets)
        self.windows = windows
        self.use_graphs = use_graphs
        self._kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # Bb -> per layer (keys, values)
        self._pools: dict[int, KVPool] = {}  # Bb -> the one tensor those buffers are views of
        self._shapes: dict[tuple[int, int, int], _Shape] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.replays = 0  # forwards that took the static path
        self.eager = 0  # forwards that ran eagerly (prefills into a fresh cache, or too large)
        self.captures = 0  # graphs captured (each one a slow step: the speculation gate leaves it out)
        self._warned = False

    def bucket(self, n: int) -> int | None:
        """The padded size for ``n`` query tokens, None beyond the largest bucket."""
        return next((b for b in self.buckets if b >= n), None)

    def batch_bucket(self, b: int) -> int | None:
        """The padded batch size for ``b`` sequences, None beyond the largest batch bucket."""
        return next((x for x in self.batch_buckets if x >= b), None)

    def _buffers(self, b: int, layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if b not in self._kv:
            k = layers[0].keys
            if any(x.keys.shape[1::2] != k.shape[1::2] or x.values.shape[1::2] != k.shape[1::2] for x in layers):
                raise ValueError("the static KV cache needs the same key/value heads and head size in every layer")
            self._pools[b] = KVPool(k.new_zeros(len(layers), 2, b, k.shape[1], self.capacity, k.shape[3]))
            self._kv[b] = self._pools[b].layer_buffers()
            logger.info("static KV cache for %d rows: %d positions, %.1f MB", b, self.capacity,
                        self._pools[b].pool.numel() * k.element_size() / 1e6)
        return self._kv[b]

    def _bind(self, cache, b: int, bb: int, t: int) -> None:
        """Points every cache layer's B rows at the first rows of the static buffers of bucket
        ``bb`` (copying its T entries in when they live elsewhere)."""
        layers = cache.cache.layers
        for layer, (kb, vb) in zip(layers, self._buffers(bb, layers)):
            if not (is_leading_view(layer.keys, kb, b) and is_leading_view(layer.values, vb, b)):
                kb[:b, :, :t].copy_(layer.keys)
                vb[:b, :, :t].copy_(layer.values)
                layer._key_buffer, layer._value_buffer = kb, vb
                layer.keys, layer.values = kb[:b, :, :t], vb[:b, :, :t]

    def window(self, end: int) -> int:
        """The attention window for a forward whose cache and padded tree end at ``end`` (≤ capacity)."""
        return next(w for w in self.windows if w >= end)

    def _shape(self, b: int, nb: int, wb: int) -> _Shape:
        key = (b, nb, wb)
        if key not in self._shapes:
            dev, dtype = self.target.device, self.target.dtype
            self._shapes[key] = _Shape(ids=torch.zeros(b, nb, dtype=torch.long, device=dev),
                                       pos=torch.zeros(b, nb, dtype=torch.long, device=dev),
                                       mask=torch.zeros(b, 1, nb, wb, dtype=dtype, device=dev),
                                       write_index=torch.arange(nb, device=dev), window=wb)
        return self._shapes[key]

    def _run(self, s: _Shape, cache) -> None:
        """One forward of the static inputs, writing through ``write_index`` (eager, or recorded)."""
        layers = cache.cache.layers
        for layer in layers:
            layer.static_write_index, layer.static_window = s.write_index, s.window
        try:
            out = self.target.model_forward(s.ids, s.pos, s.mask, cache)
        finally:
            for layer in layers:
                layer.static_write_index = layer.static_window = None
        s.logits, s.taps = out.logits, out.taps

    def _capture(self, s: _Shape, cache) -> None:
        stream = torch.cuda.Stream(self.target.device)
        stream.wait_stream(torch.cuda.current_stream(self.target.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (kernel selection, allocator) with the real inputs
                self._run(s, cache)
        torch.cuda.current_stream(self.target.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._run(s, cache)
        s.graph = graph
        self.captures += 1
        logger.info("captured a CUDA graph for batch %d, %d query tokens, a window of %d positions",
                    *s.ids.shape, s.window)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's forward of N new tokens over the static cache, or None when it does not fit
        (the caller then runs the ordinary forward).

        Args:
            input_ids, position_ids: [B, N]; attention_mask: [B, 1, N, T + N] additive, as
                :func:`~dart_core.model.kv_cache.cache_mask` builds it; cache: the
                :class:`~dart_core.model.target.TargetCache` (T = its padded length).

        Returns:
            (logits [B, N, V] float32, taps [B, N, 3H]): views of static outputs, overwritten by
            the next forward.  The cache then holds T + N entries per row, as after the
            ordinary forward.
        """
        b, n = input_ids.shape
        t = cache.padded_length
        nb, bb = self.bucket(n), self.batch_bucket(b)
        layers = cache.cache.layers
        if (nb is None or bb is None or t + nb > self.capacity or not layers
                or not all(getattr(x, "is_initialized", False) for x in layers)):
            if nb is not None and t + nb > self.capacity and not self._warned:
                logger.warning("the KV cache (%d positions) outgrew the static capacity %d: such steps run "
                               "without CUDA graphs (raise capacity)", t + nb, self.capacity)
                self._warned = True
            self.eager += 1
            return None
        self._bind(cache, b, bb, t)
        s = self._shape(bb, nb, self.window(t + nb))
        # static inputs: padding nodes and rows take token 0 and see only themselves
        s.ids.zero_()
        s.ids[:b, :n] = input_ids
        s.pos.zero_()
        s.pos[:b, :n] = position_ids
        s.pos[:b, n:] = position_ids[:, -1:]
        s.mask.fill_(torch.finfo(s.mask.dtype).min)
        s.mask[:b, :, :n, : t + n] = attention_mask
        node = torch.arange(nb, device=s.mask.device)
        s.mask[:, 0, node, t + node] = 0  # every node sees itself (real ones already do)
        torch.add(node, t, out=s.write_index)
        if not self.use_graphs:
            self._run(s, cache)
        elif s.graph is None:
            self._capture(s, cache)
            s.graph.replay()
        else:
            s.graph.replay()
        self._pools[bb].bind(layers, b, t + n)  # the layers' keys/values: views of the pool (one-pass compaction)
        cache.pool = self._pools[bb]
        self.replays += 1
        return s.logits[:b, :n], s.taps[:b, :n]



DEFAULT_DRAFT_WIDTHS = (1, 2, 4, 8, 16)


@dataclass
class _DraftShape:
    """The static tensors of one (Bb, Wb) draft shape and its graph (None without CUDA graphs)."""

    taps: torch.Tensor  # [Bb, Wb, 3H] head dtype: taps of the new real positions
    next_ids: torch.Tensor  # [Bb, Wb] int64: the token after each of them
    pos: torch.Tensor  # [Bb, Wb] int64 RoPE positions
    last_index: torch.Tensor  # [Bb] int64: each row's last valid real position in Wb
    lengths: torch.Tensor  # [Bb] int64: valid head-cache entries before the forward
    ids: torch.Tensor | None = None  # [Bb, d, k] int64 target ids of the top-k per level (graph output)
    probs: torch.Tensor | None = None  # [Bb, d, k] float32 softmax over the top-k logits (graph output)
    graph: "torch.cuda.CUDAGraph | None" = None


class StaticDrafter:
    """Runs the draft head's forward over a static head KV cache, as CUDA graphs on a GPU.

    The draft forward (:meth:`DartDraftHead.forward_static <dart_core.spec.draft_head.DartDraftHead.forward_static>`)
    together with the target's embedding of the next tokens, the top-k per level, its softmax and
    the draft-to-target vocabulary mapping:

    - **A static head KV cache**: per batch bucket one [Bb, H_kv, capacity, D] key and value buffer.
      The :class:`~dart_core.model.kv_cache.HeadKVCache`'s ``keys``/``values`` become views of its first B
      rows (a cache that lives elsewhere, after continuous batching merged or dropped rows, is
      copied in once); a forward writes the new entries in place and only ``lengths`` advances: no
      concatenation, no compaction, no host read.
    - **With CUDA graphs** (``use_graphs``, default on CUDA), at fixed shapes: a forward of W new
      real positions per row (the tokens accepted since the last draft) runs at the smallest width
      bucket Wb >= W (1, 2, 4, 8, 16), a batch at its batch bucket (padding rows draft garbage that
      is dropped), all d levels (a step that needs fewer reads the first ones: they do not depend
      on the later slots), one graph per (Bb, Wb) captured lazily.  Wider catch-up drafts (steps
      without drafting, with the engine's folding off) and caches past ``capacity`` (2,048 by
      default) run eagerly.
    - **Without graphs** (a CPU): the same static cache at the exact shapes, only the levels asked
      for; the capacity (unless given) starts at 256 positions and doubles as sequences grow, so
      every draft takes this path.

    Args:
        head: the :class:`~dart_core.spec.draft_head.DartDraftHead`.
        embed: the target's input embedding module (``TargetModel.embed_tokens``).
        top_k: draft tokens per level (``SearchParams.top_k``; at most the draft vocabulary).
        capacity: head KV positions per sequence in the static buffers (None: 2,048 with graphs,
            growing without them).
        widths, batch_buckets: the padded widths and batch sizes, ascending.
        use_graphs: capture and replay CUDA graphs (default: on a CUDA device).

    Raises:
        ValueError: ``use_graphs=True`` off CUDA, buckets that are not positive and ascending, or a
            capacity that leaves no room for the largest width and the mask slots.
    """

    def __init__(self, head, embed, *, top_k: int, capacity: int | None = None,
                 widths: tuple[int, ...] = DEFAULT_DRAFT_WIDTHS,
                 batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS, use_graphs: bool | None = None) -> None:
        device = head.norm.weight.device
        use_graphs = _check_settings("draft head", device, use_graphs, widths=widths, batch_buckets=batch_buckets)
        if capacity is None and use_graphs:
            capacity = 2048
        if capacity is not None and capacity < widths[-1] + head.config.depth + 2:
            raise ValueError(f"capacity {capacity} leaves no room for width {widths[-1]} and the mask slots")
        self.head, self.embed, self.device = head, embed, device
        self.top_k = top_k
        self.capacity = capacity  # None: grows (without graphs)
        self.widths = tuple(widths)
        self.batch_buckets = tuple(batch_buckets)
        self.use_graphs = use_graphs
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # Bb -> (keys, values) buffers
        self._shapes: dict[tuple[int, int], _DraftShape] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.replays = 0  # drafts that took the static path
        self.eager = 0  # drafts that did not fit it
        self.captures = 0  # graphs captured
        self._warned = False

    def _buffers(self, bb: int, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers of batch bucket ``bb``, (re)allocated to hold ``need`` positions per row."""
        have = self._kv.get(bb)
        if have is None or have[0].shape[2] < need:
            c = self.head.config
            cap = self.capacity or max(256, 1 << (need - 1).bit_length())
            shape = (bb, c.num_key_value_heads, cap, c.head_dim)
            self._kv[bb] = (torch.zeros(shape, dtype=self.head.dtype, device=self.device),
                            torch.zeros(shape, dtype=self.head.dtype, device=self.device))
        return self._kv[bb]

    def _holds(self, cache, bb: int, b: int) -> bool:
        """Whether the cache's keys/values are already the first ``b`` rows of bucket ``bb``'s buffers."""
        kb, vb = self._kv[bb]
        return is_leading_view(cache.keys, kb, b) and is_leading_view(cache.values, vb, b)

    def _shape(self, bb: int, wb: int) -> _DraftShape:
        key = (bb, wb)
        if key not in self._shapes:
            c, dev = self.head.config, self.device
            long = dict(dtype=torch.long, device=dev)
            self._shapes[key] = _DraftShape(
                taps=torch.zeros(bb, wb, 3 * c.target_hidden_size, dtype=self.head.dtype, device=dev),
                next_ids=torch.zeros(bb, wb, **long), pos=torch.zeros(bb, wb, **long),
                last_index=torch.zeros(bb, **long), lengths=torch.zeros(bb, **long))
        return self._shapes[key]

    def _topk(self, taps, next_ids, pos, last_index, keys, values, lengths, levels=None):
        """The draft and its top-k: (ids [B, L, k] target ids, probs [B, L, k] float32)."""
        head = self.head
        return head.topk_static(taps, self.embed(next_ids).to(head.dtype), pos, last_index, keys, values, lengths,
                                self.top_k, levels)

    def _run(self, s: _DraftShape, keys: torch.Tensor, values: torch.Tensor) -> None:
        s.ids, s.probs = self._topk(s.taps, s.next_ids, s.pos, s.last_index, keys, values, s.lengths)

    def _capture(self, s: _DraftShape, keys: torch.Tensor, values: torch.Tensor) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up with the real inputs (it writes the same cache entries)
                self._run(s, keys, values)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._run(s, keys, values)
        s.graph = graph
        self.captures += 1
        logger.info("captured a draft CUDA graph for batch %d, width %d", *s.next_ids.shape)

    @torch.inference_mode()
    def forward(self, taps: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                last_index: torch.Tensor, cache, max_positions: int, levels: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One draft over the static cache, or None when it does not fit (the caller drafts eagerly).

        Args:
            taps: [B, W, 3H]; next_ids, positions: [B, W] int64; last_index: [B] int64, as
                :meth:`DartDraftHead.forward <dart_core.spec.draft_head.DartDraftHead.forward>` takes them.
            cache: the :class:`~dart_core.model.kv_cache.HeadKVCache`; its ``lengths`` advance by
                ``last_index + 1`` and its ``keys``/``values`` become views of the static buffers.
            max_positions: a host-side upper bound on every row's head-cache length after this
                draft (its tokens so far), so that the capacity check reads no device tensor.
            levels: the levels needed (default d; with graphs all d are drafted anyway).

        Returns:
            (ids [B, L, k] int64 target ids, probs [B, L, k] float32), L = ``levels`` (with graphs,
            views of static outputs, valid until the next draft).
        """
        b, w = next_ids.shape
        t = cache.keys.shape[2]
        wb = next((x for x in self.widths if x >= w), None)
        bb = next((x for x in self.batch_buckets if x >= b), None)
        if not self.use_graphs:
            wb, bb = w, bb or b
        need = max_positions + self.head.config.depth + 2
        if bb not in self._kv or not self._holds(cache, bb, b):
            need = max(need, t)  # the cache is copied in
        if wb is None or bb is None or (self.capacity is not None and need > self.capacity):
            if wb is not None and bb is not None and not self._warned:
                logger.warning("the draft head's KV cache outgrew the static capacity %d: such drafts run "
                               "eagerly", self.capacity)
                self._warned = True
            self.eager += 1
            return None
        kb, vb = self._buffers(bb, need)
        if not self._holds(cache, bb, b):
            kb[:b, :, :t].copy_(cache.keys)
            vb[:b, :, :t].copy_(cache.values)
        if not self.use_graphs:
            ids, probs = self._topk(taps, next_ids, positions, last_index, kb[:b], vb[:b], cache.lengths, levels)
        else:
            s = self._shape(bb, wb)
            s.taps.zero_()
            s.taps[:b, :w] = taps
            s.next_ids.zero_()
            s.next_ids[:b, :w] = next_ids
            s.pos.zero_()
            s.pos[:b, :w] = positions
            s.last_index.zero_()
            s.last_index[:b] = last_index
            s.lengths.zero_()
            s.lengths[:b] = cache.lengths
            if s.graph is None:
                self._capture(s, kb, vb)
            s.graph.replay()
            levels = self.head.config.depth if levels is None else levels
            ids, probs = s.ids[:b, :levels], s.probs[:b, :levels]
        cache.keys, cache.values = kb[:b], vb[:b]
        cache.lengths = cache.lengths + last_index + 1
        self.replays += 1
        return ids, probs
