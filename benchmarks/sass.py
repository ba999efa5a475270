"""A Triton kernel compiled for sm_90 and disassembled on a machine without a GPU.

Triton's bundled `ptxas` and `cuobjdump` target Hopper anywhere, so what a kernel's
code does (its loops, barriers, where its loads sit) can be read before device time
is spent on it. The Triton installed here may differ from the device's: read the
SASS as a guide to the device's code, not as that code. Used by
`fp8_gemv_sass.py` and `pdl_sass.py`.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def signature(fn, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> dict[str, str]:
    """The compile signature of jitted `fn`: `pointers` (name -> '*bf16' ...), the
    `floats` as fp32, every other run-time argument i32."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            continue
        sig[p.name] = pointers.get(p.name) or ("fp32" if p.name in floats else "i32")
    return sig


def divisibility(fn, names) -> dict:
    """Hints that the arguments `names` of jitted `fn` are multiples of 16, as Triton
    specializes them at a launch where they are (aligned pointers, strides and sizes
    of the decode shapes): without them loads compile unvectorized."""
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
            if p.name in names}


def sm90_sass(fn, sig: dict[str, str], constants: dict, warps: int, stages: int = 1,
              hints: dict | None = None) -> list[tuple[int, str]]:
    """(address, instruction) of `fn` compiled for sm_90 with these constexprs."""
    kernel = triton.compile(ASTSource(fn, sig, constants, hints or {}),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", text)]


def opcode(instruction: str) -> str:
    """'LDG' for '@P0 LDG.E.128 R4, desc[UR4][R2.64]' (predicate and modifiers dropped)."""
    return (instruction.split()[1] if instruction.startswith("@") else
            instruction.split()[0]).split(".")[0]


def main_loop(ins: list[tuple[int, str]]) -> list[str]:
    """The instructions of the widest loop in `ins` (the span of its longest
    backward branch): a GEMV's main loop."""
    loops = []  # (target, branch) of every backward branch
    for addr, text in ins:
        target = re.search(r"0x([0-9a-f]+)", text) if "BRA" in text else None
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    return [text for addr, text in ins if lo <= addr <= hi]


def opcode_counts(body: list[str]) -> collections.Counter:
    return collections.Counter(opcode(t) for t in body)


def mma_gemv_loop(ptx: str, warps: int) -> list[str]:
    """The main loop of `mma_gemv_kernel` running `ptx` (an int4 or FP8 tensor-core
    GEMV's, `int4_mma.gemv_ptx` / `fp8_mma.gemv_ptx`), compiled for sm_90. The
    PTX takes every address as a 64-bit integer, so the pointer types here are any."""
    from radixlm.layers.quantization.triton_ops.mma_gemv import mma_gemv_kernel as kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "a_ptr": "*fp32", "b_ptr": "*fp32",
                "ws_ptr": "*fp32"}
    consts = dict(WARPS=warps, PTX=ptx, PDL=True, PTX_WAITS="griddepcontrol.wait" in ptx)
    return main_loop(sm90_sass(kernel, signature(kernel, pointers), consts, warps,
                               hints=divisibility(kernel, set(pointers))))
