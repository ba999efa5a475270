"""Block configs of the fused MoE: a committed table per (device, E, H, I, dtype,
token bucket), a heuristic for anything the table lacks, and the limits every
config is fitted to before launch.

One `MoEConfig` serves a whole MoE layer call: BLOCK_M is shared (the alignment
pads groups to it, and both GEMMs walk the same row blocks), the other tile
parameters are per GEMM. The layer shape fixes both GEMMs' (N, K): gate/up is
(2I, H), down (H, I); so the table's key (E, H, I, dtype) is the brief's
(E, N, K, dtype) of both at once.

The table (`fused_moe_configs.json`) maps device name -> shape key -> token count
-> config; a call uses the bucket nearest its token count in log scale.
`benchmarks/tune_fused_moe.py` times candidates on a GPU and writes such a file;
keys starting with "_" are comments. This module needs only torch (no triton), so
the table can be read and checked anywhere.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("fused_moe_configs.json")
# Shared memory a config may plan for (H100/H200 allow 227 KiB per block; Triton's
# own scratch and the epilogue's layout conversion need some of it).
SMEM_BUDGET = 196 * 1024


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gate_up: GemmTile
    down: GemmTile

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> MoEConfig:
        return cls(int(d["block_m"]), GemmTile(**d["gate_up"]), GemmTile(**d["down"]))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={inter},dtype={dtype_name(dtype)}"


class ConfigTable:
    """Tuned configs: {device name: {shape_key: {token count: MoEConfig}}}."""

    def __init__(self, entries: dict[str, dict[str, dict[int, MoEConfig]]]):
        self.entries = entries

    @classmethod
    def from_json(cls, data: dict) -> ConfigTable:
        entries = {
            dev: {key: {int(t): MoEConfig.from_json(c) for t, c in buckets.items()
                        if not t.startswith("_")}
                  for key, buckets in shapes.items() if not key.startswith("_")}
            for dev, shapes in data.items() if not dev.startswith("_")}
        return cls(entries)

    @classmethod
    def load(cls, path: str | Path) -> ConfigTable:
        with open(path) as f:
            return cls.from_json(json.load(f))

    def to_json(self) -> dict:
        return {dev: {key: {str(t): c.to_json() for t, c in sorted(b.items())}
                      for key, b in shapes.items()} for dev, shapes in self.entries.items()}

    def dumps(self, comment: str) -> str:
        """The table as JSON text, one line per token bucket."""
        lines = ["{", f' "_comment": {json.dumps(comment)},']
        devs = list(self.entries.items())
        for i, (dev, shapes) in enumerate(devs):
            lines.append(f" {json.dumps(dev)}: {{")
            for j, (key, buckets) in enumerate(shapes.items()):
                lines.append(f"  {json.dumps(key)}: {{")
                items = sorted(buckets.items())
                lines += [f"   \"{t}\": {json.dumps(c.to_json())}"
                          + ("," if n < len(items) - 1 else "") for n, (t, c) in enumerate(items)]
                lines.append("  }" + ("," if j < len(shapes) - 1 else ""))
            lines.append(" }" + ("," if i < len(devs) - 1 else ""))
        return "\n".join(lines + ["}"]) + "\n"

    def lookup(self, device_name: str, key: str, num_tokens: int) -> MoEConfig | None:
        buckets = self.entries.get(device_name, {}).get(key)
        if not buckets:
            return None
        t = math.log2(max(num_tokens, 1))
        return buckets[min(buckets, key=lambda b: (abs(math.log2(b) - t), b))]


@functools.cache
def default_table() -> ConfigTable:
    return ConfigTable.load(TABLE_PATH)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


# (most expected rows per routed expert, config): decode is weight-read bound (many
# narrow column tiles), prefill compute bound (the largest tiles that do not spill).
HEURISTIC = [
    (24, MoEConfig(16, GemmTile(32, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))),
    (48, MoEConfig(32, GemmTile(64, 128, 1, 4, 3), GemmTile(64, 128, 1, 4, 4))),
    (96, MoEConfig(64, GemmTile(64, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 4))),
    (math.inf, MoEConfig(128, GemmTile(128, 64, 8, 8, 3), GemmTile(256, 64, 8, 8, 3))),
]


def heuristic_config(num_tokens: int, num_experts: int, top_k: int,
                     dtype: torch.dtype) -> MoEConfig:
    """A config from the expected rows per routed expert (uniform routing), for
    shapes or devices the table lacks; `fit_tile` then sizes it to the shape."""
    pairs = num_tokens * top_k
    active = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** pairs)  # experts hit
    rows = pairs / max(active, 1.0)
    cfg = next(c for most, c in HEURISTIC if rows <= most)
    if dtype.itemsize > 2:
        # fp32 operands take twice the registers and shared memory: BLOCK_M 128 spills
        # (ptxas, sm_90), and half the K step keeps the bytes per stage.
        if cfg.block_m > 64:
            cfg = HEURISTIC[2][1]
        cfg = replace(cfg, gate_up=replace(cfg.gate_up, block_k=cfg.gate_up.block_k // 2),
                      down=replace(cfg.down, block_k=cfg.down.block_k // 2))
    return cfg


def get_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
               dtype: torch.dtype, device: torch.device,
               table: ConfigTable | None = None) -> MoEConfig:
    """The table's config for this shape on this device, else the heuristic's."""
    if device.type == "cuda":
        tab = table if table is not None else default_table()
        name = _device_name(device.index if device.index is not None else
                            torch.cuda.current_device())
        cfg = tab.lookup(name, shape_key(num_experts, hidden, inter, dtype), num_tokens)
        if cfg is not None:
            return cfg
    return heuristic_config(num_tokens, num_experts, top_k, dtype)


def _pow2_floor(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << (max(x, 1) - 1).bit_length()


def fit_tile(tile: GemmTile, n: int, k: int, block_m: int, a_bytes: int, b_bytes: int,
             b_tiles: int, k_multiple_of: int | None = None) -> GemmTile:
    """`tile` shrunk to the GEMM: tiles no wider than N or K need (tl.dot's minimum is
    16), BLOCK_K a divisor of `k_multiple_of` (a weight scale block), and the
    pipelined A + `b_tiles` B tiles within SMEM_BUDGET (fewer stages first, then
    a shorter K step)."""
    bn = max(16, min(tile.block_n, _pow2_ceil(n)))
    bk = max(16, min(tile.block_k, _pow2_ceil(k)))
    if k_multiple_of is not None:
        bk = min(bk, _pow2_floor(k_multiple_of & -k_multiple_of))  # largest pow2 divisor
        assert bk >= 16, f"a weight scale block of {k_multiple_of} along K is below 16"
    stages = tile.num_stages

    def smem(bk: int, stages: int) -> int:
        return stages * bk * (block_m * a_bytes + b_tiles * bn * b_bytes)

    while smem(bk, stages) > SMEM_BUDGET and stages > 2:
        stages -= 1
    while smem(bk, stages) > SMEM_BUDGET and bk > 16:
        bk //= 2
    return replace(tile, block_n=bn, block_k=bk, num_stages=stages)



def fit_config(cfg: MoEConfig, hidden: int, inter: int, dtype: torch.dtype) -> MoEConfig:
    """Both tiles of `cfg` fitted to a layer with unscaled weights of `dtype` (what
    the launch would use; the tuner stores and compares these)."""
    size = dtype.itemsize
    return replace(cfg, gate_up=fit_tile(cfg.gate_up, inter, hidden, cfg.block_m, size, size, 2),
                   down=fit_tile(cfg.down, hidden, inter, cfg.block_m, size, size, 1))
