"""The DART decoding engine: one generator loop, batch-first.

A step for a batch of active sequences (docs/design.md §2) has four phases:

1. **propose** — the engine's :class:`~dart_core.drafters.Drafter` gives one
   tree per sequence: by default one forward of the draft head over each
   sequence's newly accepted positions (top-k per level) and one call to the
   :class:`TreeSearchClient` for the whole batch, or a lookup step's context
   chains (:mod:`dart_core.drafters`);
2. **select** — the adaptive budget keeps the nodes worth verifying, and no
   tree reaches past its sequence's token limit; the trees are packed into
   one :class:`~dart_core.drafters.DraftBatch`;
3. **verify** — one target forward over all trees (padded to a common node
   count) with tree attention over each sequence's cached prefix;
4. **accept** — greedy or stochastic acceptance per sequence, then the
   accepted KV entries are compacted and the rest dropped.

Plain autoregressive decoding is the same loop with trees of only the root
(:class:`~dart_core.drafters.NoDraft`): the baseline of every benchmark runs
the same code.  :meth:`DartEngine.generate_stream` yields each step's new
tokens with its statistics; :meth:`DartEngine.generate` drains it.  Sequences
have their own lengths, trees, acceptance and stop conditions, and leave the
batch when done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Container, Iterator, Sequence

import numpy as np
import torch

from dart_core.budget import AdaptiveBudget, SpeculationGate
from dart_core.cuda_graphs import StaticDrafter
from dart_core.device import sync_device as _sync
from dart_core.draft_head import DartDraftHead
from dart_core.drafters import DartDrafter, DraftBatch, Drafter, NoDraft, Proposal, ProposalKind
from dart_core.grammar import row_constraint
from dart_core.kv_cache import HeadKVCache, cache_mask, zero_pad
from dart_core.rows import padded_rows
from dart_core.sampling import SamplingParams, target_probs
from dart_core.speculative import FOLD_WIDTH
from dart_core.target import TargetCache, TargetModel, TargetOutput
from dart_core.verify import (accept_constrained, accept_greedy, accept_greedy_batch, accept_greedy_cpu,
                              accept_sampling, accept_sampling_batch, uniform_draws)
from ngram_service.client import InProcessTreeSearch, TreeSearchClient
from ngram_service.context import ContextIndex
from ngram_service.tree_search import SearchParams, TreeBatch

logger = logging.getLogger(__name__)

#: the DEBUG record of each gated step (batch, mode, tokens, wall ms, step ms, verified tokens, whether it was
#: measured, the gate's measured speed-up), which :mod:`dart_core.bench.gate_replay` reads back
GATE_LOG = "gate: batch %d, %s step, %d tokens in %.2f ms (step %.2f ms, verified %d)%s; measured speed-up %s"

__all__ = ["DartEngine", "StepOutput", "TokenLogprobs", "GenerationResult", "NewSequence"]


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """One decoding step, built by keyword.  Lists are aligned: entry i is about request seq_ids[i]."""

    seq_ids: list[int]  # indices into the request batch
    new_tokens: list[list[int]]  # tokens emitted this step (accepted drafts + bonus), stop-trimmed
    finish_reasons: list[str | None]  # "stop", "length", "cancelled" or None (still running)
    accepted_lengths: list[int]  # τ of this step per sequence (0 for the prefill step)
    draft_nodes: list[int]  # draft nodes verified per sequence (the tree budget chosen)
    num_nodes: int  # tree nodes verified per sequence, root included (padded count)
    draft_ms: float
    tree_search_ms: float
    verify_ms: float  # target forward + acceptance + KV compaction
    step_ms: float
    logprobs: list["TokenLogprobs | None"] = field(default_factory=list)  # per sequence, when its sampling asks
    lookup: bool = False  # a lookup step: each sequence's context chain verified alone, no draft head
    catch_up: bool = False  # the draft caught up on more positions than one step can accept (autoregressive
    # or lookup steps since the last draft): not a typical step, left out of step-time averages

    @property
    def speculated(self) -> bool:
        """Whether this step verified draft nodes (False: autoregressive, or a prefill)."""
        return max(self.draft_nodes, default=0) > 0

    @property
    def verified_tokens(self) -> int:
        """Query tokens this step verified, all sequences: draft nodes plus one root each."""
        return sum(self.draft_nodes) + len(self.seq_ids)

    @property
    def padded_tokens(self) -> int:
        """Positions of the padded tree layout the step verified: sequences × ``num_nodes``."""
        return self.num_nodes * len(self.seq_ids)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of a sequence's emitted tokens under the target's own distribution (log-softmax
    of its logits, before temperature, top-p and top-k).  Lists are aligned with the emitted tokens."""

    logprobs: list[float]  # [n] of each emitted token
    top_ids: list[list[int]]  # [n, k] the k most likely tokens at that position, best first
    top_logprobs: list[list[float]]  # [n, k]


def _token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> TokenLogprobs:
    """logits [n, V] predicting tokens [n] -> their :class:`TokenLogprobs` with the top ``k``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long, device=lp.device)]
    top = lp.topk(k, dim=-1) if k else None
    return TokenLogprobs(chosen.tolist(), top.indices.tolist() if k else [[] for _ in tokens],
                         top.values.tolist() if k else [[] for _ in tokens])


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per request (prompt excluded)
    finish_reasons: list[str]
    target_forwards: int = 0  # decoding steps after prefill
    emitted_after_prefill: int = 0  # tokens emitted by those steps, summed over sequences
    sequence_steps: int = 0  # (sequence, step) pairs after prefill
    verified_nodes: int = 0  # tree nodes the target verified after prefill, roots included, over sequences
    # ms summed over steps; "total": every step, the prefills included; "prefill": the prefills alone
    phase_ms: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "tree_search": 0.0, "verify": 0.0,
                                                                 "total": 0.0, "prefill": 0.0})

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per target forward per sequence, bonus included."""
        return self.emitted_after_prefill / max(self.sequence_steps, 1)


