"""GGUF blocks and activations for the quantized-kernel and weight-method tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from radixlm.layers.cpu_ops import qpack

GGUF_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "q4_k": "Q4_K", "q5_k": "Q5_K",
              "q6_k": "Q6_K"}


def random_blocks(fmt: str, n: int, k: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """Random GGUF blocks: every code pattern possible, scales of realistic size
    (times `scale`)."""
    rng = np.random.default_rng(seed)
    block_bytes, block_values = qpack._GGUF_BLOCKS[fmt]
    count = n * k // block_values
    b = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)

    def put_f16(col: int, lo: float, hi: float) -> None:
        values = rng.uniform(lo * scale, hi * scale, count).astype(np.float16)
        b[:, col:col + 2] = values.view(np.uint8).reshape(count, 2)

    if fmt in ("q4_0", "q8_0"):
        put_f16(0, 1e-3, 2e-2)
    elif fmt == "q4_1":
        put_f16(0, 1e-3, 2e-2)
        put_f16(2, -0.15, 0.0)
    elif fmt in ("q4_k", "q5_k"):
        put_f16(0, 1e-4, 2e-3)
        put_f16(2, 1e-4, 2e-3)
    else:  # q6_k: d last
        put_f16(208, 1e-4, 2e-3)
    return b.reshape(n, -1)


def exact_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Integers in [-127, 127] with 127 in every block: int8 quantization is exact."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    x.view(m, -1, 32)[:, :, 0] = 127.0
    return x


def require_kernels(load: Callable[[], bool], what: str) -> None:
    """A machine with a compiler must build our C++ kernels (CI has one):
    fail if `load()` cannot; without a compiler they are optional: skip."""
    if not load():
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(f"a C++ compiler is present but the {what} did not build (see log)")
        pytest.skip(f"no C++ compiler: the {what} are unavailable")


def add_hparams(w: Any, config: Any) -> None:
    """The hyper-parameters every decoder's GGUF carries, from an HF config, as
    llama.cpp's converter writes them (rope and family extras are the caller's)."""
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
