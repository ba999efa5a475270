"""Small helpers shared across modules."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch stays out of the API process, which imports this module
    import torch


def cache_root() -> Path:
    """Where converted weights and built CPU kernels are kept ($RADIXLM_CACHE_DIR)."""
    return Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")


def lazy_import(name: str) -> types.ModuleType:
    """Module `name`, executed on its first attribute access.

    For the CUDA-only kernel modules the layers call on GPU tensors alone:
    importing Triton costs a CPU process ~70 MiB of resident memory and half a
    second at start, for kernels it never launches. After the first access the
    object is the ordinary module (no per-call cost)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported, asked without importing it."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _libc_malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim).

    glibc keeps freed memory for reuse, and a busy batch's activations (torch
    CPU tensors, freed into the heap) stay resident after the load is gone:
    +33 MiB after 32 requests of 128/64 tokens on the embedded model, all
    returned by a trim. Called when the scheduler goes idle; a few ms."""
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


def to_device(t: torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host tensor -> device without stalling the GPU stream.

    A copy from pageable host memory makes CUDA wait for all queued work on the
    stream first; staging through pinned memory keeps the copy asynchronous,
    which is what lets the host prepare batch N+1 while the GPU runs batch N.
    """
    import torch

    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def ints_to_device(parts: Sequence[Sequence[int] | torch.Tensor],
                   device: torch.device | str) -> list[torch.Tensor]:
    """Several host integer sequences (lists, or integer tensors, read flat) as
    1-D int64 tensors on `device`, through one host-to-device copy: views of one
    buffer, in the order given (a tensor already on the device stays where it is).

    Each `to_device` costs the host ~15 us on CUDA (a pinned staging block, a
    copy, an event), and a step prepares a dozen small index tensors before its
    forward can start. Every part starts on a 16-byte boundary, as Triton's
    launches specialise on (a misaligned pointer would compile a kernel variant).
    """
    import torch

    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(parts)
    flat: list[int] = []
    big: list[tuple[int, torch.Tensor]] = []  # host tensors too long to go through lists
    spans: list[tuple[int, int]] = []  # (part, length) in buffer order
    for i, p in enumerate(parts):
        if isinstance(p, torch.Tensor):
            if p.device.type != "cpu":
                out[i] = p.reshape(-1).to(device, torch.int64)
                continue
            if p.numel() > _LIST_LIMIT:
                big.append((i, p.reshape(-1).to(torch.int64)))
                continue
            p = p.reshape(-1).tolist()
        flat += p
        if len(p) % 2:
            flat.append(0)  # int64 pairs: 16-byte aligned starts
        spans.append((i, len(p)))
    pin = device.type == "cuda"
    # Pinned once: here, or after the long tensors join the lists' values.
    host = torch.tensor(flat, dtype=torch.int64, pin_memory=pin and not big)
    if big:
        pieces = [host]
        for i, t in big:
            pieces += [t, t.new_zeros(t.numel() % 2)]
            spans.append((i, t.numel()))
        host = torch.cat(pieces)
        if pin:
            host = host.pin_memory()
    buf = host.to(device, non_blocking=True) if pin else host.to(device)
    at = 0
    for i, n in spans:
        out[i] = buf[at:at + n]
        at += n + n % 2
    return out  # type: ignore[return-value]


_LIST_LIMIT = 512  # longer host tensors are concatenated, not read into lists
