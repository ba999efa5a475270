"""The W8A8 GEMV (`triton_ops/fp8_w8a8_gemv.py`) on the CPU:
`tests/gpu/test_quant_kernels.py`'s W8A8 GEMV tests (codes against the GEMM
path's, per-row and block scales, 1-64 rows, every swept tile, SiLU-and-mul,
routing) in a child pytest under Triton's interpreter, ~10 s."""

from __future__ import annotations

import os

import pytest
from interpreter import run_file_under_interpreter

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)

GPU_TESTS = os.path.join(os.path.dirname(__file__), "gpu", "test_quant_kernels.py")


def test_w8a8_gemv_under_interpreter() -> None:
    run_file_under_interpreter(GPU_TESTS, "w8a8", min_passed=50)
