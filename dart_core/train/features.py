"""Teacher features of the training sequences, computed by one target forward
per sequence and kept on disk compactly as plain ``.npy`` arrays (read with
``allow_pickle=False``; docs/design.md §2 "Training": the teacher
distributions come from one target forward over the sequence).

Per sequence position t (all sequences concatenated, ``offsets`` delimits them):

- ``taps_q.npy`` [N, 3H] int8 and ``taps_scale.npy`` [N, 3] float16: the
  hidden-state taps the head reads, each of the three H-wide taps of a
  position quantised symmetrically to int8 with its own scale (absmax / 127).
  1,734 bytes per position instead of 6,912 in float32: on held-out SmolLM2
  sequences the shipped head's top-1 accuracy is the same with these taps as
  with float32 ones (docs/training.md gives the measurement);
- ``teacher_ids.npy`` [N, K] int16 (int32 for draft vocabularies over 32,767)
  and ``teacher_probs.npy`` [N, K] float16: the K most likely tokens of the
  target's distribution at t (the distribution of x_{t+1}), as
  **draft-vocabulary indices**, with their probabilities under the
  full-vocabulary softmax (draft tokens only, so the mass can be < 1; the
  cross-entropy against them is the KL objective up to a constant and the
  truncation);
- ``tokens.npy`` [N] int32: x_t itself; ``offsets.npy`` [S + 1] int64.

Computation is resumable: ``progress.json`` records how many sequences are
done, so a killed run continues where it stopped.  The draft vocabulary
(``draft_vocab.npy``: target ids sorted ascending) is the ``draft_vocab_size``
most frequent target tokens of the training sequences, EOS always included.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dart_core.train.data import Example

logger = logging.getLogger(__name__)

__all__ = ["Features", "choose_draft_vocab", "compute_features", "quantize_taps"]


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
    """Memory-mapped teacher features of a folder written by :func:`compute_features`.

    Raises:
        FileNotFoundError: no finished features in the folder.
    """

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        meta = folder / "meta.json"
        if not meta.is_file():
            raise FileNotFoundError(f"no teacher features at {folder}")
        self.meta = json.loads(meta.read_text())
        load = lambda n: np.load(folder / f"{n}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        self.taps_q, self.taps_scale = load("taps_q"), load("taps_scale")
        self.teacher_ids, self.teacher_probs = load("teacher_ids"), load("teacher_probs")
        self.tokens, self.offsets, self.draft_vocab = load("tokens"), load("offsets"), load("draft_vocab")
        self.prompt_lengths = load("prompt_lengths")
        self.indices = load("indices")  # example index of each sequence

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def taps(self, a: int, b: int) -> np.ndarray:
        """Positions a..b-1 de-quantised: [b - a, 3H] float32."""
        q = np.asarray(self.taps_q[a:b], dtype=np.float32)
        scale = np.asarray(self.taps_scale[a:b], dtype=np.float32)
        return (q.reshape(len(q), 3, -1) * scale[:, :, None]).reshape(len(q), -1)

    def sequence(self, i: int) -> dict[str, np.ndarray | int]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"taps": self.taps(a, b), "teacher_ids": self.teacher_ids[a:b], "teacher_probs": self.teacher_probs[a:b],
                "tokens": self.tokens[a:b], "prompt_length": int(self.prompt_lengths[i])}


_PROGRESS_EVERY = 200  # sequences between progress records (a killed run redoes at most this many)


def quantize_taps(taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 3H] float -> ([T, 3H] int8, [T, 3] float16 scales): each H-wide tap of a row on its own absmax."""
    t3 = taps.float().reshape(taps.shape[0], 3, -1)
    scale = (t3.abs().amax(-1) / 127).clamp(min=1e-12)  # [T, 3]
    q = (t3 / scale[:, :, None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(taps.shape), scale.half()


@torch.inference_mode()
def compute_features(target, examples: list[Example], folder: str | Path, *, draft_vocab: np.ndarray,
                     top_k: int = 16, max_length: int = 512, progress: bool = True,
                     deadline: float | None = None, batch_tokens: int | None = None) -> Features | None:
    """One target forward per sequence (truncated to ``max_length``) → :class:`Features` in ``folder``.

    Reuses the folder when its ``meta.json`` matches (same sequences, vocabulary, K, length), and
    continues a computation that was stopped (``progress.json``).  With ``deadline`` (a
    ``time.time()`` value) it stops at the first progress record past it and returns None: call
    again to continue.  ``batch_tokens`` (default: 1 sequence per forward on a CPU, where a
    forward is compute-bound, and 16,384 padded tokens on a GPU, where one sequence leaves it idle)
    groups consecutive sequences into one right-padded forward: under the causal mask a real
    position never sees the padding after it, so the features are those of separate forwards.
    """
    folder = Path(folder)
    key = {"indices": [e.index for e in examples], "draft_vocab_sha": _sha(draft_vocab), "top_k": top_k,
           "max_length": max_length, "tap_layers": list(target.tap_layers), "format": 2}
    if target.dtype != torch.float32:  # fp32 stores (all made before the key had a dtype) stay valid
        key["dtype"] = str(target.dtype).removeprefix("torch.")
    meta_path, progress_path = folder / "meta.json", folder / "progress.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("key") == key:
        return Features(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = [min(len(e.ids), max_length) for e in examples]
    n = sum(lengths)
    h3 = 3 * target.config.hidden_size
    ids_dtype = np.int16 if len(draft_vocab) <= np.iinfo(np.int16).max else np.int32
    done = 0
    if progress_path.is_file():
        state = json.loads(progress_path.read_text())
        done = int(state["done"]) if state.get("key") == key else 0
    mode = "r+" if done else "w+"
    arrays = {name: np.lib.format.open_memmap(folder / f"{name}.npy", mode=mode, dtype=dtype, shape=shape)
              for name, dtype, shape in (("taps_q", np.int8, (n, h3)), ("taps_scale", np.float16, (n, 3)),
                                         ("teacher_ids", ids_dtype, (n, top_k)),
                                         ("teacher_probs", np.float16, (n, top_k)), ("tokens", np.int32, (n,)))}
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    vocab_t = torch.as_tensor(draft_vocab, device=target.device)
    model = target.model
    if done:
        logger.info("teacher features: continuing at sequence %d of %d", done, len(examples))
    bar = tqdm(total=len(examples), initial=done, desc="teacher forward", unit="seq", disable=not progress)
    t0, tokens_done = time.perf_counter(), 0
    if batch_tokens is None:
        batch_tokens = 16_384 if target.device.type == "cuda" else 1
    i = done
    while i < len(examples):
        # sequences i..j-1 share one forward (padded to the longest, within batch_tokens), never
        # across a progress record, which falls every _PROGRESS_EVERY sequences
        stop = min(len(examples), (i // _PROGRESS_EVERY + 1) * _PROGRESS_EVERY)
        j = i + 1
        while j < stop and (j - i + 1) * max(lengths[i: j + 1]) <= batch_tokens:
            j += 1
        width = max(lengths[i:j])
        ids = torch.zeros(j - i, width, dtype=torch.long, device=target.device)
        for r in range(i, j):
            ids[r - i, : lengths[r]] = torch.tensor(examples[r].ids[: lengths[r]])
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        taps = torch.cat([out.hidden_states[k] for k in target.tap_layers], dim=-1)  # [b, width, 3H]
        for r in range(i, j):
            a, b, m = int(offsets[r]), int(offsets[r + 1]), lengths[r]
            q, scale = quantize_taps(taps[r - i, :m])
            arrays["taps_q"][a:b] = q.cpu().numpy()
            arrays["taps_scale"][a:b] = scale.cpu().numpy()
            probs = out.logits[r - i, :m].float().softmax(-1)[:, vocab_t]  # [T, V_draft]
            p, idx = probs.topk(top_k, dim=-1)
            arrays["teacher_ids"][a:b] = idx.cpu().numpy().astype(ids_dtype)
            arrays["teacher_probs"][a:b] = p.cpu().numpy()
            arrays["tokens"][a:b] = examples[r].ids[:m]
            tokens_done += m
        bar.update(j - i)
        i = j
        if i % _PROGRESS_EVERY == 0 or i == len(examples):
            for arr in arrays.values():
                arr.flush()
            progress_path.write_text(json.dumps({"key": key, "done": i}))
            bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - t0):.0f}")
            if deadline is not None and time.time() > deadline and i < len(examples):
                bar.close()
                logger.info("teacher features: stopped at sequence %d of %d (time limit; resumable)", i,
                            len(examples))
                return None
    bar.close()
    for arr in arrays.values():
        arr.flush()
    np.save(folder / "offsets.npy", offsets)
    np.save(folder / "draft_vocab.npy", draft_vocab)
    np.save(folder / "prompt_lengths.npy", np.array([len(e.prompt_ids) for e in examples], dtype=np.int64))
    np.save(folder / "indices.npy", np.array([e.index for e in examples], dtype=np.int64))
    seconds = time.perf_counter() - t0
    meta_path.write_text(json.dumps({"key": key, "tokens": n, "sequences": len(examples),
                                     "bytes_per_token": round(sum(a.nbytes for a in arrays.values()) / max(n, 1), 1),
                                     "tokens_per_s": round(tokens_done / max(seconds, 1e-9), 1)}) + "\n")
    progress_path.unlink(missing_ok=True)
    logger.info("teacher features: %d sequences, %d positions in %s", len(examples), n, folder)
    return Features(folder)


def _sha(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
