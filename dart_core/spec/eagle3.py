"""An EAGLE-3 draft head (Li et al., "EAGLE-3", arXiv 2503.01840) in the layout the community
publishes (the EAGLE repository's ``cnets.py``, as vendored by the DART reference), and its
dynamic draft tree (EAGLE-2, arXiv 2406.16858, §4).

The head is one decoder layer run autoregressively, one tree level per forward:

    g      = fc(taps_t)              # [H], only where the input is wider than H (the target's taps)
    attn_x = concat(input_layernorm(embed(x_{t+1})), hidden_norm(g))   # [2H], embedding first
    h      = g + o_proj(attention(q, k, v = proj(attn_x)))
    h      = h + mlp(post_attention_layernorm(h))                      # the forward's output
    logits = lm_head(norm(h))        # [V_draft]; draft id i is target id i + d2t[i]

A draft position t pairs the target's taps at t with the id of token t + 1.  Past the real
positions, each tree level feeds the previous level's outputs back as the hidden input (width
H: no ``fc``) with the chosen tokens' embeddings.

:func:`draft_tree` is the reference's dynamic tree (its ``topK_genrate``): the top-k children of
the last real position, then ``depth`` expansions of the k best nodes by cumulative log-probability
(k² candidates each, the best k kept as the next frontier), and finally the ``total_tokens - 1``
best of every candidate, kept in generation order under the root.  tests/dart_core/test_eagle3.py
checks the forward (logits and KV cache to 1e-5) and the trees (equal) against the reference run on
a random checkpoint (tests/fixtures/reference-eagle3/README.md).

:func:`draft_trees` drafts a batch at once, and :class:`Eagle3Drafter` serves it behind the engine's
drafter interface.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from dart_core.model.device import sync_device
from dart_core.spec.budget import AdaptiveBudget
from dart_core.spec.draft_head import HeadLoadError, add_reference_layers, checked_state
from dart_core.spec.drafters import DraftInputs, Drafter, HeadState, Proposal, ProposalKind
from ngram_service.tree_search import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["Eagle3Config", "Eagle3Head", "Eagle3Cache", "Eagle3Tree", "Eagle3Drafter", "load_eagle3_head",
           "save_eagle3_head", "draft_tree", "draft_trees", "EAGLE3_ARCHITECTURES"]

#: ``architectures`` names of published EAGLE-3 checkpoints (the EAGLE repository, SpecForge, AngelSlim)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's sizes, read from its ``config.json``.

    ``target_hidden_size``: the target's H where it differs from the head's (``fc`` then reads
    3 · target_hidden_size); the head's own otherwise."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"

    @classmethod
    def for_target(cls, target_config, *, draft_vocab_size: int | None = None) -> "Eagle3Config":
        """One decoder layer of the target's shape (what EAGLE-3 trains for a target), with a draft
        vocabulary of ``draft_vocab_size`` tokens (default the target's)."""
        c = target_config
        heads = c.num_attention_heads
        return cls(hidden_size=c.hidden_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                   draft_vocab_size=draft_vocab_size or c.vocab_size, target_hidden_size=c.hidden_size,
                   rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
                   rope_theta=float(getattr(c, "rope_theta", None) or 10000.0),
                   max_position_embeddings=getattr(c, "max_position_embeddings", 2048))

    @classmethod
    def from_json_dict(cls, d: dict) -> "Eagle3Config":
        """Reads an EAGLE-3 ``config.json``.

        Raises:
            HeadLoadError: a required size missing, or ``architectures`` naming no EAGLE-3 model."""
        archs = d.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise HeadLoadError(f"config.json names architectures {archs}, not an EAGLE-3 head "
                                f"({', '.join(EAGLE3_ARCHITECTURES)})")
        need = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in need if k not in d]
        if missing:
            raise HeadLoadError(f"EAGLE-3 config.json lacks {', '.join(missing)}")
        heads = d["num_attention_heads"]
        return cls(hidden_size=d["hidden_size"], num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                   draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(d.get("rope_theta", 10000.0)),
                   max_position_embeddings=d.get("max_position_embeddings", 2048),
                   hidden_act=d.get("hidden_act", "silu"))


