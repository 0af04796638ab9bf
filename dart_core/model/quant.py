"""GGUF-native low-bit weights for the target model on a CPU.

A GGUF such as the embedded SmolLM2-135M-Instruct (Q4_1 layers, a Q8_0
token embedding tied to the output layer) is loaded by transformers as
de-quantised float32 weights, so every forward streams 4 bytes per weight.
Here each linear layer is rebuilt from the GGUF's own blocks
(:class:`Int4Linear`), about 0.6 to 0.75 bytes per weight, and run by one of
three kernels (:func:`default_kernel` chooses, ``gguf_kernel`` overrides; figures
in ``bench/results/gguf_native/``):

- **qmm-a8** (``dart_core/csrc/qmm_a8.cpp``, the default where the CPU has
  AVX-512 VNNI or AVX2): the GGUF's codes and scales (:func:`qmm_a8_weight`) times activations
  quantised to 8 bits per block of 32 inputs, integer dot products within a
  block: the arithmetic of llama.cpp's CPU back end for these block types.
  The weights are the GGUF's values; the activations are rounded to 8 bits.
- **qmm** (``dart_core/csrc/qmm.cpp``, ``gguf_kernel: qmm``; the draft head's Q8_0
  layers where the CPU has AVX-512): the
  GGUF's codes, scales and minimums as they are (:func:`qmm_weight`), float32
  activations; each block's scale and minimum are factored out of its 32
  products, so the weights are the GGUF's de-quantised values.
- **aten**: PyTorch's CPU int4 weight-only layout
  (``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` and
  ``_weight_int4pack_mm_for_cpu``, group size 32), whose weight for 4-bit
  code ``q`` of group ``g`` is ``(q - 8) · scale[g] + zero[g]``:

  - Q4_0 (``w = d · (q - 8)``): scale ``d``, zero 0.
  - Q4_1 (``w = d · q + m``): scale ``d``, zero ``m + 8d``.
  - Q8_0 (``w = d · q``, q an int8): two 4-bit parts, the high and the low
    nibble of ``q + 128``: scale ``16d``, zero ``8d`` (high) plus scale
    ``d``, zero 0 (low). The output layer of a tied GGUF is Q8_0.

  The kernel takes its scales and zeros in the activation dtype: with
  float32 activations the weights equal the GGUF's de-quantised values (to
  float32 rounding of ``m + 8d``); with bfloat16 activations (its default,
  the one it is fast with) scales and zeros are rounded to bfloat16, and
  every linear layer's input and output too.

The codes are the GGUF's, never re-quantised (:func:`int4_parts` gives both
kernels' inputs).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from dart_core import _kernels
from dart_core.model.rows import REAL_ROWS, over_real_rows
from ngram_service.cache import save_converted

logger = logging.getLogger(__name__)

__all__ = ["GGUFWeightsError", "Int4Linear", "int4_parts", "quantize_linears", "qmm_weight", "qmm_a8_weight",
           "quantize_from_gguf",
           "can_int4", "default_compute_dtype", "default_kernel", "qmm_runs_vectorised", "KERNELS", "GROUP_SIZE", "QMM_KERNELS"]

GROUP_SIZE = 32  # the GGUF block length of Q4_0, Q4_1 and Q8_0, and the kernel's group size


class GGUFWeightsError(ValueError):
    """A GGUF tensor that cannot become GGUF-native weights: an unsupported block type, a corrupt or
    truncated block array, or blocks whose de-quantised values are not the loaded model's weights."""


