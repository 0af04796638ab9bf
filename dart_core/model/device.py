"""Device helpers shared by every layer."""

from __future__ import annotations

import torch

__all__ = ["sync_device"]


def sync_device(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA); a no-op elsewhere. For host-side timings."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
