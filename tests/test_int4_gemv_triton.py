"""The one-row int4 GEMV's packed-halves path (`triton_ops/int4.py`, the GPU's
default for AWQ / GPTQ decode) on the CPU: `test_int4_gemv_packed_halves` of
tests/gpu/test_quant_kernels.py, in bf16 and fp16, with and without split K and
`Int4Config.lean`, against float64, in a child pytest under Triton's interpreter
(tests/interpreter.py says why a child). The kernel's PTX is emulated there in
Triton operations with the same nibble pairs, x pairs and roundings, so what this
covers is the indexing: which nibbles, zeros, scales and x features meet. ~35 s
on 2 cores. Also the GEMMs above 8 rows: the folded one with its K split and
the dequantized one, the latter over the tensor-core GEMV's fragment-order
words too.
"""

from __future__ import annotations

import os

import pytest
from interpreter import run_file_under_interpreter

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)

GPU_TESTS = os.path.join(os.path.dirname(__file__), "gpu", "test_quant_kernels.py")


def test_packed_halves_under_interpreter() -> None:
    run_file_under_interpreter(GPU_TESTS, "packed_halves", min_passed=8)


def test_fragment_order_gemm_under_interpreter() -> None:
    """`int4_gemm_mma` (rows above the tensor-core GEMV's, over its words)."""
    run_file_under_interpreter(GPU_TESTS, "frag_dequantized", min_passed=2)


def test_folded_and_dequantized_gemm_under_interpreter() -> None:
    """`int4_gemm` above 8 rows on the GPTQ form, and the tensor-core GEMVs'
    split-K sum of every row in one launch, ~15 s."""
    run_file_under_interpreter(GPU_TESTS, "folded_gemm or int4_dequantized or split_sums",
                               min_passed=28)
