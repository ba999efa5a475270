"""GGUF tensors kept quantized: their blocks under HF names, packed for our
CPU kernels (`layers/cpu_ops/qpack.py`), cached; and the `--quantization
gguf` config that maps them onto a model's layers.

The first use of a GGUF file packs every tensor of a kept block format
(`qpack.GGUF_FORMATS`) into `cache_root()/<stem>-<digest>-packed<VERSION>/`
(safetensors shards of one uint8 tensor per HF name, the bytes
`layers/quantization/packed.PackedLayout` describes, and an index of formats
and shapes; the directory appears atomically, as the dequantized
conversion's does); later starts read the shards (0.1 s for SmolLM2-135M,
against 5 s to pack). q/k rows are un-permuted on the blocks (a row
permutation: blocks run along the input features, so whole rows move),
exactly as the dequantized conversion does on floats. Tensors of other
types (F32 norms, F16) are not here: they load as floats from the converted
directory, as do the tensors of any layer that holds floats.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from radixlm.layers.cpu_ops import qgemm, qpack
from radixlm.layers.quantization import QuantizationConfig, float_config
from radixlm.layers.quantization.gguf import GGUFConfig, GGUFTensors
from radixlm.layers.quantization.packed import PackedLayout, packed_bytes
from radixlm.models.decoder import num_experts
from radixlm.models.gguf_arch import EXPERT, GgufArch, arch_spec
from radixlm.models.gguf_convert import gguf_field, unpermute_qk
from radixlm.models.loader import cached_dir, gguf_tensor_summary, iter_safetensors
from radixlm.models.registry import get_model_class

logger = logging.getLogger(__name__)

VERSION = 2  # of the packed layout; a new layout gets a new cache directory
_SHARD_BYTES = 2 << 30


def tensor_types(gguf_path: str | Path) -> dict[str, str]:
    """HF name -> GGUF type name ('Q4_1', 'F32', ...) of every tensor with an HF name
    (a stacked expert tensor's, with `gguf_arch.EXPERT` for the expert's index)."""
    arch, tensors = gguf_tensor_summary(gguf_path)
    spec = arch_spec(arch, tensors)
    return {name: kind for gguf_name, (kind, _) in tensors.items()
            if (name := spec.hf_name(gguf_name)) is not None}


# The dtype a .gguf file's matrices are stored in, by GGUF type; the block formats'
# values are half precision or less (fp16 scales times small integers).
_STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def stored_dtype(gguf_path: str | Path) -> tuple[str, str]:
    """(dtype name, why) of a .gguf file's weight matrices, for --dtype auto: the
    widest float type among them (F32 > F16 / BF16), or bfloat16 when all are in
    block formats. Norms (1-D, always F32 in GGUF) do not count."""
    _, tensors = gguf_tensor_summary(gguf_path)
    kinds = sorted({kind for kind, dims in tensors.values() if dims >= 2})
    floats = [k for k in ("F32", "F16", "BF16") if k in kinds]
    if floats:
        return _STORED_DTYPES[floats[0]], f"its matrices include {floats[0]} tensors"
    return "bfloat16", f"its matrices are {', '.join(kinds)} blocks (half precision or less)"


def record_stored_dtype(hf_config: PretrainedConfig, gguf_path: str | Path) -> None:
    """Give a converted .gguf config (which records no dtype) the file's stored dtype."""
    if getattr(hf_config, "dtype", None) is None and \
            getattr(hf_config, "torch_dtype", None) is None:
        dtype, why = stored_dtype(gguf_path)
        logger.info("the .gguf file's dtype is taken as %s: %s", dtype, why)
        hf_config.dtype = dtype


def _arch(reader: Any) -> GgufArch:
    return arch_spec(gguf_field(reader, "general.architecture"), (t.name for t in reader.tensors))


