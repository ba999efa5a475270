"""The fused MoE's direct small-batch path (`triton_ops/moe_gemv.py`) on the CPU:
the `direct` tests of tests/gpu/test_fused_moe.py (against the float64 loop, the
aligned path, -1 ids, shared experts, GELU, FP8 per-channel scales, strided
weights, auto's choice, refusals), run in a child pytest under Triton's
interpreter, which must be on before triton is first imported in a process
(tests/interpreter.py says why). ~20 s on 2 cores.
"""

from __future__ import annotations

import os

import pytest
from interpreter import run_file_under_interpreter

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)

GPU_TESTS = os.path.join(os.path.dirname(__file__), "gpu", "test_fused_moe.py")


def test_direct_path_under_interpreter() -> None:
    run_file_under_interpreter(GPU_TESTS, "direct", min_passed=20)
