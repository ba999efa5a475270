"""FP8 (e4m3) experts: a MoE layer's stacked expert weights in FP8, by the FP8 schemes
of the dense layers (`fp8.py`).

- Online (`--quantization fp8` on a float checkpoint): each expert's weight rows
  quantized at load with one float32 scale per row, codes and scale in one
  parameter per stack as `Fp8OnlineSpec` holds a dense weight ([E, rows,
  row_stride(features)]); read back as floats.
- An FP8 checkpoint (HF `quant_method: fp8`, compressed-tensors FP8): per expert
  its `gate_proj` / `up_proj` / `down_proj` codes and scales, stacked into
  `gate_up_proj` / `down_proj` and `<stack>_<scale name>` (the checkpoint's
  `experts.<e>.gate_proj.weight_scale_inv` resolves to `gate_up_proj_weight_scale_inv`
  at shard (e, 0)), with the dense specs under `ExpertSpec`: block grids
  (`BlockScaleSpec`: gate and up each their own grid, ragged edges included,
  stacked), per-channel or per-tensor scales. A tensor-parallel cut inside a
  block is refused at construction, naming the layer.

Products are weight-only: activations stay in the model's dtype and the
codes are converted to it tile by tile (the Triton kernels on CUDA, or the
CPU under the Triton interpreter) or expert by expert when it has tokens
(the CPU and torch backends), never stored dequantized. A checkpoint's static
activation scales load (so that its tensors all have a place) and are not
used. The backend comes from the registry (`layers/moe/backends.py`) as
for float experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.layers.moe.backends import select_backend
from radixlm.layers.moe.method import check_graph_capture
from radixlm.layers.quantization.base import FusedMoEMethod
from radixlm.layers.quantization.fp8 import (
    F32,
    FP8,
    Fp8OnlineSpec,
    Fp8Scheme,
    block_table,
    online_scales,
    row_stride,
)
from radixlm.layers.quantization.specs import BlockScaleSpec, PartScalarSpec, cdiv
from radixlm.layers.sharding import AxisSpec, ExpertPartition, ExpertSpec

if TYPE_CHECKING:
    from radixlm.layers.moe.fused_moe import FusedMoE

STACKS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Experts:
    """What the products read, derived after loading: the FP8 stacks (views of the
    parameters, rows maybe strided) and their float32 scales in the layout
    `fused_experts` takes: [E, rows] per row, or with `block_shape` (bn, bk)
    [E, cdiv(rows, bn), cdiv(features, bk)] per block."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    block_shape: tuple[int, int] | None = None


class Fp8FusedMoEMethod(FusedMoEMethod):
    """A MoE layer's experts in FP8: quantized at load (`scheme` None) or as an FP8
    checkpoint stores them (see the module docstring); products by the backend
    `backend` names."""

    def __init__(self, scheme: Fp8Scheme | None = None, backend: str = "auto") -> None:
        if scheme is not None and scheme.strategy not in ("block", "channel", "tensor"):
            raise ValueError(f"FP8 experts: weight scale strategy {scheme.strategy!r} "
                             "(radixlm reads block, channel and tensor)")
        self.scheme = scheme
        self.backend_name = backend

    def create_weights(self, layer: FusedMoE, params_dtype: torch.dtype) -> None:
        for name in STACKS:
            part = layer.partition(name)
            if self.scheme is None:
                self._online_stack(layer, name, part)
            else:
                self._checkpoint_stack(layer, name, part)
        self.backend = select_backend(self.backend_name, torch.get_default_device())
        self.fused_experts = self.backend.load()

    @staticmethod
    def _online_stack(layer: FusedMoE, name: str, part: ExpertPartition) -> None:
        rows = sum(p.size for p in part.outputs)
        weight = torch.zeros(layer.num_local_experts, rows, row_stride(part.input.size),
                             dtype=FP8)
        layer.add_weight(name, weight, ExpertSpec(Fp8OnlineSpec(), part))

    def _checkpoint_stack(self, layer: FusedMoE, name: str, part: ExpertPartition) -> None:
        s, e = self.scheme, layer.num_local_experts
        rows, k, parts = sum(p.size for p in part.outputs), part.input.size, len(part.shard_ids)
        layer.add_weight(name, torch.zeros(e, rows, k, dtype=FP8), ExpertSpec(
            AxisSpec(output_dim=0, input_dim=1, checkpoint_dtypes=frozenset({FP8})), part))
        if s.strategy == "block":
            spec = _block_spec(layer, name, part, s.block)
            scale = torch.ones(e, sum(spec.part_rows(part)), cdiv(k, s.block[1]), dtype=F32)
        elif s.strategy == "channel":
            spec, scale = AxisSpec(output_dim=0, input_dim=None), torch.ones(e, rows, 1,
                                                                             dtype=F32)
        else:
            spec, scale = PartScalarSpec(s.scalar_ndim), torch.ones(e, parts, dtype=F32)
        layer.add_weight(f"{name}_{s.weight_scale}", scale, ExpertSpec(spec, part))
        if s.static_input:  # loaded so that the checkpoint's tensors have a place; unused
            layer.add_weight(f"{name}_{s.input_scale}", torch.ones(e, parts, dtype=F32),
                             ExpertSpec(PartScalarSpec(s.scalar_ndim), part))

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if self.scheme is None:
            layer.fp8_experts = Fp8Experts(*_online(layer, "gate_up_proj"),
                                           *_online(layer, "down_proj"))
        elif self.scheme.strategy == "block":
            layer.fp8_experts = _blocks(layer, self.scheme)
        else:
            layer.fp8_experts = Fp8Experts(*_per_row(layer, "gate_up_proj", self.scheme),
                                           *_per_row(layer, "down_proj", self.scheme))

    def drop_derived(self, layer: FusedMoE) -> None:
        layer.fp8_experts = None

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w: Fp8Experts | None = getattr(layer, "fp8_experts", None)
        assert w is not None, "process_weights_after_loading has not run on this layer"
        check_graph_capture(self.backend, x)
        return self.fused_experts(x, w.w13, w.w2, topk_weights, topk_ids,
                                  activation=layer.activation, w13_scale=w.w13_scale,
                                  w2_scale=w.w2_scale, block_shape=w.block_shape)

    def describe(self, layer: FusedMoE) -> str:
        if self.scheme is None:
            how = "quantized at load, per-channel weight scales"
        else:
            s = self.scheme
            how = (f"{s.block[0]}x{s.block[1]} block" if s.block else f"per-{s.strategy}") + \
                " weight scales" + (" (the static activation scales unused)"
                                    if s.static_input else "")
        dtype = str(layer.params_dtype).removeprefix("torch.")
        return (f"FP8 e4m3 experts ({how}), weight-only: products in {dtype} on the "
                f"{self.backend.name} backend")


