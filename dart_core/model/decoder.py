"""The target's decoder forward written out for the CPU: Llama-family models, eager, few operators.

A CPU forward of a small target through transformers' modules is mostly overhead: for
SmolLM2-135M on the 4-bit weights, the matrix kernels are the smaller part of a one-token forward
and the rest is Python (module calls, keyword plumbing, output collection) and small operators.
:class:`LlamaDecoder` runs the same computation directly over the model's own parameters:

- q, k and v are one 4-bit matrix product, as are gate and up (:meth:`Int4Linear.fuse
  <dart_core.model.quant.Int4Linear.fuse>`: the packed rows are concatenated, and the original
  layers become views of the fused weight, so nothing is stored twice);
- the rotary tables are computed once for all positions, the way transformers computes them
  per forward (each entry one product, so the values are the same);
- the rotation of q and k and the KV-cache append are one C++ call per layer
  (:func:`dart_core.model.kernels.rope_append`, PyTorch's arithmetic operator for operator); on the 4-bit
  target the same call continues with the row-exact attention (:func:`~dart_core.model.kernels.rope_attend`),
  its mask converted once per forward;
- taps, logits and the KV cache are what :meth:`TargetModel.model_forward
  <dart_core.model.target.TargetModel.model_forward>` returns and writes through transformers.

Every operation is the one transformers' Llama applies, in the same order and dtypes, so the
logits, the taps and the KV entries equal the stock forward's bit for bit (tested), and a row's
result still does not depend on the other rows of the call (the row-exact property of the 4-bit
target, docs/engine.md).

When every layer runs one of dart-serve's kernels (``qmm-a8`` or ``qmm``, :mod:`dart_core.model.quant`),
the layers are one C++ call per forward (``_kernels.GGUFLayers``): RMS norm, SiLU-and-multiply and
the residual additions happen inside the kernel calls (:meth:`Int4Linear.fused_into
<dart_core.model.quant.Int4Linear.fused_into>`), with no Python between them. Those sums run in an order
of their own, so this path is close to the stock forward rather than equal to it; it stays
row-exact. Figures: ``bench/results/gguf_native/``.
"""

from __future__ import annotations

import torch

from dart_core import _kernels
from dart_core.model import kernels
from dart_core.model.attention import ROW_EXACT_QUERY, grouped_sdpa
from dart_core.model.kv_cache import BufferedKVCache
from dart_core.model.quant import Int4Linear
from dart_core.model.rows import REAL_ROWS

__all__ = ["LlamaDecoder", "decoder_unsupported"]