def _prefill_groups(lengths: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) groups of prompts whose padded size (rows x longest) stays within
    ``max_tokens``; a prompt longer than that forms a group of its own."""
    groups, lo, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and (i - lo + 1) * max(longest, n) > max_tokens:
            groups.append((lo, i))
            lo, longest = i, 0
        longest = max(longest, n)
    if lengths:
        groups.append((lo, len(lengths)))
    return groups


class DartEngine:
    """Target model + DART draft head + tree search.

    Args:
        target: the target model adapter.
        head: the draft head, on the target's device; None runs plain
            autoregressive decoding only.  Its dtype may differ from the
            target's (a bf16 head beside an fp32 target on a CPU): its inputs
            are cast to it, and output stays exact since the target verifies.
        tree_search: tree-search client (default: in-process, logits-only).
        search_params: tree-search parameters; ``top_k`` drafts per level and
            ``budget`` draft nodes per tree (the most an adaptive budget may use).
        budget: None keeps ``search_params.budget`` fixed; an
            :class:`AdaptiveBudget` picks each tree's size per step.
        gate: a :class:`SpeculationGate` that lets a step speculate only where
            speculation measures faster than autoregressive steps; None always
            speculates (when allowed).
        context_window: with ``search_params.context_weight`` > 0, each sequence keeps a
            :class:`~ngram_service.context.ContextIndex` of its prompt and accepted tokens
            (contexts of up to ``context_order`` tokens, at most this many tokens indexed), and
            each step's tree search gets its continuation (docs/design.md §2, "Context in the tree").
        context_order: longest context the index matches, in tokens.
        lookup_length: with the context in use and an adaptive budget, a step may verify each
            sequence's context chain alone (up to this many tokens), skipping the draft head and
            the tree search, where the budget expects that to be faster
            (:meth:`AdaptiveBudget.select_lookup`; docs/engine.md, "Context in the tree"); 0 never does.
        drafter: what proposes each step's draft trees (:class:`~dart_core.drafters.Drafter`);
            None: :class:`~dart_core.drafters.DartDrafter` with a head (lookup steps, or the head
            plus the tree search), no speculation without one.
        pooled_budget, grammar_drafting, fold_width: as the fields of
            :class:`~dart_core.speculative.SpeculativeConfig` (their comments there, and the
            attributes' below).
        max_prefill_tokens: sequences that join together are prefilled in groups of at most this
            many padded tokens (rows x longest prompt of the group; a longer prompt goes alone):
            a prefill returns [rows, length, vocabulary] logits and every layer's hidden states,
            so 512 prompts of up to 1,024 tokens prefilled at once would need ≈ 100 GB for
            SmolLM2's logits alone.  The groups keep the joining order; each is its own step.

    Raises:
        ValueError: a negative ``lookup_length`` or a ``max_prefill_tokens`` under 1, a head of
            another hidden size or vocabulary than the target.
    """

    def __init__(self, target: TargetModel, head: DartDraftHead | None = None,
                 tree_search: TreeSearchClient | None = None, search_params: SearchParams | None = None,
                 budget: AdaptiveBudget | None = None, gate: SpeculationGate | None = None,
                 context_window: int = 1 << 16, context_order: int = 4, lookup_length: int = 24,
                 max_prefill_tokens: int = 8192, drafter: Drafter | None = None, pooled_budget: bool = False,
                 grammar_drafting: bool = True, fold_width: int | None = FOLD_WIDTH) -> None:
        self.target = target
        self.head = head
        # what proposes each step's trees (dart_core.drafters); None: autoregressive decoding only
        self.drafter = drafter if drafter is not None else (DartDrafter() if head is not None else None)
        self.tree_search = tree_search or InProcessTreeSearch(None)
        self.search_params = search_params or SearchParams()
        self.budget = budget
        self.gate = gate
        # reading a device tensor costs no sync (a CPU target): a sampling walk stops once every row
        # has ended instead of warping max_depth + 1 distributions per row (verify.accept_sampling_batch),
        # and greedy acceptance walks the trees in one C++ call (verify.accept_greedy_cpu)
        self.cheap_host_reads = self.target.device.type == "cpu"
        # one verification budget pooled across the batch, verified without computing padding
        # (packed_verification); off by default: not measured faster yet (bench/results/pooled_budget)
        self.pooled_budget = pooled_budget
        # structured output: draft trees cut to what the grammar allows, with the tokens it forces added
        # (GrammarState.draft_tree); False leaves the trees as drafted (verification masks either way)
        self.grammar_drafting = grammar_drafting
        # a sequence's draft-head inputs held past this many positions after an autoregressive step
        # (the gate or max_speculative_batch keeps speculation off) are folded into its head KV cache
        # (_fold_held), as is a new prompt, so that a draft after such steps reads no more than the
        # static drafter's widest graph-captured width; None holds them until the next draft
        self.fold_width: int | None = fold_width
        # a gated-off step (the batch speculates, this step does not) keeps only references to its
        # taps and tokens (_BatchState.hold): the step's work is the autoregressive step's.  They
        # become pending draft-head inputs (and the context indexes see the tokens) when speculation
        # resumes, when sequences join or leave, or once a sequence's held and pending positions
        # pass this many (then folded: _fold_held), which bounds what is held
        self.hold_steps = 64
        self.context_window = context_window
        self.context_order = context_order
        if lookup_length < 0:
            raise ValueError("lookup_length must be >= 0")
        self.lookup_length = lookup_length
        if max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        self.max_prefill_tokens = max_prefill_tokens
        # the draft head's static KV cache (eager; enable_static_draft captures it in CUDA graphs)
        self.static_draft = StaticDrafter(head, target.embed_tokens, top_k=self.search_params.top_k,
                                          use_graphs=False) if head is not None else None
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
                result.verified_nodes += sum(step.draft_nodes) + len(step.seq_ids)
            else:  # a prefill (generate cancels nothing)
                result.phase_ms["prefill"] += step.step_ms
            for name, ms in (("draft", step.draft_ms), ("tree_search", step.tree_search_ms),
                             ("verify", step.verify_ms), ("total", step.step_ms)):
                result.phase_ms[name] += ms
        return result

    @torch.inference_mode()
    def generate_stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
                        | None = None, *, speculative: bool = True, admit: Callable[[], list[NewSequence]] | None = None,
                        cancelled: Container[int] = (), max_speculative_batch: int | None = None,
                        ) -> Iterator[StepOutput]:
        """Decodes a batch; yields one :class:`StepOutput` per target forward.

        Args:
            prompts: B token-id lists (different lengths allowed); seq_ids 0..B-1.
            sampling: one :class:`SamplingParams` for all, or one per prompt.
                Temperature 0 is greedy (lossless: equals the target's greedy output).
            speculative: False runs plain autoregressive decoding with the same engine.
            admit: continuous batching: called before every step; the sequences it
                returns are prefilled and join the running batch (seq_ids continue
                after the last one given).  The loop ends when no sequence runs and
                ``admit`` returns none.  While a sequence that joined with
                ``NewSequence.speculative=False`` runs, every step is autoregressive
                (a per-request opt-out, used for A/B comparisons on one server).
            cancelled: seq_ids to drop at the next step (finish reason "cancelled").
            max_speculative_batch: steps with more running sequences than this are
                plain autoregressive steps (speculation stops paying at large batch);
                the draft head catches up on the skipped positions at the next draft
                (most of them folded into its KV cache ahead of it: ``fold_width``).

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, or a prompt
                that leaves no room in the target's context.
        """
        speculative = speculative and self.drafter is not None
        prompts = [list(map(int, p)) for p in prompts]
        if isinstance(sampling, (list, tuple)):
            samplings = list(sampling)
        else:  # one parameter set for the batch: row i samples with seed + i
            sampling = sampling or SamplingParams()
            samplings = [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
                         for i in range(len(prompts))]
        if len(samplings) != len(prompts):
            raise ValueError(f"{len(samplings)} sampling parameters for {len(prompts)} prompts")
        self._check_prompts(prompts)
        # the draft head's inputs (taps of accepted positions, its KV cache) are kept for drafters that read them
        state = _BatchState.empty(speculative and self.drafter.uses_taps and self.head is not None)
        next_id = 0
        pending = [NewSequence(p, s) for p, s in zip(prompts, samplings)]
        while True:
            if admit is not None:
                joining = admit()
                if joining:
                    self._check_prompts([list(map(int, x.prompt)) for x in joining])
                    pending += joining
            if pending:
                ids = list(range(next_id, next_id + len(pending)))
                next_id += len(pending)
                prefilling, pending = pending, []
                for lo, hi in _prefill_groups([len(x.prompt) for x in prefilling], self.max_prefill_tokens):
                    step = self._prefill(state, ids[lo:hi], prefilling[lo:hi], speculative)
                    yield step
                    state.keep([i for i, r in enumerate(state.reasons) if r is None])
                continue
            gone = {i for i, sid in enumerate(state.seq_ids) if sid in cancelled}
            if gone:
                zeros = [0] * len(gone)
                yield StepOutput(seq_ids=[state.seq_ids[i] for i in sorted(gone)], new_tokens=[[] for _ in gone],
                                 finish_reasons=["cancelled"] * len(gone), accepted_lengths=zeros, draft_nodes=zeros,
                                 num_nodes=0, draft_ms=0.0, tree_search_ms=0.0, verify_ms=0.0, step_ms=0.0,
                                 logprobs=[None] * len(gone))
                state.keep([i for i in range(len(state.seq_ids)) if i not in gone])
            if not state.seq_ids:  # nothing runs and admit (called above) brought nothing
                return
            spec_now = (speculative and all(state.spec_ok)
                        and (max_speculative_batch is None or len(state.seq_ids) <= max_speculative_batch))
            gated = spec_now and self.gate is not None
            if gated:
                spec_now = self.gate.speculate(len(state.seq_ids))
            captures = self._graph_captures()
            t_step = time.perf_counter()
            step = self._step(state, spec_now)
            yield step
            if gated:  # wall time until the caller asks for the next step: its per-step work counts too
                # a step that captured a CUDA graph is not typical of its mode (tens of ms of capture)
                tokens, wall_ms = sum(step.accepted_lengths), 1e3 * (time.perf_counter() - t_step)
                typical = not step.catch_up and self._graph_captures() == captures
                self.gate.observe(len(state.seq_ids), spec_now, tokens, wall_ms, typical=typical)
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(GATE_LOG, len(state.seq_ids), "speculative" if spec_now else "autoregressive",
                                 tokens, wall_ms, step.step_ms, step.verified_tokens,
                                 "" if typical else ", not measured", self.gate.speedup(len(state.seq_ids)))
            state.keep([i for i, r in enumerate(state.reasons) if r is None])

    def _prefill(self, state: "_BatchState", ids: list[int], joining: list["NewSequence"],
                 speculative: bool = True) -> StepOutput:
        """Prefills new sequences in their own cache and merges them into the running batch.
        Sequences that will never speculate (``speculative`` False for the whole call, or their own
        ``NewSequence.speculative`` False) keep no context index: nothing would read it."""
        target, device = self.target, self.target.device
        t0 = time.perf_counter()
        prompts = [list(map(int, x.prompt)) for x in joining]
        cache = TargetCache(len(prompts), device)
        out = target.prefill(prompts, cache, last_logits=True)  # logits [N, 1, V]: each prompt's last token
        gens = [torch.Generator().manual_seed(x.sampling.seed if x.sampling.seed is not None
                                              else int(torch.seed() % (1 << 63))) for x in joining]
        constraints = [row_constraint(x.sampling) for x in joining]
        first = self._sample_rows(out.logits[:, 0], [x.sampling for x in joining], gens, constraints)
        new = _BatchState(seq_ids=ids, tokens=[list(p) for p in prompts], produced=[0] * len(prompts),
                          samplings=[x.sampling for x in joining], generators=gens, cache=cache,
                          # held in the draft head's dtype, the one it reads them in: half the bytes to
                          # copy on every join and leave where a bf16 head drafts for a float32 target
                          pend_taps=out.taps[:, :0].to(self.head.dtype if self.head is not None else out.taps.dtype),
                          pend_next=[[] for _ in prompts],
                          pend_pos=torch.zeros(len(prompts), 0, dtype=torch.long, device=device),
                          pend_count=torch.zeros(len(prompts), dtype=torch.long, device=device),
                          head_cache=None, reasons=[None] * len(prompts),
                          spec_ok=[x.speculative for x in joining],
                          context=[self._new_context(p) if speculative and x.speculative else None
                                   for p, x in zip(prompts, joining)], constraints=constraints)
        # the prompt's positions feed the first draft (rows that opted out keep none)
        new.add_pending(out.taps, torch.arange(out.taps.shape[1], device=device)[None, :].expand(len(prompts), -1),
                        cache.lengths, [p[1:] + [f] for p, f in zip(prompts, first)])
        if state.speculative:
            c = self.head.config
            new.head_cache = HeadKVCache(len(prompts), c.num_key_value_heads, c.head_dim, device=device,
                                         dtype=self.head.dtype)
            if self.fold_width is not None:  # the work the first draft would do, and the batch holds 1 position
                self._fold_held(new)
        new_tokens, logprobs = [], []
        for b, f in enumerate(first):
            emitted, new.reasons[b] = self._emit(new, b, [f])
            new_tokens.append(emitted)
            k = joining[b].sampling.logprobs
            logprobs.append(None if k is None else _token_logprobs(out.logits[b], emitted, k))
        state.merge(new)
        _sync(device)
        ms = 1e3 * (time.perf_counter() - t0)
        return StepOutput(seq_ids=list(ids), new_tokens=new_tokens, finish_reasons=list(new.reasons),
                          accepted_lengths=[0] * len(ids), draft_nodes=[0] * len(ids), num_nodes=0, draft_ms=0.0,
                          tree_search_ms=0.0, verify_ms=ms, step_ms=ms, logprobs=logprobs)

    @property
    def uses_context(self) -> bool:
        """Whether sequences keep a context index (the head drafts and the search weighs its chains)."""
        return self.head is not None and self.search_params.context_weight > 0

    def _new_context(self, prompt: list[int]) -> ContextIndex | None:
        if not self.uses_context:
            return None
        index = ContextIndex(self.context_order, self.context_window)
        index.append(prompt)
        return index

    def _step(self, state: "_BatchState", speculative: bool) -> StepOutput:
        """One step for every running sequence: propose → select → verify → accept."""
        t_step = time.perf_counter()
        if speculative and state.held:  # speculation resumes: the draft head catches up once
            self._release_held(state)
        proposal = (self.drafter.propose(self, state) if speculative else None) or NoDraft().propose(self, state)
        draft, predicted = self._select(state, proposal)
        t_verify = time.perf_counter()
        cached = state.cache.padded_length  # before the forward appends the trees' entries
        out = self._verify(state, draft)
        return self._accept_step(state, proposal, draft, predicted, out, cached, t_step, t_verify)

    def _select(self, state: "_BatchState", proposal: Proposal) -> tuple[DraftBatch, np.ndarray | None]:
        """The budget's choice of nodes (a ``ProposalKind.TREE`` proposal with an adaptive budget; ``predicted``
        [B]: its expected accepted draft nodes per tree), every tree cut to the sequence's remaining
        tokens and context, packed for the device."""
        trees, predicted = proposal.trees, None
        if self.grammar_drafting and proposal.kind is not ProposalKind.NONE and any(g is not None for g in state.constraints):
            # grammar-aware drafting, before the budget chooses: forbidden nodes out, forced tokens in
            # with estimate 1, so forced nodes compete for the budget like any other (the plain step stays
            # plain); a grammar reads one tree at a time
            rows = [trees.tree(i) for i in range(len(trees))]
            trees = TreeBatch.from_trees([tr if g is None else g.draft_tree(tr, self.search_params.budget)
                                          for tr, g in zip(rows, state.constraints)])
        if proposal.kind is ProposalKind.TREE and self.budget is not None:
            trees, predicted = self.budget.select_batch(trees, packed=self.packed_verification)
        # never draft past max_new_tokens or the context window (a root alone never does)
        if proposal.kind is not ProposalKind.NONE:
            trees = trees.clip_depth(np.fromiter(
                (min(s.max_new_tokens - p - 1, self.target.max_context - len(t))
                 for s, p, t in zip(state.samplings, state.produced, state.tokens)), dtype=np.int64, count=len(trees)))
        return DraftBatch.pack(trees, self.target.device), predicted

    def _verify(self, state: "_BatchState", draft: DraftBatch):
        """One target forward over every sequence's tree, with tree attention over its cached prefix.
        A batch that needs no logits (every row greedy and unconstrained, no logprobs) asks for the
        argmax alone, which a 4-bit output layer computes without writing the logits
        (:attr:`TargetModel.fused_argmax <dart_core.target.TargetModel.fused_argmax>`)."""
        cache = state.cache
        mask = cache_mask(cache.lengths, cache.padded_length, draft.tree_mask, self.target.dtype)
        greedy = (all(s.greedy and s.logprobs is None for s in state.samplings)
                  and all(g is None for g in state.constraints))
        return self.target.forward(draft.tokens, cache.lengths[:, None] + draft.depths, mask, cache,
                                   rows=self._real_rows(draft.trees.counts, draft.num_nodes), greedy=greedy)

    def _accept_step(self, state: "_BatchState", proposal: Proposal, draft: DraftBatch, predicted: np.ndarray | None,
                     out, padded_len: int, t_step: float, t_verify: float) -> StepOutput:
        """Acceptance, KV compaction (``padded_len``: the cache's padded length before the
        verification forward), the emitted tokens, the budget's observations and the step's figures."""
        device = self.target.device
        trees, n, b_size = draft.trees, draft.num_nodes, len(state.seq_ids)
        speculative, lookup = proposal.kind is not ProposalKind.NONE, proposal.kind is ProposalKind.LOOKUP
        cache = state.cache
        paths, counts_host, bonus, path = self._accept(draft, out, state.samplings, state.generators,
                                                       state.constraints)
        a_max = int(counts_host.max())
        paths = paths[:, :a_max]  # [B, A] accepted node indices (0 past each row's count), host
        path = path[:, :a_max]  # the same on the device
        counts = torch.from_numpy(counts_host).to(device)
        old_lengths = cache.lengths
        # the cache holds every token but the root: its lengths are known here without a read
        cache.compact_paths([len(t) - 1 for t in state.tokens], padded_len, paths, counts, counts_host)
        # [B, A + 1]: each row's accepted draft tokens (after its root), then its bonus token
        emitted_rows = np.concatenate([np.take_along_axis(trees.tokens, paths, axis=1)[:, 1:], bonus[:, None]], axis=1)
        if lookup:
            for i in np.flatnonzero(trees.counts > 1):
                if state.constraints[i] is None:  # a grammar reshapes the chain
                    self.budget.observe_lookup(proposal.chains[i].match_length, int(trees.counts[i]) - 1,
                                               int(counts_host[i]) - 1)
        elif predicted is not None:  # a constraint may have reshaped a tree: those rows are left out
            free = np.fromiter((g is None for g in state.constraints), dtype=bool, count=b_size)
            self.budget.observe_batch(predicted[free], counts_host[free] - 1, proposal.draft_ms + proposal.search_ms)
        # a gated-off step of a speculative batch: the draft head's inputs and the context indexes wait
        hold = state.speculative and not speculative
        new_tokens, nexts, logprobs = [], [], []
        for i, row in enumerate(emitted_rows.tolist()):  # per sequence: its token list, stop conditions, context
            candidates = row[: counts_host[i] - 1] + row[-1:]
            nexts.append(candidates)
            emitted, state.reasons[i] = self._emit(state, i, candidates, index=not hold)
            new_tokens.append(emitted)
            k = state.samplings[i].logprobs  # token j of the path is predicted by the node before it
            logprobs.append(None if k is None else
                            _token_logprobs(out.logits[i, paths[i, : len(emitted)].tolist()], emitted, k))
        acc_lens = counts_host.tolist()
        if hold:  # references only (a static verifier's output is reused by the next forward: a copy)
            taps = out.taps[:, :1]
            state.hold(taps if self.target.static is None else taps.clone(), old_lengths, nexts)
            if len(state.held) + max(len(x) for x in state.pend_next) > self.hold_steps:
                self._release_held(state)
        elif state.speculative:  # the accepted positions feed the next draft
            # no row accepted a draft node: the roots' taps, a view (a run of lookup steps is left to
            # the next draft: folding there measured slower at batch 1, the static draft's cache
            # copied in after each fold)
            taps = (out.taps[:, :1] if a_max == 1
                    else out.taps.gather(1, path[..., None].expand(-1, -1, out.taps.shape[-1])))
            positions = old_lengths[:, None] + (0 if a_max == 1 else torch.arange(a_max, device=device))
            state.add_pending(taps, positions, counts, nexts)
        _sync(device)
        verify_ms = 1e3 * (time.perf_counter() - t_verify)
        step_ms = 1e3 * (time.perf_counter() - t_step)
        if speculative and self.budget is not None and not proposal.catch_up:
            self.budget.observe_step(b_size, lookup, sum(acc_lens), step_ms, b_size * n)
        return StepOutput(seq_ids=list(state.seq_ids), new_tokens=new_tokens, finish_reasons=list(state.reasons),
                          accepted_lengths=acc_lens, draft_nodes=(trees.counts - 1).tolist(), num_nodes=n,
                          draft_ms=proposal.draft_ms, tree_search_ms=proposal.search_ms, verify_ms=verify_ms,
                          step_ms=step_ms, logprobs=logprobs, lookup=lookup, catch_up=proposal.catch_up)

    @property
    def packed_verification(self) -> bool:
        """Whether a verification forward computes only the real nodes of a padded batch of trees:
        :attr:`pooled_budget` set on a packed CPU target without a static cache
        (:meth:`TargetModel.forward` ``rows``).  The adaptive budget then prices a step by its real
        nodes and lets them compete across the batch (:meth:`AdaptiveBudget.select_batch`)."""
        return (self.pooled_budget and bool(getattr(self.target, "packed", False))
                and getattr(self.target, "static", None) is None)

    def _real_rows(self, counts: np.ndarray, n: int) -> torch.Tensor | None:
        """Flat indices (b · n + node) of the real nodes of trees padded to ``n`` (``counts`` [B]:
        nodes per tree); None when nothing is padding or the target computes every row anyway."""
        if not self.packed_verification:
            return None
        return padded_rows(counts, n, self.target.device)

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

    def _emit(self, state: "_BatchState", i: int, candidates: list[int], index: bool = True
              ) -> tuple[list[int], str | None]:
        """Appends tokens to sequence i until a stop token, max_new_tokens or the context limit;
        ``index``: its context index sees them now (else when its held tokens are released)."""
        sampling = state.samplings[i]
        stop_ids = () if sampling.ignore_eos else sampling.stop_token_ids
        seq = state.tokens[i]
        out: list[int] = []
        reason = None
        for tok in candidates:
            seq.append(tok)
            out.append(tok)
            state.produced[i] += 1
            if tok in stop_ids:
                reason = "stop"
                break
            if state.produced[i] >= sampling.max_new_tokens or len(seq) >= self.target.max_context:
                reason = "length"
                break
        if reason is None and state.constraints[i] is not None and state.constraints[i].stopped:
            reason = "stop"  # the grammar is complete (its EOS consumed, even with ignore_eos)
        if index and state.context[i] is not None:
            state.context[i].append(out)  # one call per step: the index sees what the sequence kept
        return out, reason

    def _sample_rows(self, logits: torch.Tensor, samplings: list[SamplingParams],
                     generators: list[torch.Generator], constraints: list) -> list[int]:
        """[B, V] logits -> one token per row (argmax at temperature 0), each row with its own parameters
        (and its constraint: a grammar or min_tokens, which the token advances)."""
        out = logits.argmax(-1).tolist()
        for i, s in enumerate(samplings):
            if constraints[i] is not None:
                out[i] = accept_constrained(np.zeros(1, dtype=np.int64), np.array([-1]), logits[i][None], s,
                                            generators[i], constraints[i]).bonus
            elif not s.greedy:
                probs = target_probs(logits[i], s).double().cpu()
                out[i] = int(torch.multinomial(probs, 1, generator=generators[i])[0])
        return out

    def _draft_levels(self) -> int:
        """Draft levels this step needs: a tree of n nodes is at most n deep, and the
        adaptive budget asks for one level more than it recently kept (its ``search_depth``)."""
        depth = min(self.head.config.depth, self.search_params.max_depth, self.search_params.budget)
        if self.budget is not None:
            depth = self.budget.search_depth(depth)
        return max(1, depth)

    def _graph_captures(self) -> int:
        """CUDA graphs captured so far by the target's static verifier and the static drafter."""
        return (getattr(self.target.static, "captures", 0)
                + (self.static_draft.captures if self.static_draft is not None else 0))

    def enable_static_draft(self, **kwargs) -> StaticDrafter:
        """Replaces the drafter's static KV cache by one built with ``kwargs``: by default on a GPU
        one replayed as CUDA graphs (:class:`~dart_core.cuda_graphs.StaticDrafter`: padded widths
        and batch sizes, one graph per pair, captured when first needed).  Sequences already
        running keep their cache (it is copied into the new buffers at their next draft).

        Raises:
            ValueError: no draft head, or as :class:`~dart_core.cuda_graphs.StaticDrafter`."""
        if self.head is None:
            raise ValueError("a static draft needs a draft head")
        self.static_draft = StaticDrafter(self.head, self.target.embed_tokens, top_k=self.search_params.top_k,
                                          **kwargs)
        return self.static_draft

    def _release_held(self, state: "_BatchState") -> None:
        """The gated-off steps' held taps and tokens become pending draft-head inputs
        (:meth:`_BatchState.release_held`), then all but each sequence's last position are folded into
        its head KV cache past ``fold_width`` (the catch-up paid once, where speculation resumes or
        the held positions pass ``hold_steps``)."""
        state.release_held()
        if self.fold_width is not None and max(len(x) for x in state.pend_next) > self.fold_width:
            self._fold_held(state)

    @torch.inference_mode()
    def _fold_held(self, state: "_BatchState") -> None:
        """Moves each sequence's held draft-head inputs, all but its last position, into its head KV
        cache (:meth:`DartDraftHead.keys_values`) with no read of a device tensor.

        What the next draft would compute from them anyway, done ahead, so that the draft is
        unchanged (up to rounding) and the inputs held per sequence between steps stay at most
        ``fold_width`` positions while steps are autoregressive: a held position is 3 · H_target
        values (1,728 for SmolLM2), a head KV cache entry 2 · H_kv · D (384), and both are copied
        whenever sequences join or leave the batch.  The last position stays held: the next draft
        queries from it."""
        width = max((len(x) for x in state.pend_next), default=0)
        if width <= 1:
            return
        head = self.head
        nxt = _padded_ids(state.pend_next, width, self.target.device)
        keys, values = head.keys_values(state.pend_taps[:, :width], self.target.embed(nxt).to(head.dtype),
                                        state.pend_pos[:, :width])
        last = (state.pend_count - 1).clamp(min=0)  # [B]; rows that hold nothing fold nothing
        # a row's head KV cache never holds more entries than the row has tokens
        state.head_cache.extend(keys, values, last, max(len(t) for t in state.tokens))
        state.pend_taps = state.pend_taps.gather(1, last[:, None, None].expand(-1, 1, state.pend_taps.shape[-1]))
        state.pend_pos = state.pend_pos.gather(1, last[:, None])
        state.pend_count = state.pend_count.clamp(max=1)
        state.pend_next = [row[-1:] for row in state.pend_next]

    @torch.inference_mode()
    def _draft(self, taps, next_tokens: list[list[int]], positions, last_index, head_cache: HeadKVCache,
               levels: int | None = None, max_positions: int | None = None):
        """Draft head forward → (topk_ids [B, L, k] int64 target ids, topk_probs [B, L, k] float32),
        L = ``levels`` (default d); the tree search goes no deeper than L.  With a static drafter
        (the default; :meth:`enable_static_draft`) and ``max_positions`` (a host-side bound on
        every row's tokens) the draft runs over its static cache where it fits; either way the
        top-k comes to the host in one copy."""
        head, device = self.head, self.target.device
        nxt = _padded_ids(next_tokens, taps.shape[1], device)
        levels = head.config.depth if levels is None else levels
        static = None
        if self.static_draft is not None and max_positions is not None:
            static = self.static_draft.forward(taps.to(head.dtype), nxt, positions, last_index, head_cache,
                                               max_positions, levels)
        if static is not None:
            ids, probs = static  # [B, L, k] each
        else:
            dtype = head.dtype
            logits, new_k, new_v = head(taps.to(dtype), self.target.embed(nxt).to(dtype), positions, last_index,
                                        head_cache.keys, head_cache.values, head_cache.lengths, levels)
            head_cache.append(new_k, new_v, last_index + 1)
            ids, probs = head.top_k(logits, self.search_params.top_k)
        if ids.device.type == "cpu" and self.cheap_host_reads:  # already on the host: views, no copy
            return ids.long().numpy(), probs.float().contiguous().numpy()
        # one copy to the host: the ids as int32 beside the probabilities' bits
        host = torch.stack([ids.to(torch.int32), probs.contiguous().view(torch.int32)]).cpu().numpy()
        return host[0].astype(np.int64), host[1].view(np.float32)

    def _accept(self, batch: DraftBatch, out: TargetOutput, samplings: list[SamplingParams],
                generators: list[torch.Generator], constraints: list
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
        """Each sequence's accepted path and bonus token, on the host and the paths on the device, from
        the verification forward's output (its logits, or for a greedy batch possibly its fused argmax
        alone: :meth:`TargetOutput.greedy_tokens <dart_core.target.TargetOutput.greedy_tokens>`).

        Returns:
            (paths [B, W] int64 accepted node indices from the root, 0 past each row's count, W ≥ the
            longest count; counts [B] int64 accepted nodes, root included; bonus [B] int64 bonus
            tokens), numpy arrays, and the paths [B, W'] int64 on the device (W' ≥ the longest count).

        A greedy unconstrained batch of roots alone (an autoregressive step) takes each root's
        argmax as its bonus token, read in one copy.  On a CPU (:attr:`cheap_host_reads`) a greedy
        unconstrained batch of trees is walked in one C++ call over its host tensors
        (:func:`~dart_core.verify.accept_greedy_cpu`, no read).  Otherwise an unconstrained batch is
        accepted on the device, greedy and sampling rows alike
        (:func:`~dart_core.verify.accept_greedy_batch`, or
        :func:`~dart_core.verify.accept_sampling_batch` with each sampling row's uniforms drawn
        from its own generator), and read back in one copy; a batch with a constrained row (a
        grammar, min_tokens) goes through the host, row by row (a constrained row masks the nodes
        its walk visits: :func:`~dart_core.verify.accept_constrained`)."""
        logits, device = out.logits, out.taps.device
        b = len(samplings)
        if all(g is None for g in constraints):
            if batch.num_nodes == 1 and all(s.greedy for s in samplings):  # roots alone: the bonus is the argmax
                bonus = (out.argmax[:, 0] if out.argmax is not None else logits[:, 0].argmax(-1)).cpu().numpy()
                zeros = np.zeros((b, 1), dtype=np.int64)  # one read above
                return zeros, np.ones(b, dtype=np.int64), bonus, torch.from_numpy(zeros).to(device)
            if all(s.greedy for s in samplings) and self.cheap_host_reads and device.type == "cpu":  # no read
                path, counts, bonus = accept_greedy_cpu(batch.tokens, batch.parents, batch.counts,
                                                        out.greedy_tokens())
                return path, counts, bonus, torch.from_numpy(path)
            if all(s.greedy for s in samplings):
                path, counts, bonus = accept_greedy_batch(batch.tokens, batch.parents, batch.depths, batch.counts,
                                                          batch.tree_mask, out.greedy_tokens())
            else:
                levels = batch.max_depth + 1
                uniforms = torch.stack([torch.ones(levels, dtype=torch.float64) if s.greedy else
                                        uniform_draws(g, levels) for s, g in zip(samplings, generators)])
                path, counts, bonus = accept_sampling_batch(batch.tokens, batch.parents, batch.counts, logits,
                                                            samplings, uniforms, batch.max_depth,
                                                            stop_when_done=self.cheap_host_reads)
            width = batch.max_depth + 1
            host = torch.cat([counts[:, None], bonus[:, None], path[:, :width]], dim=1).cpu().numpy()  # one read
            return host[:, 2:], host[:, 0], host[:, 1], path
        trees = batch.trees
        argmax = logits.argmax(-1).cpu().numpy()  # [B, N]
        accepted = []
        for i in range(b):  # a constrained row's walk asks its grammar node by node
            m = int(trees.counts[i])
            tokens, parents = trees.tokens[i, :m], trees.parents[i, :m]
            accepted.append(
                accept_constrained(tokens, parents, logits[i, :m], samplings[i], generators[i], constraints[i])
                if constraints[i] is not None else accept_greedy(tokens, parents, argmax[i]) if samplings[i].greedy
                else accept_sampling(tokens, parents, logits[i, :m], samplings[i], generators[i]))
        path = np.zeros((b, batch.num_nodes), dtype=np.int64)
        for i, acc in enumerate(accepted):
            path[i, : len(acc.path)] = acc.path
        counts = np.fromiter((len(acc.path) for acc in accepted), dtype=np.int64, count=b)
        bonus = np.fromiter((acc.bonus for acc in accepted), dtype=np.int64, count=b)
        return path, counts, bonus, torch.from_numpy(path).to(device)


@dataclass(frozen=True)
class NewSequence:
    """A sequence joining the batch (continuous batching)."""

    prompt: Sequence[int]
    sampling: SamplingParams
    speculative: bool = True  # False: while this sequence runs, every step of the batch is autoregressive


def _padded_ids(rows: list[list[int]], width: int, device) -> torch.Tensor:
    """[B, width] int64 on ``device``: row b's ids, zero-padded."""
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return torch.from_numpy(ids).to(device)


def _pad_cat(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenates along the batch (dim 0) after zero-padding dimension ``dim`` to the longer one."""
    n = max(a.shape[dim], b.shape[dim])
    return torch.cat([zero_pad(a, dim, n), zero_pad(b, dim, n)], dim=0)


def _append_in_place(buf: torch.Tensor, counts: torch.Tensor, new: torch.Tensor, longest: int) -> torch.Tensor:
    """Writes new[r, :] at buf[r, counts[r]:] and returns the buffer ([B, capacity, ...]);
    ``longest`` = max(counts), which the caller knows without reading ``counts``.

    Amortised O(new): the buffer grows (doubling, zero-filled, so padding stays finite) only
    when a row would run past its capacity; entries past a row's count are padding.
    """
    rows, t_new = new.shape[0], new.shape[1]
    need = longest + t_new if rows else 0
    if need > buf.shape[1]:
        buf = zero_pad(buf, 1, max(need, 2 * buf.shape[1]))
    idx = counts[:, None] if t_new == 1 else counts[:, None] + torch.arange(t_new, device=counts.device)[None, :]
    # an index write, not scatter_: PyTorch's CPU scatter_ into a bfloat16 buffer took milliseconds
    buf[torch.arange(rows, device=counts.device)[:, None], idx] = new
    return buf


def _rows():
    """A per-row list field of :class:`_BatchState`: merged by concatenation, kept by row index."""
    return field(default_factory=list, metadata={"rows": True})


@dataclass
class _BatchState:
    """Everything about the running sequences, row-aligned (continuous batching merges and drops rows).

    Every per-row list is declared once, with :func:`_rows`: :meth:`merge` and :meth:`keep` act on
    all of them; the tensors and caches below them are laid out by row as well and handled by name."""

    seq_ids: list[int] = _rows()
    tokens: list[list[int]] = _rows()  # prompt + generated; tokens[b][-1] is the root, not yet cached
    produced: list[int] = _rows()
    samplings: list[SamplingParams] = _rows()
    generators: list[torch.Generator] = _rows()
    reasons: list[str | None] = _rows()
    spec_ok: list[bool] = _rows()  # per row: may this sequence's steps speculate (NewSequence.speculative)
    context: list[ContextIndex | None] = _rows()  # per row: its prompt + accepted tokens indexed (None: not used)
    # per row: what masks its logits (dart_core.grammar.row_constraint: a grammar's state, min_tokens) or None
    constraints: list = _rows()
    pend_next: list[list[int]] = _rows()  # the next token of each pending draft-head position
    cache: TargetCache | None = None
    # draft-head inputs not yet fed to the head (with speculation): taps [B, P, 3H] in the head's dtype,
    # positions [B, P] (buffers: row b's first pend_count[b] entries are valid, the rest padding), valid counts [B]
    pend_taps: torch.Tensor | None = None
    pend_pos: torch.Tensor | None = None
    pend_count: torch.Tensor | None = None
    head_cache: HeadKVCache | None = None
    speculative: bool = False
    # gated-off steps not yet pending, oldest first: (taps [B, 1, 3H], positions [B], next tokens per row)
    held: list = field(default_factory=list)

    @classmethod
    def empty(cls, speculative: bool) -> "_BatchState":
        return cls(speculative=speculative)

    def merge(self, new: "_BatchState") -> None:
        self.release_held()  # held steps are laid out by the old rows
        if not self.seq_ids:
            speculative = self.speculative
            self.__dict__.update(new.__dict__)
            self.speculative = speculative
            return
        for name in _ROW_LISTS:
            getattr(self, name).extend(getattr(new, name))
        old, nc = self.cache, new.cache
        for lo, ln in zip(old.cache.layers, nc.cache.layers):
            lo.keys, lo.values = _pad_cat(lo.keys, ln.keys, 2), _pad_cat(lo.values, ln.values, 2)
        old.lengths = torch.cat([old.lengths, nc.lengths])
        if self.speculative:
            self.pend_taps = _pad_cat(self.pend_taps, new.pend_taps, 1)
            self.pend_pos = _pad_cat(self.pend_pos, new.pend_pos, 1)
            self.pend_count = torch.cat([self.pend_count, new.pend_count])
            h, hn = self.head_cache, new.head_cache
            h.keys, h.values = _pad_cat(h.keys, hn.keys, 2), _pad_cat(h.values, hn.values, 2)
            h.lengths = torch.cat([h.lengths, hn.lengths])

    def keep(self, rows: list[int]) -> None:
        """Keeps the given rows (finished or cancelled sequences leave)."""
        if len(rows) == len(self.seq_ids):
            return
        if rows:
            self.release_held()  # held steps are laid out by the old rows
        else:  # nobody stays: nothing to catch up on
            self.held = []
        for name in _ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in rows])
        if not rows:
            self.cache = self.head_cache = self.pend_taps = self.pend_pos = self.pend_count = None
            return
        sel = torch.tensor(rows, device=self.cache.lengths.device)
        self.cache.select(sel)
        if self.speculative:
            self.head_cache.select(sel)
            self.pend_taps, self.pend_pos, self.pend_count = self.pend_taps[sel], self.pend_pos[sel], self.pend_count[sel]

    def hold(self, taps: torch.Tensor, positions: torch.Tensor, nexts: list[list[int]]) -> None:
        """Keeps a gated-off step's root taps [B, 1, 3H], positions [B] (the cache lengths before the
        step) and each row's next token, by reference: no device work (:meth:`release_held`)."""
        self.held.append((taps, positions, nexts))

    def release_held(self) -> None:
        """The held steps, in order, as pending draft-head inputs (one concatenation), and their tokens
        into each row's context index."""
        if not self.held:
            return
        held, self.held = self.held, []
        taps = held[0][0] if len(held) == 1 else torch.cat([h[0] for h in held], 1)
        positions = torch.stack([h[1] for h in held], 1)
        nexts = [[tok for h in held for tok in h[2][i]] for i in range(len(self.seq_ids))]
        for ctx, toks in zip(self.context, nexts):
            if ctx is not None:
                ctx.append(toks)
        counts = torch.full((len(nexts),), len(held), dtype=torch.long, device=positions.device)
        self.add_pending(taps, positions, counts, nexts)

    def clear_pending(self) -> None:
        """Empties every row's pending inputs (the buffers keep their capacity)."""
        b = len(self.seq_ids)
        self.pend_count = torch.zeros(b, dtype=torch.long, device=self.pend_count.device)
        self.pend_next = [[] for _ in range(b)]

    def add_pending(self, taps: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor,
                    nexts: list[list[int]]) -> None:
        """Appends each row's newly accepted positions (taps [B, A, 3H], positions [B, A], counts [B]).

        Rows that opted out of speculation (``spec_ok`` false) keep none: they never draft.
        """
        taps = taps.to(self.pend_taps.dtype)  # the draft head's dtype (_prefill)
        if not all(self.spec_ok):
            counts = torch.where(torch.tensor(self.spec_ok, dtype=torch.bool, device=counts.device), counts, 0)
            nexts = [n if ok else [] for n, ok in zip(nexts, self.spec_ok)]
        longest = max((len(x) for x in self.pend_next), default=0)  # max(pend_count), known on the host
        self.pend_taps = _append_in_place(self.pend_taps, self.pend_count, taps, longest)
        self.pend_pos = _append_in_place(self.pend_pos, self.pend_count, positions, longest)
        self.pend_count = self.pend_count + counts
        self.pend_next = [a + b for a, b in zip(self.pend_next, nexts)]


_ROW_LISTS = tuple(f.name for f in fields(_BatchState) if f.metadata.get("rows"))  # the per-row list fields
