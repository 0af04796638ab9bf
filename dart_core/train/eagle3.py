"""Training of an EAGLE-3 head with the training-time test (EAGLE-3, arXiv 2503.01840, §3.2),
from the same teacher features as the DART head (``python -m dart_core.train --method eagle3``).

For a sequence of n tokens the head's real positions are t = 0 .. n-2: position t reads the
target's taps at t and the embedding of token t + 1.  Step 0 runs the head over all of them at once
(causal attention) and predicts token t + 2 at each; step j = 1 .. ``steps``-1 runs it again at
every position, the hidden input being the head's own output of step j - 1 there (width H, no
``fc``), the token input the true token t + 1 + j, the RoPE position t + j, and predicts token
t + 2 + j.  A step-j query at t attends to the step-0 keys of positions <= t and to its own keys
of steps 1 .. j (the diagonal blocks): what the draft tree's level j node sees at inference, its
real prefix and its own lineage (:func:`~dart_core.spec.eagle3.draft_tree`).  The gradient flows
through the unrolled steps.

Loss, per position t of the response (the same anchors as the DART trainer draws):
Σ_j γ^j · CE(p_{t+1+j}, q_j(t)), p the target's top-K distribution at t + 1 + j restricted to the
draft vocabulary (the teacher features), as the DART loss weighs its d positions.
"""

from __future__ import annotations

import numpy as np
import torch

from dart_core.spec.draft_head import start_from_target
from dart_core.spec.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from dart_core.step.engine import DartEngine
from dart_core.step.sampling import SamplingParams

__all__ = ["init_eagle3_head", "eagle3_sequence_loss", "evaluate_eagle3_accuracy", "evaluate_eagle3_tau"]


def init_eagle3_head(target, draft_vocab: np.ndarray, seed: int) -> Eagle3Head:
    """A head of the target's shape (:meth:`Eagle3Config.for_target`): ``lm_head`` rows copied from
    the target's output embedding for the draft vocabulary, ``fc`` starting as the identity on the
    highest tap (small random weights on the others), the rest torch's seeded initialisation
    (:func:`~dart_core.spec.draft_head.start_from_target`)."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=len(draft_vocab)))
    start_from_target(head, target.model.get_output_embeddings().weight, draft_vocab)
    return head


def _step_mask(t: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, T, (step + 1) · T] additive: step 0's keys causally, steps 1 .. step on the diagonal."""
    idx = torch.arange(t, device=device)
    blocks = [idx[None, :] <= idx[:, None]] + [torch.eye(t, dtype=torch.bool, device=device)] * step
    allowed = torch.cat(blocks, dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[None, None]


def eagle3_sequence_loss(head: Eagle3Head, embed, seq: dict, anchors: list[int], steps: int, gamma: float,
                         device, autocast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's training-time-test loss (module docstring) at ``anchors`` (real positions).

    Args:
        seq: a teacher-feature sequence (``tokens`` [n], ``taps`` [n, 3H], ``teacher_ids`` /
            ``teacher_probs`` [n, K] over the draft vocabulary).
        anchors: the positions t whose predictions count (each < n - 1).
        steps: unrolled steps (EAGLE-3's test length; 1 is plain EAGLE training).

    Returns:
        (loss, the anchors' mean weighted cross-entropy; logits [steps, A, V_draft];
        valid [A, steps], False where the step's token lies past the sequence's end).
    """
    n = len(seq["tokens"])
    t = n - 1
    tokens = torch.from_numpy(np.asarray(seq["tokens"], dtype=np.int64)).to(device)
    t_ids = torch.from_numpy(np.asarray(seq["teacher_ids"], dtype=np.int64)).to(device)
    t_p = torch.from_numpy(np.asarray(seq["teacher_probs"], dtype=np.float32)).to(device)
    at = torch.tensor(anchors, dtype=torch.long, device=device)
    hidden = torch.from_numpy(np.asarray(seq["taps"][:t], dtype=np.float32)).to(device)[None]
    positions = torch.arange(t, device=device)
    c = head.config
    keys = values = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim, device=device)
    loss = torch.zeros((), device=device)
    all_logits, valid = [], []
    with autocast:
        for j in range(steps):
            ids = tokens[(positions + 1 + j).clamp(max=n - 1)]  # token t + 1 + j (clamped past the end: masked)
            with torch.no_grad():
                embeds = embed(ids).float()[None]
            mask = _step_mask(t, j, torch.float32, device)
            h, k, v = head(hidden.to(head.dtype), embeds.to(head.dtype), (positions + j)[None], keys, values, mask)
            keys, values = torch.cat([keys, k.to(keys.dtype)], 2), torch.cat([values, v.to(values.dtype)], 2)
            logits = head.logits(h[0, at]).float()  # [A, V_draft]
            teacher = at + 1 + j  # its distribution is the target's for token t + 2 + j
            ok = teacher <= n - 2
            teacher = teacher.clamp(max=n - 2)
            ce = -(t_p[teacher] * logits.log_softmax(-1).gather(-1, t_ids[teacher])).sum(-1)
            loss = loss + gamma ** j * (ce * ok).sum()
            all_logits.append(logits)
            valid.append(ok)
            hidden = h
    return loss / max(len(anchors), 1), torch.stack(all_logits), torch.stack(valid, 1)


@torch.no_grad()
def evaluate_eagle3_accuracy(head: Eagle3Head, embed, features, rows: list[int], device, steps: int,
                             gamma: float) -> dict:
    """Held-out top-1 per step: the step's argmax (in target ids) == the token the target wrote
    there, over every response position.  Returns ``{"top1": [per step], "loss", "anchors"}``."""
    head.eval()
    hits = torch.zeros(steps, dtype=torch.float64)
    counts = torch.zeros(steps, dtype=torch.float64)
    losses, n_anchors = 0.0, 0
    off = torch.autocast("cpu", enabled=False)
    for i in rows:
        seq = features.sequence(i)
        n = len(seq["tokens"])
        anchors = list(range(max(seq["prompt_length"] - 1, 0), n - 2))
        if not anchors:
            continue
        loss, logits, valid = eagle3_sequence_loss(head, embed, seq, anchors, steps, gamma, device, off)
        tokens = torch.from_numpy(np.asarray(seq["tokens"], dtype=np.int64)).to(device)
        at = torch.tensor(anchors, device=device)
        for j in range(steps):
            truth = tokens[(at + 2 + j).clamp(max=n - 1)]
            hit = (head.draft_to_target(logits[j].argmax(-1)) == truth) & valid[:, j]
            hits[j] += float(hit.sum())
            counts[j] += float(valid[:, j].sum())
        losses += float(loss) * len(anchors)
        n_anchors += len(anchors)
    head.train()
    return {"top1": [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts)],
            "loss": round(losses / max(n_anchors, 1), 4), "anchors": n_anchors}


def evaluate_eagle3_tau(head: Eagle3Head, target, prompts: list[list[int]], *, total_tokens: int,
                        max_new_tokens: int) -> float | None:
    """τ of greedy decoding with this head's trees (depth 7, top-k 10 as the reference, at most
    ``total_tokens`` nodes), all of each tree verified; None without prompts."""
    if not prompts:
        return None
    head.eval()
    top_k, depth = 10, 7
    drafter = Eagle3Drafter(head, target.embed_tokens, total_tokens=min(total_tokens, top_k * (1 + depth * top_k)),
                            depth=depth, top_k=top_k)
    res = DartEngine(target, drafter=drafter).generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    head.train()
    return round(res.tau, 3)
