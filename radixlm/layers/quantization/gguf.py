"""GGUF weights kept as their blocks (`--quantization gguf`, the CPU only).

The config is built from a .gguf file's tensor types (`models/gguf_packed.py`
maps them onto our layers and yields the packed tensors): every linear
layer, the embedding and the LM head whose GGUF tensors are in a format our
kernels run (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) keeps them, repacked into
the kernels' tile layout (`packed.py`); a layer with a part in any other
type (F32, F16, Q5_0, ...), or a tensor-parallel piece that is not whole
tiles and blocks, holds floats (the dequantized conversion's tensors), and
the start-up log says which and why. The checkpoint tensors of a kept layer
are the packed bytes, so a weight update or read-back of one speaks bytes
too (`get_weights_by_name` gives them; an update from floats is refused by
dtype).

A MoE layer's experts (a file's stacked `ffn_*_exps`, one packed tensor per
expert under its HF name) keep their blocks the same way when every expert's
part is in a kept format (`GGUFFusedMoEMethod`): each rank's experts in two
stacks of packed bytes, and per expert with tokens one product for gate/up
and one for down in our kernels, so a decode step reads only the selected
experts' blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from radixlm import distributed as tp
from radixlm.layers.activation import SiluAndMul
from radixlm.layers.cpu_ops import qgemm
from radixlm.layers.cpu_ops.qpack import GGUF_FORMATS
from radixlm.layers.quantization.base import (
    EmbeddingMethod,
    FusedMoEMethod,
    LinearMethod,
    QuantizationConfig,
)
from radixlm.layers.quantization.packed import (
    PackedEmbeddingMethod,
    PackedLinearMethod,
    PackedSpec,
    layer_parts,
    why_not_packed,
)
from radixlm.layers.quantization.unquantized import UnquantizedConfig
from radixlm.layers.sharding import ExpertSpec, ShardId

# (our module name, shard id) -> (the checkpoint tensor's HF name, its GGUF type name)
GGUFTensors = Mapping[tuple[str, ShardId], tuple[str, str]]
# (model_dir, HF names kept packed) -> the checkpoint's (name, tensor) pairs
WeightSource = Callable[[str, frozenset[str]], Iterator[tuple[str, torch.Tensor]]]


def check_cpu_kernels(name: str) -> None:
    """ValueError unless layers are being built on the CPU and our kernels build."""
    device = torch.get_default_device()
    if device.type != "cpu":
        raise ValueError(f"quantization={name!r} runs on the CPU only (our C++ kernels), not "
                         f"on {device.type}; use --quantization none (a .gguf file is then "
                         "dequantized at load)")
    if not qgemm.load():
        raise ValueError(f"quantization={name!r}: the quantized CPU kernels could not be "
                         "built (see the warning above: a C++ compiler and ninja are needed); "
                         "use --quantization none")


def rows_of(layer: Any) -> list[int]:
    """This rank's rows of each fused part; an embedding table's padded rows."""
    padded = getattr(layer, "num_embeddings_per_partition", None)
    if padded is not None:
        return [padded]
    return [layer.output_piece(s).size for s in layer.shard_ids]


class GGUFLinearMethod(PackedLinearMethod):
    """Products on GGUF blocks (repacked); checkpoint tensors are the packed bytes."""


# The stacked expert weights and their parts inside one expert.
EXPERT_PARTS = {"gate_up_proj": (0, 1), "down_proj": (None,)}


class GGUFFusedMoEMethod(FusedMoEMethod):
    """Experts on GGUF blocks: per stacked weight one uint8 parameter [local
    experts, bytes], each row an expert's `PackedLayout` bytes (gate then up;
    down), loaded per expert from its packed checkpoint tensor (`PackedSpec`
    under the layer's per-expert pieces). Only the experts with tokens run:
    tokens grouped by expert, gate/up, silu * up and down in our kernels,
    weighted sums in float32."""

    on_product_pool = True

    def __init__(self, formats: dict[str, list[str]]) -> None:
        self.formats = formats  # stacked weight -> its parts' formats

    def create_weights(self, layer: Any, params_dtype: torch.dtype) -> None:
        if params_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"quantized CPU experts compute in float32 or bfloat16, not "
                             f"{params_dtype} (pass --dtype float32 or bfloat16)")
        for name, formats in self.formats.items():
            part = layer.partition(name)
            runs, parts = layer_parts(part, formats, part.input.size,
                                      [p.size for p in part.outputs])
            nbytes = sum(run.layout.nbytes for run in runs)
            weight = torch.zeros(layer.num_local_experts, nbytes, dtype=torch.uint8,
                                 device="cpu")
            layer.add_weight(name, weight, ExpertSpec(PackedSpec(runs, parts), part))
        self.act = SiluAndMul()

    def process_weights_after_loading(self, layer: Any) -> None:
        layer.packed_experts = [
            tuple(self._runs(getattr(layer, name), e) for name in EXPERT_PARTS)
            for e in range(layer.num_local_experts)]
        # One run per part (gate/up in one format): a lone token's experts take
        # one grouped product per part.
        layer.grouped_experts = all(len(runs) == 1 for parts in layer.packed_experts
                                    for runs in parts)

    @staticmethod
    def _runs(param: torch.nn.Parameter, expert: int) -> list[tuple[Any, int, int]]:
        buf = param.data[expert]
        return [(run.layout.weight(buf[run.offset:run.offset + run.layout.nbytes]), run.column,
                 run.column + run.layout.n) for run in param.weight_spec.inner.runs]

    def drop_derived(self, layer: Any) -> None:
        layer.packed_experts = None

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        from radixlm.layers.moe.cpu import routed_sum

        experts = layer.packed_experts
        assert experts is not None, "process_weights_after_loading has not run on this layer"

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up, down = experts[expert]
            return _product(self.act(_product(rows, gate_up)), down)

        def experts_mlp(chosen: list[int], x: torch.Tensor) -> torch.Tensor:
            """A lone token's experts: their gate/up products in one call, the
            activation over their rows, their down products in one call (one
            pool job each), each row the bits expert_mlp gives."""
            gate_up = qgemm.grouped_linear(x, [experts[e][0][0][0] for e in chosen])
            return qgemm.grouped_linear(self.act(gate_up), [experts[e][1][0][0] for e in chosen])

        return routed_sum(x, topk_weights, topk_ids, len(experts), expert_mlp,
                          experts_mlp if layer.grouped_experts else None).to(x.dtype)

    def describe(self, layer: Any) -> str:
        kinds = ", ".join(f"{n} {'/'.join(sorted(set(f)))}" for n, f in self.formats.items())
        return f"experts kept as GGUF blocks ({kinds}) on our {qgemm.default_isa()} kernels"


def _product(x: torch.Tensor, runs: list[tuple[Any, int, int]]) -> torch.Tensor:
    """x W^T for a packed weight of one or more runs (parts in different formats)."""
    if len(runs) == 1:
        return qgemm.linear(x, runs[0][0])
    act = qgemm.quantize_activations(x, runs[0][0])
    y = x.new_empty(x.shape[0], runs[-1][2])
    for w, c0, c1 in runs:
        qgemm.gemm_into(act, w, y[:, c0:c1])
    return y


class GGUFConfig(QuantizationConfig):
    """Per layer: its GGUF blocks where our kernels run their format, else floats."""

    name = "gguf"

    def __init__(self, tensors: GGUFTensors, weights: WeightSource,
                 fallback: QuantizationConfig | None = None) -> None:
        self.tensors = tensors
        self._weights = weights
        self.fallback = fallback or UnquantizedConfig()
        self.packed: dict[str, str] = {}  # HF name -> GGUF type, of the tensors kept
        self.floats: dict[str, str] = {}  # our module -> why it holds floats

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethod:
        formats = self._formats(layer, prefix)
        if formats is None:
            return self.fallback.get_linear_method(layer, prefix)
        return GGUFLinearMethod(formats)

    def get_embedding_method(self, layer: Any, prefix: str) -> EmbeddingMethod:
        formats = self._formats(layer, prefix)
        if formats is None:
            return self.fallback.get_embedding_method(layer, prefix)
        return PackedEmbeddingMethod(GGUFLinearMethod(formats))

    def get_moe_method(self, layer: Any, prefix: str) -> FusedMoEMethod:
        formats = self._expert_formats(layer, prefix)
        if formats is None:
            return self.fallback.get_moe_method(layer, prefix)
        return GGUFFusedMoEMethod(formats)

    def _expert_formats(self, layer: Any, prefix: str) -> dict[str, list[str]] | None:
        """Each stacked weight's parts' formats when every expert of this layer
        has its parts in one kept format each; None (and the reason) otherwise."""
        check_cpu_kernels(self.name)
        out: dict[str, list[str]] = {}
        entries: list[tuple[str, str]] = []
        for name, parts in EXPERT_PARTS.items():
            out[name] = []
            for part in parts:
                found = [self.tensors.get((f"{prefix}.{name}", (e, part)))
                         for e in range(layer.num_experts)]
                if any(f is None for f in found):
                    return None  # not GGUF experts; the loader names what is missing
                kinds = sorted({kind for _, kind in found})
                if len(kinds) > 1 or kinds[0] not in GGUF_FORMATS:
                    self.floats[prefix] = (f"experts' {name} in GGUF type {', '.join(kinds)} "
                                           f"(kept: one of {', '.join(GGUF_FORMATS)})")
                    return None
                out[name].append(GGUF_FORMATS[kinds[0]])
                entries += found
        ep = tp.moe_parallel()
        if ep.ep_size > 1 and ep.tp_size > 1:
            # Reading an expert back would gather its tiles over the wrong ranks.
            self.floats[prefix] = "experts split over both expert and tensor parallelism"
            return None
        for name, formats in out.items():
            part = layer.partition(name)
            why = why_not_packed(part, formats, [p.size for p in part.outputs], part.input.size)
            if why:
                self.floats[prefix] = f"experts' {name}: {why}"
                return None
        self.packed.update(entries)
        return out

    def _formats(self, layer: Any, prefix: str) -> list[str] | None:
        check_cpu_kernels(self.name)
        entries = [self.tensors.get((prefix, s)) for s in layer.shard_ids]
        if any(e is None for e in entries):
            # A part the file lacks is named by the loader's completeness check; a
            # tensor that is several of our parts at once (a fused qkv) loads as floats.
            if any(e is not None for e in entries) or any(k[0] == prefix for k in self.tensors):
                self.floats[prefix] = "its GGUF tensors are not one per part of this layer"
            return None
        unkept = sorted({t for _, t in entries if t not in GGUF_FORMATS})
        if unkept:
            why = f"GGUF type {', '.join(unkept)} (kept: {', '.join(GGUF_FORMATS)})"
        else:
            formats = [GGUF_FORMATS[t] for _, t in entries]
            why = why_not_packed(layer, formats, rows_of(layer), layer.input_piece().size)
        if why:
            self.floats[prefix] = why
            return None
        self.packed.update(entries)
        return formats

    def checkpoint_weights(self, model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
        return self._weights(model_dir, frozenset(self.packed))

    def describe(self) -> str:
        kinds = Counter(self.packed.values())
        kept = ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
        line = (f"quantization gguf: {len(self.packed)} tensors kept as GGUF blocks ({kept}), "
                f"products on our {qgemm.default_isa()} kernels")
        if self.floats:
            shown = "; ".join(f"{p}: {why}" for p, why in list(self.floats.items())[:4])
            more = ", ..." if len(self.floats) > 4 else ""
            line += f"; {len(self.floats)} layer(s) hold floats ({shown}{more})"
        return line
