"""The DART decoding engine: one generator loop, batch-first.

A step for a batch of active sequences (docs/design.md §2) has four phases:

1. **propose** — the engine's :class:`~dart_core.spec.drafters.Drafter` gives one
   tree per sequence: by default one forward of the draft head over each
   sequence's newly accepted positions (top-k per level) and one call to the
   :class:`TreeSearchClient` for the whole batch, or a lookup step's context
   chains (:mod:`dart_core.spec.drafters`);
2. **select** — the adaptive budget keeps the nodes worth verifying, and no
   tree reaches past its sequence's token limit; the trees are packed into
   one :class:`~dart_core.spec.drafters.DraftBatch`;
3. **verify** — one target forward over all trees (padded to a common node
   count) with tree attention over each sequence's cached prefix;
4. **accept** — greedy or stochastic acceptance per sequence, then the
   accepted KV entries are compacted and the rest dropped.

Plain autoregressive decoding is the same loop with trees of only the root
(:class:`~dart_core.spec.drafters.NoDraft`): the baseline of every benchmark runs
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

from dart_core.spec.budget import AdaptiveBudget, SpeculationGate
from dart_core.model.device import sync_device as _sync
from dart_core.spec.draft_head import DartDraftHead
from dart_core.spec.drafters import DartDrafter, DraftBatch, Drafter, DraftInputs, HeadState, NoDraft, Proposal, ProposalKind
from dart_core.spec.routing import RoutedState
from dart_core.step.grammar import row_constraint
from dart_core.model.kv_cache import cache_mask, pad_cat
from dart_core.model.prefix_cache import PrefixCache
from dart_core.model.rows import padded_rows
from dart_core.step.sampling import SamplingParams, target_probs
from dart_core.spec.speculative import FOLD_WIDTH
from dart_core.model.target import TargetCache, TargetModel
from dart_core.step.verify import accept, accept_constrained
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
        drafter: what proposes each step's draft trees (:class:`~dart_core.spec.drafters.Drafter`);
            None: :class:`~dart_core.spec.drafters.DartDrafter` with a head (lookup steps, or the head
            plus the tree search), no speculation without one.
        pooled_budget, grammar_drafting, fold_width: as the fields of
            :class:`~dart_core.spec.speculative.SpeculativeConfig` (their comments there, and the
            attributes' below).
        max_prefill_tokens: sequences that join together are prefilled in groups of at most this
            many padded tokens (rows x longest prompt of the group; a longer prompt goes alone):
            a prefill returns [rows, length, vocabulary] logits and every layer's hidden states,
            so 512 prompts of up to 1,024 tokens prefilled at once would need ≈ 100 GB for
            SmolLM2's logits alone.  The groups keep the joining order; each is its own step.
        prefix_cache_tokens: with more than 0, a :class:`~dart_core.model.prefix_cache.PrefixCache`
            of prompts' KV entries and taps holding up to this many positions: a prompt that starts
            like an earlier one prefills only the rest (:attr:`prefix_cache`).

    Raises:
        ValueError: a negative ``lookup_length`` or ``prefix_cache_tokens``, a ``max_prefill_tokens`` under 1, a head of
            another hidden size or vocabulary than the target.
    """

    def __init__(self, target: TargetModel, head: DartDraftHead | None = None,
                 tree_search: TreeSearchClient | None = None, search_params: SearchParams | None = None,
                 budget: AdaptiveBudget | None = None, gate: SpeculationGate | None = None,
                 context_window: int = 1 << 16, context_order: int = 4, lookup_length: int = 24,
                 max_prefill_tokens: int = 8192, drafter: Drafter | None = None, pooled_budget: bool = False,
                 grammar_drafting: bool = True, fold_width: int | None = FOLD_WIDTH,
                 prefix_cache_tokens: int = 0) -> None:
        self.target = target
        self.head = head
        if head is not None:
            if head.config.target_hidden_size != target.config.hidden_size:
                raise ValueError("draft head and target hidden sizes differ")
            if head.config.vocab_size != target.config.vocab_size:
                raise ValueError("draft head and target vocabularies differ")
        if lookup_length < 0:
            raise ValueError("lookup_length must be >= 0")
        if max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        self.tree_search = tree_search or InProcessTreeSearch(None)
        self.search_params = search_params or SearchParams()
        self.budget = budget
        self.gate = gate
        # reading a device tensor costs no sync (a CPU target): a sampling walk stops once every row
        # has ended instead of warping max_depth + 1 distributions per row (verify.accept_sampling_batch),
        # and greedy acceptance walks the trees in one C++ call (verify.accept_greedy_cpu)
        self.cheap_host_reads = self.target.device.type == "cpu"
        # what proposes each step's trees (dart_core.spec.drafters); None: autoregressive decoding only
        self._owns_drafter = drafter is None
        if drafter is None and head is not None:
            drafter = DartDrafter(head, target.embed_tokens, self.tree_search, self.search_params, budget=budget,
                                  cheap_host_reads=self.cheap_host_reads, fold_width=fold_width,
                                  lookup_length=lookup_length)
        self.drafter = drafter
        # one verification budget pooled across the batch, verified without computing padding
        # (packed_verification); off by default: not measured faster yet (bench/results/pooled_budget)
        self.pooled_budget = pooled_budget
        # structured output: draft trees cut to what the grammar allows, with the tokens it forces added
        # (GrammarState.draft_tree); False leaves the trees as drafted (verification masks either way)
        self.grammar_drafting = grammar_drafting
        # a gated-off step (the batch speculates, this step does not) keeps only references to its
        # taps and tokens (HeadState.hold): the step's work is the autoregressive step's.  They
        # become pending draft-head inputs (and the context indexes see the tokens) when speculation
        # resumes, when sequences join or leave, or once a sequence's held and pending positions
        # pass this many (then the drafter catches up: Drafter.catch_up), which bounds what is held
        self.hold_steps = 64
        self.context_window = context_window
        self.context_order = context_order
        self.max_prefill_tokens = max_prefill_tokens
        # prompts' KV entries and taps kept after their prefill (None: off); what a NewSequence with
        # cache_prefix False prompts is never stored
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None

    # the tree search, its parameters, the adaptive budget and whether host reads are cheap are the engine's
    # and its default drafter's:
    # set on the engine (a server swaps in its gRPC client, a benchmark its searcher), they reach both
    tree_search = property(lambda self: self._tree_search, lambda self, v: self._share("_tree_search", v))
    search_params = property(lambda self: self._search_params, lambda self, v: self._share("_search_params", v))
    budget = property(lambda self: self._budget, lambda self, v: self._share("_budget", v))
    cheap_host_reads = property(lambda self: self._cheap_host_reads,
                                lambda self, v: self._share("_cheap_host_reads", v))

    def _share(self, name: str, value) -> None:
        setattr(self, name, value)
        drafter = self.__dict__.get("drafter")
        if self.__dict__.get("_owns_drafter") and hasattr(drafter, name[1:]):
            setattr(drafter, name[1:], value)

    # -- public API -------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None, *,
                 speculative: bool = True, method: str | None = None) -> GenerationResult:
        """Drains :meth:`generate_stream`; returns every sequence's tokens and τ."""
        sampling = sampling or SamplingParams()
        result = GenerationResult([[] for _ in prompts], ["length"] * len(prompts))
        for step in self.generate_stream(prompts, sampling, speculative=speculative, method=method):
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
                        method: str | None = None) -> Iterator[StepOutput]:
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
            method: the drafter of the ``prompts`` (one of :attr:`methods`; a sequence from
                ``admit`` names its own, ``NewSequence.method``); None: the engine's default.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, or a prompt
                that leaves no room in the target's context; a method the engine does not hold.
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
        state = _BatchState.empty(speculative and self.drafter.uses_taps)
        next_id = 0
        pending = [NewSequence(p, s, method=method) for p, s in zip(prompts, samplings)]
        self._check_methods(pending)
        while True:
            if admit is not None:
                joining = admit()
                if joining:
                    self._check_prompts([list(map(int, x.prompt)) for x in joining])
                    self._check_methods(joining)
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
        pc = self.prefix_cache
        hits = [pc.lookup(p) for p in prompts] if pc is not None else [None] * len(prompts)
        starts = [h.length if h is not None else 0 for h in hits]
        cache = TargetCache.with_prefixes(hits, device)
        # logits [N, 1, V]: each prompt's last token; the prefill computes what follows each stored prefix
        out = target.prefill([p[s:] for p, s in zip(prompts, starts)], cache, last_logits=True)
        taps = out.taps  # [N, P, 3H] over each prompt's positions
        if any(starts):
            taps = taps.new_zeros(len(prompts), max(map(len, prompts)), taps.shape[-1])
            for b, (p, s, h) in enumerate(zip(prompts, starts, hits)):
                if h is not None:
                    taps[b, :s] = h.taps
                taps[b, s:len(p)] = out.taps[b, :len(p) - s]
        if pc is not None:
            layers = cache.cache.layers
            for b, (p, x) in enumerate(zip(prompts, joining)):
                if x.cache_prefix:
                    pc.store(p, [layer.keys[b] for layer in layers], [layer.values[b] for layer in layers], taps[b])
        gens = [torch.Generator().manual_seed(x.sampling.seed if x.sampling.seed is not None
                                              else int(torch.seed() % (1 << 63))) for x in joining]
        constraints = [row_constraint(x.sampling) for x in joining]
        first = self._sample_rows(out.logits[:, 0], [x.sampling for x in joining], gens, constraints)
        new = _BatchState(seq_ids=ids, tokens=[list(p) for p in prompts], produced=[0] * len(prompts),
                          samplings=[x.sampling for x in joining], generators=gens, cache=cache,
                          reasons=[None] * len(prompts), spec_ok=[x.speculative for x in joining],
                          context=[self._new_context(p) if speculative and x.speculative else None
                                   for p, x in zip(prompts, joining)], constraints=constraints)
        if state.speculative:  # the prompt's positions feed the first draft (rows that opted out keep none)
            new.draft = self.drafter.new_state(len(prompts), device, methods=[x.method for x in joining])
            new.add_pending(taps, torch.arange(taps.shape[1], device=device)[None, :].expand(len(prompts), -1),
                            cache.lengths, [p[1:] + [f] for p, f in zip(prompts, first)])
            # the work the first draft would do, done now (the batch then holds one position per row)
            self.drafter.catch_up(new.draft, max(len(p) for p in prompts), prompt=True)
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
        if speculative and state.draft is not None and state.draft.held:  # speculation resumes: one catch-up
            self._release_held(state)
        inputs = DraftInputs(state.tokens, state.context, state.draft)
        proposal = (self.drafter.propose(inputs) if speculative else None) or NoDraft().propose(inputs)
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
        (:attr:`TargetModel.fused_argmax <dart_core.model.target.TargetModel.fused_argmax>`)."""
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
        old_lengths = cache.lengths
        # the cache holds every token but the root: its lengths are known here without a read
        accepted = accept(draft, out, state.samplings, state.generators, state.constraints,
                          cheap_host_reads=self.cheap_host_reads, cache=cache,
                          cached_lengths=[len(t) - 1 for t in state.tokens], padded_length=padded_len)
        paths, counts_host, bonus, path = accepted.paths, accepted.counts, accepted.bonus, accepted.device_paths
        counts, a_max = accepted.device_counts, accepted.longest
        # [B, A + 1]: each row's accepted draft tokens (after its root), then its bonus token
        emitted_rows = np.concatenate([np.take_along_axis(trees.tokens, paths, axis=1)[:, 1:], bonus[:, None]], axis=1)
        if lookup:
            for i in np.flatnonzero(trees.counts > 1):
                if state.constraints[i] is None:  # a grammar reshapes the chain
                    self.budget.observe_lookup(proposal.chains[i].match_length, int(trees.counts[i]) - 1,
                                               int(counts_host[i]) - 1)
        elif predicted is not None:  # a constraint may have reshaped a tree: those rows are left out
            free = np.fromiter((g is None for g in state.constraints), dtype=bool, count=b_size)
            # a catch-up's draft (the positions held while speculation was off) is the gate's switch
            # cost, not what the next step's drafting costs: it leaves the overhead average alone
            self.budget.observe_batch(predicted[free], counts_host[free] - 1,
                                      None if proposal.catch_up else proposal.draft_ms + proposal.search_ms)
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
            state.draft.hold(taps if self.target.static is None else taps.clone(), old_lengths, nexts)
            if len(state.draft.held) + state.draft.width > self.hold_steps:
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

    @property
    def methods(self) -> tuple[str, ...]:
        """The drafting methods a joining sequence may name (``NewSequence.method``): the drafter's,
        several with a :class:`~dart_core.spec.routing.RoutedDrafter`; none without a drafter."""
        return self.drafter.methods if self.drafter is not None else ()

    # -- internals ----------------------------------------------------------

    def _check_methods(self, joining: list["NewSequence"]) -> None:
        for x in joining:
            if x.method is not None and x.method not in self.methods:
                raise ValueError(f"no drafter for method {x.method!r} in this engine (loaded: "
                                 f"{', '.join(self.methods) or 'none'})")

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

    def _graph_captures(self) -> int:
        """CUDA graphs captured so far by the target's static verifier and the drafter."""
        return getattr(self.target.static, "captures", 0) + (self.drafter.captures if self.drafter is not None else 0)

    def _release_held(self, state: "_BatchState") -> None:
        """The gated-off steps' held taps and tokens become pending draft inputs
        (:meth:`_BatchState.release_held`), then the drafter catches up on them (the draft head folds
        all but each sequence's last position into its KV cache past its ``fold_width``): paid once,
        where speculation resumes or the held positions pass ``hold_steps``."""
        state.release_held()
        self.drafter.catch_up(state.draft, max(len(t) for t in state.tokens))


