"""The one-sequence reference step: DART decoding as plainly as it can be written.

One sequence, one tree per step, a fixed node budget, greedy acceptance, no KV cache kept between
steps, no batching, no adaptive budget, no gate, no static buffers or CUDA graphs.  Each step
recomputes everything from the tokens so far:

1. **target prefix**: the target over every token but the root (the last one) gives the hidden-state
   taps of those positions and a KV cache holding them;
2. **propose**: one draft-head forward over all those positions (each position's taps with the
   token after it, paper §3) drafts ``L`` levels of top-k tokens, and the tree search turns them
   into one prefix-closed tree of at most ``search_params.budget`` draft nodes, weighing the
   sequence's own context chain where ``search_params.context_weight`` > 0 (docs/design.md §2);
3. **verify**: one target forward over the tree (node 0 the root) with tree attention over the
   cached prefix;
4. **accept**: the greedy walk (:func:`~dart_core.step.verify.accept_greedy`): the accepted draft tokens,
   then the bonus token.

It is the test oracle the engine's fast paths are checked against (tests/dart_core/test_reference.py):
at the same fixed budget the engine proposes the same trees, so it accepts the same tokens per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dart_core.spec.draft_head import DartDraftHead
from dart_core.spec.drafters import DraftBatch
from dart_core.model.kv_cache import HeadKVCache, cache_mask
from dart_core.model.target import TargetCache, TargetModel
from dart_core.step.verify import accept_greedy
from ngram_service.client import TreeSearchClient
from ngram_service.context import ContextIndex
from ngram_service.tree_search import SearchParams

__all__ = ["ReferenceResult", "reference_generate"]


@dataclass(frozen=True)
class ReferenceResult:
    tokens: list[int]  # the generated tokens (prompt excluded)
    accepted: list[int]  # per decoding step after the first token: τ, accepted draft nodes + the bonus token


@torch.inference_mode()
def reference_generate(target: TargetModel, head: DartDraftHead, tree_search: TreeSearchClient, prompt: list[int],
                       max_new_tokens: int, search_params: SearchParams, context_order: int = 4) -> ReferenceResult:
    """Greedy DART decoding of one prompt (module docstring), ``max_new_tokens`` tokens exactly
    (no stop tokens).  The first token comes from the prompt's own forward, as in the engine.

    Args:
        target, head, tree_search: the target model, its draft head and the tree-search client.
        prompt: token ids, at least one.
        search_params: top-k per level and ``budget`` draft nodes per tree (fixed).
        context_order: the longest context the sequence's context index matches, in tokens.

    Returns:
        a :class:`ReferenceResult`.
    """
    device = target.device
    tokens = list(prompt)
    out = target.prefill([tokens], TargetCache(1, device), last_logits=True)
    tokens.append(int(out.logits[0, -1].argmax()))
    accepted = []
    levels = max(1, min(head.config.depth, search_params.max_depth, search_params.budget))
    while len(tokens) - len(prompt) < max_new_tokens:
        # 1. the target over every token but the root: taps [1, T, 3H] and the prefix's KV cache
        prefix, root = tokens[:-1], tokens[-1]
        cache = TargetCache(1, device)
        taps = target.prefill([prefix], cache).taps
        # 2. propose: the head over all T positions (position t reads its taps and token t + 1)
        t = len(prefix)
        empty = HeadKVCache(1, head.config.num_key_value_heads, head.config.head_dim, device=device, dtype=head.dtype)
        next_embeds = target.embed(torch.tensor([tokens[1:]], device=device)).to(head.dtype)
        logits, _, _ = head(taps.to(head.dtype), next_embeds, torch.arange(t, device=device)[None],
                            torch.tensor([t - 1], device=device), empty.keys, empty.values, empty.lengths, levels)
        ids, probs = head.top_k(logits, search_params.top_k)  # [1, L, k] each
        chains = None
        if search_params.context_weight > 0:  # the sequence's tokens so far, indexed afresh
            index = ContextIndex(context_order, 1 << 16)
            index.append(tokens)
            chains = [index.continuation(levels)]
        trees = tree_search.search_batch(ids.long().numpy(), probs.float().numpy(), [np.asarray(tokens)],
                                         search_params, chains)
        trees = trees.clip_depth(np.array([max_new_tokens - (len(tokens) - len(prompt)) - 1]))
        tree = trees.tree(0)
        assert tree.tokens[0] == root
        # 3. verify: one forward over the tree, each node at the prefix length plus its depth
        batch = DraftBatch.pack(trees, device)
        mask = cache_mask(cache.lengths, cache.padded_length, batch.tree_mask, target.dtype)
        verified = target.forward(batch.tokens, t + batch.depths, mask, cache)
        # 4. accept: the greedy walk from the root, then the bonus token
        walk = accept_greedy(tree.tokens, tree.parents, verified.greedy_tokens()[0].cpu().numpy())
        tokens += [int(tree.tokens[i]) for i in walk.path[1:]] + [int(walk.bonus)]
        accepted.append(len(walk.path))
    return ReferenceResult(tokens[len(prompt):len(prompt) + max_new_tokens], accepted)
