"""The PDL contract (`radixlm/layers/pdl.py`), checked in every taking-part kernel's
sm_90 SASS, compiled here without a GPU (Triton's bundled ptxas; the kernels and
their decode configurations are `benchmarks/pdl_sass.py`'s list):

- the kernel waits (`griddepcontrol.wait`, SASS ACQBULK) exactly once and signals
  (`launch_dependents`, PREEXIT) after it;
- before the wait it writes nothing to global memory and does not exit: a program
  that returned early would signal without having waited, and the next kernel's
  early reads of what two launches back wrote would no longer be safe.

What a kernel reads before its wait cannot be checked here; the contract names it.
The list must hold every jitted kernel of the package that takes a PDL argument.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import shutil
import sys
from pathlib import Path

import pytest

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for sm_90: not under the interpreter", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import triton  # noqa: E402
from pdl_sass import case_ops, kernels  # noqa: E402

import radixlm  # noqa: E402

# Device functions that take PDL and are called from kernels, not launched.
HELPERS = {"pdl_wait", "pdl_trigger", "_down_one_block", "_run_ptx"}
GLOBAL_WRITES = ("STG", "ATOM", "RED")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _pdl_kernels() -> set[str]:
    """module.name of every jitted function in radixlm taking a PDL argument."""
    found = set()
    for info in pkgutil.walk_packages(radixlm.__path__, "radixlm."):
        if not info.name.startswith("radixlm.layers"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, triton.runtime.jit.JITFunction)
                    and obj.__module__ == module.__name__ and name not in HELPERS
                    and any(p.name == "PDL" for p in obj.params)):
                found.add(f"{module.__name__}.{name}")
    return found


CASES = list(kernels())


def test_every_pdl_kernel_is_checked() -> None:
    listed = {f"{fn.__module__}.{fn.__name__}" for _, fn, *_ in CASES}
    assert _pdl_kernels() == listed, "add the kernel to benchmarks/pdl_sass.py's kernels()"


@pytest.mark.skipif(not (PTXAS.exists() or shutil.which("ptxas")),
                    reason="no ptxas in this Triton install")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_wait_before_any_write_or_exit(case) -> None:
    name, ops = case[0], case_ops(case)
    assert ops.count("ACQBULK") == 1, f"{name}: expected one wait"
    wait = ops.index("ACQBULK")
    assert "PREEXIT" in ops[wait:], f"{name}: no signal after the wait"
    early = [op for op in ops[:wait] if op in GLOBAL_WRITES + ("EXIT", "PREEXIT")]
    assert not early, f"{name}: {early} before the wait"
