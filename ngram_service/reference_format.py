"""The DART reference's n-gram file format (its ``TrieNgram.save``) from the Python side:
dart-serve trie levels as numpy arrays (:func:`read_levels`), written out in the
reference format (:func:`write_reference_levels`: for the conversion benchmark and for
pruning like the reference), and the reference's pruning (:func:`reduce_levels`).

The format (reference_trie.hpp): ``u64 order | u64 node_count`` then one record per node,
node 0 the root: ``i32 token | u64 parent | i32 freq | u64 n_children | n_children x
(i32 token, u64 node index)``, little-endian, packed.  Reading it is the C++ converter's
job (:mod:`ngram_service.convert`).
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ngram_service.trie import NgramTrie, level_table

__all__ = ["read_levels", "reduce_levels", "write_reference_format", "write_reference_levels"]

_RECORD = np.dtype([("token", "<i4"), ("parent", "<u8"), ("freq", "<i4"), ("n_children", "<u8")])  # 24 B, packed
_CHILD = np.dtype([("token", "<i4"), ("index", "<u8")])  # 12 B, packed


def read_levels(path: str | os.PathLike[str]) -> list[dict[str, np.ndarray]]:
    """The arrays of a dart-serve trie, per level (level 1 first): ``tokens`` u32 [n],
    ``counts`` u64 [n] and, except on the last level, ``children`` u64 [n + 1] (CSR offsets
    into the next level).  Memory-mapped where the widths allow; layout in trie_format.hpp.

    Raises:
        TrieFormatError: not a readable trie (checked by opening it first).
    """
    NgramTrie(path)  # header, CRC and bounds checks
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    table = level_table(raw)
    levels = []
    for m, e in enumerate(table):
        level = {"tokens": np.frombuffer(raw, "<u4", e.num_nodes, e.tokens_offset),
                 "counts": np.frombuffer(raw, f"<u{e.count_width}", e.num_nodes, e.counts_offset).astype(np.uint64)}
        if m < len(table) - 1:
            level["children"] = np.frombuffer(raw, f"<u{e.child_width}", e.num_nodes + 1,
                                              e.children_offset).astype(np.uint64)
        levels.append(level)
    return levels


def _fan_out(levels: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """Per level, the number of children of each node (int64; 0 on the last level)."""
    return [np.diff(lv["children"].astype(np.int64)) if "children" in lv else np.zeros(len(lv["tokens"]), np.int64)
            for lv in levels]


def _parent_of(n_children: np.ndarray) -> np.ndarray:
    """For children listed parent by parent: the index of each child's parent."""
    return np.repeat(np.arange(len(n_children)), n_children)


