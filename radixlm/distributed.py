"""Tensor-parallel state: which rank of how many this process is, and its collectives.

Until `set_tp_group` is called (the tensor-parallel launcher does it once per
rank, before building the model), every process is rank 0 of a group of one
and the collectives are no-ops, so single-device runs never touch
torch.distributed.

Expert parallelism runs inside the tensor-parallel group (`set_ep_size`):
its ranks form `ep_size` groups of consecutive ranks, each holding a share of
every MoE layer's experts and splitting those experts' intermediate
dimension among its own `tp_size / ep_size` ranks. Attention is tensor
parallel, so every rank already holds every token: a rank runs its experts
on the tokens routed to them and leaves a partial sum, which the all-reduce
the next norm runs anyway combines with the other ranks' (no dispatch
collective is needed while attention is not data parallel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from radixlm.layers.allreduce_norm import AllReduceNorm

logger = logging.getLogger(__name__)

_TP_GROUP: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    """Use `group` (e.g. `dist.group.WORLD`) for tensor parallelism; None resets to one rank."""
    global _TP_GROUP, _TP_SYNC, _CUSTOM_AR, _AR_NORM, _MOE
    _TP_GROUP = group
    _TP_SYNC = None
    _MOE = None
    _CUSTOM_AR = None
    _AR_NORM = None


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def _tp_active() -> bool:
    return _TP_GROUP is not None and dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank(_TP_GROUP) if _tp_active() else 0


def get_tp_size() -> int:
    return dist.get_world_size(_TP_GROUP) if _tp_active() else 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks. Use the returned tensor: it is `x`
    itself (summed in place by NCCL or gloo) or, for a small message on GPUs with
    the custom all-reduce, a new tensor."""
    if get_tp_size() == 1:
        return x
    if _CUSTOM_AR is not None and _CUSTOM_AR.can_reduce(x):
        return _CUSTOM_AR(x)
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


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in `group` (None: the tensor-parallel group); 1 without torch.distributed."""
    if group is None or not _tp_active():
        return get_tp_size()
    return dist.get_world_size(group)


def all_gather(x: torch.Tensor, dim: int = -1,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`tensor_model_parallel_all_gather` over `group` (None: the tensor-parallel group)."""
    if group is None:
        return tensor_model_parallel_all_gather(x, dim)
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def broadcast_from(x: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Overwrite `x` (contiguous) on every tensor-parallel rank with that of rank `tp_rank`."""
    if get_tp_size() > 1:
        dist.broadcast(x, src=dist.get_global_rank(_TP_GROUP, tp_rank), group=_TP_GROUP)
    return x


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s (in place)."""
    if get_tp_size() > 1:
        dist.broadcast(x, src=src, group=_TP_GROUP)
    return x


def init_distributed(backend: str, init_method: str, world_size: int, rank: int,
                     timeout_s: float, custom_all_reduce: bool = True,
                     allreduce_fusion: bool = True, ep_size: int = 1) -> None:
    """Join the tensor-parallel group (the default process group) and use it for TP,
    with `ep_size` expert-parallel groups inside it (`set_ep_size`);
    on NCCL also set up the custom all-reduce unless `custom_all_reduce` is False,
    and with it the all-reduce fused with add + RMSNorm unless `allreduce_fusion`
    is False."""
    from datetime import timedelta

    dist.init_process_group(backend, init_method=init_method, world_size=world_size,
                            rank=rank, timeout=timedelta(seconds=timeout_s))
    set_tp_group(dist.group.WORLD)
    set_ep_size(ep_size)
    if backend == "nccl" and custom_all_reduce and world_size > 1:
        init_custom_all_reduce(allreduce_fusion)


# ---- expert parallelism -----------------------------------------------------------
@dataclass(frozen=True)
class MoeParallel:
    """How this rank takes part in the MoE layers: expert-parallel group `ep_rank`
    of `ep_size` (each holding a share of the experts), and within it rank
    `tp_rank` of `tp_size` (each holding a slice of those experts' intermediate
    dimension). Tensor-parallel rank r is (r // tp_size, r % tp_size). `group`:
    the ranks of this expert-parallel group (None when that is the whole
    tensor-parallel group or one rank)."""

    ep_size: int = 1
    ep_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    group: Any = None

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the experts this rank's group holds."""
        return _even_split(num_experts, self.ep_size, self.ep_rank)

    def owner_rank(self, expert: int, num_experts: int) -> int:
        """The first tensor-parallel rank of the group holding global `expert`."""
        for group in range(self.ep_size):
            start, count = _even_split(num_experts, self.ep_size, group)
            if start <= expert < start + count:
                return group * self.tp_size
        raise ValueError(f"expert {expert} is out of range [0, {num_experts})")


def _even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


_MOE: MoeParallel | None = None  # set by set_ep_size; None: one expert-parallel group


def set_ep_size(ep_size: int) -> None:
    """Split the tensor-parallel group into `ep_size` expert-parallel groups of
    consecutive ranks (every rank calls it, after `set_tp_group`). ValueError
    unless `ep_size` divides the tensor-parallel size."""
    global _MOE
    world = get_tp_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide tp_size={world}: expert parallelism "
                         "runs inside the tensor-parallel group")
    rank, per_group = get_tp_rank(), world // ep_size
    group = None
    if ep_size > 1 and per_group > 1:
        # new_group is collective: every rank creates every group, in order.
        for g in range(ep_size):
            ranks = [dist.get_global_rank(_TP_GROUP, g * per_group + r) for r in range(per_group)]
            created = dist.new_group(ranks)
            if g == rank // per_group:
                group = created
    _MOE = MoeParallel(ep_size, rank // per_group, per_group, rank % per_group, group)
    if ep_size > 1:
        logger.info("expert parallelism: %d groups of %d rank(s); this rank is group %d",
                    ep_size, per_group, rank // per_group)


def moe_parallel() -> MoeParallel:
    """This rank's place in the MoE layers (by default one expert-parallel group:
    every rank holds every expert, a slice of each)."""
    return _MOE or MoeParallel(1, 0, get_tp_size(), get_tp_rank())


# ---- custom all-reduce ------------------------------------------------------------
# One-shot reads every peer's whole message over NVLink, so its cost grows with
# size times ranks; NCCL's ring moves 2(n-1)/n of it. Decode messages (batch x
# hidden x 2 bytes: 8 KB at batch 1, 2 MB at batch 256 on Llama-8B) sit far
# below the crossover, where NCCL's fixed cost per call dominates (2 x H200,
# in a CUDA graph: 19.5 us vs 6.6 at 8 KB, 38 vs 21 at 2 MB; BENCHMARKS.md).
CUSTOM_AR_MAX_BYTES = 2 << 20
CUSTOM_AR_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one-shot kernel sums


class SymmMemAllReduce:
    """All-reduce of small messages by one kernel over NVLink peer-to-peer loads.

    Every rank owns a buffer in torch's symmetric memory (mapped into each
    peer's address space); a call copies `x` into it, meets the peers at a
    device-side barrier, sums all ranks' buffers and meets them again before the
    buffer can be reused (`symm_mem::one_shot_all_reduce_copy_out`). No host
    work but a launch, so it replays inside CUDA graphs. Needs no NVLink
    multicast. With two ranks both get the same bits (a + b = b + a; the GPU
    test checks it); sampled ids are broadcast from rank 0 in any case.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 max_bytes: int = CUSTOM_AR_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.device = device
        self.max_bytes = max_bytes
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        major_minor = tuple(int(p) for p in torch.__version__.split(".")[:2])
        if major_minor < (2, 11):  # needed by older torch; deprecated (warns) in 2.11
            symm_mem.enable_symm_mem_for_group(self.group_name)
        for dtype in CUSTOM_AR_DTYPES:
            buf = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf

    def can_reduce(self, x: torch.Tensor) -> bool:
        return (x.dtype in self.buffers and x.device == self.device and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        view = self.buffers[x.dtype][:x.numel()].view_as(x)
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self.group_name, out)
        return out


_CUSTOM_AR: SymmMemAllReduce | None = None
_AR_NORM: AllReduceNorm | None = None


def _agree(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of the TP group (a collective)."""
    agreed = torch.tensor([int(ok)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=_TP_GROUP)
    return bool(agreed.item())


def init_custom_all_reduce(allreduce_fusion: bool = True) -> bool:
    """Set up the custom all-reduce for the TP group, and (`allreduce_fusion`) the
    all-reduce fused with add + RMSNorm (collectives: every rank calls this). On
    any rank's failure every rank keeps NCCL alone, or the unfused path;
    returns whether the custom all-reduce is in use."""
    global _CUSTOM_AR, _AR_NORM
    assert _tp_active() and _TP_GROUP is not None
    device = torch.device("cuda", torch.cuda.current_device())
    world = get_tp_size()
    custom: SymmMemAllReduce | None = None
    try:
        custom = SymmMemAllReduce(_TP_GROUP, device)
        probe = torch.full((64,), float(get_tp_rank() + 1), device=device)
        ok = bool((custom(probe) == world * (world + 1) / 2).all())
    except Exception as e:  # no P2P, no symmetric memory in this torch, ...
        logger.warning("custom all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
        ok = False
    _CUSTOM_AR = custom if _agree(ok, device) else None
    if _CUSTOM_AR is None:
        return False
    logger.info("custom all-reduce on: one-shot over symmetric memory up to %d KB",
                CUSTOM_AR_MAX_BYTES >> 10)
    if allreduce_fusion:
        _AR_NORM = _init_allreduce_norm(device)
        if _AR_NORM is not None:
            logger.info("all-reduce fused with residual add + RMSNorm on")
    return True


def _init_allreduce_norm(device: torch.device) -> AllReduceNorm | None:
    """The fused all-reduce + add + RMSNorm, if every rank can set it up and a probe
    sums right. Ranks agree before the probe: a rank that launched the kernel
    alone would wait at its barrier forever."""
    fused: AllReduceNorm | None = None
    try:
        fused = _symm_allreduce_norm(_TP_GROUP, device)
    except Exception as e:  # no Triton, an older symmetric-memory API, ...
        logger.warning("fused all-reduce + RMSNorm unavailable (%s: %s)", type(e).__name__, e)
    if not _agree(fused is not None, device):
        return None
    assert fused is not None
    world = get_tp_size()
    x = fused.buffer((1, 64), torch.float32)
    x.fill_(float(get_tp_rank() + 1))
    _, summed = fused(x, torch.zeros_like(x), torch.ones(64, device=device), 1e-6)
    ok = bool((summed == world * (world + 1) / 2).all())
    return fused if _agree(ok, device) else None


def _symm_allreduce_norm(group: dist.ProcessGroup, device: torch.device) -> AllReduceNorm:
    """An `AllReduceNorm` over two slots of `FUSED_MAX_BYTES` in symmetric memory."""
    import torch.distributed._symmetric_memory as symm_mem

    from radixlm.layers.allreduce_norm import (
        FUSED_MAX_BYTES,
        HAS_TRITON,
        MAX_PROGRAMS,
        AllReduceNorm,
    )

    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    buf = symm_mem.empty(2 * FUSED_MAX_BYTES, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    assert handle.buffer_ptrs[handle.rank] == buf.data_ptr()
    assert handle.signal_pad_size >= MAX_PROGRAMS * handle.world_size * 4
    ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
    return AllReduceNorm(buf, ptrs, pads, handle.rank, handle.world_size)


def _fused_for(shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> AllReduceNorm | None:
    """The fused all-reduce + norm kernel, if it is set up and takes such a tensor:
    one test for the producer (`partial_sum_buffer`) and the consumer."""
    fused = _AR_NORM
    if fused is None or device.type != "cuda" or not fused.can_reduce(shape, dtype):
        return None
    return fused


def partial_sum_buffer(shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor | None:
    """Where a row-parallel layer should write a partial sum that the next
    `all_reduce_add_rms_norm` takes: a slot of symmetric memory, or None (write
    it anywhere; the reduction then runs apart from the norm)."""
    fused = _fused_for(shape, dtype, device)
    return None if fused is None else fused.buffer(shape, dtype)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(all_reduce(x) + residual) * weight, all_reduce(x) + residual) in one
    kernel (`layers.allreduce_norm`), or None where that kernel is not set up or
    does not take x: the caller then reduces and normalizes apart."""
    fused = _fused_for(x.shape, x.dtype, x.device)
    return None if fused is None else fused(x, residual, weight, eps)


def custom_all_reduce_enabled() -> bool:
    return _CUSTOM_AR is not None


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
