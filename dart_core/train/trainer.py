"""Training of the DART draft head (docs/design.md §2 "Training"; issue 5).

Objective (DART, arXiv 2601.19278): for an anchor position a the head drafts
d distributions q_1..q_d of x_{a+2} .. x_{a+1+d} in one forward; the loss is

    L(a) = Σ_{j=1..d} γ^(j-1) · CE(p_j, q_j),   γ = 0.6 by default,

where p_j is the target's distribution of the same token (its logits at
position a + j), restricted to the draft vocabulary and truncated to its top
K entries; CE(p, q) = KL(p ‖ q) + H(p), so minimising it minimises the KL.
Many anchors of one sequence share one forward through
:meth:`DartDraftHead.forward_train` (block attention mask).  Anchors are drawn
from the response part of each self-distilled sequence, ``anchors_per_seq`` at
most.

Data: the self-distilled responses (the target's own greedy answers) and,
with ``sharegpt_turns``, ShareGPT's own assistant turns teacher-forced
(:func:`~dart_core.train.data.sharegpt_examples`).  Teacher features are
computed once for all of them (resumable); ``train_tokens`` trains on a seeded
random subset of about that many tokens, so one feature store serves every
point of a learning curve.

AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on
CUDA and on CPUs that multiply bf16 natively; a checkpoint (tensors and numbers
only, loaded with ``weights_only=True``) every ``save_every`` steps, kept under
``<work_dir>/runs/<run key>/`` so runs of different settings do not collide,
makes a killed run resumable; ``max_minutes`` (counted from the call's start, generation
and teacher forwards included) stops a run on purpose the same way (generation stops admitting
prompts and lets the answers in flight finish).  What happens when the work dir is gone: everything is computed again
(the responses are regenerated, the features recomputed, training restarts).
"""

from __future__ import annotations

import json
import logging
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig, save_draft_head, start_from_target
from dart_core.spec.eagle3 import save_eagle3_head
from dart_core.step.engine import _sync
from dart_core.train.data import (RESPONSES, DataConfig, Example, answer_prompts, is_teacher_forced,
                                  later_turn_prompts, load_examples, prompt_examples, read_examples,
                                  stored_examples, training_prompts)
from dart_core.train.eagle3 import (eagle3_sequence_loss, evaluate_eagle3_accuracy, evaluate_eagle3_tau,
                                    init_eagle3_head)
from dart_core.train.features import Features, choose_draft_vocab, compute_features
from ngram_service.cache import cache_root

logger = logging.getLogger(__name__)

__all__ = ["TrainConfig", "train", "evaluate_accuracy", "evaluate_tau"]


