"""Ragged, left-aligned KV caches for batched speculative decoding.

Layout (the target's Hugging Face ``DynamicCache`` layers and the draft
head's cache alike): keys/values are [B, H_kv, T, D] and sequence b's valid
entries are exactly positions [0, lengths[b]).  A step appends its new
tokens (a draft tree) at [T, T + N) for every sequence; the 4D attention
masks let sequence b see only its valid prefix plus its own tree.  After
verification, :func:`compact_` moves each sequence's accepted entries to
[lengths[b], lengths[b] + counts[b]) and crops T to the longest sequence, so
rejected nodes and padding never survive a step and nothing grows.
"""

from __future__ import annotations

import torch

__all__ = ["compact_", "HeadKVCache", "cache_mask"]


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
    b, a = src.shape
    new_len = int((lengths + counts).max()) if b else 0
    if a:
        j = torch.arange(a, device=src.device)
        keep = j[None, :] < counts[:, None]  # [B, A]
        rows = torch.arange(b, device=src.device)[:, None].expand(b, a)[keep]
        dst = (lengths[:, None] + j[None, :])[keep]
        srcs = src[keep]
        keys[rows, :, dst] = keys[rows, :, srcs]
        values[rows, :, dst] = values[rows, :, srcs]
    return keys[:, :, :new_len], values[:, :, :new_len]


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
    k_idx = torch.arange(cache_len, device=lengths.device)
    prefix = (k_idx[None, :] < lengths[:, None])[:, None, :].expand(b, n, cache_len)
    allowed = torch.cat([prefix, tree_mask], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=lengths.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
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

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the given batch rows (finished sequences leave)."""
        self.keys, self.values, self.lengths = self.keys[rows], self.values[rows], self.lengths[rows]
        t = int(self.lengths.max()) if len(rows) else 0
        self.keys, self.values = self.keys[:, :, :t], self.values[:, :, :t]
