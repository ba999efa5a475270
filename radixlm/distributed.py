"""Tensor-parallel state: which rank of how many this process is, and its collectives.

Until `set_tp_group` is called (the tensor-parallel launcher does it once per
rank, before building the model), every process is rank 0 of a group of one
and the collectives are no-ops, so single-device runs never touch
torch.distributed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    """Use `group` (e.g. `dist.group.WORLD`) for tensor parallelism; None resets to one rank."""
    global _TP_GROUP, _TP_SYNC
    _TP_GROUP = group
    _TP_SYNC = None


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


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s (in place)."""
    if get_tp_size() > 1:
        dist.broadcast(x, src=src, group=_TP_GROUP)
    return x


def init_distributed(backend: str, init_method: str, world_size: int, rank: int,
                     timeout_s: float) -> None:
    """Join the tensor-parallel group (the default process group) and use it for TP."""
    from datetime import timedelta

    dist.init_process_group(backend, init_method=init_method, world_size=world_size,
                            rank=rank, timeout=timedelta(seconds=timeout_s))
    set_tp_group(dist.group.WORLD)


class TpSync:
    """Host-side lockstep of the scheduler ranks of one tensor-parallel group.

    Rank 0 alone talks to the outside world; each step it broadcasts what it
    received (msgpack, never pickle) so every rank applies
    the same inputs in the same order and takes the same scheduling decisions.
    Uses a gloo group, which is the TP group itself on the CPU and a separate
    one next to NCCL on GPUs (NCCL cannot move host bytes).
    """

    def __init__(self) -> None:
        assert _tp_active(), "init_distributed first"
        self.rank, self.size = get_tp_rank(), get_tp_size()
        world = dist.group.WORLD
        self.group = world if dist.get_backend(world) == "gloo" else dist.new_group(
            backend="gloo")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def broadcast_obj(self, obj: Any = None) -> Any:
        """Rank 0 passes a msgpack-able value (followers pass nothing); every rank
        returns rank 0's value, except that an empty one (None, [], ...) arrives as
        None and costs a single 8-byte broadcast: the common case of a busy step."""
        data = msgspec.msgpack.encode(obj) if self.is_leader and obj else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        n = int(size.item())
        if n == 0:
            return None
        if self.is_leader:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return obj if self.is_leader else msgspec.msgpack.decode(buf.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the KV capacity all can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


_TP_SYNC: TpSync | None = None


def get_tp_sync() -> TpSync | None:
    """The host-side lockstep of this rank's TP group; None with one rank."""
    global _TP_SYNC
    if _TP_SYNC is None and get_tp_size() > 1:
        _TP_SYNC = TpSync()
    return _TP_SYNC