@dataclass
class TrainConfig:
    out: str  # output folder of the head (config.json + model.safetensors + training.json)
    work_dir: str | None = None  # responses, teacher features, checkpoint; None = $DART_SERVE_CACHE/train
    model: str | None = None  # target: None = embedded SmolLM2-135M-Instruct
    data: DataConfig = field(default_factory=DataConfig)
    draft_vocab_size: int = 8192  # tokens the head predicts (the most frequent of the training data; d2t / t2d)
    teacher_top_k: int = 16  # target probabilities kept per position as the distillation target
    max_length: int = 512  # tokens per training sequence (prompt + response)
    anchors_per_seq: int = 64  # sampled per sequence and step; real positions cost little (keys/values only)
    gamma: float = 0.6  # weight gamma^(j-1) of draft position j in the loss
    epochs: float = 2.0  # passes over the training sequences (fractions allowed)
    batch_size: int = 8  # sequences per optimizer step
    lr: float = 5e-4  # peak learning rate (AdamW)
    warmup_steps: int = 50  # linear warm-up, then cosine decay
    min_lr_ratio: float = 0.05  # the cosine ends at this fraction of the peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # gradient norm clip
    eval_every: int = 200  # steps; 0 = only at the end
    eval_tau_prompts: int = 4  # held-out prompts decoded with the engine to measure τ (0 = skip)
    eval_tau_tokens: int = 64  # new tokens per prompt for that τ
    eval_budget: int = 60  # draft tree size (nodes) for that τ
    save_every: int = 100  # steps between checkpoints (resume)
    seed: int = 0  # head initialisation, anchor sampling, train_tokens subset
    device: str | None = None  # default CUDA when available
    threads: int | None = None  # torch CPU threads
    train_tokens: int | None = None  # train on a seeded random subset of about this many tokens (learning curves)
    train_source: str = "all"  # "all", "self" (self-distilled only) or "sharegpt" (teacher-forced only): mix studies
    max_minutes: float | None = None  # stop (checkpointed, resumable) after this long: for time-limited machines
    autocast: str = "auto"  # "auto": bf16 on CUDA and on CPUs with native bf16 matmul; "bf16" or "off"
    teacher_dtype: str = "auto"  # the target's dtype for answers and teacher features: "auto" (bf16 on CUDA, fp32 on
    # a CPU), "float32" or "bfloat16" (faster teacher forwards on a CPU with native bf16 matmul)
    final_norm_twice: bool = False  # train for the reference's lm_head(norm(norm(h))) path instead of lm_head(norm(h))
    init_from: str | None = None  # warm start: a head folder to continue from (same target; its draft vocabulary is kept)
    sequences_per_forward: int | None = None  # sequences padded into one head forward (None: 8 on CUDA, 1 elsewhere)
    method: str = "dart"  # "dart": the DART head; "eagle3": an EAGLE-3 head with the training-time test (train/eagle3.py)
    ttt_steps: int = 7  # with method eagle3: unrolled steps of the training-time test (EAGLE-3's length)


def _device(cfg: TrainConfig) -> torch.device:
    return torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def init_head(target, draft_vocab: np.ndarray, seed: int, *, final_norm_twice: bool = False) -> DartDraftHead:
    """A head of the target's shape: lm_head rows copied from the target's
    output embedding for the draft vocabulary, fc starting as the identity on
    the highest tap (small random weights on the others), the rest random
    (:func:`~dart_core.spec.draft_head.start_from_target`)."""
    cfg = replace(DraftHeadConfig.for_target(target.config, draft_vocab_size=len(draft_vocab)),
                  final_norm_twice=final_norm_twice)
    head = DartDraftHead(cfg)
    head.reset_parameters(seed)
    start_from_target(head, target.model.get_output_embeddings().weight, draft_vocab)
    return head


def head_draft_vocab(head: DartDraftHead) -> np.ndarray:
    """[V_draft] int64, ascending: the target ids of a head's draft vocabulary (draft index i is
    target id i + d2t[i], the reference ``d2t`` convention)."""
    return head.draft_to_target(torch.arange(head.d2t.numel(), device=head.d2t.device)).cpu().numpy()


def warm_start_head(folder: str | Path, target, *, final_norm_twice: bool = False) -> DartDraftHead:
    """The head saved in ``folder``, to continue training from.

    A warm start trains further from an existing head (more passes over the
    same feature store, or new data) instead of from :func:`init_head`.  It
    keeps the head's own draft vocabulary (:func:`head_draft_vocab`): the
    teacher features are computed over it, whatever the new data's most
    frequent tokens are.  Its weights are read in fp32 (a bf16 head is
    widened exactly).

    Raises:
        HeadLoadError: ``folder`` is not a readable head of this target.
        ValueError: its final-norm path differs from ``final_norm_twice`` (:func:`train` also
            refuses a ``draft_vocab_size`` other than the head's).
    """
    from dart_core.spec.draft_head import load_draft_head

    head = load_draft_head(folder, target.config)
    if head.config.final_norm_twice != final_norm_twice:
        raise ValueError(f"--init-from {folder}: final_norm_twice is {head.config.final_norm_twice} there, "
                         f"{final_norm_twice} here")
    return head


