"""Target-model adapter over stock Hugging Face causal LMs (no copied modeling files).

Every forward the engine needs is one call of the stock model with
explicit ``position_ids``, a 4D additive attention mask and a
``DynamicCache``: prefill of right-padded prompts, verification of a draft
tree with tree attention over the cached prefix (docs/design.md §2,
"Verification"), and a plain one-token step, which is a tree of one node.
The adapter returns the logits and the three hidden-state taps the DART
head reads: the inputs of decoder layers 2, L//2 and L-3, i.e. indices
2, L//2, L-3 of ``output_hidden_states`` (index 0 is the embedding output).
On a CPU, a Llama-architecture target with packed or 4-bit linear layers runs
the same operators through :class:`~dart_core.model.decoder.LlamaDecoder` instead of
transformers' modules (equal values, far less overhead per forward).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dart_core import _kernels
from dart_core.model.attention import GROUPED_SDPA, attention_backend
from dart_core.model.cuda_graphs import StaticVerifier
from dart_core.model.decoder import LlamaDecoder, decoder_unsupported
from dart_core.model.kernel_config import KernelConfig
from dart_core.model.kv_cache import (BufferedKVCache, KVPool, cache_mask, compact_buffered, compact_layers,
                                compaction_plan, compaction_plan_host)
from dart_core.model.quant import KERNELS, quantize_from_gguf
from dart_core.model.rows import can_pack, pack_linears, padded_rows, real_rows
from dart_core.model.tokenizer import converted_cache, load_tokenizer, resolve_model, save_converted

logger = logging.getLogger(__name__)

__all__ = ["TargetModel", "TargetOutput", "TargetCache"]


@dataclass(frozen=True)
class TargetOutput:
    """A target forward's outputs: the logits (or, for a ``greedy`` forward whose output layer fuses
    the argmax, the argmax alone) and the taps the draft head reads."""

    logits: torch.Tensor | None  # [B, Q, V] float32; None when only ``argmax`` was computed
    taps: torch.Tensor  # [B, Q, 3H] low|mid|high hidden states
    argmax: torch.Tensor | None = None  # [B, Q] int64: each position's greedy token, when fused

    def greedy_tokens(self) -> torch.Tensor:
        """[B, Q] int64: each position's argmax over the vocabulary (the fused one, else the logits')."""
        return self.argmax if self.argmax is not None else self.logits.argmax(-1)


class TargetCache:
    """The target's KV cache (a ``DynamicCache`` that appends in place) plus per-sequence valid lengths.

    Layout in :mod:`dart_core.model.kv_cache`.
    """

    def __init__(self, batch: int, device) -> None:
        self.cache = BufferedKVCache()
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        # the static verifier's pool that the layers are views of after its forwards (compacted in one pass)
        self.pool: KVPool | None = None

    @classmethod
    def with_prefixes(cls, prefixes: list, device) -> "TargetCache":
        """A cache whose row b holds ``prefixes[b]``'s entries (a
        :class:`~dart_core.model.prefix_cache.PrefixHit`: per layer keys and values [H_kv, n_b, D]),
        or nothing for None: lengths [B] = n_b, the rows zero-padded to the longest.  What
        :meth:`TargetModel.prefill` continues from."""
        cache = cls(len(prefixes), device)
        hits = [h for h in prefixes if h is not None and h.length]
        if not hits:
            return cache
        t = max(h.length for h in hits)
        for i, (k0, v0) in enumerate(zip(hits[0].keys, hits[0].values)):
            kb, vb, _ = cache.cache.layer(i).reserve(len(prefixes), k0.shape[0], t, k0.shape[-1], v0.shape[-1],
                                                     k0.dtype, device)
            kb[:, :, :t].zero_()
            vb[:, :, :t].zero_()
            for b, h in enumerate(prefixes):
                if h is not None and h.length:
                    kb[b, :, :h.length] = h.keys[i]
                    vb[b, :, :h.length] = h.values[i]
            cache.cache.layer(i).commit(t)
        cache.lengths = torch.tensor([h.length if h is not None else 0 for h in prefixes], dtype=torch.long,
                                     device=device)
        return cache

    @property
    def padded_length(self) -> int:
        return self.cache.get_seq_length()

    def compact(self, src: torch.Tensor, counts: torch.Tensor) -> None:
        """Keeps entries src[b, :counts[b]] (positions in the padded cache) after each prefix.

        The moves are planned once for all layers (:func:`~dart_core.model.kv_cache.compaction_plan`);
        entries already in place are not copied."""
        self.compact_planned(compaction_plan(self.lengths, src, counts), counts)

    def compact_planned(self, plan, counts: torch.Tensor) -> None:
        """:meth:`compact` with its plan already made (:func:`~dart_core.model.kv_cache.compaction_plan`,
        or :func:`~dart_core.model.kv_cache.compaction_plan_host`, which reads no device tensor);
        counts [B] entries kept per sequence. Layers that are still the views a static verifier's
        forward left (:class:`~dart_core.model.kv_cache.KVPool`) are compacted in one pass for all layers."""
        layers = self.cache.layers
        if self.pool is not None and self.pool.holds(layers):
            self.pool.compact(layers, plan)
        else:
            compact_layers(layers, plan)
        self.lengths = self.lengths + counts

    def compact_paths(self, lengths: list[int], offset: int, paths: np.ndarray, counts: torch.Tensor,
                      counts_host: np.ndarray) -> None:
        """:meth:`compact_planned` with :func:`~dart_core.model.kv_cache.compaction_plan_host`'s plan
        (``lengths``: the valid lengths before the step, ``offset``: the cache's padded length before
        it, ``paths`` [B, A]: each row's kept entries as increasing offsets from ``offset``, padded
        past its ``counts_host[b]``; counts [B] the same numbers on the device), planned and applied
        in one C++ call where the layers are CPU buffers (:func:`~dart_core.model.kv_cache.compact_buffered`),
        else through the plan."""
        layers = self.cache.layers
        if ((self.pool is None or not self.pool.holds(layers))
                and compact_buffered(layers, lengths, offset, paths, counts_host)):
            self.lengths = self.lengths + counts
            return
        self.compact_planned(compaction_plan_host(lengths, offset, paths, self.lengths.device, counts_host), counts)

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the given batch rows, cropped to their longest prefix."""
        self.lengths = self.lengths[rows]
        t = int(self.lengths.max()) if len(rows) else 0
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[rows, :, :t], layer.values[rows, :, :t]


