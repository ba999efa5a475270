"""The fused MoE's direct small-batch path (`triton_ops/moe_gemv.py`) on the CPU:
the `direct` tests of tests/gpu/test_fused_moe.py (against the float64 loop, the
aligned path, -1 ids, shared experts, GELU, FP8 per-channel scales, strided
weights, auto's choice, refusals), run in a child pytest under Triton's
interpreter, which must be on before triton is first imported in a process
(tests/interpreter.py says why). ~20 s on 2 cores.

The child runs a `-k` selection of another file, which `run_file_under_interpreter`
(whole files) does not offer; it is otherwise the same call.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from interpreter import HERE

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)

GPU_TESTS = os.path.join(os.path.dirname(__file__), "gpu", "test_fused_moe.py")


def test_direct_path_under_interpreter() -> None:
    if HERE:
        pytest.skip("already under the interpreter: run tests/gpu/test_fused_moe.py -k direct")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           GPU_TESTS, "-k", "direct"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    # The whole selection ran, not a part that renames left behind.
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 20, done.stdout[-3000:]
