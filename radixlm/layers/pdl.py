"""Programmatic dependent launch (PDL) for the decode-path Triton kernels.

Why: at batch 1 a decode step is ~300 small kernels. Normally a kernel starts
only after the one before it in the stream has finished and drained, so every
boundary costs a launch plus the next kernel's ramp-up. On Hopper and newer, a
kernel launched with PDL may start as soon as every program of the kernel
before it has signalled (`pdl_trigger`); it then blocks in `pdl_wait` until
that kernel has finished and its writes are visible. What a kernel does before
its wait (address math, loading weights) overlaps the previous kernel.

Contract for a kernel that takes part (it takes a `PDL: tl.constexpr` argument
and is launched with `**launch_args()`):
- before `pdl_wait(PDL)` it writes nothing and reads nothing the kernel just
  before it may write: the weights, the step's inputs that the host set before
  the pass (positions, sequence lengths, the request-to-token table, cache
  slots), and what a kernel two or more launches back wrote (the MoE down
  product's routing, written before its gate/up kernel). That is safe because
  of the next rule: a kernel starts only once every program of the one before
  it has waited, so everything two or more launches back has finished. So the
  wait comes before any early return, and a caller that relies on a kernel
  standing between a write and a read launches it unconditionally;
- it calls `pdl_trigger(PDL)` after its wait, so the next kernel cannot start
  before everything earlier in the stream than this one has finished.
`tests/test_pdl_contract.py` checks the wait, the trigger, and no write or exit
before the wait in every taking-part kernel's compiled code.
Kernels that do not take part (torch's, cuBLAS, NCCL) are launched without the
attribute: they start only after everything before them has finished, and the
kernel after them may start early only if they signal; its wait still covers
them.

The switch is per process (`set_pdl`), off by default and where unsupported
(pre-Hopper and non-NVIDIA GPUs, CPU, the Triton interpreter, a Triton without
`gdc_wait`).
The model runner turns it on for CUDA unless `--disable-pdl`.
"""

from __future__ import annotations

import os

import torch

try:  # CPU-only installs may lack Triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton
    HAS_GDC = False

_state = {"on": False}


def pdl_on() -> bool:
    return _state["on"]


def launch_args() -> dict:
    """Launch keywords for a kernel that takes part: its `PDL` constexpr and Triton's
    `launch_pdl` (the launch attribute)."""
    on = _state["on"]
    return {"PDL": on, "launch_pdl": on}


def set_pdl(enabled: bool, device: torch.device | None = None) -> bool:
    """Turn PDL on (where `supported(device)`) or off for this process; returns the
    resulting state."""
    _state["on"] = bool(enabled) and supported(device)
    return _state["on"]


def supported(device: torch.device | None = None) -> bool:
    if not (HAS_TRITON and HAS_GDC and torch.cuda.is_available()):
        return False
    if torch.version.hip is not None:  # griddepcontrol is NVIDIA's (ROCm reports 9.x too)
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


if HAS_TRITON:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Block until the previous kernel in the stream has finished (no-op without PDL)."""
        if PDL:
            gdc_wait()

    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        """Let the next kernel in the stream launch (no-op without PDL)."""
        if PDL:
            gdc_launch_dependents()
