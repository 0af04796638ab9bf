"""The DART draft head: one Llama-style decoder layer that drafts d tokens in
one forward (DART, arXiv 2601.19278; docs/design.md §2).

Per real position t the head reads three target hidden states (the inputs of
decoder layers 2, L//2 and L-3, concatenated low|mid|high → [3H]) and the
embedding of the *next* token x_{t+1}:

    g      = fc(taps_t)                                          # [H]
    attn_x = concat(input_layernorm(embed(x_{t+1})), hidden_norm(g))  # [2H]
    h      = g + o_proj(attention(q,k,v = proj(attn_x)))
    h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                                    # [V_draft]

After the last real position, d-1 **mask slots** follow; each has the learned
attention input ``mask_rep`` [2H] and residual ``mask_rep[:H]``.  Attention
is causal over the head's own KV cache (real positions only), then over the
earlier slots; RoPE positions continue the sequence.  Logits are
**shifted**: the last real position t predicts x_{t+2} and slot j predicts
x_{t+2+j}, so one forward yields d distributions.  The draft vocabulary is
a subset of the target's: draft index i is target id ``i + d2t[i]``.

Checkpoints use the reference layout (``config.json`` + ``model.safetensors``
with the parameter names below) so published heads load.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from dart_core import _kernels
from dart_core.model.attention import attention_backend, grouped_query_sdpa, sdpa_backends, use_grouped_query
from dart_core.model.kernel_config import KernelConfig
from dart_core.model.kernels import PARALLEL_WORK, RopeTables, rope_attend
from dart_core.model.quant import QMM_KERNELS, Int4Linear

logger = logging.getLogger(__name__)

__all__ = ["DraftHeadConfig", "DartDraftHead", "HeadLoadError", "load_draft_head", "save_draft_head"]


class HeadLoadError(ValueError):
    """A draft-head checkpoint is missing, corrupt, or does not fit the target model."""


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int  # H of the head (the reference uses the target's)
    target_hidden_size: int  # H of the target; fc reads 3 of its hidden states
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary (the embedding is the target's)
    draft_vocab_size: int  # V_draft, lm_head rows
    draft_length: int = 7  # mask slots = d - 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    rope_scaling: dict | None = None  # transformers' rope_scaling (linear, dynamic, llama3, yarn ...); None = plain RoPE
    final_norm_twice: bool = False  # the reference generation path's lm_head(norm(norm(h))) (reference checkpoints)

    @property
    def depth(self) -> int:
        """d: distributions per forward (last real position + mask slots)."""
        return self.draft_length + 1

    @classmethod
    def for_target(cls, target_config, *, draft_vocab_size: int | None = None, draft_length: int = 7) -> "DraftHeadConfig":
        """The reference sizes for a Hugging Face target config (one layer of the target's shape)."""
        c = target_config
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size,
            target_hidden_size=c.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            draft_length=draft_length,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=float(_rope_theta(c)),
            max_position_embeddings=getattr(c, "max_position_embeddings", 8192),
            rope_scaling=_rope_scaling(c),
        )

    @classmethod
    def from_json_dict(cls, d: dict) -> "DraftHeadConfig":
        """Reads a reference ``config.json`` (unknown keys ignored)."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw.setdefault("target_hidden_size", d.get("hidden_size"))
        if "head_dim" not in kw and "hidden_size" in d and "num_attention_heads" in d:
            kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        kw.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        rope = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else None
        if "rope_theta" not in kw and rope is not None:
            kw["rope_theta"] = rope.get("rope_theta", 10000.0)
        if kw.get("rope_scaling") is None and rope is not None and rope.get("rope_type", "default") != "default":
            kw["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "final_norm_twice" not in kw:
            # a checkpoint of the reference's own class (not saved by dart-serve): its generation path
            # normalises twice (end of the layer's forward, then again before lm_head)
            kw["final_norm_twice"] = "DartDraftHead" not in (d.get("architectures") or ["DartDraftHead"])
        missing = [f.name for f in fields(cls) if f.name not in kw and f.default is MISSING]
        if missing:
            raise HeadLoadError(f"draft head config.json lacks {', '.join(missing)}")
        return cls(**kw)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return getattr(config, "rope_theta", 10000.0)


def _rope_scaling(config) -> dict | None:
    """A target config's RoPE scaling (transformers' ``rope_parameters`` or legacy ``rope_scaling``), None if plain."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or params.get("rope_type", params.get("type", "default")) == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


