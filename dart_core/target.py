"""Target-model adapter over stock Hugging Face causal LMs (no copied modeling files).

Every forward the engine needs is one call of the stock model with
explicit ``position_ids``, a 4D additive attention mask and a
``DynamicCache``: prefill of right-padded prompts, verification of a draft
tree with tree attention over the cached prefix (DESIGN.md §2,
"Verification"), and a plain one-token step, which is a tree of one node.
The adapter returns the logits and the three hidden-state taps the DART
head reads: the inputs of decoder layers 2, L//2 and L-3, i.e. indices
2, L//2, L-3 of ``output_hidden_states`` (index 0 is the embedding output).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dart_core.kv_cache import BufferedKVCache, cache_mask, compact_
from dart_core.tokenizer import converted_cache, load_tokenizer, resolve_model, save_converted

logger = logging.getLogger(__name__)

__all__ = ["TargetModel", "TargetOutput", "TargetCache"]


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [B, Q, V] float32
    taps: torch.Tensor  # [B, Q, 3H] low|mid|high hidden states


class TargetCache:
    """The target's KV cache (a ``DynamicCache`` that appends in place) plus per-sequence valid lengths.

    Layout in :mod:`dart_core.kv_cache`.
    """

    def __init__(self, batch: int, device) -> None:
        self.cache = BufferedKVCache()
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]

    @property
    def padded_length(self) -> int:
        return self.cache.get_seq_length()

    def compact(self, src: torch.Tensor, counts: torch.Tensor) -> None:
        """Keeps entries src[b, :counts[b]] (positions in the padded cache) after each prefix."""
        for layer in self.cache.layers:
            layer.keys, layer.values = compact_(layer.keys, layer.values, self.lengths, src, counts)
        self.lengths = self.lengths + counts

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the given batch rows, cropped to their longest prefix."""
        self.lengths = self.lengths[rows]
        t = int(self.lengths.max()) if len(rows) else 0
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[rows, :, :t], layer.values[rows, :, :t]


def _grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, minus a copy on CPUs.

    With a mask and more than one query token (tree verification, prefill)
    transformers repeats every key/value head ``num_key_value_groups`` times
    before calling SDPA: a copy of the whole KV cache in every layer, every
    step (at batch 8 on a CPU it cost more than the attention itself).  On a
    CPU, PyTorch's SDPA takes grouped heads directly (``enable_gqa``) with
    bit-identical results; elsewhere (CUDA's masked kernels do not take
    grouped heads) and for single-token queries (already copy-free) this
    defers to transformers.

    Shapes: query [B, H, Q, D], key/value [B, H_kv, T, D], attention_mask
    [B, 1, Q, T] additive; returns ([B, Q, H, D], None).
    """
    if query.device.type != "cpu" or attention_mask is None or query.shape[2] == 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


GROUPED_SDPA = "dart_grouped_sdpa"
AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # masks built by transformers (generate) stay sdpa's


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
    """

    def __init__(self, model, tokenizer=None) -> None:
        self.model = model.eval()
        if getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            self.model.set_attn_implementation(GROUPED_SDPA)
        self.tokenizer = tokenizer
        self.config = model.config
        layers = self.config.num_hidden_layers
        if layers < 5:
            raise ValueError(f"DART taps layers 2, L//2 and L-3; the target has only {layers} layers")
        self.tap_layers = (2, layers // 2, layers - 3)
        self.embed_tokens = model.get_input_embeddings()

    @classmethod
    def from_pretrained(cls, spec: str | None = None, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", device_map=None) -> "TargetModel":
        """Loads a local model (see :func:`dart_core.tokenizer.resolve_model`); never a hub.

        Args:
            spec: None for the embedded SmolLM2-135M-Instruct, a model folder or a .gguf file.
            dtype: e.g. torch.float32 / torch.bfloat16 on CPU, torch.bfloat16 / torch.float16 on CUDA.
            device: where the model goes when ``device_map`` is None.
            device_map: passed to transformers/accelerate (e.g. "auto") for models larger than one device.
        """
        source = resolve_model(spec)
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
        return cls(model, load_tokenizer(spec))

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
                cache: TargetCache) -> TargetOutput:
        """One forward of new tokens after the cached prefix; appends their KV entries.

        Args:
            input_ids: [B, Q]; position_ids: [B, Q]; attention_mask: [B, 1, Q, T + Q] additive.
        """
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         past_key_values=cache.cache, use_cache=True, output_hidden_states=True)
        hs = out.hidden_states
        taps = torch.cat([hs[i] for i in self.tap_layers], dim=-1)
        return TargetOutput(logits=out.logits.float(), taps=taps)

    def prefill(self, prompts: list[list[int]], cache: TargetCache) -> TargetOutput:
        """Right-padded prompts [B, P]: causal within each prompt, padding masked.

        The cache then holds P entries per sequence, of which lengths[b] = len(prompts[b]) are valid.
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
        mask = cache_mask(cache.lengths, cache.padded_length, causal, self.dtype)
        out = self.forward(ids, idx[None, :].expand(b, p), mask, cache)
        cache.lengths = lengths
        return out
