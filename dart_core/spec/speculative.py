"""One configuration for how the engine speculates.

Every setting that decides what a decoding step drafts and verifies lives in
:class:`SpeculativeConfig`, validated once when it is built: the tree budget
and its gate, the tree-search parameters, the request's context (window and
order), lookup steps, prefill grouping, CUDA graphs, and the engine's
switches that used to be mutable attributes or environment variables
(pooled budget, grammar drafting, the held-input fold width, draft graphs).
:meth:`DartModel.from_pretrained <dart_core.api.DartModel.from_pretrained>`
takes it, and the Serve application's config (``deployments/dart.yaml``)
builds it from its fields, so every one is reachable from there.  This module imports
neither torch nor transformers, so the Serve ingress validates the config without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ngram_service.tree_search import SearchParams

__all__ = ["SpeculativeConfig", "LOOKUP_PREFERENCE", "FOLD_WIDTH", "METHODS"]

# a sequence's held draft-head inputs past this many positions are folded into its head KV cache: one
# below the static drafter's widest graph-captured width (dart_core.model.cuda_graphs.DEFAULT_DRAFT_WIDTHS; tested)
FOLD_WIDTH = 15
METHODS = ("dart", "eagle3", "none")  # SpeculativeConfig.method: the drafters a config can name
LOOKUP_PREFERENCE = 1.0  # a lookup step when its expected rate reaches the tree steps' measured one (tuning split, docs/engine.md)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (docs/design.md §2; docs/engine.md, "Context in the tree").

    Raises:
        ValueError: a field out of range (the field is named); tree-search fields are checked by
            :class:`~ngram_service.tree_search.SearchParams`.
    """

    budget: Union[int, str] = "auto"  # "auto": tree size adapted to the measured verify cost, with the speculation
    # gate; an int: that many draft nodes per tree, always speculating
    search: SearchParams = field(default_factory=SearchParams)  # tree search: top-k, beam width, κ, ...
    context_window: int = 1 << 16  # tokens of a sequence's prompt and output indexed for its context chains
    context_order: int = 4  # longest context the index matches, in tokens
    lookup_length: int = 24  # longest context chain a lookup step verifies alone (0: no lookup steps)
    lookup_preference: float = LOOKUP_PREFERENCE  # a lookup step is taken when its rate reaches this x tree steps'
    gate_probe_every: int = 64  # the gate re-measures the path it is not on every this many steps
    max_prefill_tokens: int = 8192  # joining prompts are prefilled in groups of at most this many padded tokens
    cuda_graphs: bool = False  # CUDA: verification and draft replayed as CUDA graphs over static KV caches
    draft_graphs: bool = True  # with cuda_graphs: False keeps the draft head eager beside captured verification
    pooled_budget: bool = False  # one verification budget across the batch, padding not computed (CPU packed target)
    grammar_drafting: bool = True  # structured output: trees cut to what the grammar allows (False: as drafted)
    fold_width: int | None = FOLD_WIDTH  # held draft-head inputs folded past this many positions; None: held
    prefix_cache_tokens: int = 0  # prompts' KV entries kept for prompts that start alike, positions (0: off)
    method: str = "dart"  # the drafter: "dart" (head + tree search), "eagle3" (an EAGLE-3 head's tree), "none"
    # with method eagle3, the largest tree (the adaptive budget drafts less: Eagle3Drafter.tree_size):
    eagle3_total_tokens: int = 60  # nodes, root included (the reference's default)
    eagle3_depth: int = 7  # expansions after the first level
    eagle3_top_k: int = 10  # children per node and frontier width

    def __post_init__(self) -> None:
        if not (self.budget == "auto" or (isinstance(self.budget, int) and not isinstance(self.budget, bool)
                                          and self.budget >= 1)):
            raise ValueError(f"budget must be 'auto' or a positive int, got {self.budget!r}")
        for name, low, high in (("context_window", 1, None), ("context_order", 1, None), ("lookup_length", 0, None),
                                ("gate_probe_every", 5, 1024), ("max_prefill_tokens", 1, None),
                                ("prefix_cache_tokens", 0, None), ("eagle3_depth", 1, None), ("eagle3_top_k", 1, None),
                                ("eagle3_total_tokens", 2, None)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low or (high is not None and value > high):
                raise ValueError(f"{name} must be an int in {low}..{high or 'any'}, got {value!r}")
        if self.fold_width is not None and (not isinstance(self.fold_width, int) or self.fold_width < 0):
            raise ValueError(f"fold_width must be None or an int >= 0, got {self.fold_width!r}")
        for name in ("cuda_graphs", "draft_graphs", "pooled_budget", "grammar_drafting"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.eagle3_total_tokens > self.eagle3_top_k * (1 + self.eagle3_depth * self.eagle3_top_k) + 1:
            raise ValueError(f"eagle3_total_tokens {self.eagle3_total_tokens} is more than an EAGLE-3 tree of "
                             f"depth {self.eagle3_depth} and top-k {self.eagle3_top_k} drafts (plus the root)")
        if not self.lookup_preference > 0:
            raise ValueError(f"lookup_preference must be > 0, got {self.lookup_preference!r}")

    @property
    def search_params(self) -> SearchParams:
        """The tree-search parameters, their budget the fixed one (an adaptive budget's upper bound)."""
        from dataclasses import replace

        return replace(self.search, budget=self.budget) if isinstance(self.budget, int) else self.search

    def engine_kwargs(self) -> dict:
        """The :class:`~dart_core.step.engine.DartEngine` arguments this config sets directly."""
        return {"context_window": self.context_window, "context_order": self.context_order,
                "lookup_length": self.lookup_length, "max_prefill_tokens": self.max_prefill_tokens,
                "pooled_budget": self.pooled_budget, "grammar_drafting": self.grammar_drafting,
                "fold_width": self.fold_width, "prefix_cache_tokens": self.prefix_cache_tokens}
