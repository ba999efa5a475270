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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from radixlm.layers.cpu_ops import qgemm
from radixlm.layers.cpu_ops.qpack import GGUF_FORMATS
from radixlm.layers.quantization.base import EmbeddingMethod, LinearMethod, QuantizationConfig
from radixlm.layers.quantization.packed import (
    PackedEmbeddingMethod,
    PackedLinearMethod,
    why_not_packed,
)
from radixlm.layers.quantization.unquantized import UnquantizedConfig
from radixlm.layers.sharding import ShardId

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
