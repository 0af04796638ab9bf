"""How the model's kernels and memory run: the switches that are not speculation.

:class:`KernelConfig` holds what used to be read from environment variables
at every call (the SDPA backends, grouped-query attention under a mask, the
static cache's attention windows, glibc's freed-memory thresholds). It is
validated once, when built, given to
:meth:`DartModel.from_pretrained <dart_core.api.DartModel.from_pretrained>`,
logged at start-up and written into benchmark results. The defaults are the
shipped behaviour; the other values exist for measurements (``bench/results/gpu/``, compares them). This module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["KernelConfig", "SDPA_BACKEND_NAMES"]

SDPA_BACKEND_NAMES = ("flash", "efficient", "math", "cudnn")  # torch.nn.attention.SDPBackend members, by name


@dataclass(frozen=True)
class KernelConfig:
    """Kernel and memory switches of a loaded model (docs/design.md, "Attention backend").

    Fields:
        sdpa_backends: ``"auto"`` (CUDA: flash, memory-efficient, math, cuDNN left out; CPU:
            PyTorch's own choice), ``"default"`` (PyTorch's own priority everywhere) or a
            comma-separated list of :data:`SDPA_BACKEND_NAMES`
            (:func:`dart_core.model.attention.sdpa_backends`).
        grouped_query: on CUDA, masked attention stacks a key/value head's query heads along the
            query axis instead of repeating keys and values per head
            (:func:`dart_core.model.attention.grouped_query_sdpa`); False repeats them.
        static_windows: the static KV cache attends over windows of 256, 512, ... positions up to
            its capacity (:func:`dart_core.model.cuda_graphs.default_windows`); False: the whole capacity.
        keep_freed_memory: on a CPU, glibc keeps freed tensor memory mapped for reuse
            (:func:`dart_core.model.allocator.keep_freed_memory`); False leaves glibc's thresholds.
        amx: on a CPU with Intel AMX-INT8, the ``qmm-a8`` kernel's products of several rows (a
            verification's query tokens, a prefill) run on AMX tiles, the same bits as its VNNI loop
            (``dart_core/csrc/qmm_a8.cpp``); False keeps the VNNI loop.  A process-wide switch, set
            when a :class:`~dart_core.model.target.TargetModel` is built; ignored elsewhere.

    Raises:
        ValueError: an unknown ``sdpa_backends`` value, or a switch that is not a bool.
    """

    sdpa_backends: str = "auto"
    grouped_query: bool = True
    static_windows: bool = True
    keep_freed_memory: bool = True
    amx: bool = True

    def __post_init__(self) -> None:
        setting = self.sdpa_backends.strip().lower() if isinstance(self.sdpa_backends, str) else None
        names = [x.strip() for x in (setting or "").split(",") if x.strip()]
        if setting not in ("auto", "default") and (not names or any(x not in SDPA_BACKEND_NAMES for x in names)):
            raise ValueError(f"sdpa_backends={self.sdpa_backends!r}: use auto, default or a comma-separated list of "
                             f"{', '.join(SDPA_BACKEND_NAMES)}")
        object.__setattr__(self, "sdpa_backends", setting if setting in ("auto", "default") else ",".join(names))
        for name in ("grouped_query", "static_windows", "keep_freed_memory", "amx"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def as_dict(self) -> dict:
        """The fields as a plain dict (for logs and result files)."""
        return asdict(self)