def decoder_unsupported(model) -> str | None:
    """Why :class:`LlamaDecoder` cannot run ``model`` (None: it can): it covers Llama-architecture
    causal LMs on the CPU with the default rotary embedding, no biases, SiLU, and linear layers
    that honour :func:`dart_core.model.rows.real_rows` (``Int4Linear`` or ``PackedLinear``)."""
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        return f"model type {getattr(config, 'model_type', None)!r} (only 'llama')"
    if next(model.parameters()).device.type != "cpu":
        return "not on the CPU"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope type {rope.get('rope_type', rope.get('type'))!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biases in attention or MLP"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return "an activation other than SiLU, or tensor-parallel pre-training slices"
    for layer in model.model.layers:
        for lin in (*_attention_linears(layer), *_mlp_linears(layer)):
            if not getattr(lin, "honours_real_rows", False):
                return f"a linear layer of type {type(lin).__name__} (not Int4Linear or PackedLinear)"
    return None


def _attention_linears(layer) -> tuple:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


def _mlp_linears(layer) -> tuple:
    m = layer.mlp
    return m.gate_proj, m.up_proj, m.down_proj


class _Layer:
    """One decoder layer's parameters as the forward uses them."""

    def __init__(self, layer) -> None:
        self.attn = layer.self_attn  # the module the attention function reads its settings from
        self.ln1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        q, k, v, self.o = _attention_linears(layer)
        gate, up, self.down = _mlp_linears(layer)
        self.qkv = Int4Linear.fuse([q, k, v]) if Int4Linear.can_fuse([q, k, v]) else None
        self.q, self.k, self.v = q, k, v
        self.gate_up = Int4Linear.fuse([gate, up]) if Int4Linear.can_fuse([gate, up]) else None
        self.gate, self.up = gate, up
        self.intermediate = gate.out_features


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm on float32 activations, operator for operator."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x · cos + rotate_half(x) · sin, as transformers' ``apply_rotary_pos_emb``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaDecoder:
    """The forward of a Llama-family target on the CPU (see the module docstring).

    Args:
        model: a ``LlamaForCausalLM`` that :func:`decoder_unsupported` accepts; its q/k/v and gate/up
            ``Int4Linear`` layers are fused in place (their weights become views of the fused ones).
        tap_layers: the layer indices whose inputs are the taps (``TargetModel.tap_layers``).

    Raises:
        ValueError: a model :func:`decoder_unsupported` refuses (the message says why).
    """

    def __init__(self, model, tap_layers: tuple[int, ...]) -> None:
        reason = decoder_unsupported(model)
        if reason is not None:
            raise ValueError(f"LlamaDecoder cannot run this model: {reason}")
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.embed = model.model.embed_tokens
        self.layers = [_Layer(layer) for layer in model.model.layers]
        self.norm, self.norm_eps = model.model.norm.weight, model.model.norm.variance_epsilon
        self.lm_head = model.lm_head
        self.tap_layers = tuple(tap_layers)
        rotary = model.model.rotary_emb
        self._rope = kernels.RopeTables(rotary.inv_freq, rotary.attention_scaling)  # (position_ids, bound) -> cos, sin
        self.row_exact = bool(getattr(self.layers[0].attn, "dart_row_exact", False))
        # every layer's products on one of dart-serve's kernels (qmm, qmm-a8): the norms, SiLU and
        # residual adds inside its calls
        kinds = {getattr(lin, "kernel", None) for layer in self.layers
                 for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)}
        self.fused_layers = self.row_exact and len(kinds) == 1 and kinds <= {"qmm", "qmm-a8"}
        self._stack = None
        scales = {float(layer.attn.scaling) for layer in self.layers}
        if self.fused_layers and len(scales) == 1:  # the layers as one C++ object: a forward in one call
            self._stack = _kernels.GGUFLayers(
                [(x.qkv.kernel_args(), x.o.kernel_args(), x.gate_up.kernel_args(), x.down.kernel_args(),
                  x.ln1.detach().numpy(), float(x.eps1), x.ln2.detach().numpy(), float(x.eps2)) for x in self.layers],
                self.heads, self.kv_heads, self.head_dim, scales.pop())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cache, logit_index: torch.Tensor | None = None, greedy: bool = False
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """One forward of new tokens after the cached prefix; appends their KV entries to ``cache``.

        Args:
            input_ids, position_ids: [B, Q] int64.
            attention_mask: [B, 1, Q, T + Q] additive float32 (:func:`~dart_core.model.kv_cache.cache_mask`).
            cache: the target's ``BufferedKVCache`` (``TargetCache.cache``).
            logit_index: int64 [B] or None: one query position per row whose logits are computed
                (logits [B, 1, V]); None computes all.
            greedy: only each position's argmax is wanted: an output layer with a fused argmax
                (:attr:`fused_argmax`) then returns it instead of the logits.

        Returns:
            (logits [B, Q, V] (or [B, 1, V]) float32 or None, taps [B, Q, 3H] float32, argmax [B, Q]
            (or [B, 1]) int64 or None): the logits, or with ``greedy`` and :attr:`fused_argmax` their
            argmax alone (:meth:`Int4Linear.argmax <dart_core.model.quant.Int4Linear.argmax>`, the same index
            as the logits' argmax), as :meth:`TargetModel.model_forward
            <dart_core.model.target.TargetModel.model_forward>`.
        """
        b, q = input_ids.shape
        x = self.embed(input_ids)
        # a position is at most the cache's padded length plus the query's depth
        cos, sin = self._rope(position_ids, cache.get_seq_length() + q)
        # the row-exact attention's kernel directly (as grouped_sdpa would call it), its mask made once
        exact_mask = kernels.additive_mask(attention_mask) if self.row_exact and q <= ROW_EXACT_QUERY else False
        n_qk = (self.heads + self.kv_heads) * self.head_dim
        fused = x.dtype == torch.float32 and isinstance(cache, BufferedKVCache)
        cos_np, sin_np = cos.view(b * q, -1).numpy(), sin.view(b * q, -1).numpy()  # read by the kernels
        if self.fused_layers and fused and exact_mask is not False:
            x, taps = self._fused_layers(x, cache, cos_np, sin_np, exact_mask)
            if logit_index is not None:
                x = x[torch.arange(b, device=x.device), logit_index][:, None]
            return self._outputs(x, taps, greedy)
        inputs = {}  # layer index -> that layer's input (the taps)
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:
                inputs[i] = x
            h = _rms_norm(x, layer.ln1, layer.eps1)
            qkv = layer.qkv.forward(h) if layer.qkv is not None else \
                torch.cat([layer.q.forward(h), layer.k.forward(h), layer.v.forward(h)], dim=-1)
            kv = cache.layer(i) if fused else None
            if kv is not None and kv.static_write_index is not None:
                kv = None  # a static cache (CUDA graphs) writes through update()
            if kv is not None:  # the kernels write the new keys and values at t .. t + q - 1
                kb, vb, t = kv.reserve(b, self.kv_heads, q, self.head_dim, self.head_dim, torch.float32, x.device)
            if kv is not None and exact_mask is not False:
                # the 4-bit target: rotation, cache append and row-exact attention in one kernel call
                out = kernels.rope_attend(qkv, cos_np, sin_np, self.heads, self.kv_heads, kb, vb, t, exact_mask,
                                          layer.attn.scaling)
                kv.commit(t + q)
            else:
                if kv is not None:  # rotation and cache append: one kernel call
                    query = kernels.rope_append(qkv, cos_np, sin_np, self.heads, self.kv_heads, kb, vb, t)
                    key, value = kv.commit(t + q)
                else:  # q and k side by side: one rotation for both
                    qk = _rotate(qkv[..., :n_qk].view(b, q, self.heads + self.kv_heads, self.head_dim),
                                 cos[:, :, None], sin[:, :, None])
                    query, key = qk[:, :, :self.heads].transpose(1, 2), qk[:, :, self.heads:].transpose(1, 2)
                    value = qkv[..., n_qk:].view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
                    key, value = cache.update(key, value, i)
                if exact_mask is not False:
                    out = kernels.attend(query, key, value, exact_mask, layer.attn.scaling)
                else:
                    out, _ = grouped_sdpa(layer.attn, query, key, value, attention_mask, scaling=layer.attn.scaling)
            x = x + layer.o.forward(out.reshape(b, q, -1))
            h = _rms_norm(x, layer.ln2, layer.eps2)
            if layer.gate_up is not None:
                gate, up = layer.gate_up.forward(h).split(layer.intermediate, dim=-1)
            else:
                gate, up = layer.gate.forward(h), layer.up.forward(h)
            x = x + layer.down.forward(torch.nn.functional.silu(gate) * up)
        taps = torch.cat([inputs[i] for i in self.tap_layers], dim=-1)
        if logit_index is not None:
            x = x[torch.arange(b, device=x.device), logit_index][:, None]
        return self._outputs(x, taps, greedy)

    @property
    def fused_argmax(self) -> bool:
        """Whether the output layer computes an argmax without writing the logits (a float32 4-bit
        output layer on one of dart-serve's kernels: :meth:`Int4Linear.argmax
        <dart_core.model.quant.Int4Linear.argmax>`)."""
        return bool(getattr(self.lm_head, "fused_argmax", False)) and self.norm.dtype == torch.float32

    def _outputs(self, x: torch.Tensor, taps: torch.Tensor, greedy: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The final norm and the output layer over x [B, Q, H]: (logits, taps, None), or with
        ``greedy`` and :attr:`fused_argmax` (None, taps, argmax [B, Q])."""
        h = _rms_norm(x, self.norm, self.norm_eps)
        if greedy and self.fused_argmax:
            return None, taps, self.lm_head.argmax(h)
        return self.lm_head(h).float(), taps, None

    def _fused_layers(self, x: torch.Tensor, cache, cos_np, sin_np,
                      exact_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers on a qmm kernel, five kernel calls a layer: RMS norm + q/k/v,
        rotation + cache append + row-exact attention, o_proj added to the residual, RMS norm +
        gate/up, SiLU-and-multiply + down_proj added to the residual (:meth:`Int4Linear.fused_into
        <dart_core.model.quant.Int4Linear.fused_into>`), all in one C++ call (``_kernels.GGUFLayers``).
        Each row is computed on its own, as in the other path; inside
        :func:`~dart_core.model.rows.real_rows` the same kernel calls run from Python on the real rows
        only (the same bits).

        Returns:
            (x [B, Q, H] after the last layer, taps [B, Q, len(tap_layers)·H]: the tap layers' inputs
            side by side in ``tap_layers`` order)."""
        b, q, hidden = x.shape
        real = REAL_ROWS.get()
        sel = real[0] if real is not None and real[1] == b * q else None
        x = x.reshape(b * q, hidden).contiguous()
        if sel is None and self._stack is not None:  # every row: the layers in one kernel call
            caches = [cache.layer(i) for i in range(len(self.layers))]
            buffers = [kv.reserve(b, self.kv_heads, q, self.head_dim, self.head_dim, torch.float32, x.device)
                       for kv in caches]
            t = buffers[0][2]
            taps = torch.empty(b * q, len(self.tap_layers) * hidden)
            # numpy views of the float32 buffers, made once per buffer (.numpy() refuses any other dtype)
            arrays = [kv.buffer_arrays() if kb.dtype == torch.float32 else (kb.numpy(), vb.numpy())
                      for kv, (kb, vb, _) in zip(caches, buffers)]
            self._stack.forward(x.numpy(), cos_np, sin_np, [k for k, _ in arrays], [v for _, v in arrays], t, b, q,
                                exact_mask, list(self.tap_layers), taps.numpy(), kernels.PARALLEL_WORK)
            for kv in caches:
                kv.commit(t + q, lazy=True)
            return x.view(b, q, hidden), taps.view(b, q, -1)
        work = x if sel is None else x.index_select(0, sel)  # the rows the products compute
        m = work.shape[0]
        taps = {}
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:
                taps[i] = (work if sel is None else x.index_copy(0, sel, work)).clone().view(b, q, hidden)
            qkv = layer.qkv.fused_into(work, torch.empty(m, layer.qkv.out_features), layer.ln1, layer.eps1)
            if sel is not None:
                qkv = qkv.new_zeros(b * q, layer.qkv.out_features).index_copy_(0, sel, qkv)
            kv = cache.layer(i)
            kb, vb, t = kv.reserve(b, self.kv_heads, q, self.head_dim, self.head_dim, torch.float32, x.device)
            out = kernels.rope_attend(qkv.view(b, q, -1), cos_np, sin_np, self.heads, self.kv_heads, kb, vb, t,
                                      exact_mask, layer.attn.scaling).reshape(b * q, -1)
            kv.commit(t + q)
            if sel is not None:
                out = out.index_select(0, sel)
            layer.o.fused_into(out, work, accumulate=True)
            gate_up = layer.gate_up.fused_into(work, torch.empty(m, layer.gate_up.out_features), layer.ln2,
                                               layer.eps2)
            layer.down.fused_into(gate_up, work, gated=True, accumulate=True)
        x = work if sel is None else x.index_copy(0, sel, work)
        return x.view(b, q, hidden), torch.cat([taps[i] for i in self.tap_layers], dim=-1)
