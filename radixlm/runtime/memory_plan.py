"""One memory plan sizes every KV pool (seed 001 ModelRunner: `init_memory_pool`).

Once every model's weights are loaded, the memory left pays first for a
reserved budget (adapters), then for the KV cache of each model that runs on
these slots: the target's and, with a drafter, the drafter's. All pools get
the same number of slots: the scheduler hands out one slot per token, and a
drafter's pool keeps that token's draft-model KV at the same slot (only the
first pool's allocator is ever used). Each pool comes from the pool registry
(`cache/pool_registry.py`) for its model's `KVSpec` and KV dtype.

Memory left: on CUDA the free device memory above `1 - mem_fraction_static`
of the card; on the CPU a modest slice of the host's available RAM, which
other processes share. `--max-total-tokens` overrides the sizing. Every
tensor-parallel rank must admit the same requests, so all take the smallest
count any rank can hold.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import psutil
import torch

from radixlm import distributed as tp
from radixlm.cache.kv_spec import KVSpec
from radixlm.cache.memory_pool import KVPool, PoolOptions, ReqToTokenPool
from radixlm.cache.pool_registry import kv_pool_class
from radixlm.config import ServerArgs

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.1
CPU_MAX_DEFAULT_TOKENS = 65536
MIN_TOKENS = 16
# Request-table columns beyond the context: a verify step's draft tokens past
# the last position still get a (never read) table entry.
TABLE_SLACK = 8


@dataclass(frozen=True)
class KVRequest:
    """One model's KV needs: `name` ("target", "draft") labels its pool."""

    name: str
    spec: KVSpec
    dtype: torch.dtype


@dataclass
class KVPools:
    """What the plan built: the request table, one KV pool per request (by name),
    and the limits the scheduler admits against."""

    req_to_token_pool: ReqToTokenPool
    pools: dict[str, KVPool]
    max_total_tokens: int
    max_running_requests: int

    @property
    def target(self) -> KVPool:
        return self.pools["target"]


class MemoryPlan:
    def __init__(self, args: ServerArgs, device: torch.device, context_len: int,
                 requests: list[KVRequest], reserve_bytes: int = 0) -> None:
        """`requests`: the target's first. `reserve_bytes`: kept out of the KV cache
        (adapter weights)."""
        if not requests or requests[0].name != "target":
            raise ValueError("the memory plan needs the target model's KV request first")
        self.args = args
        self.device = device
        self.context_len = context_len
        self.requests = requests
        self.reserve_bytes = reserve_bytes
        self.options = PoolOptions(swa_full_tokens_ratio=args.swa_full_tokens_ratio)
        self.classes = [kv_pool_class(r.spec, r.dtype) for r in requests]

    def bytes_per_token(self) -> float:
        """KV bytes one slot costs over all pools."""
        return sum(cls.bytes_per_slot(r.spec, r.dtype, self.options)
                   for cls, r in zip(self.classes, self.requests))

    def available_bytes(self) -> float:
        """Memory the KV cache may take, before the reserve."""
        if self.device.type == "cuda":
            # An earlier engine of this process may be garbage still (its model and
            # graph runner hold each other): collected, its tensors' blocks count below.
            gc.collect()
            free, total = torch.cuda.mem_get_info(self.device)
            # Blocks torch's allocator holds but no tensor uses (an earlier engine's,
            # in this process) are the pools' to reuse, though the driver counts them.
            cached = (torch.cuda.memory_reserved(self.device)
                      - torch.cuda.memory_allocated(self.device))
            return free + cached - total * (1 - self.args.mem_fraction_static)
        return psutil.virtual_memory().available * CPU_KV_FRACTION

    def total_tokens(self) -> int:
        """Slots per pool, the same on every tensor-parallel rank."""
        tokens = self._local_tokens()
        sync = tp.get_tp_sync()
        return sync.min_int(tokens) if sync is not None else tokens

    def _local_tokens(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        budget = self.available_bytes() - self.reserve_bytes
        tokens = int(max(budget, 0) // self.bytes_per_token())
        if self.device.type == "cpu":
            tokens = min(tokens, CPU_MAX_DEFAULT_TOKENS)
        if tokens < MIN_TOKENS:
            raise RuntimeError(
                f"not enough memory for the KV cache ({budget / 2**20:.0f} MiB left after "
                f"{self.reserve_bytes / 2**20:.0f} MiB reserved); lower --mem-fraction-static "
                "or set --max-total-tokens")
        return tokens

    def build(self) -> KVPools:
        tokens = self.total_tokens()
        if self.reserve_bytes:
            logger.info("memory plan: %.1f MiB reserved for adapters", self.reserve_bytes / 2**20)
        pools = {}
        for cls, r in zip(self.classes, self.requests):
            pools[r.name] = cls.create(r.spec, r.dtype, tokens, self.device, self.options)
            nbytes = cls.bytes_per_slot(r.spec, r.dtype, self.options) * tokens
            logger.info("memory plan: %s KV pool %s, %d tokens x %d layers in %s: %.1f MiB",
                        r.name, cls.__name__, tokens, r.spec.num_layers,
                        str(r.dtype).removeprefix("torch."), nbytes / 2**20)
        default = 256 if self.device.type == "cuda" else 128
        max_running = min(self.args.max_running_requests or default, tokens)
        width = self.context_len + TABLE_SLACK
        path_rows = self.tree_path_rows(max_running)
        if path_rows:
            logger.info("memory plan: %d request-table rows for tree verifies in CUDA graphs, "
                        "%.1f MiB", path_rows, path_rows * width * 4 / 2**20)
        table = ReqToTokenPool(max_running, width, self.device, path_rows=path_rows)
        return KVPools(table, pools, tokens, max_running)

    def tree_path_rows(self, max_running: int) -> int:
        """Spare request-table rows for the CUDA graph runner's tree verifies (one per
        verify row of its largest graph; `cuda_graph_runner.py`): with tree drafts
        on CUDA only (also with --disable-cuda-graph, whose static batches must
        compute what the graphs would)."""
        if self.device.type != "cuda" or self.args.speculative_topk <= 1:
            return 0
        return min(self.args.cuda_graph_max_bs, max_running)