@dataclass
class Eagle3Cache:
    """One sequence's draft KV cache: keys and values [1, H_kv, T, D] of its real positions
    (rotated keys), T of them.  Tree levels are appended during a draft and dropped after it."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (module docstring).  Parameter names follow the published checkpoints:
    ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, buffers ``d2t`` [V_draft] (int64 offsets) and
    ``t2d`` [V] (bool, unused by drafting).  The token embedding is the target's, passed in."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c = self.config = config
        add_reference_layers(self, c, mask_slots=False)  # fc, midlayer, norm, lm_head, d2t, t2d
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(
            hidden_size=c.num_attention_heads * c.head_dim, head_dim=c.head_dim,
            num_attention_heads=c.num_attention_heads, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over Q new positions.

        Args:
            hidden: [B, Q, 3 · H_target] taps (``fc`` applies) or [B, Q, H] earlier outputs.
            embeds: [B, Q, H] embeddings of the positions' input tokens (target ids).
            positions: [B, Q] int64 RoPE positions.
            past_k, past_v: [B, H_kv, K, D] the cache before these positions (K may be 0).
            mask: [B, 1, Q, K + Q] additive, or None for causal attention over the new positions
                after the whole cache.

        Returns:
            (h [B, Q, H] the layer's output, before the final norm; keys, values [B, H_kv, Q, D]
            of the new positions, keys rotated).
        """
        layer = self.midlayer
        g = self.fc(hidden) if hidden.shape[-1] != self.config.hidden_size else hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(g)], dim=-1)
        cos, sin = self.rotary(x, positions)
        if mask is None:
            b, q, k = x.shape[0], x.shape[1], past_k.shape[2]
            allowed = torch.ones(q, k + q, dtype=torch.bool, device=x.device).tril(k)
            mask = torch.zeros(b, 1, q, k + q, dtype=x.dtype, device=x.device).masked_fill(
                ~allowed, torch.finfo(x.dtype).min)
        attn, ks, vs = layer.self_attn(x, x, cos, sin, cos, sin, past_k, past_v, mask)
        h = g + attn
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, ks, vs

    @property
    def dtype(self) -> torch.dtype:
        """The head's activations' dtype (its norms keep it when the linear layers are Q8_0 blocks)."""
        return self.norm.weight.dtype

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] forward output -> [..., V_draft] draft logits: ``lm_head(norm(h))``."""
        return self.lm_head(self.norm(h))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``i + d2t[i]``)."""
        return draft_ids + self.d2t[draft_ids]