def _anchors(length: int, prompt_length: int, limit: int, rng: random.Random | None) -> list[int]:
    """Anchor positions a in the response: P-1 <= a <= length-3 (a+1 needs a teacher)."""
    lo, hi = max(prompt_length - 1, 0), length - 3
    if hi < lo:
        return []
    pool = list(range(lo, hi + 1))
    if rng is not None and len(pool) > limit:
        pool = sorted(rng.sample(pool, limit))
    return pool


def _sequence_loss(head, embed, seq, anchors, gamma, device, dtype_ctx):
    """Weighted cross-entropy of one sequence's anchors; returns (loss, logits [A, d, V], valid [A, d])."""
    losses, logits, valid = _batch_loss(head, embed, [seq], [anchors], gamma, device, dtype_ctx)
    return losses[0], logits[0], valid[0]


def _batch_loss(head, embed, seqs, anchors_list, gamma, device, dtype_ctx):
    """Loss Σ_j γ^(j-1) CE(p_target,j, q_j) of several sequences in one padded forward: returns
    (losses [B], each sequence's weighted cross-entropy averaged over its own anchors;
    logits [B, A, d, V]; valid [B, A, d], False past a sequence's end or on a padding anchor).

    Sequences are right-padded to the longest (zero taps and embeddings, zero teacher
    probabilities) and anchor lists to the longest (repeats, masked out of the loss).  Padding
    changes no sequence's result: under :meth:`DartDraftHead.forward_train`'s block mask a query
    sees real positions up to its anchor only, and every anchor lies inside its own sequence
    (tested equal to one sequence per call).  On a GPU this divides the kernel launches of a
    training step by the number of sequences per forward.
    """
    d = head.config.depth
    lengths = torch.tensor([len(s["tokens"]) for s in seqs], device=device)
    taps, embeds, t_ids, t_p, anchors, real = [], [], [], [], [], []
    a_max = max(len(a) for a in anchors_list)
    for seq, a in zip(seqs, anchors_list):
        n = len(seq["tokens"])
        taps.append(torch.from_numpy(np.asarray(seq["taps"][: n - 1], dtype=np.float32)))
        tokens = torch.from_numpy(np.asarray(seq["tokens"], dtype=np.int64)).to(device)
        with torch.no_grad():
            embeds.append(embed(tokens[1:]).float())
        t_ids.append(torch.from_numpy(np.asarray(seq["teacher_ids"], dtype=np.int64)))
        t_p.append(torch.from_numpy(np.asarray(seq["teacher_probs"], dtype=np.float32)))
        anchors.append(list(a) + [a[0]] * (a_max - len(a)))
        real.append([True] * len(a) + [False] * (a_max - len(a)))
    pad = torch.nn.utils.rnn.pad_sequence
    taps = pad(taps, batch_first=True).to(device)  # [B, T, 3H]
    embeds = pad(embeds, batch_first=True)  # [B, T, H]
    t_ids = pad(t_ids, batch_first=True).to(device)  # [B, L, K]
    t_p = pad(t_p, batch_first=True).to(device)
    anchor_t = torch.tensor(anchors, dtype=torch.long, device=device)  # [B, A]
    real = torch.tensor(real, device=device)
    with dtype_ctx:
        logits = head.forward_train(taps, embeds, anchor_t)  # [B, A, d, V]
    logq = logits.float().log_softmax(-1)
    pos = anchor_t[:, :, None] + torch.arange(1, d + 1, device=device)  # [B, A, d]
    valid = (pos <= (lengths - 2)[:, None, None]) & real[:, :, None]
    pos = torch.minimum(pos, (lengths - 1)[:, None, None])
    rows = torch.arange(len(seqs), device=device)[:, None, None]
    ce = -(t_p[rows, pos] * logq.gather(-1, t_ids[rows, pos])).sum(-1)  # [B, A, d]
    w = gamma ** torch.arange(d, device=device, dtype=torch.float32)
    counts = torch.tensor([max(len(a), 1) for a in anchors_list], device=device, dtype=torch.float32)
    return (ce * w * valid).sum((1, 2)) / counts, logits, valid