def _save_dequantised(model, folder) -> None:
    """config.json + model.safetensors of a GGUF-loaded model (whose save_pretrained refuses):
    the de-quantised fp32 weights, loaded in seconds next time (shared tensors written once)."""
    import json

    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(folder / "model.safetensors"))


class TargetModel:
    """A Hugging Face causal LM seen as a DART target.

    Args:
        model: any ``AutoModelForCausalLM`` whose forward accepts a 4D
            ``attention_mask``, ``position_ids`` and a ``DynamicCache``
            (Llama, Qwen2/3, Mistral, ... with sdpa or eager attention).
        tokenizer: optional; needed for text and chat inputs.
        pack: replace the model's linear layers (in place) by
            :class:`PackedLinear`; None (default) packs a float32 model on a
            CPU with oneDNN (:func:`can_pack`), where it makes a forward cheaper,
            most for 2 to 16 query tokens (docs/engine.md, "Packed CPU target").  The model then serves
            inference only (no gradients through the packed layers).
        decoder: run forwards with :class:`~dart_core.model.decoder.LlamaDecoder` (the same values as
            the stock forward, bit for bit, with far less per-operator overhead on a CPU); None
            (default) where :func:`~dart_core.model.decoder.decoder_unsupported` accepts the model
            (a Llama-architecture target on a CPU with packed or 4-bit linear layers), False never.
            The 4-bit q/k/v and gate/up layers are then fused in place (:meth:`Int4Linear.fuse
            <dart_core.model.quant.Int4Linear.fuse>`).

    Raises:
        ValueError: ``pack=True`` for a model that :func:`can_pack` refuses, ``decoder=True`` for
            one the decoder does not cover, or a target with fewer than 5 layers (DART's taps need them).
    """

    def __init__(self, model, tokenizer=None, *, pack: bool | None = None, decoder: bool | None = None,
                 kernels: KernelConfig | None = None) -> None:
        self.model = model.eval()
        # the SDPA backends and grouped-query switch of every attention call (dart_core.model.kernel_config)
        self.kernels = kernels or KernelConfig()
        _kernels.set_qmm_a8_amx(self.kernels.amx)  # process-wide: qmm-a8's multi-row products on AMX tiles
        if pack is None:
            pack = can_pack(model)
        elif pack and not can_pack(model):
            raise ValueError("pack=True needs float32 weights on a CPU and a PyTorch built with oneDNN")
        if pack:
            logger.info("packed %d linear layers for oneDNN", pack_linears(self.model))
        # forward(rows=...) skips padding rows in the linear layers that honour real_rows (PackedLinear, Int4Linear)
        self.packed = any(getattr(m, "honours_real_rows", False) for m in self.model.modules())
        if getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            self.model.set_attn_implementation(GROUPED_SDPA)
        # 4-bit layers round activations to bfloat16: attention must then be row-exact too
        self.row_exact = any(getattr(m, "row_exact", False) for m in self.model.modules())
        for m in self.model.modules():
            if hasattr(m, "is_causal") and hasattr(m, "head_dim"):  # attention modules: what the plug-in reads
                m.dart_row_exact = self.row_exact
                m.dart_grouped_query = self.kernels.grouped_query
        self.tokenizer = tokenizer
        self.config = model.config
        # the KV cache argument: `cache` from transformers 5.24 on (`past_key_values` deprecated there)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        layers = self.config.num_hidden_layers
        if layers < 5:
            raise ValueError(f"DART taps layers 2, L//2 and L-3; the target has only {layers} layers")
        self.tap_layers = (2, layers // 2, layers - 3)
        self.embed_tokens = model.get_input_embeddings()
        self.static: "StaticVerifier | None" = None  # enable_static_cache
        self.decoder: "LlamaDecoder | None" = None
        if decoder is not False:
            reason = decoder_unsupported(self.model)
            if reason is None:
                self.decoder = LlamaDecoder(self.model, self.tap_layers)
            elif decoder:
                raise ValueError(f"decoder=True: {reason}")

    def enable_static_cache(self, **kwargs) -> "StaticVerifier":
        """Runs verification forwards over a static KV cache from now on, replayed as CUDA graphs
        on a GPU: :class:`~dart_core.model.cuda_graphs.StaticVerifier` (padded tree and batch sizes,
        one graph per batch bucket and size bucket, captured when first needed), built with
        ``kwargs``.

        Raises:
            ValueError: as :class:`~dart_core.model.cuda_graphs.StaticVerifier`."""
        self.static = StaticVerifier(self, **kwargs)
        return self.static

    @classmethod
    def from_pretrained(cls, spec: str | None = None, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", device_map=None,
                        pack: bool | None = None, weights: str = "dense",
                        gguf_kernel: str | None = None, kernels: KernelConfig | None = None) -> "TargetModel":
        """Loads a local model (see :func:`dart_core.model.tokenizer.resolve_model`); never a hub.

        Args:
            spec: None for the embedded SmolLM2-135M-Instruct, a model folder or a .gguf file.
            dtype: e.g. torch.float32 / torch.bfloat16 on CPU, torch.bfloat16 / torch.float16 on CUDA.
            device: where the model goes when ``device_map`` is None.
            device_map: passed to transformers/accelerate (e.g. "auto") for models larger than one device.
            pack: see the class; None with a ``device_map`` keeps ``nn.Linear`` (accelerate places
                the layers and its hooks wrap them).
            weights: "dense" (the weights de-quantised to ``dtype``) or "gguf-native": a GGUF's
                Q4_0 / Q4_1 / Q8_0 linear layers run from their own 4-bit blocks on the CPU
                (:func:`dart_core.model.quant.quantize_from_gguf`; ``dtype`` float32 for the rest of the
                model).
            gguf_kernel: with "gguf-native", the 4-bit layers' kernel (one of
                :data:`dart_core.model.quant.KERNELS`); None: :func:`dart_core.model.quant.default_kernel`.
            kernels: the attention switches (:class:`~dart_core.model.kernel_config.KernelConfig`;
                None: its defaults).

        Raises:
            ValueError: ``pack=True`` together with a ``device_map``; "gguf-native" for a source that
                is not a GGUF, off the CPU, with a ``device_map`` or another dtype than float32; an
                unknown ``gguf_kernel``, or one given without "gguf-native".
            dart_core.model.quant.GGUFWeightsError: a GGUF whose blocks do not match its de-quantised weights.
        """
        if pack and device_map is not None:
            raise ValueError("pack=True cannot be combined with a device_map: accelerate places and wraps the "
                             "linear layers; load without device_map to pack")
        if weights not in ("dense", "gguf-native"):
            raise ValueError(f"weights must be 'dense' or 'gguf-native', not {weights!r}")
        if gguf_kernel is not None:
            if gguf_kernel not in KERNELS:
                raise ValueError(f"gguf_kernel must be one of {', '.join(KERNELS)} (or None), not {gguf_kernel!r}")
            if weights != "gguf-native":
                raise ValueError(f"gguf_kernel={gguf_kernel!r} applies to weights='gguf-native' only")
        source = resolve_model(spec)
        if weights == "gguf-native":
            if not source.gguf_file:
                raise ValueError(f"weights='gguf-native' needs a .gguf model; {source.folder} has none")
            if torch.device(device).type != "cpu" or device_map is not None or dtype != torch.float32:
                raise ValueError("weights='gguf-native' runs on the CPU only, without a device_map, dtype float32")
        logger.info("loading target %s from %s (%s)", source.name, source.folder, dtype)
        cached = converted_cache(source, "model")
        if cached is not None and (cached / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, device_map=device_map,
                                                         attn_implementation="sdpa")
        else:
            model = AutoModelForCausalLM.from_pretrained(
                source.folder, dtype=dtype, device_map=device_map, attn_implementation="sdpa",
                **source.from_pretrained_kwargs())
            if cached is not None and dtype == torch.float32 and device_map is None:
                save_converted(lambda folder: _save_dequantised(model, folder), cached)
        if device_map is None:
            model = model.to(device)
        if weights == "gguf-native":
            quantize_from_gguf(model, source.folder / source.gguf_file, cache=converted_cache(source, "int4"),
                               kernel=gguf_kernel)
        return cls(model, load_tokenizer(spec), pack=pack if device_map is None else False, kernels=kernels)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 20))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, H] input embeddings (shared with the draft head)."""
        return self.embed_tokens(ids)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cache: TargetCache, rows: torch.Tensor | None = None,
                logit_index: torch.Tensor | None = None, greedy: bool = False) -> TargetOutput:
        """One forward of new tokens after the cached prefix; appends their KV entries.

        Args:
            input_ids: [B, Q]; position_ids: [B, Q]; attention_mask: [B, 1, Q, T + Q] additive.
            rows: int64 [R], the flat indices (b · Q + q) of the positions that matter, or None
                for all. With a packed target (:attr:`packed`) the linear layers compute only
                those (:func:`real_rows`): the other positions' logits and taps are then
                meaningless (zero or finite garbage), their KV entries too.  Ignored otherwise.
            logit_index: as :meth:`model_forward` (logits [B, 1, V]); such a forward never takes
                the static cache's path.
            greedy: only each position's argmax is wanted (every row at temperature 0, no
                logprobs): where the output layer fuses the argmax (:attr:`fused_argmax`) the output
                holds ``argmax`` [B, Q] and no logits; elsewhere the logits as usual.

        With :meth:`enable_static_cache`, a forward that fits the static cache returns views
        valid until the next forward.
        """
        if self.static is not None and logit_index is None:
            static = self.static.forward(input_ids, position_ids, attention_mask, cache)
            if static is not None:
                return TargetOutput(logits=static[0], taps=static[1])
        if rows is not None and self.packed:
            with real_rows(rows, input_ids.numel()):
                return self.model_forward(input_ids, position_ids, attention_mask, cache, logit_index, greedy)
        return self.model_forward(input_ids, position_ids, attention_mask, cache, logit_index, greedy)

    @property
    def fused_argmax(self) -> bool:
        """Whether a ``greedy`` forward returns the argmax without the logits (the output layer on
        one of dart-serve's 4-bit kernels, through :attr:`decoder`: :meth:`Int4Linear.argmax
        <dart_core.model.quant.Int4Linear.argmax>`); a static-cache forward (CUDA graphs) never does."""
        return self.decoder is not None and self.decoder.fused_argmax

    @torch.inference_mode()
    def model_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                      cache: TargetCache, logit_index: torch.Tensor | None = None,
                      greedy: bool = False) -> TargetOutput:
        """The model's forward behind :meth:`forward` (no static cache): logits and the taps, from
        :attr:`decoder` where there is one, else from the stock model's forward (equal bit for bit).

        ``logit_index``: int64 [B], one query position per row: the logits are then [B, 1, V], that
        position's only (the output layer runs on B rows instead of B · Q; the taps stay [B, Q, 3H]).
        ``greedy``: as :meth:`forward`."""
        # an explicit SDPA choice (dart_core.model.attention)
        with attention_backend(input_ids.device, self.kernels.sdpa_backends):
            if self.decoder is not None:
                logits, taps, argmax = self.decoder.forward(input_ids, position_ids, attention_mask, cache.cache,
                                                            logit_index=logit_index, greedy=greedy)
                return TargetOutput(logits=logits, taps=taps, argmax=argmax)
            keep = {}
            if logit_index is not None:  # the distinct positions, then each row's own among them
                positions, own = torch.unique(logit_index, return_inverse=True)
                keep = {"logits_to_keep": positions}
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=True, output_hidden_states=True, **{self._cache_kwarg: cache.cache}, **keep)
        hs = out.hidden_states
        taps = torch.cat([hs[i] for i in self.tap_layers], dim=-1)
        logits = out.logits
        if logit_index is not None:
            logits = logits[torch.arange(logits.shape[0], device=logits.device), own][:, None]
        return TargetOutput(logits=logits.float(), taps=taps)

    def prefill(self, prompts: list[list[int]], cache: TargetCache, *, last_logits: bool = False) -> TargetOutput:
        """Right-padded prompts [B, P]: causal within each prompt, padding masked, each after its
        row's cached entries (none for a new cache; a prefix cache's for
        :meth:`TargetCache.with_prefixes`: ``prompts[b]`` is then what follows row b's prefix).

        The cache then holds lengths[b] + len(prompts[b]) valid entries per sequence (its rows
        compacted when their prefixes differ in length), P past the longest prefix in all.
        ``last_logits``: the logits are [B, 1, V], each prompt's last position only (what decoding
        needs: the output layer over B rows instead of B · P, for SmolLM2 a 49,152-wide product per
        prompt token); taps stay [B, P, 3H], the prompts' positions. Otherwise [B, P, V].
        With a packed target (:attr:`packed`) the linear layers compute the prompts' own tokens
        only (:func:`real_rows`; their results equal the padded forward's bit for bit), so a group
        of prompts of different lengths does not pay for its padding; the padding positions'
        logits and taps are then meaningless.
        """
        b = len(prompts)
        p = max(len(x) for x in prompts)
        ids = torch.zeros(b, p, dtype=torch.long, device=self.device)
        lengths = torch.tensor([len(x) for x in prompts], dtype=torch.long, device=self.device)
        for i, x in enumerate(prompts):
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        idx = torch.arange(p, device=self.device)
        causal = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] < lengths[:, None, None])
        causal = causal | torch.eye(p, dtype=torch.bool, device=self.device)[None]  # padded rows see themselves
        t, start = cache.padded_length, cache.lengths
        mask = cache_mask(start, t, causal, self.dtype)
        rows = padded_rows([len(x) for x in prompts], p, self.device) if self.packed else None
        out = self.forward(ids, start[:, None] + idx[None, :], mask, cache, rows=rows,
                           logit_index=lengths - 1 if last_logits else None)
        if t and bool((start < t).any()):  # a shorter prefix: its prompt's entries move up to it
            cache.compact((t + idx)[None, :].expand(b, p), lengths)
        else:
            cache.lengths = start + lengths
        return out