def _head_counts(reader: Any) -> tuple[int, int]:
    arch = gguf_field(reader, "general.architecture")
    heads = gguf_field(reader, f"{arch}.attention.head_count")
    return heads, gguf_field(reader, f"{arch}.attention.head_count_kv", heads)


def _blocks(tensor: Any, n: int, permuted: bool, heads: int, kv_heads: int) -> np.ndarray:
    """The tensor's blocks as [n rows, bytes per row], q/k rows in HF order."""
    raw = np.asarray(tensor.data).reshape(n, -1)
    part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if permuted and part in ("attn_q", "attn_k"):
        raw = unpermute_qk(raw, heads if part == "attn_q" else kv_heads)
    return raw


def _pack_all(gguf_path: Path) -> Iterator[tuple[str, qgemm.QuantizedWeight]]:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    spec = _arch(reader)
    heads, kv_heads = _head_counts(reader)
    for tensor in reader.tensors:
        name = spec.hf_name(tensor.name)
        kind = tensor.tensor_type.name
        if name is None or kind not in qpack.GGUF_FORMATS:
            continue
        k, n = int(tensor.shape[0]), int(np.prod(tensor.shape[1:]))
        blocks = _blocks(tensor, n, spec.permuted_qk, heads, kv_heads)
        if len(tensor.shape) == 3:  # stacked experts: [E, rows, bytes], packed one by one
            blocks = blocks.reshape(int(tensor.shape[2]), int(tensor.shape[1]), -1)
        for hf_name, raw in spec.hf_tensors(tensor.name, blocks):
            yield hf_name, qpack.pack_gguf(raw, kind, raw.shape[0], k)


def _write_cache(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file

    index: dict[str, dict[str, Any]] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        filename = f"packed-{len({v['file'] for v in index.values()}):05d}.safetensors"
        save_file(shard, out / filename)
        for key in shard:
            index[key]["file"] = filename
        shard, size = {}, 0

    for name, w in _pack_all(gguf_path):
        index[name] = {"format": w.format, "n": w.n, "k": w.k, "in_features": w.in_features,
                       "file": None}
        shard[name] = packed_bytes(w)
        size += w.nbytes
        if size >= _SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "index.json").write_text(json.dumps(index, indent=1))


def packed_dir(gguf_path: str | Path) -> Path:
    """The cache directory of `gguf_path`'s packed tensors (packing them on first use)."""
    path = Path(gguf_path)
    return cached_dir(path, f"-packed{VERSION}", lambda out: _write_cache(path, out),
                      "Packing GGUF blocks of")


def iter_packed(gguf_path: str | Path, names: frozenset[str] | None = None
                ) -> Iterator[tuple[str, PackedLayout, torch.Tensor]]:
    """(HF name, layout, bytes) of every tensor of a kept block format (of
    `names` only, when given)."""
    from safetensors import safe_open

    directory = packed_dir(gguf_path)
    index = json.loads((directory / "index.json").read_text())
    if names is not None and not names <= set(index):
        raise ValueError(f"{gguf_path}: no packed blocks for {sorted(names - set(index))[:3]}")
    handles: dict[str, Any] = {}
    for name, meta in index.items():
        if names is not None and name not in names:
            continue
        if meta["file"] not in handles:
            handles[meta["file"]] = safe_open(str(directory / meta["file"]), framework="pt")
        layout = PackedLayout(meta["format"], meta["n"], meta["k"], meta["in_features"])
        yield name, layout, handles[meta["file"]].get_tensor(name)


# ---- the --quantization gguf config ---------------------------------------------------
# Whether a .gguf file on the CPU keeps its blocks by default (--quantization auto): it
# does since they won every measured workload against the dequantized weights
# (BENCHMARKS.md, "CPU: GGUF blocks in the engine").
KEEP_BLOCKS_BY_DEFAULT = True


