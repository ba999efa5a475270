"""Tensor-parallel state: which rank of how many this process is, and its collectives.

Until `set_tp_group` is called (the tensor-parallel launcher does it once per
rank, before building the model), every process is rank 0 of a group of one
and the collectives are no-ops, so single-device runs never touch
torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    """Use `group` (e.g. `dist.group.WORLD`) for tensor parallelism; None resets to one rank."""
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def _tp_active() -> bool:
    return _TP_GROUP is not None and dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank(_TP_GROUP) if _tp_active() else 0


def get_tp_size() -> int:
    return dist.get_world_size(_TP_GROUP) if _tp_active() else 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place when there is more than one)."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    world = get_tp_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
