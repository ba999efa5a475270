"""GGUF blocks packed for the CPU kernels (models/gguf_packed.py): the embedded
model's tensors, un-permuted and packed, give back the dequantized conversion's
values bit for bit, and the pack is cached."""

from __future__ import annotations

import pytest
import torch

from radixlm.layers.cpu_ops import qgemm
from radixlm.models import gguf_packed
from radixlm.models.loader import default_model_path, iter_safetensors


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")


def test_embedded_model_packs_to_the_dequantized_values(model_dir):
    path = default_model_path()
    packed = {name: layout.weight(data) for name, layout, data in gguf_packed.iter_packed(path)}
    types = gguf_packed.tensor_types(path)
    kept = {name for name, kind in types.items() if kind in ("Q4_1", "Q8_0")}
    assert set(packed) == kept and len(kept) == 211  # 30 layers x 7 + the embedding
    assert packed["model.embed_tokens.weight"].format == "q8_0"
    assert packed["model.layers.0.self_attn.q_proj.weight"].format == "q4_1"
    for name, tensor in iter_safetensors(model_dir):
        if name in packed:
            assert torch.equal(qgemm.dequantize(packed[name]), tensor), name
    some = frozenset({"model.norm.weight", "model.layers.3.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match="no packed blocks for"):
        list(gguf_packed.iter_packed(path, some))  # the norm is F32: never packed
    directory = gguf_packed.packed_dir(path)
    stamp = (directory / "index.json").stat().st_mtime_ns
    assert gguf_packed.packed_dir(path) == directory
    assert (directory / "index.json").stat().st_mtime_ns == stamp  # read, not packed again