def _block_spec(layer: FusedMoE, name: str, part: ExpertPartition,
                block: tuple[int, int]) -> BlockScaleSpec:
    """The block-scale spec of stack `name`; ValueError naming the layer when a
    tensor-parallel piece of an expert is not whole blocks."""
    spec = BlockScaleSpec(*block)
    try:
        spec.check_cuts(part)
    except ValueError as e:
        raise ValueError(f"{layer.prefix}.{name}: the experts' intermediate size "
                         f"{layer.intermediate_size} split into pieces of "
                         f"{layer.intermediate_per_partition} cuts a weight_block_size "
                         f"[{block[0]}, {block[1]}] FP8 expert weight inside a block ({e}); "
                         "use a tensor-parallel size (or ep_size) whose pieces are whole "
                         "blocks") from None
    return spec


def _online(layer: FusedMoE, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [E, rows, features] strided, scales [E, rows]) of an online stack."""
    param = getattr(layer, name).data
    e, rows, _ = param.shape
    scales = online_scales(param.flatten(0, 1)).view(e, rows)
    return param[:, :, :layer.partition(name).input.size], scales


def _per_row(layer: FusedMoE, name: str, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, a scale per expert and row [E, rows]) of a channel or tensor stack."""
    weight = getattr(layer, name).data
    scale = getattr(layer, f"{name}_{scheme.weight_scale}").data.float()
    if scheme.strategy == "channel":
        return weight, scale.squeeze(-1).contiguous()
    sizes = torch.tensor([p.size for p in layer.partition(name).outputs], device=scale.device)
    return weight, scale.repeat_interleave(sizes, dim=1).contiguous()


def _blocks(layer: FusedMoE, scheme: Fp8Scheme) -> Fp8Experts:
    """Both stacks' block grids as tables with one row per g weight rows, g the
    largest divisor of the block that both stacks' parts share (the kernels take
    one block shape): gate's and up's grids each keep their ragged last block."""
    bn, bk = scheme.block
    up, down = layer.partition("gate_up_proj"), layer.partition("down_proj")
    up_rows, down_rows = [p.size for p in up.outputs], [p.size for p in down.outputs]
    g = math.gcd(bn, *up_rows, *down_rows)
    tables = []
    for name, rows in (("gate_up_proj", up_rows), ("down_proj", down_rows)):
        grid = getattr(layer, f"{name}_{scheme.weight_scale}").data.float()
        tables.append(block_table(grid, rows, bn, g)[0])
    return Fp8Experts(layer.gate_up_proj.data, tables[0], layer.down_proj.data, tables[1],
                      (g, bk))