@torch.no_grad()
def evaluate_accuracy(head, embed, features: Features, rows: list[int], device, gamma: float = 0.6) -> dict:
    """Per-position top-1 accuracy on held-out sequences: draft argmax == the
    token the target wrote there (its greedy choice), over every response anchor.

    Returns: {"top1": [acc_1 .. acc_d], "loss": mean weighted loss, "anchors": n}.
    """
    head.eval()
    d = head.config.depth
    t2d_index = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=device)
    vocab = torch.tensor(np.asarray(features.draft_vocab), device=device)
    t2d_index[vocab] = torch.arange(len(vocab), device=device)
    hits = torch.zeros(d, dtype=torch.float64)
    counts = torch.zeros(d, dtype=torch.float64)
    losses, n = 0.0, 0
    for i in rows:
        seq = features.sequence(i)
        anchors = _anchors(len(seq["tokens"]), seq["prompt_length"], 0, None)
        if not anchors:
            continue
        loss, logits, valid = _sequence_loss(head, embed, seq, anchors, gamma, device, torch.autocast("cpu", enabled=False))
        tokens = torch.from_numpy(np.asarray(seq["tokens"], dtype=np.int64)).to(device)
        pos = (torch.tensor(anchors, device=device)[:, None] + torch.arange(2, d + 2, device=device)).clamp(
            max=len(tokens) - 1)
        truth = t2d_index[tokens[pos]]  # [A, d] draft index of x_{a+1+j}, -1 when outside the draft vocab
        hit = (logits.argmax(-1) == truth) & valid
        hits += hit.sum(0).double().cpu()
        counts += valid.sum(0).double().cpu()
        losses += float(loss) * len(anchors)
        n += len(anchors)
    head.train()
    return {"top1": [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts)],
            "loss": round(losses / max(n, 1), 4), "anchors": n}


def evaluate_tau(head, target, prompts: list[list[int]], *, budget: int, max_new_tokens: int, trie="auto",
                 context_weight: float = 0.0) -> float | None:
    """τ of greedy DART decoding with this head on the given prompts (fixed tree budget).

    τ = tokens emitted after prefill ÷ target forwards, summed over the prompts (bonus token
    included).  ``context_weight`` 0 (default) measures the head with the corpus trie alone, as
    the paper's search; the serving default (κ = 0.5) adds the request's own context."""
    if not prompts:
        return None
    from dart_core.api import DartModel
    from dart_core.step.engine import DartEngine
    from dart_core.step.sampling import SamplingParams
    from ngram_service.client import InProcessTreeSearch
    from ngram_service.tree_search import SearchParams

    params = SearchParams(budget=budget, context_weight=context_weight)
    trie_obj = None
    if target.tokenizer is not None and trie is not None:
        trie_obj = DartModel._load_trie(trie, getattr(target.tokenizer, "dart_model_name", ""), target.tokenizer)
    was_training = head.training
    engine = DartEngine(target, head.eval(), InProcessTreeSearch(trie_obj), params)
    eos = target.tokenizer.eos_token_id if target.tokenizer is not None else None
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(eos,) if eos is not None else ())
    accepted = forwards = 0
    for p in prompts:
        res = engine.generate([p], sampling)
        accepted += sum(len(x) for x in res.token_ids)
        forwards += res.target_forwards
    head.train(was_training)
    return round(accepted / max(forwards, 1), 3)


def _lr_lambda(cfg: TrainConfig, total: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def _autocast(cfg: TrainConfig, device: torch.device):
    """The training autocast context: bf16 on CUDA and on CPUs with native bf16 matmul (``auto``)."""
    want = cfg.autocast
    if want == "auto":
        from dart_core.api import native_bf16_cpu

        want = "bf16" if device.type == "cuda" or native_bf16_cpu() else "off"
    if want == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16), "bf16"
    if want != "off":
        raise ValueError(f'autocast must be "auto", "bf16" or "off", got {cfg.autocast!r}')
    return torch.autocast(device.type, enabled=False), "off"