def load_eagle3_head(folder: str | Path, target_config=None, *, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Loads a published EAGLE-3 head: ``config.json`` and ``model.safetensors`` (or
    ``pytorch_model.bin``, read with ``weights_only=True``).  An ``embed_tokens.weight`` in the file
    is ignored: drafting embeds with the target's embedding.

    Args:
        folder: the checkpoint folder.
        target_config: the target's Hugging Face config; when given, the head must read its hidden
            size (``fc`` is 3 · hidden wide) and share its vocabulary.

    Raises:
        HeadLoadError: missing or unreadable files, a config that is not an EAGLE-3 head, missing
            or mis-shaped tensors (named: ``d2t`` when the draft vocabulary is smaller, ``fc`` of
            another width ...), a ``d2t`` mapping outside the vocabulary, or sizes that do not
            match the target.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise HeadLoadError(f"{folder} is not an EAGLE-3 head: it has no config.json")
    try:
        config = Eagle3Config.from_json_dict(json.loads((folder / "config.json").read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        if isinstance(e, HeadLoadError):
            raise
        raise HeadLoadError(f"{folder / 'config.json'} is unreadable: {e}") from None
    state = _read_weights(folder)
    if target_config is not None:
        problems = []
        if config.vocab_size != target_config.vocab_size:
            problems.append(f"head vocabulary {config.vocab_size}, target vocabulary {target_config.vocab_size}")
        fc = state.get("fc.weight")
        if fc is not None and fc.shape[-1] != 3 * target_config.hidden_size:
            problems.append(f"fc reads {fc.shape[-1]} features, the target's three hidden states are "
                            f"3 x {target_config.hidden_size} = {3 * target_config.hidden_size}")
        if problems:
            raise HeadLoadError(f"EAGLE-3 head {folder} does not fit the target model: " + "; ".join(problems))
    head = Eagle3Head(config)
    # d2t may be absent where the draft vocabulary is the target's (the reference then deletes it)
    optional = {"t2d"} | ({"d2t"} if config.draft_vocab_size == config.vocab_size else set())
    state = checked_state(head, state, f"EAGLE-3 head {folder}", optional)
    state["d2t"] = state["d2t"].long() if "d2t" in state else torch.zeros(config.draft_vocab_size, dtype=torch.long)
    mapped = torch.arange(config.draft_vocab_size) + state["d2t"]
    if int(mapped.min()) < 0 or int(mapped.max()) >= config.vocab_size:
        raise HeadLoadError(f"EAGLE-3 head {folder}: d2t maps draft tokens outside the target vocabulary")
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    else:
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, mapped, True)
    head.load_state_dict(state, strict=False)
    logger.info("loaded EAGLE-3 head from %s (draft vocabulary %d)", folder, config.draft_vocab_size)
    return head.to(device=device, dtype=dtype).eval()


def save_eagle3_head(head: Eagle3Head, folder: str | Path, *, dtype: torch.dtype | None = torch.bfloat16) -> None:
    """Writes ``config.json`` (``architectures`` ``LlamaForCausalLMEagle3``, as published checkpoints
    name it) and ``model.safetensors`` in the published layout: what :func:`load_eagle3_head` and the
    reference's loader read."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
             for name, t in head.state_dict().items() if not name.startswith("rotary.")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = asdict(head.config) | {"architectures": [EAGLE3_ARCHITECTURES[0]], "model_type": "llama",
                                    "num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    st, binary = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if st.is_file():
            return load_file(str(st))
        if binary.is_file():
            state = torch.load(binary, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise HeadLoadError(f"{binary} does not hold a state dict of tensors")
            return state
    except (SafetensorError, OSError, RuntimeError, EOFError) as e:
        raise HeadLoadError(f"the weights of {folder} are unreadable: {e}") from None
    raise HeadLoadError(f"{folder} is not an EAGLE-3 head: it has neither model.safetensors nor pytorch_model.bin")


@dataclass(frozen=True)
class Eagle3Tree:
    """A draft tree: node 0 the root (the target's last sampled token), nodes 1..N-1 the kept
    candidates in generation order (level, then frontier row, then child rank).

    ``tokens`` [N] int64 target ids; ``parents`` [N] int64 (-1 for the root); ``scores`` [N]
    float32 cumulative log-probabilities (0 for the root)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor

    @property
    def depths(self) -> torch.Tensor:
        """[N] int64 each node's depth (the root's is 0): its RoPE offset in verification."""
        depths = torch.zeros(len(self.parents), dtype=torch.long)
        for i in range(1, len(self.parents)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def mask(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j when j is i or an ancestor of i (tree attention)."""
        n = len(self.parents)
        m = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            m[i] |= m[int(self.parents[i])]
        return m

    def paths(self) -> torch.Tensor:
        """[leaves, max depth + 1] int64: each leaf's nodes from the root, padded with -1, rows by
        ascending leaf index (the reference's ``retrieve_indices``)."""
        n = len(self.parents)
        has_child = torch.zeros(n, dtype=torch.bool)
        has_child[self.parents[1:]] = True
        depths = self.depths
        rows = []
        for leaf in (i for i in range(n) if not has_child[i]):
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = int(self.parents[node])
            rows.append(path[::-1] + [-1] * (int(depths.max()) + 1 - len(path)))
        return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def draft_tree(head: Eagle3Head, embed: nn.Module, cache: Eagle3Cache, taps: torch.Tensor, next_ids: torch.Tensor,
               *, total_tokens: int = 60, depth: int = 7, top_k: int = 10) -> Eagle3Tree:
    """Drafts one sequence's tree (EAGLE-2's dynamic tree with the EAGLE-3 head; the reference's
    ``topK_genrate``), appending the new real positions to ``cache``: :func:`draft_trees` for one row.

    Args:
        head: the EAGLE-3 head.
        embed: the target's token embedding (``[...] int64 -> [..., H]``).
        cache: the sequence's draft KV cache (real positions; empty before its first draft).
        taps: [1, Q, 3 · H_target] the target's taps at the Q positions not yet in the cache.
        next_ids: [1, Q] int64 the id of each new position's next token (position t reads id
            t + 1), the last one the target's newly sampled token: the tree's root.  (The
            reference passes the whole sequence and drops the first T + 1 ids.)
        total_tokens: nodes of the tree, the root included.
        depth: expansions after the first level: the tree reaches at most depth + 1 levels below
            the root.
        top_k: children per node, and the frontier's width.

    Returns:
        The :class:`Eagle3Tree` of ``total_tokens`` nodes.

    Raises:
        ValueError: ``next_ids`` and ``taps`` of different lengths, or ``total_tokens``
            above the candidates drafted (top_k + depth · top_k², plus the root).
    """
    q = taps.shape[1]
    if next_ids.shape[1] != q or not q:
        raise ValueError(f"{next_ids.shape[1]} next ids for {q} new positions (one each, at least one)")
    c = head.config
    empty = taps.new_zeros(1, c.num_key_value_heads, 0, c.head_dim, dtype=head.dtype)
    keys = cache.keys if cache.keys is not None else empty
    values = cache.values if cache.values is not None else empty
    (tree,), new_k, new_v = draft_trees(head, embed, keys, values, torch.tensor([cache.length], device=taps.device),
                                        taps, next_ids, torch.tensor([q], device=taps.device),
                                        total_tokens=total_tokens, depth=depth, top_k=top_k)
    cache.keys, cache.values = torch.cat([keys, new_k], dim=2), torch.cat([values, new_v], dim=2)
    return tree


@torch.no_grad()
def draft_trees(head: Eagle3Head, embed: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                lengths: torch.Tensor, taps: torch.Tensor, next_ids: torch.Tensor, counts: torch.Tensor, *,
                total_tokens: int = 60, depth: int = 7, top_k: int = 10
                ) -> tuple[list[Eagle3Tree], torch.Tensor, torch.Tensor]:
    """:func:`draft_tree` for B sequences at once: one head forward per tree level for the whole
    batch (ragged caches and new positions masked per row), the same trees as drafting each row
    alone up to floating-point summation order (tested equal).

    Args:
        keys, values: [B, H_kv, T, D] the draft KV caches (row b's first ``lengths[b]`` valid).
        lengths: [B] int64.
        taps: [B, W, 3 · H_target] the new positions' taps (row b's first ``counts[b]`` real).
        next_ids: [B, W] int64 their next tokens (padding anything), row b's last real one its root.
        counts: [B] int64 new positions per row, each >= 1.

    Returns:
        (one :class:`Eagle3Tree` per row; new keys, values [B, H_kv, W, D] of the new positions, row
        b's first ``counts[b]`` real: what the caches append).

    Raises:
        ValueError: a row without a new position, or ``total_tokens`` above the candidates drafted.
    """
    if not 1 <= total_tokens - 1 <= top_k + depth * top_k * top_k:
        raise ValueError(f"total_tokens must be in 2..{top_k + depth * top_k * top_k + 1}, got {total_tokens}")
    if bool((counts < 1).any()):
        raise ValueError("every row needs at least one new position")
    b, w = next_ids.shape
    t = keys.shape[2]
    device, dtype = taps.device, head.dtype
    low = torch.finfo(dtype).min
    col = torch.arange(w, device=device)
    # the real positions: each row's cache, then its new positions causally (padding rows see themselves)
    cached = torch.arange(t, device=device)[None, :] < lengths[:, None]  # [B, T]
    causal = (col[None, :] <= col[:, None])[None] & (col[None, None, :] < counts[:, None, None])  # [B, W, W]
    causal |= torch.eye(w, dtype=torch.bool, device=device)[None]
    allowed = torch.cat([cached[:, None, :].expand(b, w, t), causal], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, low)[:, None]
    h, new_k, new_v = head(taps.to(dtype), embed(next_ids).to(dtype), lengths[:, None] + col[None, :], keys, values,
                           mask)
    rows = torch.arange(b, device=device)
    last = h[rows, counts - 1]  # [B, H]: the root's position
    logp = torch.log_softmax(head.logits(last).float(), dim=-1)
    scores, draft_ids = logp.topk(top_k, dim=-1)  # [B, k]
    tokens = [head.draft_to_target(draft_ids)]  # per level [B, candidates]
    cand_scores = [scores]
    cand_parents = [torch.full((b, top_k), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(top_k, device=device).expand(b, top_k)
    frontier_ids, frontier_scores = tokens[0], scores
    hidden = last[:, None].expand(b, top_k, last.shape[-1])
    real = torch.cat([cached, col[None, :] < counts[:, None]], dim=1)  # [B, T + W] visible real entries
    all_k, all_v = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
    lineage = torch.eye(top_k, dtype=torch.bool, device=device).expand(b, top_k, top_k)
    base = (lengths + counts)[:, None]  # each row's first tree position
    offset = top_k
    for level in range(depth):
        allowed = torch.cat([real[:, None, :].expand(b, top_k, real.shape[1]), lineage], dim=2)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, low)[:, None]
        out, ks, vs = head(hidden, embed(frontier_ids).to(dtype), (base + level).expand(b, top_k), all_k, all_v, mask)
        all_k, all_v = torch.cat([all_k, ks], 2), torch.cat([all_v, vs], 2)
        logp = torch.log_softmax(head.logits(out).float(), dim=-1)  # [B, k, V_draft]
        child_p, child_ids = logp.topk(top_k, dim=-1)  # [B, k, k]
        flat = (child_p + frontier_scores[:, :, None]).reshape(b, -1)  # [B, k²]
        tokens.append(head.draft_to_target(child_ids.reshape(b, -1)))
        cand_scores.append(flat)
        cand_parents.append(frontier.repeat_interleave(top_k, dim=1))
        frontier_scores, best = flat.topk(top_k, dim=-1)
        parent_rows = best // top_k
        frontier = offset + best
        frontier_ids = tokens[-1].gather(1, best)
        hidden = out.gather(1, parent_rows[:, :, None].expand(b, top_k, out.shape[-1]))
        lineage = torch.cat([lineage.gather(1, parent_rows[:, :, None].expand(b, top_k, lineage.shape[2])),
                             torch.eye(top_k, dtype=torch.bool, device=device).expand(b, top_k, top_k)], dim=2)
        offset += top_k * top_k
    all_scores, all_tokens, all_parents = torch.cat(cand_scores, 1), torch.cat(tokens, 1), torch.cat(cand_parents, 1)
    kept = all_scores.topk(total_tokens - 1, dim=-1).indices.sort(dim=-1).values  # [B, N - 1], generation order
    node_of = torch.full(all_scores.shape, -1, dtype=torch.long, device=device)
    node_of.scatter_(1, kept, torch.arange(1, total_tokens, device=device).expand(b, -1))
    parent_flat = all_parents.gather(1, kept)
    parents = torch.where(parent_flat < 0, 0, node_of.gather(1, parent_flat.clamp(min=0)))
    if bool((parents < 0).any()):
        raise RuntimeError("a kept candidate's parent was not kept (scores out of order)")
    roots = next_ids[rows, counts - 1]
    tok = torch.cat([roots[:, None], all_tokens.gather(1, kept)], 1).cpu()
    par = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=device), parents], 1).cpu()
    sc = torch.cat([torch.zeros(b, 1, device=device), all_scores.gather(1, kept)], 1).cpu()
    return [Eagle3Tree(tok[i], par[i], sc[i]) for i in range(b)], new_k, new_v


class Eagle3Drafter(Drafter):
    """Drafts the running sequences' trees with an EAGLE-3 head (:func:`draft_trees`: one head
    forward per tree level for the whole batch), behind the engine's drafter interface: the engine
    keeps the target's taps of every accepted position in the drafter's
    :class:`~dart_core.spec.drafters.HeadState` (its KV cache holds the head's real positions),
    verifies the trees with tree attention and accepts as for DART.

    Args:
        head: the EAGLE-3 head, on the target's device.
        embed: the target's input embedding (token ids [..] -> [.., H]).
        total_tokens, depth, top_k: the tree's size (nodes, root included), its expansions after
            the first level, and the children per node and frontier width (:func:`draft_tree`;
            the reference's defaults are 60, 7 and 10).
        budget: the engine's adaptive budget (None: every draft has the sizes above).  With one,
            each draft is sized to what the budget keeps (:meth:`tree_size`): a head forward per
            level the budget may keep, over no more frontier nodes than it may keep.

    Each node's acceptance estimate (``DraftTree.probs``) is its draft probability given its parent,
    so an adaptive budget prices a path by the product along it, as for DART's trees.

    Raises:
        ValueError: ``total_tokens`` more than the candidates drafted, or sizes below 1.
    """

    uses_taps = True
    method = "eagle3"

    def __init__(self, head: Eagle3Head, embed: nn.Module, *, total_tokens: int = 60, depth: int = 7,
                 top_k: int = 10, budget: AdaptiveBudget | None = None) -> None:
        if min(depth, top_k) < 1 or not 2 <= total_tokens <= top_k + depth * top_k * top_k + 1:
            raise ValueError(f"total_tokens must be in 2..{top_k + depth * top_k * top_k + 1} "
                             f"and depth, top_k >= 1 (got {total_tokens}, {depth}, {top_k})")
        self.head, self.embed = head, embed
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.budget = budget

    def tree_size(self) -> tuple[int, int, int]:
        """(total_tokens, depth, top_k) of the next draft (:func:`draft_trees`' arguments).

        Without a budget, the drafter's own.  With one, what the budget can keep: the levels below
        the root it asks for (:meth:`AdaptiveBudget.search_depth
        <dart_core.spec.budget.AdaptiveBudget.search_depth>` of depth + 1; one head forward each),
        and n = :meth:`~dart_core.spec.budget.AdaptiveBudget.node_limit` draft nodes, a frontier and
        children per node of at most n, and n + 1 nodes with the root.  The smaller frontier loses
        no node the n-node tree could hold: a node's cumulative score is below its parent's, so the
        n best nodes' parents are among the n best, and a level holds at most n of them.  Each level
        costs a head forward and its ``lm_head`` rows, which on a CPU are most of the draft's time.
        """
        total, depth, top_k = self.total_tokens, self.depth, self.top_k
        if self.budget is None:
            return total, depth, top_k
        depth = self.budget.search_depth(depth + 1) - 1  # levels below the root, less the root's forward's
        n = self.budget.node_limit(total - 1)
        top_k = min(top_k, n)
        return min(total, n + 1, top_k + depth * top_k * top_k + 1), depth, top_k

    def new_state(self, rows: int, device: torch.device, methods: list[str | None] | None = None) -> HeadState:
        return HeadState.empty(rows, self.head, device)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> Proposal:
        state = inputs.state
        t0 = time.perf_counter()
        width = state.width
        if width < 1 or any(not n for n in state.next):  # a row with nothing accepted since its last draft
            raise RuntimeError("an EAGLE-3 draft needs every row's newly accepted positions")
        nexts = torch.tensor([row + [0] * (width - len(row)) for row in state.next], dtype=torch.long,
                             device=state.taps.device)
        total, depth, top_k = self.tree_size()
        trees, new_k, new_v = draft_trees(self.head, self.embed, state.cache.keys, state.cache.values,
                                          state.cache.lengths, state.taps[:, :width], nexts, state.counts,
                                          total_tokens=total, depth=depth, top_k=top_k)
        state.cache.append(new_k, new_v, state.counts)
        state.clear()
        sync_device(state.taps.device)
        return Proposal([_draft_tree(tree) for tree in trees], kind=ProposalKind.TREE,
                        draft_ms=1e3 * (time.perf_counter() - t0))


def _draft_tree(tree: Eagle3Tree) -> DraftTree:
    """The engine's :class:`~ngram_service.tree_search.DraftTree` of an EAGLE tree: each node's
    acceptance estimate its draft probability given its parent (the root's 1)."""
    parents = tree.parents.numpy()
    scores = tree.scores.numpy().astype(np.float64)
    probs = np.exp(scores - np.where(parents < 0, 0.0, scores[np.maximum(parents, 0)]))
    probs[0] = 1.0
    return DraftTree.from_parents(tree.tokens.numpy(), parents, tree.depths.numpy(), scores, probs)