class _DraftAttention(nn.Module):
    def __init__(self, c: DraftHeadConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.kernels = KernelConfig()  # SDPA backends and grouped-query switch (DartDraftHead.use_kernels)

    def keys_values(self, x, cos, sin):
        """Keys (rotated) and values [B, Hkv, N, D] of the positions x [B, N, 2H] (cos/sin [B, N, D])."""
        b, n, _ = x.shape
        c = self.c
        ks = self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        vs = self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return apply_rotary_pos_emb(ks, ks, cos, sin)[0], vs

    def forward(self, x, xq, cos, sin, cos_q, sin_q, past_k, past_v, mask, write_index=None):
        # x: [B, N, 2H] new positions (keys/values); xq: [B, Q, 2H] the subset that queries;
        # cos/sin: [B, N, D], cos_q/sin_q: [B, Q, D]; past_k/v: [B, Hkv, K, D]; mask: [B, 1, Q, K + N] additive.
        # With write_index [B, N] int64 (a static cache): past_k/v are [B, Hkv, C, D] buffers, the N new
        # keys/values are written at those positions and attention runs over the whole buffers
        # (mask: [B, 1, Q, C]).
        b, n, _ = x.shape
        q = xq.shape[1]
        c = self.c
        qs = self.q_proj(xq).view(b, q, c.num_attention_heads, c.head_dim).transpose(1, 2)
        qs = apply_rotary_pos_emb(qs, qs, cos_q, sin_q)[0]
        ks, vs = self.keys_values(x, cos, sin)
        if write_index is None:
            keys = torch.cat([past_k, ks], dim=2)
            values = torch.cat([past_v, vs], dim=2)
        else:
            at = write_index[:, None, :, None].expand(b, c.num_key_value_heads, n, c.head_dim)
            keys, values = past_k.scatter_(2, at, ks), past_v.scatter_(2, at, vs)
        k = self.kernels
        if use_grouped_query(qs, keys, mask, k.grouped_query):  # CUDA: the grouped heads without copies
            with attention_backend(qs.device, k.sdpa_backends):
                out = grouped_query_sdpa(qs, keys, values, mask, None)
            return self.o_proj(out.reshape(b, q, -1)), ks, vs
        grouped = c.num_key_value_heads != c.num_attention_heads
        if grouped and sdpa_backends(qs.device, k.sdpa_backends) is not None:  # not every kernel takes grouped heads
            groups = c.num_attention_heads // c.num_key_value_heads
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            grouped = False
        with attention_backend(qs.device, k.sdpa_backends):
            out = nn.functional.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=grouped)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1)), ks, vs


class _MidLayer(nn.Module):
    """The head's decoder layer in the reference layout (``midlayer.*``): attention over
    [embedding; hidden] [2H], the MLP and three norms; DART's learned mask-slot input ``mask_rep``
    where ``mask_slots`` (EAGLE-3's layer has none)."""

    def __init__(self, c, mask_slots: bool = True) -> None:
        super().__init__()
        self.self_attn = _DraftAttention(c)
        mlp_config = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                 hidden_act=c.hidden_act)
        self.mlp = LlamaMLP(mlp_config)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if mask_slots:
            self.mask_rep = nn.Parameter(torch.zeros(2 * c.hidden_size))


def add_reference_layers(module: nn.Module, c, mask_slots: bool = True) -> None:
    """Gives a draft head (DART's or EAGLE-3's, config ``c``) the reference checkpoints' parameters:
    ``fc`` (3 target hidden states -> H), ``midlayer`` (:class:`_MidLayer`), ``norm``, ``lm_head``
    (H -> V_draft), buffers ``d2t`` [V_draft] int64 (zero) and ``t2d`` [V] bool (false)."""
    module.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
    module.midlayer = _MidLayer(c, mask_slots)
    module.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
    module.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
    module.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
    module.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))


@torch.no_grad()
def start_from_target(head: nn.Module, output_embedding: torch.Tensor, draft_vocab) -> None:
    """Where training starts a head with the reference layers (:func:`add_reference_layers`; DART's
    or EAGLE-3's), in place: ``lm_head`` rows copied from the target's output embedding
    (``output_embedding`` [V, H]) for the draft vocabulary (``draft_vocab`` [V_draft] target ids,
    ascending), ``fc`` the identity on the highest tap plus a tenth of its random initialisation,
    ``d2t`` / ``t2d`` for that vocabulary."""
    vocab = torch.tensor(np.asarray(draft_vocab, dtype=np.int64))
    head.lm_head.weight.copy_(output_embedding[vocab].float().cpu())
    hidden, target_hidden = head.fc.weight.shape[0], head.fc.weight.shape[1] // 3
    head.fc.weight.mul_(0.1)
    head.fc.weight[:, 2 * target_hidden:] += torch.eye(hidden, target_hidden)
    head.d2t.copy_(vocab - torch.arange(len(vocab)))
    head.t2d.zero_()
    head.t2d[vocab] = True