def _preorder_ids(n_children: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Depth-first preorder ids (root 0) of every node, per level in lexicographic order, with
    each node's children visited in a random order."""
    order = len(n_children)
    subtree = [np.ones(len(n), np.int64) for n in n_children]  # nodes in each subtree, itself included
    for m in range(order - 2, -1, -1):
        subtree[m] += np.bincount(_parent_of(n_children[m]), weights=subtree[m + 1],
                                  minlength=len(subtree[m])).astype(np.int64)
    ids, parent_ids = [], np.zeros(1, np.int64)
    counts = [np.array([len(n_children[0])], np.int64)] + n_children[:-1]
    for m in range(order):
        parent_of = _parent_of(counts[m])
        visit = np.lexsort((rng.random(len(parent_of)), parent_of))  # siblings in a random order
        before = np.cumsum(subtree[m][visit]) - subtree[m][visit]  # nodes visited earlier, any parent
        group_start = np.repeat(np.cumsum(counts[m]) - counts[m], counts[m])
        level_ids = np.empty(len(parent_of), np.int64)
        level_ids[visit] = parent_ids[parent_of[visit]] + 1 + before - before[group_start]
        ids.append(level_ids)
        parent_ids = level_ids
    return ids


def write_reference_format(trie_path: str | os.PathLike[str], out: str | os.PathLike[str], **kwargs) -> dict:
    """Writes the nodes of a dart-serve trie as a reference ``TrieNgram.save`` file
    (:func:`write_reference_levels` on :func:`read_levels`)."""
    return write_reference_levels(read_levels(trie_path), out, **kwargs)


def write_reference_levels(levels: list[dict[str, np.ndarray]], out: str | os.PathLike[str], *, id_order: str = "dfs",
                           seed: int = 0, chunk: int = 1 << 19, progress: bool = True) -> dict:
    """Writes trie levels (as :func:`read_levels` returns them; counts may be signed, as after
    :func:`reduce_levels`) as a reference ``TrieNgram.save`` file.

    Node ids (the root is 0): ``"dfs"``, depth-first preorder with each node's children in a
    random order (the layout a reference merge writes); ``"level"``, level 1, level 2, ...
    with a random order inside each level (closer to a fresh reference build, whose ids follow
    insertion order, and the worst case for the converter's depth-first walk).  Either way
    every parent precedes its children and a record lists its children in id order, so not by
    token.  The root's freq is the level-1 total.  Returns {"nodes", "bytes", "seconds"}.

    Raises:
        ValueError: a count does not fit the reference's i32 freq, or an unknown id_order.
    """
    t0 = time.perf_counter()
    order = len(levels)
    rng = np.random.default_rng(seed)
    sizes = [len(lv["tokens"]) for lv in levels]
    if any(int(lv["counts"].max(initial=0)) >= 2**31 or int(lv["counts"].min(initial=0)) < -2**31 for lv in levels):
        raise ValueError("a count does not fit the reference format's i32 freq")
    n_children = _fan_out(levels)
    if id_order == "level":
        base = np.cumsum([1] + sizes[:-1], dtype=np.int64)  # id of the first node of each level
        ids = [b + rng.permutation(n).astype(np.int64) for b, n in zip(base, sizes)]  # lexicographic index -> id
    elif id_order == "dfs":
        ids = _preorder_ids(n_children, rng)
    else:
        raise ValueError(f'id_order must be "dfs" or "level", got {id_order!r}')
    # record sizes in id order: 24 + 12 * n_children
    rec_bytes = np.empty(1 + sum(sizes), np.int64)
    rec_bytes[0] = 24 + 12 * sizes[0]
    for m in range(order):
        rec_bytes[ids[m]] = 24 + 12 * n_children[m]
    offsets = np.empty_like(rec_bytes)
    offsets[0] = 16
    np.cumsum(rec_bytes[:-1], out=offsets[1:])
    offsets[1:] += 16
    total = int(offsets[-1] + rec_bytes[-1])
    del rec_bytes
    out = Path(out)
    buf = np.memmap(out, dtype=np.uint8, mode="w+", shape=(total,))
    buf[:16] = np.frombuffer(struct.pack("<QQ", order, 1 + sum(sizes)), np.uint8)
    bar = tqdm(total=1 + sum(sizes), unit="node", unit_scale=True, desc="writing reference format",
               disable=not progress)

    def put(at: np.ndarray, items: np.ndarray) -> None:  # packed records at byte offsets `at`
        width = items.dtype.itemsize
        buf[(at[:, None] + np.arange(width, dtype=np.int64)).ravel()] = items.view(np.uint8).ravel()

    def put_children(parent_at: np.ndarray, child_ids: np.ndarray, child_tokens: np.ndarray,
                     count: np.ndarray) -> None:
        # children of each parent in id order, at parent_at + 24 + 12 * rank
        parent_of = _parent_of(count)
        order_ = np.lexsort((child_ids, parent_of))
        rank = np.arange(len(order_), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        entries = np.empty(len(order_), _CHILD)
        entries["token"] = child_tokens[order_]
        entries["index"] = child_ids[order_]
        put(parent_at[parent_of] + 24 + 12 * rank, entries)

    root = np.zeros(1, _RECORD)
    level1_total = int(levels[0]["counts"].astype(np.int64).sum())
    root["freq"] = level1_total if -2**31 <= level1_total < 2**31 else -1  # not read by the converter
    root["n_children"] = sizes[0]
    put(offsets[:1], root)
    put_children(offsets[:1], ids[0], levels[0]["tokens"].astype(np.int32), np.array([sizes[0]], np.int64))
    bar.update(1)
    for m in range(order):
        lv = levels[m]
        parent_ids = None
        if m > 0:  # parent id of every node of this level, from the previous level's CSR offsets
            parent_ids = ids[m - 1][_parent_of(n_children[m - 1])]
        for lo in range(0, sizes[m], chunk):
            hi = min(sizes[m], lo + chunk)
            rec = np.empty(hi - lo, _RECORD)
            rec["token"] = lv["tokens"][lo:hi]
            rec["parent"] = 0 if m == 0 else parent_ids[lo:hi]
            rec["freq"] = lv["counts"][lo:hi]
            rec["n_children"] = n_children[m][lo:hi]
            at = offsets[ids[m][lo:hi]]
            put(at, rec)
            if m < order - 1:
                c_lo, c_hi = int(lv["children"][lo]), int(lv["children"][hi])
                put_children(at, ids[m + 1][c_lo:c_hi], levels[m + 1]["tokens"][c_lo:c_hi].astype(np.int32),
                             n_children[m][lo:hi])
            bar.update(hi - lo)
    bar.close()
    buf.flush()
    del buf
    return {"nodes": 1 + sum(sizes), "bytes": total, "seconds": round(time.perf_counter() - t0, 2)}


def reduce_levels(levels: list[dict[str, np.ndarray]], threshold: int) -> list[dict[str, np.ndarray]]:
    """The reference's ``reduce(threshold)`` on trie levels: nodes whose count is below
    ``threshold`` go (their subtrees with them, since a child never outnumbers its parent), and
    every kept node's count loses the counts of all the nodes dropped below it, so it can reach
    0 or less.  Returns new levels with int64 ``counts``; to be written with
    :func:`write_reference_levels` and converted (the converter's rule for such counts:
    reference_trie.hpp).

    Raises:
        ValueError: ``threshold`` below 1.
    """
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    order = len(levels)
    counts = [lv["counts"].astype(np.int64) for lv in levels]
    dropped = [c < threshold for c in counts]
    below = [np.zeros(len(c), np.int64) for c in counts]  # dropped counts in each node's subtree, itself excluded
    n_children = _fan_out(levels)
    for m in range(order - 2, -1, -1):
        lost = np.where(dropped[m + 1], counts[m + 1], 0) + below[m + 1]
        below[m] = np.bincount(_parent_of(n_children[m]), weights=lost, minlength=len(counts[m])).astype(np.int64)
    out = []
    for m in range(order):
        keep = ~dropped[m]
        level = {"tokens": np.asarray(levels[m]["tokens"])[keep], "counts": (counts[m] - below[m])[keep]}
        if m < order - 1:
            kept_before = np.concatenate([[0], np.cumsum(~dropped[m + 1])])  # kept children before each offset
            starts = kept_before[levels[m]["children"].astype(np.int64)]
            level["children"] = np.append(starts[:-1][keep], starts[-1]).astype(np.uint64)
        out.append(level)
    return out
