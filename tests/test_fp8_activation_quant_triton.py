"""Per-token FP8 activation quantization (`triton_ops/fp8.quantize_activations`,
what the W8A8 GEMM's input goes through) on the CPU: the scale and every code
bit for bit against torch's round-to-nearest-even, per row (short rows and
rows of 14336 and 20000 features), per group, and by a static scale; the norm
and SiLU-and-mul writing those codes themselves (`fp8_out`, `Fp8Rows`);
`tests/gpu/test_quant_kernels.py`'s tests in a child pytest under Triton's
interpreter (tests/interpreter.py says why a child), ~5 s."""

from __future__ import annotations

import os

import pytest
from interpreter import run_file_under_interpreter

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)

GPU_TESTS = os.path.join(os.path.dirname(__file__), "gpu", "test_quant_kernels.py")


def test_activation_quantization_under_interpreter() -> None:
    run_file_under_interpreter(GPU_TESTS, "activation_quantization or static_activation "
                               "or fp8_out or fp8_rows", min_passed=30)