def quant_config(hf_config: PretrainedConfig, gguf_path: Path, quantization: str | None,
                 device: torch.device, dtype: torch.dtype = torch.float32, *,
                 prepack: bool = True, gemv: bool = True,
                 moe_backend: str = "auto", deterministic: bool = False,
                 lm_head: str = "none") -> QuantizationConfig:
    """The config of a model loaded from the .gguf file `gguf_path`: its blocks
    in our kernels (`quantization` 'gguf', or auto where that is the default),
    or floats ('none'; auto on a GPU or in float16). The choice and its reason
    go to the log."""
    floats = float_config(lm_head, prepack=prepack, gemv=gemv, moe_backend=moe_backend,
                          deterministic=deterministic)
    if quantization == "int8":
        raise ValueError("quantization='int8' quantizes a float checkpoint; a .gguf file keeps "
                         "its own blocks (--quantization gguf) or is dequantized (none)")
    if quantization not in (None, "auto", "none", "gguf"):
        raise ValueError(f"quantization={quantization!r}: a .gguf file takes auto, none or gguf")
    if quantization in (None, "auto"):
        quantization, why = _default_choice(device, dtype)
        logger.info("quantization auto -> %s for a .gguf file: %s", quantization, why)
    if quantization == "none":
        return floats
    return GGUFConfig(gguf_tensors(gguf_path, hf_config),
                      lambda model_dir, packed: checkpoint_tensors(gguf_path, model_dir, packed),
                      fallback=floats)


def _default_choice(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    if device.type != "cpu":
        return "none", f"our GGUF kernels run on the CPU, the model on {device.type}"
    if not KEEP_BLOCKS_BY_DEFAULT:
        return "none", ("its blocks in our kernels (--quantization gguf) are not yet faster "
                        "on every measured workload")
    if dtype not in (torch.float32, torch.bfloat16):
        return "none", f"our kernels take float32 or bfloat16 activations, not {dtype}"
    if not qgemm.load():
        return "none", "the quantized CPU kernels could not be built (see the warning above)"
    return "gguf", (f"its blocks in our {qgemm.default_isa()} kernels read 4-8x fewer bytes "
                    "per token than dequantized weights and were faster on every measured "
                    "workload (--quantization none: dequantized)")


def gguf_tensors(gguf_path: str | Path, hf_config: PretrainedConfig) -> GGUFTensors:
    """`fold_types` of the file's tensor types."""
    return fold_types(tensor_types(gguf_path), hf_config)


def fold_types(types: dict[str, str], hf_config: PretrainedConfig) -> GGUFTensors:
    """HF name -> GGUF type, as (our module, shard id) -> (HF name, GGUF type) for
    every weight of the model's layers (the model's `weight_mapping` folds q/k/v
    and gate/up, and stacks experts: an expert's tensor is under (our stacked
    parameter, (expert, part)); a tied LM head is the embedding's table)."""
    mapping = get_model_class(hf_config).weight_mapping
    experts = num_experts(hf_config)
    out: dict[tuple[str, Any], tuple[str, str]] = {}
    for stacked, kind in types.items():
        for name in _expert_names(stacked, experts):
            if not name.endswith(".weight"):
                continue
            parts, shard = mapping.our_parts(name)
            # A dense layer's key is the module; a stacked expert weight's, the parameter.
            key = ".".join(parts) if isinstance(shard, tuple) else ".".join(parts[:-1])
            out[(key, shard)] = (name, kind)
    if getattr(hf_config, "tie_word_embeddings", False) and ("model.embed_tokens", None) in out:
        out[("lm_head", None)] = out[("model.embed_tokens", None)]
    return out


def _expert_names(name: str, experts: int) -> list[str]:
    if EXPERT not in name:
        return [name]
    return [name.replace(EXPERT, str(e)) for e in range(experts)]


def checkpoint_tensors(gguf_path: Path, model_dir: str, packed: frozenset[str]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors: the packed bytes of `packed`, floats from the converted
    directory `model_dir` for the rest."""
    yield from iter_safetensors(model_dir, skip=packed)
    for name, _, data in iter_packed(gguf_path, packed):
        yield name, data
