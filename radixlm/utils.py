"""Small helpers shared across modules."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def cache_root() -> Path:
    """Where converted weights and built CPU kernels are kept ($RADIXLM_CACHE_DIR)."""
    return Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")


def to_device(t: torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host tensor -> device without stalling the GPU stream.

    A copy from pageable host memory makes CUDA wait for all queued work on the
    stream first; staging through pinned memory keeps the copy asynchronous,
    which is what lets the host prepare batch N+1 while the GPU runs batch N.
    """
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