class DartDraftHead(nn.Module):
    """The DART draft head (module docstring).  Parameter names follow the
    reference checkpoints: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
    buffers ``d2t`` [V_draft] (int64 offsets) and ``t2d`` [V] (bool)."""

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        add_reference_layers(self, c)
        self.t2d[: c.draft_vocab_size] = True
        rope_config = LlamaConfig(hidden_size=c.num_attention_heads * c.head_dim, head_dim=c.head_dim,
                                  num_attention_heads=c.num_attention_heads, rope_theta=c.rope_theta,
                                  max_position_embeddings=c.max_position_embeddings,
                                  rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None)
        self.rotary = LlamaRotaryEmbedding(rope_config)
        self._inv_freq = self.rotary.inv_freq.float().clone()  # [D/2] kept in float32 (see _apply)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.half()`` / ``.cuda()`` as for any module, except that the rotary
        frequencies stay float32: a bf16 ``inv_freq`` is off by up to 0.4 %, so the rotation
        angle at position 500 is off by up to 2 radians for the fastest frequency."""
        super()._apply(fn, recurse)
        self.rotary.inv_freq = self._inv_freq.to(self.rotary.inv_freq.device)
        return self

    def use_kernels(self, kernels: KernelConfig) -> "DartDraftHead":
        """Runs the head's attention under ``kernels``' SDPA backends and grouped-query switch
        (:class:`~dart_core.model.kernel_config.KernelConfig`; the defaults until called); returns self."""
        for m in self.modules():
            if isinstance(m, _DraftAttention):
                m.kernels = kernels
        return self

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Random initialisation (a random head drafts garbage but decoding stays lossless)."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                bound = 1.0 / math.sqrt(module.in_features)
                module.weight.copy_(torch.empty_like(module.weight).uniform_(-bound, bound, generator=g))
            elif isinstance(module, LlamaRMSNorm):
                module.weight.fill_(1.0)
        self.midlayer.mask_rep.copy_(torch.randn(self.midlayer.mask_rep.shape, generator=g) * 0.02)

    def forward(
        self,
        taps: torch.Tensor,  # [B, T, 3 * H_target] hidden-state taps of the new real positions
        next_embeds: torch.Tensor,  # [B, T, H] target embeddings of x_{t+1} for those positions
        positions: torch.Tensor,  # [B, T] RoPE positions of the new real positions
        last_index: torch.Tensor,  # [B] index in T of each sequence's last real position
        past_k: torch.Tensor,  # [B, Hkv, K, D] head KV cache (real positions only)
        past_v: torch.Tensor,  # [B, Hkv, K, D]
        past_lengths: torch.Tensor,  # [B] valid cache entries per sequence (left-aligned)
        levels: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft forward for a batch with ragged new positions.

        ``levels`` (1..d, default d) drafts only the first levels: ``levels - 1``
        mask slots.  Slot j attends to the real positions and the earlier slots
        only, so these levels equal the first ones of a full draft (tested);
        a step that verifies shallow trees pays for fewer slots.

        Returns:
            logits: [B, levels, V_draft] for x_{t+2} .. x_{t+1+levels} (t = last real position);
            new_k, new_v: [B, Hkv, T, D] keys/values of the real positions, for the caller's cache.

        Raises:
            ValueError: ``levels`` outside 1..d.
        """
        b, t, _ = taps.shape
        slots = self._slots(levels)
        last_pos = positions.gather(1, last_index[:, None])  # [B, 1]
        slot_pos = last_pos + torch.arange(1, slots + 1, device=positions.device)  # [B, slots]
        mask = _head_mask(past_lengths, past_k.shape[2], last_index, t, slots, taps.dtype)
        # only the last real position and the slots produce distributions: only they query
        take = torch.cat([last_index[:, None], t + torch.arange(slots, device=taps.device).expand(b, slots)], dim=1)
        mask = mask.gather(2, take[:, None, :, None].expand(b, 1, slots + 1, mask.shape[-1]))
        h, ks, vs = self._layer(taps, next_embeds, positions, slot_pos, past_k, past_v, mask, take)
        return self.logits(h), ks[:, :, :t], vs[:, :, :t]

    def _slots(self, levels: int | None) -> int:
        """Mask slots for ``levels`` drafted levels (1..d; None: all d).  Raises ValueError outside."""
        if levels is not None and not 1 <= levels <= self.config.depth:
            raise ValueError(f"levels must be in 1..{self.config.depth}, got {levels}")
        return self.config.draft_length if levels is None else levels - 1

    def forward_static(
        self,
        taps: torch.Tensor,  # [B, T, 3 * H_target] as forward
        next_embeds: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        last_index: torch.Tensor,  # [B]
        key_buffer: torch.Tensor,  # [B, Hkv, C, D] static head KV cache, updated in place
        value_buffer: torch.Tensor,  # [B, Hkv, C, D]
        past_lengths: torch.Tensor,  # [B] valid entries per sequence at [0, past_lengths[b])
        levels: int | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` over a static KV cache, with no shape that depends on the cache's contents
        (so it can be captured in a CUDA graph: ``dart_core.model.cuda_graphs.StaticDrafter``).

        Sequence b's valid real keys go to [L_b, L_b + n_b) (L = ``past_lengths``, n_b =
        ``last_index[b] + 1``), its d - 1 mask slots' keys to [L_b + n_b, L_b + n_b + d - 1), the padded
        real positions to the scratch entry C - 1; a query sees the entries before L_b + n_b and the
        slots up to itself, as in :meth:`forward`.  Nothing is compacted: the caller advances
        ``past_lengths`` by n_b, and the next step overwrites the slots' entries.  The caller keeps
        L_b + n_b + d + 1 <= C.  ``levels`` (1..d) drafts only the first levels, as in :meth:`forward`.

        Returns:
            logits [B, levels, V_draft] (default d levels), equal to :meth:`forward`'s up to rounding
            (tested).

        Raises:
            ValueError: ``levels`` outside 1..d.
        """
        b, t, _ = taps.shape
        slots = self._slots(levels)
        if self._row_kernel_fits(taps, key_buffer, value_buffer):
            return self._forward_static_row(taps, next_embeds, positions, last_index, key_buffer, value_buffer,
                                            past_lengths, slots)
        dev, cap = taps.device, key_buffer.shape[2]
        last_pos = positions.gather(1, last_index[:, None])  # [B, 1]
        slot_pos = last_pos + torch.arange(1, slots + 1, device=dev)  # [B, slots]
        j = torch.arange(t, device=dev)
        base = past_lengths + last_index + 1  # [B] where the slots' keys go
        real_at = torch.where(j[None, :] <= last_index[:, None], past_lengths[:, None] + j[None, :], cap - 1)
        write = torch.cat([real_at, base[:, None] + torch.arange(slots, device=dev)], dim=1)  # [B, T + slots]
        # query q (0: the last real position, s: slot s) sees entry k iff k - base < q
        q = torch.arange(slots + 1, device=dev)
        allowed = (torch.arange(cap, device=dev)[None, None, :] - base[:, None, None]) < q[None, :, None]
        mask = torch.zeros(allowed.shape, dtype=taps.dtype, device=dev)
        mask.masked_fill_(~allowed, torch.finfo(taps.dtype).min)
        take = torch.cat([last_index[:, None], t + torch.arange(slots, device=dev).expand(b, slots)], dim=1)
        h, _, _ = self._layer(taps, next_embeds, positions, slot_pos, key_buffer, value_buffer, mask[:, None], take,
                              write)
        return self.logits(h)

    def _row_kernel_fits(self, taps: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> bool:
        """Whether :meth:`forward_static` can take :meth:`_forward_static_row`: one sequence on the CPU in
        float32, contiguous cache buffers, and rotary frequencies that do not change with the length."""
        rope_type = getattr(self.rotary, "rope_type", "default")
        return (taps.shape[0] == 1 and taps.device.type == "cpu" and taps.dtype == torch.float32
                and self.dtype == torch.float32 and key_buffer.dtype == value_buffer.dtype == torch.float32
                and key_buffer.is_contiguous() and value_buffer.is_contiguous()
                and "dynamic" not in rope_type and rope_type != "longrope")

    def _row_products(self):
        """(qkv, gate_up) of the head's layers fused side by side (:meth:`dart_core.model.quant.Int4Linear.fuse`;
        the layers become views of them), when every product of the layer is an
        :class:`~dart_core.model.quant.Int4Linear` on a qmm kernel (a Q8_0 head on the CPU); else None.
        Made on first use and kept outside the module's children (state dict unchanged)."""
        if not hasattr(self, "_row_fused"):
            a, mlp = self.midlayer.self_attn, self.midlayer.mlp
            products = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                        self.lm_head]
            fused = None
            if (all(type(x) is Int4Linear and x.kernel in QMM_KERNELS for x in products)
                    and Int4Linear.can_fuse([a.q_proj, a.k_proj, a.v_proj])
                    and Int4Linear.can_fuse([mlp.gate_proj, mlp.up_proj])):
                fused = (Int4Linear.fuse([a.q_proj, a.k_proj, a.v_proj]), Int4Linear.fuse([mlp.gate_proj, mlp.up_proj]))
            object.__setattr__(self, "_row_fused", fused)  # a plain attribute: not a submodule
        return self._row_fused

    def _row_rope(self, positions: torch.Tensor, last_index: torch.Tensor, past_lengths: torch.Tensor, slots: int
                  ) -> tuple[int, int, np.ndarray, np.ndarray]:
        """For one sequence on the CPU (:meth:`_row_kernel_fits`): (n real positions, the cache length L,
        cos and sin [n + slots, D] numpy arrays at the real positions and the slots after the last),
        the host values of CPU tensors (no device read) and the rotary tables grown on demand."""
        n = int(last_index.numpy()[0]) + 1
        start = int(past_lengths.numpy()[0])
        pos = positions.numpy()[0, :n]
        pos = np.concatenate([pos, pos[-1] + np.arange(1, slots + 1)])
        if not hasattr(self, "_rope_tables"):
            self._rope_tables = RopeTables(self._inv_freq, getattr(self.rotary, "attention_scaling", 1.0))
        cos, sin = (x.numpy() for x in self._rope_tables(pos, int(pos[-1]) + 1))
        return n, start, cos, sin

    def topk_static(self, taps: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                    last_index: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor,
                    past_lengths: torch.Tensor, k: int, levels: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``top_k(forward_static(...), k)``: (ids [B, L, k] int64 target ids, probs [B, L, k] float32), the
        same arguments and cache writes as :meth:`forward_static`.  For one sequence on the CPU with every
        product on a qmm kernel (a Q8_0 head) the layer, the draft logits and their top-k run in one C++
        call (``_kernels.DraftRow``: no tensor operator between the kernels), equal to the operator path up
        to float32 rounding (tested); otherwise :meth:`forward_static` then :meth:`top_k`.

        Raises:
            ValueError: ``levels`` outside 1..d."""
        slots = self._slots(levels)
        row = self._draft_row() if self._row_kernel_fits(taps, key_buffer, value_buffer) else None
        if row is None:
            return self.top_k(self.forward_static(taps, next_embeds, positions, last_index, key_buffer, value_buffer,
                                                  past_lengths, levels), k)
        n, start, cos, sin = self._row_rope(positions, last_index, past_lengths, slots)
        k = min(k, self.config.draft_vocab_size)
        ids = torch.empty(1, slots + 1, k, dtype=torch.int64)
        probs = torch.empty(1, slots + 1, k, dtype=torch.float32)
        row.forward(_contiguous_rows(taps[0, :n]), _contiguous_rows(next_embeds[0, :n]), cos, sin,
                    key_buffer.numpy(), value_buffer.numpy(), start, slots, ids[0].numpy(), probs[0].numpy(),
                    PARALLEL_WORK)
        return ids, probs

    def _draft_row(self):
        """The ``_kernels.DraftRow`` of this head (its fused products, norms, mask embedding and d2t), when
        :meth:`_row_products` fuses them; else None.  Made on first use, kept outside the module's children."""
        if not hasattr(self, "_row_call"):
            fused, call = self._row_products(), None
            if fused is not None and self.dtype == torch.float32:
                c, mid = self.config, self.midlayer
                products = (self.fc, fused[0], mid.self_attn.o_proj, fused[1], mid.mlp.down_proj, self.lm_head)
                norms = (mid.input_layernorm, mid.hidden_norm, mid.post_attention_layernorm, self.norm)
                call = _kernels.DraftRow(tuple(p.kernel_args() for p in products),
                                         tuple(x.weight.detach().numpy() for x in norms),
                                         tuple(float(x.variance_epsilon) for x in norms),
                                         mid.mask_rep.detach().float().contiguous().numpy(),
                                         self.d2t.contiguous().numpy(), c.num_attention_heads,
                                         c.num_key_value_heads, c.head_dim, c.head_dim ** -0.5,
                                         bool(c.final_norm_twice))
            object.__setattr__(self, "_row_call", call)
        return self._row_call

    def _forward_static_row(self, taps, next_embeds, positions, last_index, key_buffer, value_buffer, past_lengths,
                            slots: int) -> torch.Tensor:
        """:meth:`forward_static` for one sequence on the CPU (logits [1, slots + 1, V_draft], equal up to
        rounding): the new positions' rotation, cache writes and attention in one call of the row-exact
        kernel (:func:`dart_core.model.kernels.rope_attend`) instead of a dozen tensor operators, and with a
        Q8_0 head the norms, SiLU and residual adds inside the qmm kernel's calls
        (:meth:`dart_core.model.quant.Int4Linear.fused_into`).  The real positions up to the last and the
        slots are written at [L, L + n + slots) (L = the cache's length); a causal mask over them is
        the head's mask for one sequence (the slots follow the last real position); queries at the
        real positions before the last are computed and dropped."""
        c, mid = self.config, self.midlayer
        n, start, cos, sin = self._row_rope(positions, last_index, past_lengths, slots)
        taps, next_embeds = taps[:, :n], next_embeds[:, :n]
        g, real_in = self._real_inputs(taps, next_embeds)  # [1, n, H], [1, n, 2H]
        mask_in = mid.mask_rep.to(g.dtype).expand(1, slots, 2 * c.hidden_size)
        x = torch.cat([real_in, mask_in], dim=1)  # [1, n + slots, 2H]
        rows, queries = n + slots, slots + 1
        fused = self._row_products()
        if fused is not None:
            qkv = fused[0](x)
        else:
            a = mid.self_attn
            qkv = torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], dim=-1)  # [1, rows, (H + 2·Hkv)·D]
        mask = np.triu(np.full((rows, start + rows), np.finfo(np.float32).min, dtype=np.float32), start + 1)
        out = rope_attend(qkv, cos, sin, c.num_attention_heads, c.num_key_value_heads, key_buffer, value_buffer,
                          start, mask[None, None], c.head_dim ** -0.5)  # [1, rows, H, D]
        attn = out[0, n - 1:].reshape(queries, -1)  # the last real position and the slots query
        h = torch.cat([g[0, n - 1:], mask_in[0, :, : c.hidden_size]])  # [queries, H]: their residuals
        if fused is None:
            h = h + mid.self_attn.o_proj(attn)
            h = h + mid.mlp(mid.post_attention_layernorm(h))
            return self.logits(h[None])
        mlp, ln = mid.mlp, mid.post_attention_layernorm
        mid.self_attn.o_proj.fused_into(attn, h, accumulate=True)
        gate_up = fused[1].fused_into(h, torch.empty(queries, fused[1].out_features), norm=ln.weight,
                                      eps=ln.variance_epsilon)
        mlp.down_proj.fused_into(gate_up, h, gated=True, accumulate=True)
        if self.config.final_norm_twice:
            h = self.norm(h)
        logits = self.lm_head.fused_into(h, torch.empty(queries, self.lm_head.out_features), norm=self.norm.weight,
                                         eps=self.norm.variance_epsilon)
        return logits[None]

    def forward_train(self, taps: torch.Tensor, next_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Drafts for many anchor positions of whole sequences in one forward (training).

        Each anchor a gets its own d-1 mask slots; a block mask lets slot j of
        anchor a see the real positions <= a and slots 1..j of the same anchor
        only, so the result for anchor a equals :meth:`forward` run on the
        prefix ending at a (tested).  Real positions only give keys and values.

        Args:
            taps: [B, T, 3 * H_target]; next_embeds: [B, T, H] (embedding of
                x_{t+1} at real position t); anchors: [B, A] int64, each < T.

        Returns:
            logits [B, A, d, V_draft]: for anchor a, distributions of x_{a+2} .. x_{a+1+d}.
        """
        c = self.config
        b, t, _ = taps.shape
        a, slots = anchors.shape[1], c.draft_length
        dev = taps.device
        positions = torch.arange(t, device=dev).expand(b, t)
        slot_pos = (anchors[:, :, None] + torch.arange(1, slots + 1, device=dev)).reshape(b, a * slots)
        # queries: anchor a then its slots, [B, A * d] indices into the T + A * slots new positions
        take = torch.cat([anchors[:, :, None],
                          t + torch.arange(a, device=dev)[None, :, None] * slots + torch.arange(slots, device=dev)
                          .expand(b, a, slots)], dim=2).reshape(b, a * (slots + 1))
        # block mask [B, 1, A * d, T + A * slots]
        real = torch.arange(t, device=dev)
        block = torch.arange(a, device=dev).repeat_interleave(slots)  # block of each slot key
        q_anchor = anchors.repeat_interleave(slots + 1, dim=1)  # [B, A*d]
        q_block = torch.arange(a, device=dev).repeat_interleave(slots + 1)  # [A*d]
        q_j = torch.arange(slots + 1, device=dev).repeat(a)  # 0 = the anchor's real position, j = slot j
        k_j = torch.arange(1, slots + 1, device=dev).repeat(a)
        see_real = real[None, None, :] <= q_anchor[:, :, None]  # [B, A*d, T]
        see_slot = ((q_block[:, None] == block[None, :]) & (k_j[None, :] <= q_j[:, None])).expand(b, -1, -1)
        allowed = torch.cat([see_real, see_slot], 2)
        mask = torch.zeros(allowed.shape, dtype=taps.dtype, device=dev)
        mask.masked_fill_(~allowed, torch.finfo(taps.dtype).min)
        empty = torch.zeros(b, c.num_key_value_heads, 0, c.head_dim, dtype=taps.dtype, device=dev)
        h, _, _ = self._layer(taps, next_embeds, positions, slot_pos, empty, empty, mask[:, None], take)
        return self.logits(h).view(b, a, slots + 1, -1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] layer output -> [..., V_draft] draft logits: ``lm_head(norm(h))``, or
        ``lm_head(norm(norm(h)))`` with ``final_norm_twice`` (the reference's generation path,
        whose layer forward already ends with the final norm and whose logit function applies it
        again; its checkpoints were trained for that path)."""
        h = self.norm(h)
        if self.config.final_norm_twice:
            h = self.norm(h)
        return self.lm_head(h)

    def keys_values(self, taps: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head KV cache entries of real positions, without drafting.

        A real position's key and value depend only on its own inputs (its taps, the embedding of
        its next token, its RoPE position), not on attention, so they can be computed ahead of the
        draft that would otherwise compute them: the engine folds the inputs it holds for a
        sequence into its head KV cache this way while no draft runs (``DartEngine``), where an
        entry takes 2 · H_kv · D values instead of 3 · H_target.

        Args:
            taps: [B, T, 3 * H_target]; next_embeds: [B, T, H]; positions: [B, T] int64, as
                :meth:`forward` takes them.

        Returns:
            keys, values: [B, Hkv, T, D], equal to the ``new_k`` / ``new_v`` that :meth:`forward`
            returns for the same positions up to rounding (tested).
        """
        x = self._real_inputs(taps, next_embeds)[1]
        return self.midlayer.self_attn.keys_values(x, *self.rotary(x, positions))

    def _real_inputs(self, taps, next_embeds):
        """The fused taps g = fc(taps) [B, T, H] and the layer's input at the real positions [B, T, 2H]."""
        g = self.fc(taps)
        return g, torch.cat([self.midlayer.input_layernorm(next_embeds), self.midlayer.hidden_norm(g)], dim=-1)

    def _layer(self, taps, next_embeds, positions, slot_pos, past_k, past_v, mask, query_index, write_index=None):
        """The decoder layer over real positions [B, T] followed by slots [B, S], evaluated for the
        positions ``query_index`` [B, Q] only: hidden [B, Q, H] and the keys/values of all T + S
        (``write_index`` [B, T + S]: written into the static buffers ``past_k``/``past_v`` there)."""
        c = self.config
        b = taps.shape[0]
        g, real_in = self._real_inputs(taps, next_embeds)  # [B, T, H], [B, T, 2H]
        mask_in = self.midlayer.mask_rep.to(g.dtype).expand(b, slot_pos.shape[1], 2 * c.hidden_size)
        x = torch.cat([real_in, mask_in], dim=1)  # [B, T + S, 2H]
        residual = torch.cat([g, mask_in[..., : c.hidden_size]], dim=1)  # [B, T + S, H]
        cos, sin = self.rotary(x, torch.cat([positions, slot_pos], dim=1))
        pick = lambda v: v.gather(1, query_index[..., None].expand(b, query_index.shape[1], v.shape[-1]))  # noqa: E731
        attn, ks, vs = self.midlayer.self_attn(x, pick(x), cos, sin, pick(cos), pick(sin), past_k, past_v, mask,
                                                write_index)
        h = pick(residual) + attn
        return h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h)), ks, vs

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norms' weights: packed linear layers hold no parameters)."""
        return self.norm.weight.dtype

    def top_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., V_draft] draft logits -> (ids [..., k] int64 target ids of the k most likely draft
        tokens, probs [..., k] float32 softmax over those k logits), as the tree search takes them
        (k at most the draft vocabulary)."""
        values, idx = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1)
        return self.draft_to_target(idx), values.softmax(-1)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Maps draft-vocabulary indices to target token ids (``i + d2t[i]``)."""
        return draft_ids + self.d2t[draft_ids]


def _contiguous_rows(x: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy view of ``x`` (a copy only where it is not)."""
    return x.float().contiguous().detach().numpy()


def _head_mask(past_lengths, past_len, last_index, t, slots, dtype):
    """[B, 1, T + slots, past_len + T + slots] additive mask: valid cache
    entries, causal among the new real positions (padded ones masked), and each
    slot sees the real positions up to the last one and the earlier slots."""
    b = past_lengths.shape[0]
    dev = past_lengths.device
    q = t + slots
    k_idx = torch.arange(past_len, device=dev)
    cache_ok = (k_idx[None, :] < past_lengths[:, None])[:, None, :].expand(b, q, past_len)
    qi = torch.arange(q, device=dev)
    # effective "time" of each new query/key: real i -> i (if i <= last), slot j -> last + 1 + j
    last = last_index[:, None]
    real_valid = torch.arange(t, device=dev)[None, :] <= last  # [B, T]
    eff = torch.cat([torch.arange(t, device=dev).expand(b, t), last + 1 + torch.arange(slots, device=dev)], dim=1)
    key_valid = torch.cat([real_valid, torch.ones(b, slots, dtype=torch.bool, device=dev)], dim=1)
    new_ok = (eff[:, None, :] <= eff[:, :, None]) & key_valid[:, None, :]
    new_ok = new_ok | (qi[None, :, None] == qi[None, None, :])  # padded queries see themselves (no NaN rows)
    allowed = torch.cat([cache_ok, new_ok], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"


def save_draft_head(head: DartDraftHead, folder: str | Path, *, dtype: torch.dtype | None = torch.bfloat16) -> None:
    """Writes ``config.json`` + ``model.safetensors`` in the reference layout."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("rotary."):
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    save_file(state, str(folder / _WEIGHTS), metadata={"format": "pt"})
    cfg = asdict(head.config)
    cfg["architectures"] = ["DartDraftHead"]
    (folder / _CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def checked_state(head: nn.Module, state: dict[str, torch.Tensor], what: str, optional: set[str] = frozenset()
                  ) -> dict[str, torch.Tensor]:
    """``state`` cut to ``head``'s parameters and buffers (its rotary tables aside; a stored
    ``embed_tokens.weight`` is dropped: drafting embeds with the target's).

    Raises:
        HeadLoadError: tensors missing (``optional`` ones aside), unexpected or of another shape,
            each named, with ``what`` (the head and its folder) in the message."""
    expected = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    missing = sorted(set(expected) - set(state) - set(optional))
    unexpected = sorted(set(state) - set(expected) - {"embed_tokens.weight"})
    wrong = [f"{k}: checkpoint {tuple(state[k].shape)}, expected {tuple(v.shape)}"
             for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        detail = "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                         f"unexpected {', '.join(unexpected)}" if unexpected else "",
                                         "; ".join(wrong)]))
        raise HeadLoadError(f"{what} does not match its config: {detail}")
    return {k: v for k, v in state.items() if k in expected}


def load_draft_head(folder: str | Path, target_config=None, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> DartDraftHead:
    """Loads a head saved in the reference layout and checks it fits the target.

    Args:
        folder: holds ``config.json`` and ``model.safetensors``.
        target_config: the target's Hugging Face config; when given, the
            head's sizes are checked against it (hidden size, vocabulary).

    Raises:
        HeadLoadError: missing files, unreadable weights, missing or
            mis-shaped tensors, or sizes that do not match the target.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / _CONFIG).is_file() or not (folder / _WEIGHTS).is_file():
        raise HeadLoadError(f"{folder} is not a draft head: it needs {_CONFIG} and {_WEIGHTS}")
    try:
        config = DraftHeadConfig.from_json_dict(json.loads((folder / _CONFIG).read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise HeadLoadError(f"{folder / _CONFIG} is unreadable: {e}") from None
    if target_config is not None:
        problems = []
        if config.target_hidden_size != target_config.hidden_size:
            problems.append(f"head reads hidden size {config.target_hidden_size}, target has {target_config.hidden_size}")
        if config.vocab_size != target_config.vocab_size:
            problems.append(f"head vocabulary {config.vocab_size}, target vocabulary {target_config.vocab_size}")
        if problems:
            raise HeadLoadError(f"draft head {folder} does not fit the target model: " + "; ".join(problems))
    try:
        state = load_file(str(folder / _WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise HeadLoadError(f"{folder / _WEIGHTS} is unreadable: {e}") from None
    head = DartDraftHead(config)
    state = checked_state(head, state, f"draft head {folder}")
    mapped = torch.arange(config.draft_vocab_size) + state["d2t"].long()
    if len(mapped) and (int(mapped.min()) < 0 or int(mapped.max()) >= config.vocab_size):
        raise HeadLoadError(f"draft head {folder}: d2t maps draft tokens outside the target vocabulary")
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    head.load_state_dict(state, strict=False)
    logger.info("loaded draft head from %s (d=%d, draft vocabulary %d)", folder, config.depth, config.draft_vocab_size)
    return head.to(device=device, dtype=dtype)