@dataclass(frozen=True)
class NewSequence:
    """A sequence joining the batch (continuous batching)."""

    prompt: Sequence[int]
    sampling: SamplingParams
    speculative: bool = True  # False: while this sequence runs, every step of the batch is autoregressive
    cache_prefix: bool = True  # False: the prompt's entries are not kept in the engine's prefix cache
    method: str | None = None  # the drafter that drafts it (one of DartEngine.methods); None: the engine's default


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
    # per row: what masks its logits (dart_core.step.grammar.row_constraint: a grammar's state, min_tokens) or None
    constraints: list = _rows()
    cache: TargetCache | None = None
    # the drafter's own per-row inputs (with a drafter that reads taps, while the batch may speculate)
    draft: HeadState | RoutedState | None = None
    speculative: bool = False  # whether the batch keeps draft inputs (a tap-reading drafter, speculation allowed)

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
            lo.keys, lo.values = pad_cat(lo.keys, ln.keys, 2), pad_cat(lo.values, ln.values, 2)
        old.lengths = torch.cat([old.lengths, nc.lengths])
        if self.draft is not None:
            self.draft.merge(new.draft)

    def keep(self, rows: list[int]) -> None:
        """Keeps the given rows (finished or cancelled sequences leave)."""
        if len(rows) == len(self.seq_ids):
            return
        if rows:
            self.release_held()  # held steps are laid out by the old rows
        for name in _ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in rows])
        if not rows:  # nobody stays: nothing to catch up on
            self.cache = self.draft = None
            return
        self.cache.select(torch.tensor(rows, device=self.cache.lengths.device))
        if self.draft is not None:
            self.draft.select(rows)

    def release_held(self) -> None:
        """The gated-off steps held by the draft state become pending (:meth:`HeadState.release`),
        and their tokens enter each row's context index."""
        nexts = self.draft.release() if self.draft is not None else None
        for ctx, toks in zip(self.context, nexts or ()):
            if ctx is not None:
                ctx.append(toks)

    def add_pending(self, taps: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor,
                    nexts: list[list[int]]) -> None:
        """Appends each row's newly accepted positions (taps [B, A, 3H], positions [B, A], counts [B])
        to the draft state.  Rows that opted out of speculation (``spec_ok`` false) keep none: they
        never draft."""
        if not all(self.spec_ok):
            counts = torch.where(torch.tensor(self.spec_ok, dtype=torch.bool, device=counts.device), counts, 0)
            nexts = [n if ok else [] for n, ok in zip(nexts, self.spec_ok)]
        self.draft.add(taps, positions, counts, nexts)


_ROW_LISTS = tuple(f.name for f in fields(_BatchState) if f.metadata.get("rows"))  # the per-row list fields