def can_int4() -> bool:
    """True where PyTorch has the CPU int4 weight-only pair of operators used by :class:`Int4Linear`."""
    return hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu") and \
        hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def default_compute_dtype() -> torch.dtype:
    """The activation dtype of :func:`default_kernel` (the dtype layer inputs and outputs have): float32
    for ``"qmm-a8"`` and ``"qmm"``; bfloat16 for
    ``"aten"`` (on the AVX2-only CPU measured, torch 2.13 and SmolLM2's layer shapes, PyTorch's CPU
    int4 kernel was many times slower with float32 or float16 activations)."""
    return torch.float32 if default_kernel() in QMM_KERNELS else torch.bfloat16


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def int4_parts(raw: np.ndarray, type_name: str, shape: tuple[int, int]
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """GGUF blocks of one [N, K] weight -> the kernel's 4-bit parts (their weights sum to the tensor).

    Args:
        raw: uint8, the tensor's bytes (any shape with N · K/32 · block-bytes elements).
        type_name: "Q4_0", "Q4_1" or "Q8_0" (ggml block layouts: fp16 scale ``d``, Q4_1's fp16
            minimum ``m``, then 16 bytes of two 4-bit codes each, low nibbles the first 16 weights,
            or 32 int8 codes).
        shape: (N, K) = (out_features, in_features), K a multiple of 32.

    Returns:
        A list of (codes int32 [N, K] in 0..15, scale float32 [N, K/32], zero float32 [N, K/32]).

    Raises:
        GGUFWeightsError: another type, K not a multiple of 32, or a byte count that does not match.
    """
    n, k = shape
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
    if type_name not in sizes:
        raise GGUFWeightsError(f"block type {type_name} has no 4-bit layout here (supported: {', '.join(sizes)})")
    if k % GROUP_SIZE:
        raise GGUFWeightsError(f"in_features {k} is not a multiple of the block length {GROUP_SIZE}")
    size = sizes[type_name]
    if raw.dtype != np.uint8 or raw.size != n * (k // GROUP_SIZE) * size:
        raise GGUFWeightsError(f"a {type_name} [{n}, {k}] tensor needs {n * (k // GROUP_SIZE) * size} bytes, "
                               f"the file holds {raw.size} ({raw.dtype})")
    blocks = raw.reshape(n, k // GROUP_SIZE, size)
    d = _f16(blocks, 0)  # [N, K/32]
    if type_name == "Q8_0":
        u = blocks[..., 2:].view(np.int8).astype(np.int32) + 128  # [N, K/32, 32] in 0..255
        high, low = (u >> 4).reshape(n, k), (u & 15).reshape(n, k)
        return [(high, 16 * d, 8 * d), (low, d, np.zeros_like(d))]
    qs = blocks[..., size - 16:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32).reshape(n, k)
    if type_name == "Q4_0":
        return [(codes, d, np.zeros_like(d))]
    return [(codes, d, _f16(blocks, 2) + 8 * d)]


def quantize_linears(module: torch.nn.Module, kernel: str | None = None) -> int:
    """Replaces every ``nn.Linear`` of ``module`` (in place; bias-free layers only) by an
    :class:`Int4Linear` over its weight's Q8_0 blocks (the ``gguf`` package's quantiser, ggml's:
    per block of 32 inputs ``d = max |w| / 127``, codes ``round(w / d)``), run by a qmm kernel
    (``kernel``, default :func:`q8_0_kernel`: ``"qmm"``, float32 activations, which measured faster
    than ``"qmm-a8"`` for the draft head inside the engine on AVX-512 CPUs,
    ``bench/results/draft_row/``; ``"qmm-a8"`` where only AVX2 runs vectorised); returns how many.
    For inference: the new layers take float32 inputs and hold no parameters.  The draft head uses
    it on a CPU with AVX-512 or AVX2 (``DartModel.from_pretrained(draft_weights="q8_0")``;
    docs/engine.md, "Draft weights").

    Raises:
        ValueError: a linear layer with a bias, ``kernel`` not a qmm kernel, or no ``kernel`` on a
            CPU without AVX-512 or AVX2 (where the qmm kernels run only their portable loops).
        GGUFWeightsError: an in_features that is not a multiple of 32.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kernel = kernel or q8_0_kernel()
    if kernel is None:
        raise ValueError("Q8_0 linear layers need a qmm kernel, which runs vectorised only with AVX-512 (qmm) "
                         "or AVX2 (qmm-a8)")
    if kernel not in QMM_KERNELS:
        raise ValueError(f"Q8_0 linear layers need a qmm kernel ({' or '.join(QMM_KERNELS)}), not {kernel!r}")
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                if child.bias is not None:
                    raise ValueError(f"{name}: Q8_0 layers here have no bias")
                if child.in_features % GROUP_SIZE:
                    raise GGUFWeightsError(f"{name}: in_features {child.in_features} is not a multiple of the "
                                           f"block length {GROUP_SIZE}")
                w = child.weight.detach().float().numpy()
                raw = quantize(w, GGMLQuantizationType.Q8_0)
                layer = Int4Linear(int4_parts(raw, "Q8_0", tuple(w.shape)), gguf_type="Q8_0", kernel=kernel)
                setattr(parent, name, layer)
                count += 1
    return count


#: the three CPU kernels of :class:`Int4Linear`
KERNELS = ("qmm-a8", "qmm", "aten")
QMM_KERNELS = ("qmm-a8", "qmm")  # dart-serve's own kernels: float32 layer inputs and outputs


def qmm_runs_vectorised() -> bool:
    """True where the ``"qmm"`` kernel runs its AVX-512 code (elsewhere only its portable loop):
    where :func:`quantize_linears` makes Q8_0 layers on it by default."""
    return bool(_kernels.qmm_vectorised())


def q8_0_kernel() -> str | None:
    """The kernel of Q8_0 layers made by :func:`quantize_linears` (the draft head's): ``"qmm"`` where it
    runs its AVX-512 code, else ``"qmm-a8"`` where that runs vectorised (AVX2), else None (only
    portable loops: no Q8_0 layers by default)."""
    if qmm_runs_vectorised():
        return "qmm"
    return "qmm-a8" if _kernels.qmm_a8_vectorised() else None


def default_kernel() -> str:
    """The kernel of GGUF-native layers when ``gguf_kernel`` is ``auto``: ``"qmm-a8"`` (8-bit
    activations) where it runs vectorised (AVX-512 VNNI, or AVX2: ``_kernels.qmm_a8_isa()``), else
    ``"qmm"`` (float32 activations) where the CPU has AVX-512, else ``"aten"`` (PyTorch's int4 kernel
    with bfloat16 activations).  On an AVX2-only CPU qmm-a8's AVX2 loop decodes faster than ``aten``
    (``bench/results/avx2_kernel/``).

    ``qmm-a8`` is the default where it runs because speculation pays with it: on the AVX512-BF16
    EPYC of ``bench/results/kernel_default/`` a plain decoding step costs the same with both qmm
    kernels, but each further query token of a verification costs far less than with ``qmm`` (the
    verification cost curves there), so the adaptive budget can verify larger trees at the same
    price. Its arithmetic is the one llama.cpp's CPU back end uses for these block
    types, so its greedy text departs from the de-quantised float32 model's as llama.cpp's does;
    ``gguf_kernel: qmm`` keeps the float32 model's text (``weights: gguf-native`` and ``dense``
    then give the same text). Greedy DART equals greedy autoregressive decoding with every kernel.
    Without AVX-512 or AVX2 only the qmm kernels' portable loops remain."""
    if _kernels.qmm_a8_vectorised():
        return "qmm-a8"
    return "qmm" if qmm_runs_vectorised() else "aten"


def _gguf_codes(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`int4_parts` -> (codes uint8 [N, K], scale d float32 [N, K/32], minimum float32 [N, K/32]
    or None): one part (Q4_0, Q4_1: ``(q - 8)·s + z``) gives ``w = q·d + m`` with ``d = s``,
    ``m = z - 8s``; two parts (Q8_0's high and low nibbles of ``q + 128``) give the codes ``q + 128``,
    ``w = (code - 128)·d``, and no minimum.

    Raises:
        GGUFWeightsError: parts that are neither form."""
    if len(parts) == 2:
        (high, s_high, z_high), (low, d, z_low) = parts
        if not (np.array_equal(s_high, 16 * d) and np.array_equal(z_high, 8 * d) and not z_low.any()):
            raise GGUFWeightsError("two 4-bit parts that are not a Q8_0 tensor's")
        return (16 * high.astype(np.int32) + low).astype(np.uint8), d, None
    if len(parts) == 1:
        (codes, d, zero), = parts
        return codes.astype(np.uint8), d, (zero - 8 * d).astype(np.float32)
    raise GGUFWeightsError(f"{len(parts)} 4-bit parts: no GGUF block type has that form")


def qmm_weight(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`int4_parts` of one [N, K] tensor -> the qmm kernel's weight (``dart_core/csrc/qmm.cpp``):
    codes uint8 [ceil(N/64), K, 32] (4-bit: byte j < 16 holds output columns j and 32 + j of the
    block, byte 16 + j columns 16 + j and 48 + j, low nibble first) or [ceil(N/64), K, 64] (Q8_0's
    int8 codes), scales and minimums float32 [ceil(N/64), K/32, 64] (None for Q8_0); padding columns
    have scale 0.

    The weight is ``q·d + m`` as :func:`_gguf_codes` reads the parts (Q8_0: its int8 ``q``, no ``m``).

    Raises:
        GGUFWeightsError: parts that are neither form."""
    n, k = parts[0][0].shape
    blocks = -(-n // PACK_BLOCK_ROWS)
    rows = blocks * PACK_BLOCK_ROWS
    q, d, minimum = _gguf_codes(parts)
    if minimum is None:
        q = (q.astype(np.int16) - 128).astype(np.int8)  # Q8_0's own int8 codes
    padded = np.zeros((rows, k), q.dtype)
    padded[:n] = q
    cols = padded.reshape(blocks, PACK_BLOCK_ROWS, k).transpose(0, 2, 1)  # [blocks, K, 64]
    if minimum is None:
        packed = np.ascontiguousarray(cols).view(np.uint8)
    else:
        packed = np.empty((blocks, k, 32), np.uint8)
        packed[..., :16] = cols[..., 0:16] | (cols[..., 32:48] << 4)
        packed[..., 16:] = cols[..., 16:32] | (cols[..., 48:64] << 4)
    return packed, _by_block(d), None if minimum is None else _by_block(minimum)


def qmm_a8_weight(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`int4_parts` of one [N, K] tensor -> the qmm-a8 kernel's weight
    (``dart_core/csrc/qmm_a8.cpp``): codes uint8 [ceil(N/64), K/32, 1024] (4-bit: 0..15) or
    [ceil(N/64), K/32, 2048] (Q8_0: ``q + 128``), each group of 32 inputs of 64 output columns in
    the order [16-column slice][input quad][column][input within the quad] (4-bit codes: quads j
    and j + 4 share a byte, low nibble j), one 64-byte vector per slice and quad (pair);
    scales and minimums as :func:`qmm_weight` (float32 [ceil(N/64), K/32, 64], None for Q8_0;
    padding columns scale 0).

    Raises:
        GGUFWeightsError: parts that are neither a 4-bit tensor's nor a Q8_0 tensor's."""
    n, k = parts[0][0].shape
    blocks, groups = -(-n // PACK_BLOCK_ROWS), k // GROUP_SIZE
    codes, d, minimum = _gguf_codes(parts)
    padded = np.zeros((blocks * PACK_BLOCK_ROWS, k), np.uint8)
    padded[:n] = codes
    # [block, slice, column, group, quad, t] -> [block, group, slice, quad, column, t]
    order = padded.reshape(blocks, 4, 16, groups, 8, 4).transpose(0, 3, 1, 4, 2, 5)
    if minimum is None:
        packed = np.ascontiguousarray(order).reshape(blocks, groups, 2048)
    else:
        packed = np.ascontiguousarray(order[:, :, :, :4] | (order[:, :, :, 4:] << 4)).reshape(blocks, groups, 1024)
    return packed, _by_block(d), None if minimum is None else _by_block(minimum)


def _by_block(a: np.ndarray) -> np.ndarray:
    """Per-block scales or minimums [N, K/32] -> float32 [ceil(N/64), K/32, 64] (padding columns 0)."""
    n, blocks = a.shape[0], -(-a.shape[0] // PACK_BLOCK_ROWS)
    out = np.zeros((blocks * PACK_BLOCK_ROWS, a.shape[1]), np.float32)
    out[:n] = a
    return np.ascontiguousarray(out.reshape(blocks, PACK_BLOCK_ROWS, -1).transpose(0, 2, 1))


def _qmm_a8_values(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, n: int) -> np.ndarray:
    """:func:`qmm_a8_weight`'s arrays -> the de-quantised weight, float32 [N, K] (``q·d + m``)."""
    blocks, groups = codes.shape[:2]
    if minimum is None:
        q = codes.reshape(blocks, groups, 4, 8, 16, 4).astype(np.float32) - 128
    else:
        nibbles = codes.reshape(blocks, groups, 4, 4, 16, 4)
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=3).astype(np.float32)
    q = q.transpose(0, 2, 4, 1, 3, 5).reshape(blocks * PACK_BLOCK_ROWS, groups, GROUP_SIZE)  # [rows, G, 32]

    def per_row(a: np.ndarray) -> np.ndarray:  # [blocks, G, 64] -> [rows, G, 1]
        return a.transpose(0, 2, 1).reshape(blocks * PACK_BLOCK_ROWS, groups, 1)

    w = q * per_row(scale) + (0 if minimum is None else per_row(minimum))
    return np.ascontiguousarray(w.reshape(blocks * PACK_BLOCK_ROWS, -1)[:n], dtype=np.float32)


#: output rows held as one block: by qmm's layout (:func:`qmm_weight`), and by PyTorch's CPU int4 packing
#: (``_convert_weight_to_int4pack_for_cpu``: 64 with AVX512, 32 with AVX2); fused layers' parts must end
#: on a block
PACK_BLOCK_ROWS = 64


class Int4Linear(torch.nn.Module):
    """A bias-free linear layer whose weight is a GGUF tensor's 4-bit (or 8-bit) blocks, applied by
    one of three row-exact CPU kernels (``kernel``):

    - ``"qmm-a8"`` (:func:`default_kernel` where the CPU has AVX-512 VNNI or AVX2): dart-serve's kernel with
      8-bit activations (``dart_core/csrc/qmm_a8.cpp``), llama.cpp's arithmetic for these block
      types. Each input row is quantised per block of 32 inputs (scale ``max |x| / 127``, round to
      nearest even); a block's output is ``d·dx·Σ qw·qx + m·dx·Σ qx`` (integer sums, exact), added
      over the blocks in a fixed order of float32 operations. The weights are the GGUF's values;
      the activations carry 8-bit rounding (each input off by up to half of its block's
      ``max |x| / 127``). Float32 inputs and outputs.
    - ``"qmm"`` (the draft head's Q8_0 layers where the CPU has AVX-512): dart-serve's float32 kernel
      (``dart_core/csrc/qmm.cpp``). Float32 activations and results. The GGUF's codes are read
      as they are (Q8_0 in one 8-bit pass) and each block's scale ``d`` and minimum ``m`` are
      factored out of its 32 products: an output is ``Σ_blocks d · Σ x·q + m · Σ x`` in a fixed
      order of float32 operations (Q4_0: ``m = -8d``; Q8_0: no ``m`` term), so the weights are
      the GGUF's values (to float32 rounding of Q4_1's ``m + 8d - 8d``). Each conversion of
      the codes serves four rows.
    - ``"aten"``: PyTorch's int4 weight-only kernel ``torch.ops.aten._weight_int4pack_mm_for_cpu``
      (group size 32) with ``compute_dtype`` activations (bfloat16 by default: scales, zeros and
      every input and output rounded to bfloat16); a Q8_0 tensor runs as two 4-bit passes.

    Shapes: x [..., in_features] (any float dtype; cast to ``compute_dtype`` for the kernel and
    back) → [..., out_features]. With every kernel a row's result does not depend on the other
    rows of the call, so a verification forward computes each position as a one-token forward
    does. Honours :func:`dart_core.model.rows.real_rows` like :class:`~dart_core.model.rows.PackedLinear`.
    ``weight`` gives the de-quantised weight (float32 [out, in]) for code that reads it; the
    packed tensors are buffers, not parameters: for inference only.

    Args:
        parts: :func:`int4_parts` of the tensor (two parts: Q8_0).
        compute_dtype: the layer's input and output dtype; None: float32 for the qmm kernels,
            bfloat16 for ``"aten"``.
        gguf_type: the GGUF block type, for reports.
        kernel: one of :data:`KERNELS` or None: :func:`default_kernel` where it is a qmm kernel and
            ``compute_dtype`` is None or float32, else ``"aten"``.

    Raises:
        GGUFWeightsError: parts of different shapes, or sizes the kernel refuses.
        ValueError: an unknown kernel, or a qmm kernel with a compute dtype other than float32.
    """

    honours_real_rows = True
    row_exact = True  # a row's result does not depend on the other rows (TargetModel.row_exact)

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                 compute_dtype: torch.dtype | None = None, gguf_type: str | None = None,
                 kernel: str | None = None) -> None:
        super().__init__()
        if kernel is None:
            kernel = default_kernel()
            if kernel in QMM_KERNELS and compute_dtype not in (None, torch.float32):
                kernel = "aten"
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
        if compute_dtype is None:
            compute_dtype = torch.float32 if kernel in QMM_KERNELS else torch.bfloat16
        if kernel in QMM_KERNELS and compute_dtype != torch.float32:
            raise ValueError(f"the {kernel} kernel takes float32 activations, not {compute_dtype}")
        self.gguf_type = gguf_type  # the GGUF block type the parts came from (for reports)
        self.kernel = kernel
        self.out_features, self.in_features = parts[0][0].shape
        self.compute_dtype = compute_dtype
        self.n_parts = len(parts)
        for i, (codes, _, _) in enumerate(parts):
            if codes.shape != (self.out_features, self.in_features):
                raise GGUFWeightsError(f"part {i} is {codes.shape}, part 0 {parts[0][0].shape}")
        if kernel in QMM_KERNELS:
            self.q8 = self.n_parts == 2
            codes, scale, minimum = (qmm_a8_weight if kernel == "qmm-a8" else qmm_weight)(parts)
            self.register_buffer("qmm_codes", torch.from_numpy(codes), persistent=False)
            self.register_buffer("qmm_scale", torch.from_numpy(scale), persistent=False)
            self.register_buffer("qmm_minimum", None if minimum is None else torch.from_numpy(minimum),
                                 persistent=False)
            self._bind_qmm()
            return
        for i, (codes, scale, zero) in enumerate(parts):
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes), 2)
            except RuntimeError as e:
                raise GGUFWeightsError(f"the int4 kernel refuses a [{self.out_features}, {self.in_features}] "
                                       f"weight: {e}") from e
            sz = torch.from_numpy(np.stack([scale, zero], axis=-1)).transpose(0, 1).contiguous()  # [K/32, N, 2]
            self.register_buffer(f"packed_{i}", packed, persistent=False)
            self.register_buffer(f"scales_zeros_{i}", sz.to(compute_dtype), persistent=False)

    def _bind_qmm(self) -> None:
        """numpy views of the qmm buffers, made once (the kernel is called about 126 times a forward)."""
        minimum = self._buffers["qmm_minimum"]
        self._qmm_args = (self._buffers["qmm_codes"].numpy(), self._buffers["qmm_scale"].numpy(),
                          None if minimum is None else minimum.numpy())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, gguf_type={self.gguf_type}, "
                f"kernel={self.kernel}, parts={self.n_parts}, compute_dtype={self.compute_dtype}")

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel in QMM_KERNELS:
            if x.requires_grad:  # inference only: no gradient flows through the kernel
                x = x.detach()
            if not x.is_contiguous():
                x = x.contiguous()
            return self.fused_into(x, torch.empty(x.shape[0], self.out_features))
        buffers = self._buffers  # read directly: Module.__getattr__ costs more than the small kernels
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, buffers["packed_0"], GROUP_SIZE, buffers["scales_zeros_0"])
        for i in range(1, self.n_parts):
            y.add_(torch.ops.aten._weight_int4pack_mm_for_cpu(x, buffers[f"packed_{i}"], GROUP_SIZE,
                                                              buffers[f"scales_zeros_{i}"]))
        return y

    def fused_into(self, x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
                   gated: bool = False, accumulate: bool = False) -> torch.Tensor:
        """The ``"qmm-a8"`` or ``"qmm"`` kernel with the operations around a layer of a Llama decoder
        done in the same call (:class:`~dart_core.model.decoder.LlamaDecoder`), every row on its own:

        - ``norm`` (float32 [in_features]): the rows are RMS-normalised first,
          ``norm · x / sqrt(mean(x²) + eps)`` (transformers' LlamaRMSNorm; its sum of squares in a
          fixed order of its own, so equal to PyTorch's to float32 rounding, not bit for bit);
        - ``gated``: x is [M, 2·in_features] (gate and up side by side) and the layer multiplies
          ``silu(gate) · up`` (SiLU from a written-out exponential: PyTorch's to float32 rounding);
        - ``accumulate``: the product is added to ``out`` (a residual connection) instead of written.

        Args:
            x: float32 C-contiguous [M, in_features] (or [M, 2·in_features] when ``gated``).
            out: float32 C-contiguous [M, out_features], written or added to.

        Returns:
            ``out``.

        Raises:
            ValueError: the ``"aten"`` kernel, or shapes the kernel refuses."""
        if self.kernel not in QMM_KERNELS:
            raise ValueError(f"fused_into runs the qmm kernels, this layer's is {self.kernel}")
        codes, scale, minimum = self._qmm_args
        (_kernels.qmm_a8 if self.kernel == "qmm-a8" else _kernels.qmm)(
            x.numpy(), codes, scale, minimum, self.out_features, self.q8, out.numpy(),
            norm=None if norm is None else norm.detach().numpy(), eps=eps, gated=gated, accumulate=accumulate)
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the layer's outputs, the outputs never written: ``self(x).argmax(-1)``
        (an output layer at temperature 0 wants only this).  The ``"qmm-a8"`` and ``"qmm"`` kernels
        compute the outputs block by block into a small per-thread buffer and keep each row's best
        (``_kernels.qmm_argmax``): the outputs' own bits, so the same index as torch.argmax over them,
        ties to the first and a NaN above every number.  Inside :func:`~dart_core.model.rows.real_rows`
        only the selected rows are computed, the others get 0.

        Args:
            x: float32 [..., in_features].

        Returns:
            int64 [...].

        Raises:
            ValueError: the ``"aten"`` kernel (no fused argmax: use ``self(x).argmax(-1)``)."""
        if self.kernel not in QMM_KERNELS:
            raise ValueError(f"argmax runs the qmm kernels, this layer's is {self.kernel}")
        codes, scale, minimum = self._qmm_args
        kernel = _kernels.qmm_a8_argmax if self.kernel == "qmm-a8" else _kernels.qmm_argmax

        def argmax_rows(rows: torch.Tensor) -> torch.Tensor:
            out = torch.empty(rows.shape[0], dtype=torch.int64)
            kernel(rows.detach().float().contiguous().numpy(), codes, scale, minimum, self.out_features, self.q8,
                   out.numpy())
            return out

        return over_real_rows(x, argmax_rows)

    @property
    def fused_argmax(self) -> bool:
        """Whether :meth:`argmax` runs (the qmm kernels)."""
        return self.kernel in QMM_KERNELS

    def kernel_args(self) -> tuple:
        """(codes, scale, minimum or None, out_features, q8, a8): the layer as the C++ decoder layers
        (``_kernels.GGUFLayers``) take it (a qmm kernel only)."""
        return (*self._qmm_args, self.out_features, self.q8, self.kernel == "qmm-a8")

    @staticmethod
    def can_fuse(layers: list[torch.nn.Module]) -> bool:
        """Whether :meth:`fuse` accepts ``layers``: Int4Linear layers of one input size, kernel,
        compute dtype and part count, each but the last with a multiple of ``PACK_BLOCK_ROWS``
        output rows (every kernel's layout holds output rows in blocks of 64, so a part must end
        where a block does)."""
        first = layers[0]
        return all(type(x) is Int4Linear and x.in_features == first.in_features and x.n_parts == first.n_parts
                   and x.compute_dtype == first.compute_dtype and x.kernel == first.kernel for x in layers) \
            and all(x.out_features % PACK_BLOCK_ROWS == 0 for x in layers[:-1])

    @classmethod
    def fuse(cls, layers: list["Int4Linear"]) -> "Int4Linear":
        """One layer computing ``layers`` side by side: output [..., Σ out_features], the layers'
        outputs in order, each equal bit for bit to that layer's own (the kernel's packed weight
        holds each output row on its own, so the packed rows are concatenated; no re-packing). The
        given layers' packed weights become views of the fused one, so the weights are held once.

        Raises:
            ValueError: layers :meth:`can_fuse` refuses, or a fused weight that does not reproduce
                its parts on a probe input (a packing this code does not know)."""
        if not layers or not cls.can_fuse(layers):
            raise ValueError("fuse needs Int4Linear layers of one in_features, kernel, part count and compute dtype, "
                             f"each but the last with a multiple of {PACK_BLOCK_ROWS} output rows")
        first = layers[0]
        probe = torch.linspace(-1.0, 1.0, first.in_features)[None]
        expected = torch.cat([x(probe) for x in layers], dim=-1)
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.gguf_type = "+".join(sorted({str(x.gguf_type) for x in layers}))
        fused.out_features, fused.in_features = sum(x.out_features for x in layers), first.in_features
        fused.compute_dtype, fused.n_parts, fused.kernel = first.compute_dtype, first.n_parts, first.kernel
        if first.kernel in QMM_KERNELS:
            fused.q8 = first.q8
            names = ["qmm_codes", "qmm_scale"] + ([] if first.q8 else ["qmm_minimum"])
            fused.register_buffer("qmm_minimum", None, persistent=False)
            for name in names:  # [blocks of 64 output rows, ...]: the layers' blocks one after another
                fused.register_buffer(name, torch.cat([getattr(x, name) for x in layers]), persistent=False)
            fused._bind_qmm()
            if not torch.equal(fused(probe), expected):
                raise ValueError("the fused 4-bit weight does not reproduce its parts")
            start = 0
            for x in layers:
                blocks = -(-x.out_features // PACK_BLOCK_ROWS)
                for name in names:
                    setattr(x, name, getattr(fused, name)[start:start + blocks])
                x._bind_qmm()
                start += blocks
            return fused
        for i in range(first.n_parts):
            fused.register_buffer(f"packed_{i}", torch.cat([getattr(x, f"packed_{i}") for x in layers]),
                                  persistent=False)
            fused.register_buffer(f"scales_zeros_{i}", torch.cat([getattr(x, f"scales_zeros_{i}") for x in layers], 1),
                                  persistent=False)
        if not torch.equal(fused(probe), expected):
            raise ValueError("the fused 4-bit weight does not reproduce its parts (an unknown int4 packing)")
        for i in range(first.n_parts):
            packed, start = getattr(fused, f"packed_{i}"), 0
            for x in layers:
                setattr(x, f"packed_{i}", packed[start:start + x.out_features])
                start += x.out_features
        return fused

    @property
    def weight(self) -> torch.Tensor:
        if self.kernel == "qmm-a8":  # read from the layout: 8-bit activations would round an identity
            return torch.from_numpy(_qmm_a8_values(*self._qmm_args, self.out_features))
        eye = torch.eye(self.in_features, dtype=self.compute_dtype)
        return self._mm(eye).t().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel in QMM_KERNELS and x.dtype == torch.float32:
            rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
            real = REAL_ROWS.get()
            if real is None or real[1] != rows.shape[0]:  # every row: the kernel without Python around it
                y = self._mm(rows)
                return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        return over_real_rows(x, lambda rows: self._mm(rows.to(self.compute_dtype)).to(x.dtype))


def _row_order(weight: np.ndarray, values: np.ndarray, name: str) -> np.ndarray | None:
    """The row permutation p with weight[i] == values[p[i]] (None: identity), e.g. the rotary
    re-ordering of q/k rows that llama.cpp's converter applies and transformers undoes.

    Raises:
        GGUFWeightsError: some row of ``weight`` is no row of ``values``."""
    if weight.shape != values.shape:
        raise GGUFWeightsError(f"{name}: the GGUF tensor is {values.shape}, the model's weight {weight.shape}")
    if np.array_equal(weight, values):
        return None
    index = {row.tobytes(): j for j, row in enumerate(values)}
    try:
        return np.array([index[row.tobytes()] for row in weight], dtype=np.int64)
    except KeyError:
        raise GGUFWeightsError(f"{name}: the GGUF blocks do not de-quantise to the loaded model's weights "
                               "(another file, or a corrupt one)") from None


def quantize_from_gguf(model: torch.nn.Module, gguf_path: str | Path, compute_dtype: torch.dtype | None = None,
                       cache: Path | None = None, kernel: str | None = None) -> dict[str, str]:
    """Replaces (in place) each ``nn.Linear`` of a GGUF-loaded Hugging Face model whose GGUF tensor is
    Q4_0, Q4_1 or Q8_0 by an :class:`Int4Linear` built from that tensor's blocks.

    The model must hold the GGUF's de-quantised weights (as transformers loads them); each layer's
    blocks are checked to de-quantise to exactly its weight (rows matched, so a converter's row
    re-ordering is followed). An output layer tied to the input embeddings takes the embedding
    tensor's blocks; the embedding itself keeps its de-quantised table (a lookup streams one row).
    Layers of other types (F16, F32, K-quants) stay as they are.

    Args:
        model: e.g. ``LlamaForCausalLM`` on the CPU, float32 weights.
        gguf_path: the file the model was loaded from.
        compute_dtype: the kernel's activation dtype; None: :func:`default_compute_dtype` (the
            kernel's own with ``kernel`` given).
        kernel: :class:`Int4Linear`'s ``kernel``; None: :func:`default_kernel` where float32
            activations are asked for (or none), else ``"aten"``.
        cache: a folder for the checked 4-bit parts (``int4.safetensors``): read when present
            (reading the GGUF's metadata and checking every layer takes seconds), else written
            after the check. A cache that cannot be read is logged and rebuilt.

    Returns:
        {module name: GGUF block type} of the layers replaced.

    Raises:
        GGUFWeightsError: the file is unreadable or corrupt, or its blocks do not match the model.
        RuntimeError: this PyTorch lacks the CPU int4 operators (:func:`can_int4`).
    """
    if not can_int4():
        raise RuntimeError("this PyTorch has no CPU int4 weight-only kernel (_weight_int4pack_mm_for_cpu)")
    if compute_dtype is None and kernel is None:
        compute_dtype = default_compute_dtype()
    layers = _load_parts(cache / _CACHE_FILE) if cache is not None and (cache / _CACHE_FILE).is_file() else None
    if layers is None:
        layers = _gguf_parts(model, gguf_path)
        if cache is not None:
            save_converted(lambda folder: _save_parts(layers, folder / _CACHE_FILE), cache)
    for full, (kind, parts) in layers.items():
        module_name, _, child_name = full.rpartition(".")
        parent = model.get_submodule(module_name) if module_name else model
        child = getattr(parent, child_name, None)
        if type(child) is not torch.nn.Linear or tuple(child.weight.shape) != parts[0][0].shape:
            raise GGUFWeightsError(f"{full}: the model has no linear layer of shape {parts[0][0].shape} there")
        layer = Int4Linear(parts, compute_dtype, kind, kernel)
        setattr(parent, child_name, layer)
    logger.info("GGUF-native weights: %d linear layers (%s), %s kernel, activations %s", len(layers),
                ", ".join(f"{n}× {t}" for t, n in sorted(Counter(k for k, _ in layers.values()).items())),
                layer.kernel if layers else "no", layer.compute_dtype if layers else compute_dtype)
    return {name: kind for name, (kind, _) in layers.items()}


_CACHE_FILE = "int4.safetensors"
_Parts = "list[tuple[np.ndarray, np.ndarray, np.ndarray]]"


def _gguf_parts(model: torch.nn.Module, gguf_path: str | Path) -> dict[str, tuple[str, _Parts]]:
    """{module name: (GGUF type, 4-bit parts in the model's row order)} of the linear layers that have
    Q4_0 / Q4_1 / Q8_0 blocks in the file, each checked against the model's weight."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise GGUFWeightsError(f"{gguf_path}: not a readable GGUF file ({e})") from e
    tensors = {t.name: t for t in reader.tensors}
    arch_field = reader.fields.get("general.architecture")
    arch_name = bytes(arch_field.parts[-1]).decode() if arch_field is not None else "llama"
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise GGUFWeightsError(f"{gguf_path}: unknown architecture {arch_name!r}")
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    tied = getattr(model.config, "tie_word_embeddings", False)
    out: dict[str, tuple[str, _Parts]] = {}
    for full, child in model.named_modules():
        if type(child) is not torch.nn.Linear or child.bias is not None:
            continue
        base = names.get_name(full)
        tensor = tensors.get(f"{base}.weight") if base else None
        if tensor is None and tied and child is model.get_output_embeddings():
            tensor = tensors.get(f"{names.get_name('model.embed_tokens') or 'token_embd'}.weight")
        if tensor is None or tensor.tensor_type.name not in ("Q4_0", "Q4_1", "Q8_0"):
            continue
        weight = child.weight.detach().float().numpy()
        raw = np.asarray(tensor.data)
        parts = int4_parts(raw, tensor.tensor_type.name, tuple(weight.shape))
        values = sum(((c - 8) * np.repeat(s, GROUP_SIZE, 1) + np.repeat(z, GROUP_SIZE, 1)
                      for c, s, z in parts), np.zeros(weight.shape, np.float32))
        expected = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(weight.shape)
        # the parts' values reproduce the GGUF's de-quantisation (to float32 rounding of the zero)
        if not np.allclose(values, expected, rtol=1e-6, atol=1e-6):
            raise GGUFWeightsError(f"{tensor.name}: the 4-bit parts do not reproduce its values")
        order = _row_order(weight, expected, tensor.name)
        if order is not None:
            parts = [(c[order], s[order], z[order]) for c, s, z in parts]
        out[full] = (tensor.tensor_type.name, parts)
    return out


def _save_parts(layers: dict[str, tuple[str, _Parts]], path: Path) -> None:
    """The parts as safetensors: codes two per byte (low nibble first), scales and zeros float32."""
    import json

    from safetensors.numpy import save_file

    tensors, kinds = {}, {}
    for name, (kind, parts) in layers.items():
        kinds[name] = [kind, len(parts)]
        for i, (codes, scale, zero) in enumerate(parts):
            tensors[f"{name}.{i}.codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
            tensors[f"{name}.{i}.scale"], tensors[f"{name}.{i}.zero"] = scale, zero
    save_file(tensors, str(path), metadata={"format": "dart-serve-int4-v1", "layers": json.dumps(kinds)})


def _load_parts(path: Path) -> dict[str, tuple[str, _Parts]] | None:
    """What :func:`_save_parts` wrote; None (logged) for a file that cannot be read as that."""
    import json

    from safetensors import safe_open

    try:
        out = {}
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "dart-serve-int4-v1":
                raise ValueError(f"format {meta.get('format')!r}")
            for name, (kind, n) in json.loads(meta["layers"]).items():
                parts = []
                for i in range(n):
                    packed = f.get_tensor(f"{name}.{i}.codes")
                    codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.int32)
                    codes[:, 0::2], codes[:, 1::2] = packed & 15, packed >> 4
                    parts.append((codes, f.get_tensor(f"{name}.{i}.scale"), f.get_tensor(f"{name}.{i}.zero")))
                out[name] = (kind, parts)
        return out
    except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt from the GGUF
        logger.warning("ignoring the 4-bit cache %s (%s); converting the GGUF again", path, e)
        return None
