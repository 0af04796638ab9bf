"""The DART decoding engine: one generator loop, batch-first.

A step for a batch of active sequences (DESIGN.md §2):

1. **draft** — one forward of the draft head over each sequence's newly
   accepted positions plus d-1 mask slots → top-k per level;
2. **tree search** — one call to the :class:`TreeSearchClient` for the whole
   batch → one prefix-closed tree per sequence, rooted at its bonus token;
3. **verify** — one target forward over all trees (padded to a common node
   count) with tree attention over each sequence's cached prefix;
4. **accept** — greedy or stochastic acceptance per sequence, then the
   accepted KV entries are compacted and the rest dropped.

Plain autoregressive decoding is the same loop with trees of only the root
(no draft, no search): the baseline of every benchmark runs the same code.
:meth:`DartEngine.generate_stream` yields each step's new tokens with its
statistics; :meth:`DartEngine.generate` drains it.  Sequences have their own
lengths, trees, acceptance and stop conditions, and leave the batch when done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from dart_core.budget import AdaptiveBudget
from dart_core.draft_head import DartDraftHead
from dart_core.kv_cache import HeadKVCache, cache_mask
from dart_core.sampling import SamplingParams, target_probs
from dart_core.target import TargetCache, TargetModel
from dart_core.tree_client import InProcessTreeSearch, TreeSearchClient
from dart_core.verify import Acceptance, accept_greedy, accept_sampling
from ngram_service.tree_search import DraftTree, SearchParams

logger = logging.getLogger(__name__)

__all__ = ["DartEngine", "StepOutput", "GenerationResult"]


@dataclass(frozen=True)
class StepOutput:
    """One decoding step.  Lists are aligned: entry i is about request seq_ids[i]."""

    seq_ids: list[int]  # indices into the request batch
    new_tokens: list[list[int]]  # tokens emitted this step (accepted drafts + bonus), stop-trimmed
    finish_reasons: list[str | None]  # "stop", "length" or None (still running)
    accepted_lengths: list[int]  # τ of this step per sequence (0 for the prefill step)
    draft_nodes: list[int]  # draft nodes verified per sequence (the tree budget chosen)
    num_nodes: int  # tree nodes verified per sequence, root included (padded count)
    draft_ms: float
    tree_search_ms: float
    verify_ms: float  # target forward + acceptance + KV compaction
    step_ms: float


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per request (prompt excluded)
    finish_reasons: list[str]
    target_forwards: int = 0  # decoding steps after prefill
    emitted_after_prefill: int = 0  # tokens emitted by those steps, summed over sequences
    sequence_steps: int = 0  # (sequence, step) pairs after prefill
    phase_ms: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "tree_search": 0.0, "verify": 0.0,
                                                                 "total": 0.0})

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per target forward per sequence, bonus included."""
        return self.emitted_after_prefill / max(self.sequence_steps, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _root_only(tokens: list[list[int]]) -> list[DraftTree]:
    return [DraftTree.from_parents([t[-1]], [-1], [0], [0.0]) for t in tokens]


def _clip_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """Drops nodes deeper than max_depth (nodes are depth-ordered: a prefix stays prefix-closed)."""
    n = int(np.searchsorted(tree.depths, max_depth, side="right"))
    if n == tree.num_nodes:
        return tree
    return DraftTree(tokens=tree.tokens[:n], parents=tree.parents[:n], depths=tree.depths[:n],
                     scores=tree.scores[:n], tree_mask=tree.tree_mask[:n, :n],
                     retrieve_indices=np.zeros((0, 0), dtype=np.int32))


class DartEngine:
    """Target model + DART draft head + tree search.

    Args:
        target: the target model adapter.
        head: the draft head (on the target's device and dtype); None runs
            plain autoregressive decoding only.
        tree_search: tree-search client (default: in-process, logits-only).
        search_params: tree-search parameters; ``top_k`` drafts per level and
            ``budget`` draft nodes per tree (the most an adaptive budget may use).
        budget: None keeps ``search_params.budget`` fixed; an
            :class:`AdaptiveBudget` picks each tree's size per step.
    """

    def __init__(self, target: TargetModel, head: DartDraftHead | None = None,
                 tree_search: TreeSearchClient | None = None, search_params: SearchParams | None = None,
                 budget: AdaptiveBudget | None = None) -> None:
        self.target = target
        self.head = head
        self.tree_search = tree_search or InProcessTreeSearch(None)
        self.search_params = search_params or SearchParams()
        self.budget = budget
        if head is not None:
            if head.config.target_hidden_size != target.config.hidden_size:
                raise ValueError("draft head and target hidden sizes differ")
            if head.config.vocab_size != target.config.vocab_size:
                raise ValueError("draft head and target vocabularies differ")

    # -- public API -------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None, *,
                 speculative: bool = True) -> GenerationResult:
        """Drains :meth:`generate_stream`; returns every sequence's tokens and τ."""
        sampling = sampling or SamplingParams()
        result = GenerationResult([[] for _ in prompts], ["length"] * len(prompts))
        for step in self.generate_stream(prompts, sampling, speculative=speculative):
            for sid, toks, reason, acc in zip(step.seq_ids, step.new_tokens, step.finish_reasons,
                                              step.accepted_lengths):
                result.token_ids[sid].extend(toks)
                if reason is not None:
                    result.finish_reasons[sid] = reason
                if acc:
                    result.emitted_after_prefill += len(toks)
                    result.sequence_steps += 1
            if any(step.accepted_lengths):
                result.target_forwards += 1
            for name, ms in (("draft", step.draft_ms), ("tree_search", step.tree_search_ms),
                             ("verify", step.verify_ms), ("total", step.step_ms)):
                result.phase_ms[name] += ms
        return result

    @torch.inference_mode()
    def generate_stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None, *,
                        speculative: bool = True) -> Iterator[StepOutput]:
        """Decodes a batch; yields one :class:`StepOutput` per target forward.

        Args:
            prompts: B token-id lists (different lengths allowed).
            sampling: temperature 0 is greedy (lossless: equals the target's greedy output).
            speculative: False runs plain autoregressive decoding with the same engine.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, or a prompt
                that leaves no room in the target's context.
        """
        sampling = sampling or SamplingParams()
        speculative = speculative and self.head is not None
        prompts = [list(map(int, p)) for p in prompts]
        self._check_prompts(prompts)
        if not prompts:
            return
        target, device = self.target, self.target.device
        generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None
                                                  else int(torch.seed() % (1 << 63)))
        stop_ids = set() if sampling.ignore_eos else set(sampling.stop_token_ids)
        seq_ids = list(range(len(prompts)))
        tokens = [list(p) for p in prompts]  # prompt + generated; tokens[b][-1] is the root, not yet cached
        produced = [0] * len(prompts)
        cache = TargetCache(len(prompts), device)

        # prefill -----------------------------------------------------------
        t0 = time.perf_counter()
        out = target.prefill(prompts, cache)
        last = cache.lengths - 1  # [B]
        rows = torch.arange(len(prompts), device=device)
        first = self._sample_rows(out.logits[rows, last], sampling, generator)
        # draft-head inputs for the next step: taps of the new real positions, next tokens
        pend_taps = out.taps  # [B, P, 3H]
        pend_next = [p[1:] + [f] for p, f in zip(prompts, first)]
        pend_pos = torch.arange(out.taps.shape[1], device=device)[None, :].expand(len(prompts), -1)
        pend_last = last
        head_cache = None
        if speculative:
            c = self.head.config
            head_cache = HeadKVCache(len(prompts), c.num_key_value_heads, c.head_dim, device=device,
                                     dtype=target.dtype)
        new_tokens, reasons = [], []
        for b, f in enumerate(first):
            emitted, reason = self._emit(tokens[b], produced, b, [f], sampling, stop_ids)
            new_tokens.append(emitted)
            reasons.append(reason)
        _sync(device)
        ms = 1e3 * (time.perf_counter() - t0)
        yield StepOutput(list(seq_ids), new_tokens, reasons, [0] * len(seq_ids), [0] * len(seq_ids), 0, 0.0, 0.0,
                         ms, ms)

        while True:
            keep = [i for i, r in enumerate(reasons) if r is None]
            if not keep:
                return
            if len(keep) < len(seq_ids):
                sel = torch.tensor(keep, device=device)
                seq_ids = [seq_ids[i] for i in keep]
                tokens = [tokens[i] for i in keep]
                produced = [produced[i] for i in keep]
                pend_next = [pend_next[i] for i in keep]
                cache.select(sel)
                pend_taps, pend_pos, pend_last = pend_taps[sel], pend_pos[sel], pend_last[sel]
                if head_cache is not None:
                    head_cache.select(sel)
            b_size = len(seq_ids)
            t_step = time.perf_counter()

            # draft + tree search ---------------------------------------------
            draft_ms = search_ms = 0.0
            if speculative:
                t0 = time.perf_counter()
                topk_ids, topk_probs = self._draft(pend_taps, pend_next, pend_pos, pend_last, head_cache)
                _sync(device)
                draft_ms = 1e3 * (time.perf_counter() - t0)
                t0 = time.perf_counter()
                trees = self.tree_search.search(topk_ids, topk_probs, [np.asarray(t, dtype=np.int64) for t in tokens],
                                                self.search_params)
                search_ms = 1e3 * (time.perf_counter() - t0)
                if self.budget is not None:
                    chosen = [self.budget.select(tr, topk_ids[i], topk_probs[i]) for i, tr in enumerate(trees)]
                    trees = [tr for tr, _ in chosen]
                    predicted = [pr for _, pr in chosen]
            else:
                trees = _root_only(tokens)
            # never draft past max_new_tokens or the context window
            trees = [_clip_depth(tr, min(sampling.max_new_tokens - produced[i] - 1,
                                         target.max_context - len(tokens[i])))
                     for i, tr in enumerate(trees)]

            # verify ------------------------------------------------------------
            t0 = time.perf_counter()
            n = max(tr.num_nodes for tr in trees)
            node_tokens = torch.zeros(b_size, n, dtype=torch.long)
            depths = torch.zeros(b_size, n, dtype=torch.long)
            tree_mask = torch.eye(n, dtype=torch.bool).repeat(b_size, 1, 1)  # padding nodes see themselves
            for i, tr in enumerate(trees):
                m = tr.num_nodes
                node_tokens[i, :m] = torch.from_numpy(tr.tokens)
                depths[i, :m] = torch.from_numpy(tr.depths.astype(np.int64))
                tree_mask[i, :m, :m] = torch.from_numpy(tr.tree_mask)
            node_tokens, depths, tree_mask = node_tokens.to(device), depths.to(device), tree_mask.to(device)
            padded_len = cache.padded_length
            mask = cache_mask(cache.lengths, padded_len, tree_mask, target.dtype)
            out = target.forward(node_tokens, cache.lengths[:, None] + depths, mask, cache)
            accepted = self._accept(trees, out.logits, sampling, generator)
            a_max = max(len(acc.path) for acc in accepted)
            path = torch.zeros(b_size, a_max, dtype=torch.long)
            for i, acc in enumerate(accepted):
                path[i, : len(acc.path)] = torch.tensor(acc.path)
            path = path.to(device)
            counts = torch.tensor([len(acc.path) for acc in accepted], device=device)
            old_lengths = cache.lengths
            cache.compact(padded_len + path, counts)
            # the accepted positions feed the next draft
            pend_taps = out.taps.gather(1, path[..., None].expand(-1, -1, out.taps.shape[-1]))
            pend_pos = old_lengths[:, None] + torch.arange(a_max, device=device)[None, :]
            pend_last = counts - 1
            pend_next, new_tokens, reasons, acc_lens = [], [], [], []
            for i, (tr, acc) in enumerate(zip(trees, accepted)):
                drafted = [int(tr.tokens[j]) for j in acc.path[1:]]
                if speculative and self.budget is not None:
                    self.budget.observe(predicted[i], len(drafted), draft_ms + search_ms)
                pend_next.append(drafted + [acc.bonus])
                emitted, reason = self._emit(tokens[i], produced, i, drafted + [acc.bonus], sampling, stop_ids)
                new_tokens.append(emitted)
                reasons.append(reason)
                acc_lens.append(len(drafted) + 1)
            _sync(device)
            verify_ms = 1e3 * (time.perf_counter() - t0)
            yield StepOutput(list(seq_ids), new_tokens, reasons, acc_lens, [tr.num_nodes - 1 for tr in trees], n,
                             draft_ms, search_ms, verify_ms, 1e3 * (time.perf_counter() - t_step))

    # -- internals ----------------------------------------------------------

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        vocab = self.target.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary of {vocab}")
            if len(p) >= self.target.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the target's context is {self.target.max_context}")

    def _emit(self, seq: list[int], produced: list[int], i: int, candidates: list[int], sampling: SamplingParams,
              stop_ids: set[int]) -> tuple[list[int], str | None]:
        """Appends tokens to seq until a stop token, max_new_tokens or the context limit."""
        out: list[int] = []
        for tok in candidates:
            seq.append(tok)
            out.append(tok)
            produced[i] += 1
            if tok in stop_ids:
                return out, "stop"
            if produced[i] >= sampling.max_new_tokens or len(seq) >= self.target.max_context:
                return out, "length"
        return out, None

    def _sample_rows(self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> list[int]:
        """[B, V] logits -> one token per row (argmax at temperature 0)."""
        if sampling.greedy:
            return logits.argmax(-1).tolist()
        probs = target_probs(logits, sampling).double().cpu()
        return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()

    @torch.inference_mode()
    def _draft(self, taps, next_tokens: list[list[int]], positions, last_index, head_cache: HeadKVCache):
        """Draft head forward → (topk_ids [B, d, k] int64 target ids, topk_probs [B, d, k] float32)."""
        head, device = self.head, self.target.device
        b, t = taps.shape[:2]
        nxt = torch.zeros(b, t, dtype=torch.long)
        for i, row in enumerate(next_tokens):
            nxt[i, : len(row)] = torch.tensor(row)
        nxt = nxt.to(device)
        logits, new_k, new_v = head(taps, self.target.embed(nxt), positions, last_index, head_cache.keys,
                                    head_cache.values, head_cache.lengths)
        head_cache.append(new_k, new_v, last_index + 1)
        k = min(self.search_params.top_k, logits.shape[-1])
        values, idx = torch.topk(logits.float(), k, dim=-1)  # [B, d, k]
        probs = values.softmax(-1)
        ids = head.draft_to_target(idx)
        return ids.cpu().numpy().astype(np.int64), probs.cpu().numpy().astype(np.float32)

    def _accept(self, trees: list[DraftTree], logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator) -> list[Acceptance]:
        if sampling.greedy:
            argmax = logits.argmax(-1).cpu().numpy()  # [B, N]
            return [accept_greedy(tr.tokens, tr.parents, argmax[i]) for i, tr in enumerate(trees)]
        return [accept_sampling(tr.tokens, tr.parents, logits[i, : tr.num_nodes], sampling, generator)
                for i, tr in enumerate(trees)]