def _teacher_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The target's dtype while training (answers, teacher features, τ): ``auto`` is bf16 on CUDA and
    fp32 on a CPU, where the self-distilled answers should be the ones fp32 serving decodes.

    Raises:
        ValueError: a name other than ``auto``, ``float32`` or ``bfloat16``.
    """
    names = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}
    if cfg.teacher_dtype not in names:
        raise ValueError(f'teacher_dtype must be "auto", "float32" or "bfloat16", got {cfg.teacher_dtype!r}')
    return names[cfg.teacher_dtype]


def _token_count(feats: Features, rows: list[int]) -> int:
    """Tokens (prompt + response) of these feature-store rows."""
    return int(sum(feats.offsets[r + 1] - feats.offsets[r] for r in rows))


def _subset(rows: list[int], feats: Features, budget: int | None, seed: int) -> list[int]:
    """A seeded random subset of ``rows`` holding about ``budget`` tokens (all rows when None)."""
    if budget is None:
        return rows
    order = list(rows)
    random.Random(seed + 7).shuffle(order)
    out, total = [], 0
    for r in order:
        if total >= budget:
            break
        out.append(r)
        total += int(feats.offsets[r + 1] - feats.offsets[r])
    return sorted(out)


#: Data options added after runs had been checkpointed, left out of the run key at these values
#: (which do what the trainer did before the option existed), so that a new option does not orphan
#: the checkpoint of a run stopped under the earlier code.  A new field goes here with its neutral value.
_KEY_NEUTRAL_DATA = {"later_turns": 0, "later_turns_skip": 0}


def _run_key(cfg: TrainConfig, train_rows: list[int]) -> str:
    """What makes two runs the same run (their checkpoints interchangeable)."""
    import hashlib

    fields = {k: v for k, v in asdict(cfg).items() if k not in ("out", "work_dir", "threads", "device", "max_minutes",
                                                                "eval_every", "save_every", "eval_tau_prompts",
                                                                "sequences_per_forward")}
    if fields["method"] == "dart":  # keys of DART runs as before the method existed
        del fields["method"], fields["ttt_steps"]
    fields["data"] = {k: v for k, v in fields["data"].items()
                      if not (k in _KEY_NEUTRAL_DATA and v == _KEY_NEUTRAL_DATA[k])}
    blob = json.dumps(fields, sort_keys=True, default=str) + json.dumps(train_rows)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train(cfg: TrainConfig, *, target=None, progress: bool = True) -> dict:
    """Generates the data (if not cached), computes teacher features (if not
    cached), trains, and writes the head to ``cfg.out``.  Returns the summary
    also written to ``training.json`` (``"finished": False`` when ``max_minutes``
    stopped it first: run it again to continue).

    Args:
        target: an already loaded :class:`~dart_core.model.target.TargetModel` (tests), used in its own dtype;
            default loads ``cfg.model`` in ``cfg.teacher_dtype``.

    Raises:
        ValueError: no usable training sequences, or a bad ``autocast`` or ``teacher_dtype``.
    """
    from dart_core.model.target import TargetModel

    started = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = _device(cfg)
    torch.manual_seed(cfg.seed)
    work = Path(cfg.work_dir).expanduser() if cfg.work_dir else cache_root() / "train"
    cfg = replace(cfg, work_dir=str(work))  # training.json records the folder used
    dtype = _teacher_dtype(cfg, device)
    if target is None:
        target = TargetModel.from_pretrained(cfg.model, dtype=dtype, device=device)
    for p in target.model.parameters():
        p.requires_grad_(False)

    data_dir = work / "data"
    t0 = time.time()
    deadline = None if cfg.max_minutes is None else started + 60 * cfg.max_minutes
    asked_answered = None  # {"asked", "answered"}: the examples file's prompt-only examples, for the summary
    if cfg.data.examples_file:  # pre-tokenized (gpu_recipe): neither source is read here
        packed = read_examples(cfg.data.examples_file)
        examples = [e for e in packed if e.response_ids]
        asked = [e for e in packed if not e.response_ids]  # prompt-only: answered here (pack --generate-there)
        asked_answered = {"asked": len(asked), "answered": 0}
        if asked:  # every packed prompt is answered: `pack` applied its own --max-prompt-tokens already
            if cfg.data.generate and not answer_prompts(target, asked, data_dir, cfg.data, progress=progress,
                                                        deadline=deadline):
                return _unfinished(cfg, "generate", started, time.time() - t0, 0.0, _answered(asked, data_dir))
            answers = {e.index: e for e in load_examples(data_dir)} if (data_dir / RESPONSES).is_file() else {}
            examples += [answers[e.index] for e in asked if e.index in answers]
            asked_answered = {"asked": len(asked), "answered": sum(e.index in answers for e in asked)}
        examples = [e for e in examples if len(e.response_ids) >= 2]
    else:
        prompts = training_prompts(cfg.data)
        later = later_turn_prompts(target.tokenizer, cfg.data) if target.tokenizer is not None else []
        if cfg.data.generate and not answer_prompts(
                target, prompt_examples(cfg.data, data_dir, target.tokenizer, prompts, later), data_dir, cfg.data,
                progress=progress, deadline=deadline):
            return _unfinished(cfg, "generate", started, time.time() - t0, 0.0, None)
        if not cfg.data.generate and not (data_dir / RESPONSES).is_file() and not cfg.data.sharegpt_turns:
            raise ValueError(f"--no-generate with no stored responses in {data_dir} and no --sharegpt-turns: "
                             "nothing to train on")
        examples = stored_examples(cfg.data, data_dir, target.tokenizer, prompts, later)
    # self-distilled held-out prompts come first in the prompt list; ShareGPT indices are never below them
    held_ex = [e for e in examples if e.index < cfg.data.eval_prompts]
    train_ex = [e for e in examples if e.index >= cfg.data.eval_prompts]
    gen_s = time.time() - t0
    if not train_ex:
        raise ValueError(f"no training sequences in {data_dir} below prompt index {cfg.data.num_prompts}")
    eos = target.tokenizer.eos_token_id if target.tokenizer is not None else None
    if cfg.method not in ("dart", "eagle3"):
        raise ValueError(f'method must be "dart" or "eagle3", got {cfg.method!r}')
    eagle3 = cfg.method == "eagle3"
    if eagle3 and (cfg.init_from or cfg.final_norm_twice or cfg.ttt_steps < 1):
        raise ValueError("method eagle3 trains from scratch with one final norm and ttt_steps >= 1 "
                         "(no --init-from, no --final-norm-twice)")
    if cfg.init_from:  # a warm start keeps the head's draft vocabulary
        head = warm_start_head(cfg.init_from, target, final_norm_twice=cfg.final_norm_twice)
        draft_vocab = head_draft_vocab(head)
        if len(draft_vocab) != cfg.draft_vocab_size:
            raise ValueError(f"--init-from {cfg.init_from}: its draft vocabulary has {len(draft_vocab)} tokens, "
                             f"--draft-vocab-size asks for {cfg.draft_vocab_size}")
    else:
        draft_vocab = choose_draft_vocab(train_ex, cfg.draft_vocab_size, target.config.vocab_size,
                                         always=(eos,) if eos is not None else ())
        head = (init_eagle3_head(target, draft_vocab, cfg.seed) if eagle3
                else init_head(target, draft_vocab, cfg.seed, final_norm_twice=cfg.final_norm_twice))
    t0 = time.time()
    feats = compute_features(target, train_ex + held_ex, work / "features", draft_vocab=draft_vocab,
                             top_k=cfg.teacher_top_k, max_length=cfg.max_length, progress=progress,
                             deadline=deadline)
    feat_s = time.time() - t0
    if feats is None:  # the time limit came during the teacher forwards
        return _unfinished(cfg, "teacher_features", started, gen_s, feat_s, asked_answered)
    sources = {"all": lambda e: True, "self": lambda e: not is_teacher_forced(e.index),
               "sharegpt": lambda e: is_teacher_forced(e.index)}
    if cfg.train_source not in sources:
        raise ValueError(f'train_source must be "all", "self" or "sharegpt", got {cfg.train_source!r}')
    pool = [r for r, e in enumerate(train_ex) if sources[cfg.train_source](e)]
    if not pool:
        raise ValueError(f"no {cfg.train_source!r} training sequences (self-distilled: {data_dir}; "
                         "ShareGPT: --sharegpt-turns)")
    train_rows = _subset(pool, feats, cfg.train_tokens, cfg.seed)
    held_rows = list(range(len(train_ex), len(train_ex) + len(held_ex)))
    train_tokens = _token_count(feats, train_rows)
    self_rows = [r for r in train_rows if not is_teacher_forced(train_ex[r].index)]
    self_distilled = len(self_rows)
    self_tokens = _token_count(feats, self_rows)

    head = head.to(device).train()
    embed = target.embed_tokens
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    steps_per_epoch = max(1, len(train_rows) // cfg.batch_size)
    total = max(1, int(cfg.epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg, total))
    run_dir = work / "runs" / _run_key(cfg, train_rows)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "checkpoint.pt"
    step, history, train_s = 0, [], 0.0
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        if state.get("total") == total and state["draft_vocab"].tolist() == draft_vocab.tolist():
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step = int(state["step"])
            train_s = float(state.get("train_s", 0.0))
            history = json.loads((run_dir / "history.json").read_text()) if (run_dir / "history.json").is_file() else []
            logger.info("resuming at step %d of %d from %s", step, total, ckpt_path)
    autocast, autocast_name = _autocast(cfg, device)
    per_forward = cfg.sequences_per_forward or (8 if device.type == "cuda" else 1)
    if per_forward < 1:
        raise ValueError(f"sequences_per_forward must be at least 1, got {per_forward}")
    order_rng = random.Random(cfg.seed)
    order = []
    for _ in range(math.ceil(cfg.epochs) + 1):
        perm = list(train_rows)
        order_rng.shuffle(perm)
        order += perm
    held_prompts = [e.prompt_ids for e in held_ex[: cfg.eval_tau_prompts]]
    bar = tqdm(total=total, initial=step, desc=f"training {'EAGLE-3' if eagle3 else 'draft'} head", unit="step",
               disable=not progress)
    t_train = time.time() - train_s
    anchors_seen = 0
    step_s, timed_steps = 0.0, 0  # optimizer steps alone (no evaluation, no checkpoint), the call's first left out
    first_step = step
    while step < total:
        t_step = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        batch = order[step * cfg.batch_size: (step + 1) * cfg.batch_size]
        rng = random.Random(cfg.seed * 1_000_003 + step)  # per step: a resumed run samples the same anchors
        loss_sum = 0.0
        for k in range(0, len(batch), per_forward):
            seqs, anchor_lists = [], []
            for i in batch[k:k + per_forward]:  # anchors drawn in batch order whatever the grouping
                seq = feats.sequence(i)
                anchors = _anchors(len(seq["tokens"]), seq["prompt_length"], cfg.anchors_per_seq, rng)
                if anchors:
                    seqs.append(seq)
                    anchor_lists.append(anchors)
            if not seqs:
                continue
            if eagle3:  # one sequence per forward: its positions are the batch
                loss = sum(eagle3_sequence_loss(head, embed, seq, anchors, cfg.ttt_steps, cfg.gamma, device,
                                                autocast)[0] for seq, anchors in zip(seqs, anchor_lists))
            else:
                loss = _batch_loss(head, embed, seqs, anchor_lists, cfg.gamma, device, autocast)[0].sum()
            (loss / len(batch)).backward()
            loss_sum += float(loss.detach())
            anchors_seen += sum(len(a) for a in anchor_lists)
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        _sync(device)
        if step > first_step + 1:  # the call's first step pays the warm-up
            step_s += time.perf_counter() - t_step
            timed_steps += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum / max(len(batch), 1):.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
        last = step == total
        out_of_time = deadline is not None and time.time() > deadline and not last
        if (cfg.eval_every and step % cfg.eval_every == 0) or last:
            if eagle3:
                ev = evaluate_eagle3_accuracy(head, embed, feats, held_rows, device, cfg.ttt_steps, cfg.gamma)
            else:
                ev = evaluate_accuracy(head, embed, feats, held_rows, device, cfg.gamma)
            if cfg.eval_tau_prompts:
                ev["tau"] = (evaluate_eagle3_tau(head, target, held_prompts, total_tokens=cfg.eval_budget,
                                                 max_new_tokens=cfg.eval_tau_tokens) if eagle3 else
                             evaluate_tau(head, target, held_prompts, budget=cfg.eval_budget,
                                          max_new_tokens=cfg.eval_tau_tokens))
            ev["step"] = step
            history.append(ev)
            logger.info("step %d: held-out top-1 %s, loss %.3f, tau %s", step, ev["top1"], ev["loss"], ev.get("tau"))
            tqdm.write(f"step {step}: held-out top-1 {ev['top1']} loss {ev['loss']} tau {ev.get('tau')}")
        if step % cfg.save_every == 0 or last or out_of_time:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "total": total, "draft_vocab": torch.as_tensor(draft_vocab),
                        "train_s": time.time() - t_train}, ckpt_path)
            (run_dir / "history.json").write_text(json.dumps(history))
        if out_of_time:
            logger.info("stopped after %.1f minutes at step %d of %d (resumable: run again)", cfg.max_minutes,
                        step, total)
            break
    bar.close()
    finished = step >= total
    train_wall = time.time() - t_train
    if finished:
        (save_eagle3_head if eagle3 else save_draft_head)(head, cfg.out, dtype=torch.bfloat16)
    summary = {
        "config": asdict(cfg),
        "finished": finished,
        "stage": "done" if finished else "training",
        "sequences": {"train": len(train_rows), "train_self_distilled": self_distilled,
                      "train_sharegpt": len(train_rows) - self_distilled, "held_out": len(held_ex),
                      "train_tokens": train_tokens, "train_tokens_self_distilled": self_tokens,
                      "available_train_sequences": len(train_ex)},
        "prompts": asked_answered,
        "steps": total,
        "steps_done": step,
        "wall_time_s": {"generate": round(gen_s, 1), "teacher_features": round(feat_s, 1),
                        "train": round(train_wall, 1), "total": round(time.time() - started, 1)},
        "throughput": {"teacher_tokens_per_s": feats.meta.get("tokens_per_s"),
                       "anchors_this_call": anchors_seen,
                       "train_anchors_per_s_this_call": round(anchors_seen / max(time.time() - started - gen_s
                                                                                  - feat_s, 1e-9), 1),
                       "feature_bytes_per_token": feats.meta.get("bytes_per_token"),
                       "seconds_per_step": round(step_s / timed_steps, 4) if timed_steps else None},
        "autocast": autocast_name,
        "teacher_dtype": str(target.dtype).removeprefix("torch."),
        "hardware": {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else f"CPU {_cpu_name()}, {torch.get_num_threads()} threads"},
        "eval": history,
    }
    if finished:
        (Path(cfg.out) / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _answered(asked: list[Example], data_dir: Path) -> dict:
    """How many of an examples file's prompt-only examples have an answer in ``data_dir``."""
    done = {e.index for e in load_examples(data_dir)} if (data_dir / RESPONSES).is_file() else set()
    return {"asked": len(asked), "answered": sum(e.index in done for e in asked)}


def _unfinished(cfg: TrainConfig, stage: str, started: float, gen_s: float, feat_s: float,
                prompts: dict | None) -> dict:
    """The summary of a call that the time limit stopped before training (``stage``: where)."""
    return {"config": asdict(cfg), "finished": False, "stage": stage, "prompts": prompts, "steps": None,
            "steps_done": 0, "wall_time_s": {"generate": round(gen_s, 1), "teacher_features": round(feat_s, 1),
                                             "total": round(time.time() - started, 1)}}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
