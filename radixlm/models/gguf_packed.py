"""GGUF tensors kept quantized: their blocks under HF names, packed for our
CPU kernels (`layers/cpu_ops/qpack.py`), cached.

The first use of a GGUF file packs every tensor of a kept block format
(`qpack.GGUF_FORMATS`) into `cache_root()/<stem>-<digest>-packed<VERSION>/`
(safetensors shards and an index of formats and shapes; the directory appears
atomically, as the dequantized conversion's does); later starts read the
shards. q/k rows are un-permuted on the blocks (a row permutation: blocks run
along the input features, so whole rows move), exactly as the dequantized
conversion does on floats. Tensors of other types (F32 norms, F16) are not
here: they load as floats from the converted directory as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.layers.cpu_ops import qpack
from radixlm.layers.cpu_ops.qgemm import QuantizedWeight
from radixlm.models.loader import GGUF_ARCHS, cached_dir, gguf_field, gguf_hf_name, unpermute_qk

VERSION = 1  # of the packed layout; a new layout gets a new cache directory
_SHARD_BYTES = 2 << 30
_PARTS = ("qweight", "scales", "mins")


def tensor_types(gguf_path: str | Path) -> dict[str, str]:
    """HF name -> GGUF type name ('Q4_1', 'F32', ...) of every tensor with an HF name."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    return {name: t.tensor_type.name for t in reader.tensors
            if (name := gguf_hf_name(t.name)) is not None}


def _head_counts(reader: Any) -> tuple[bool, int, int]:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHS)})")
    heads = gguf_field(reader, f"{arch}.attention.head_count")
    return GGUF_ARCHS[arch][2], heads, gguf_field(reader, f"{arch}.attention.head_count_kv", heads)


def _blocks(tensor: Any, n: int, permuted: bool, heads: int, kv_heads: int) -> np.ndarray:
    """The tensor's blocks as [n rows, bytes per row], q/k rows in HF order."""
    raw = np.asarray(tensor.data).reshape(n, -1)
    part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if permuted and part in ("attn_q", "attn_k"):
        raw = unpermute_qk(raw, heads if part == "attn_q" else kv_heads)
    return raw


def _pack_all(gguf_path: Path) -> Iterator[tuple[str, QuantizedWeight]]:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    permuted, heads, kv_heads = _head_counts(reader)
    for tensor in reader.tensors:
        name = gguf_hf_name(tensor.name)
        kind = tensor.tensor_type.name
        if name is None or kind not in qpack.GGUF_FORMATS:
            continue
        k, n = int(tensor.shape[0]), int(np.prod(tensor.shape[1:]))
        yield name, qpack.pack_gguf(_blocks(tensor, n, permuted, heads, kv_heads), kind, n, k)


def _write_cache(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file

    index: dict[str, dict[str, Any]] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        filename = f"packed-{len({v['file'] for v in index.values()}):05d}.safetensors"
        save_file(shard, out / filename)
        for key in {k.rsplit(".", 1)[0] for k in shard}:
            index[key]["file"] = filename
        shard, size = {}, 0

    for name, w in _pack_all(gguf_path):
        index[name] = {"format": w.format, "n": w.n, "k": w.k, "in_features": w.in_features,
                       "file": None}
        for part in _PARTS:
            shard[f"{name}.{part}"] = getattr(w, part)
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


def iter_packed(gguf_path: str | Path) -> Iterator[tuple[str, QuantizedWeight]]:
    """(HF name, packed weight) of every tensor of a kept block format."""
    from safetensors import safe_open

    directory = packed_dir(gguf_path)
    index = json.loads((directory / "index.json").read_text())
    handles: dict[str, Any] = {}
    for name, meta in index.items():
        if meta["file"] not in handles:
            handles[meta["file"]] = safe_open(str(directory / meta["file"]), framework="pt")
        handle = handles[meta["file"]]
        parts = {part: handle.get_tensor(f"{name}.{part}") for part in _PARTS}
        yield name, QuantizedWeight(format=meta["format"], n=meta["n"], k=meta["k"],
                                    in_features=meta["in_features"], **parts)
