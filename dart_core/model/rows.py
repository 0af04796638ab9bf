"""Computing only the real rows of a padded batch, and oneDNN-packed float32 linear layers.

A batch of draft trees is padded to one node count per sequence; on a CPU its
linear layers are most of a verification forward, so the layers that honour
:func:`real_rows` (:class:`PackedLinear` here, :class:`~dart_core.model.quant.Int4Linear`)
compute the real nodes only and leave the padding rows zero.  The row
selection travels in a context variable (:data:`REAL_ROWS`) that the target's
forward sets and every such layer reads.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch

__all__ = ["REAL_ROWS", "PACK_ROWS", "real_rows", "padded_rows", "over_real_rows", "PackedLinear", "can_pack",
           "pack_linears"]

PACK_ROWS = 16  # oneDNN picks the weight layout for this many input rows; 8 to 64 all time the same


# (flat row indices, row count of the full input) while a forward computes only some rows: see real_rows
REAL_ROWS: ContextVar["tuple[torch.Tensor, int] | None"] = ContextVar("dart_real_rows", default=None)


@contextmanager
def real_rows(rows: torch.Tensor | None, total: int):
    """Within the block, every :class:`PackedLinear` given ``total`` input rows computes only ``rows``
    (int64 [R], indices into the flattened rows) and leaves the others zero: a batch of draft trees
    padded to one node count then pays its linear layers (the bulk of a CPU forward) for its real
    nodes only.  Attention still runs on the padded layout; padding positions see only themselves,
    so a zero row stays finite.  ``rows=None`` computes everything."""
    token = REAL_ROWS.set(None if rows is None else (rows, int(total)))
    try:
        yield
    finally:
        REAL_ROWS.reset(token)


def padded_rows(sizes, width: int, device) -> torch.Tensor | None:
    """int64 [Σ sizes] flat indices (b · width + i for i < sizes[b]) of the real positions of rows
    padded to ``width`` (``sizes``: [B] ints), on ``device``, for :func:`real_rows`; None when no
    row is padded."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.sum() == len(sizes) * width:
        return None
    return torch.from_numpy(np.flatnonzero(np.arange(width)[None, :] < sizes[:, None])).to(device)


def over_real_rows(x: torch.Tensor, per_rows) -> torch.Tensor:
    """``per_rows`` (rows [N, in] -> [N, ...], each result row from its input row alone) applied to
    ``x`` [..., in]: [..., ...]; inside :func:`real_rows` for x's row count, to the selected rows
    only, the others left zero.  The forward of the linear layers that honour :func:`real_rows`
    (``honours_real_rows``), and the fused argmax of a 4-bit output layer."""
    rows = x.reshape(-1, x.shape[-1])
    real = REAL_ROWS.get()
    sel = real[0] if real is not None and real[1] == rows.shape[0] else None
    y = per_rows(rows if sel is None else rows.index_select(0, sel))
    if sel is not None:
        y = y.new_zeros(rows.shape[0], *y.shape[1:]).index_copy_(0, sel, y)
    return y.view(*x.shape[:-1], *y.shape[1:])


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` for float32 inference on a CPU, its weight reordered once
    into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
    and applied by ``torch.ops.mkldnn._linear_pointwise``: the pair that
    PyTorch's Inductor puts in place of a frozen linear layer on a CPU,
    called here without compiling the model.  Input and output stay ordinary
    dense tensors.

    PyTorch's dense float32 ``F.linear`` on a CPU takes MKL's GEMV for one
    row but a GEMM that costs about twice as much for 2 to 16 rows, which is
    exactly the range of a verification forward (a draft tree of a few nodes,
    a batch of a few sequences).  Packed, a forward costs about the same for
    1 to 8 query tokens (figures in docs/engine.md, "Packed CPU target").
    Results agree with the dense layer to float32 rounding (SmolLM2 logits
    within 1e-4, same argmax), and a row's result does not depend on the
    other rows of the call.

    Shapes: x [..., in_features] float32 → [..., out_features].
    ``weight`` gives a dense copy of the weight (for code that reads it,
    e.g. the head trainer's vocabulary initialisation); the packed weight is
    not a parameter and not in ``state_dict``: pack a model only for inference.
    """

    honours_real_rows = True  # forward computes only the rows of real_rows

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.register_buffer("packed_weight", weight, persistent=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed_weight.to_dense()

    def __deepcopy__(self, memo: dict) -> "PackedLinear":
        import copy

        dense = torch.nn.Linear(self.in_features, self.out_features, bias=False)
        dense.weight = torch.nn.Parameter(self.weight, requires_grad=False)
        out = PackedLinear(dense)
        out.bias = copy.deepcopy(self.bias, memo)
        out.train(self.training)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return over_real_rows(x, lambda rows: torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""))


def can_pack(model) -> bool:
    """True where :class:`PackedLinear` applies: float32 weights on a CPU, a PyTorch built with
    oneDNN and its two linear ops (private to PyTorch: a release without them packs nothing).
    ``model``: a Hugging Face model (its input embeddings are checked) or any module whose
    linear layers would be packed (its first ``nn.Linear``)."""
    if hasattr(model, "get_input_embeddings"):
        weight = model.get_input_embeddings().weight
    else:
        weight = next((m.weight for m in model.modules() if type(m) is torch.nn.Linear), None)
        if weight is None:
            return False
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linears(model: torch.nn.Module) -> int:
    """Replaces every ``nn.Linear`` of ``model`` (in place) by a :class:`PackedLinear`; returns how many.

    For inference only: packed layers take no gradients.  The caller checks :func:`can_pack`.
    """
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, PackedLinear(child))
                count += 1
    return count
