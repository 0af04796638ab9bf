"""Teacher features of the self-distilled sequences, computed once by one target
forward per sequence and kept on disk as plain ``.npy`` arrays (read with
``allow_pickle=False``; docs/design.md §2 "Training": the teacher distributions
come from one target forward over the sequence).

Per sequence position t (all sequences concatenated, ``offsets`` delimits them):

- ``taps.npy`` [N, 3H] float16: the hidden-state taps the head reads;
- ``teacher_ids.npy`` [N, K] int32 and ``teacher_probs.npy`` [N, K] float16:
  the K most likely tokens of the target's distribution at t (the
  distribution of x_{t+1}), as **draft-vocabulary indices**, with their
  probabilities under the full-vocabulary softmax (draft tokens only, so the
  mass can be < 1; the cross-entropy against them is the KL of issue 5 up to
  a constant and the truncation);
- ``tokens.npy`` [N] int32: x_t itself; ``offsets.npy`` [S + 1] int64.

The draft vocabulary (``draft_vocab.npy``: target ids sorted ascending) is the
``draft_vocab_size`` most frequent target tokens of the training sequences,
EOS always included.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dart_core.train.data import Example

logger = logging.getLogger(__name__)

__all__ = ["Features", "choose_draft_vocab", "compute_features"]


def choose_draft_vocab(examples: list[Example], size: int, vocab_size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The ``size`` most frequent target ids of the examples (ties by id), plus ``always``; sorted ascending."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for e in examples:
        np.add.at(counts, np.asarray(e.ids, dtype=np.int64), 1)
    for t in always:
        counts[t] = counts.max() + 1
    size = min(size, vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))[:size]
    return np.sort(order).astype(np.int64)


class Features:
    """Memory-mapped teacher features of a folder written by :func:`compute_features`."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        meta = folder / "meta.json"
        if not meta.is_file():
            raise FileNotFoundError(f"no teacher features at {folder}")
        self.meta = json.loads(meta.read_text())
        load = lambda n: np.load(folder / f"{n}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        self.taps, self.teacher_ids, self.teacher_probs = load("taps"), load("teacher_ids"), load("teacher_probs")
        self.tokens, self.offsets, self.draft_vocab = load("tokens"), load("offsets"), load("draft_vocab")
        self.prompt_lengths = load("prompt_lengths")
        self.indices = load("indices")  # prompt index of each sequence

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int) -> dict[str, np.ndarray | int]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"taps": self.taps[a:b], "teacher_ids": self.teacher_ids[a:b], "teacher_probs": self.teacher_probs[a:b],
                "tokens": self.tokens[a:b], "prompt_length": int(self.prompt_lengths[i])}


@torch.inference_mode()
def compute_features(target, examples: list[Example], folder: str | Path, *, draft_vocab: np.ndarray,
                     top_k: int = 16, max_length: int = 512, progress: bool = True) -> Features:
    """One target forward per sequence (truncated to ``max_length``) → :class:`Features` in ``folder``.

    Reuses the folder when its ``meta.json`` matches (same sequences, vocabulary, K, length).
    """
    folder = Path(folder)
    key = {"indices": [e.index for e in examples], "draft_vocab_sha": _sha(draft_vocab), "top_k": top_k,
           "max_length": max_length, "tap_layers": list(target.tap_layers)}
    meta_path = folder / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("key") == key:
        return Features(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = [min(len(e.ids), max_length) for e in examples]
    n = sum(lengths)
    h3 = 3 * target.config.hidden_size
    taps = np.lib.format.open_memmap(folder / "taps.npy", mode="w+", dtype=np.float16, shape=(n, h3))
    t_ids = np.lib.format.open_memmap(folder / "teacher_ids.npy", mode="w+", dtype=np.int32, shape=(n, top_k))
    t_probs = np.lib.format.open_memmap(folder / "teacher_probs.npy", mode="w+", dtype=np.float16, shape=(n, top_k))
    tokens = np.zeros(n, dtype=np.int32)
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    vocab_t = torch.as_tensor(draft_vocab, device=target.device)
    model = target.model
    for i, e in enumerate(tqdm(examples, desc="teacher forward", unit="seq", disable=not progress)):
        ids = torch.tensor(e.ids[: lengths[i]], device=target.device)[None]
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        a, b = int(offsets[i]), int(offsets[i + 1])
        taps[a:b] = torch.cat([hs[j] for j in target.tap_layers], dim=-1)[0].float().cpu().numpy()
        probs = out.logits[0].float().softmax(-1)[:, vocab_t]  # [T, V_draft]
        p, idx = probs.topk(top_k, dim=-1)
        t_ids[a:b] = idx.int().cpu().numpy()
        t_probs[a:b] = p.cpu().numpy()
        tokens[a:b] = e.ids[: lengths[i]]
    for arr in (taps, t_ids, t_probs):
        arr.flush()
    np.save(folder / "tokens.npy", tokens)
    np.save(folder / "offsets.npy", offsets)
    np.save(folder / "draft_vocab.npy", draft_vocab)
    np.save(folder / "prompt_lengths.npy", np.array([len(e.prompt_ids) for e in examples], dtype=np.int64))
    np.save(folder / "indices.npy", np.array([e.index for e in examples], dtype=np.int64))
    meta_path.write_text(json.dumps({"key": key, "tokens": n, "sequences": len(examples)}) + "\n")
    logger.info("teacher features: %d sequences, %d positions in %s", len(examples), n, folder)
    return Features(folder)


def _sha(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
