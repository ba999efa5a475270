"""Attention backends by name (`--attention-backend`), imported only when chosen.

Each backend class builds itself from the attention shape (`AttentionBackend.create`)
and says when it cannot run (`unusable`), so choosing one is a lookup here, not a
chain of cases in the model runner. `auto` picks by device: Triton on CUDA, our
C++ kernels on the CPU where they load, else the torch reference.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixlm.layers.attention.base import AttentionBackend

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_native": ("radixlm.layers.attention.torch_native", "TorchNativeBackend"),
    "cpu": ("radixlm.layers.attention.cpu_backend", "CpuAttentionBackend"),
    "triton": ("radixlm.layers.attention.triton_backend", "TritonAttentionBackend"),
}


def attention_backend_names() -> list[str]:
    return list(_BACKENDS)


def attention_backend_class(name: str, device: torch.device,
                            head_dim: int) -> type[AttentionBackend]:
    """The class behind `name` (`auto`: the device's default); ValueError naming
    why when it cannot run here."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
        if name == "cpu" and _load(name).unusable(device, head_dim) is not None:
            name = "torch_native"
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r}: expected auto or one of "
                         f"{', '.join(_BACKENDS)}")
    cls = _load(name)
    why = cls.unusable(device, head_dim)
    if why is not None:
        raise ValueError(f"attention_backend={name!r} cannot run here: {why}")
    return cls


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)
