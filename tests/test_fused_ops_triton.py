"""The fused ops' Triton kernels (`radixlm/layers/fused_ops.py`: RMSNorm with the
residual add, neox RoPE in place with the QK norms, the K/V store and a qkv
product's split-K sums) on the CPU: the RoPE and a cut of the RMSNorm tests of
tests/gpu/test_fused_ops.py, against float64 and the torch paths, in a child
pytest under Triton's interpreter (tests/interpreter.py says why a child).
~85 s on 2 cores.
"""

from __future__ import annotations

import os

import pytest
from interpreter import run_file_under_interpreter

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)

GPU_TESTS = os.path.join(os.path.dirname(__file__), "gpu", "test_fused_ops.py")


def test_rope_and_rms_norm_under_interpreter() -> None:
    run_file_under_interpreter(GPU_TESTS, "rope or (rms_norm and 1000)", min_passed=35)
