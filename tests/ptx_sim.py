"""A warp-level simulator of the PTX subset our inline-PTX kernels use, so their
exact PTX text runs on a machine without a GPU.

It executes one thread block's code warp by warp in lockstep (every lane of a warp
runs each instruction; `@p` predicates per lane; branches must be warp-uniform, as
`bra.uni` promises), with memory as named byte buffers at made-up addresses.
`mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` follows the PTX ISA's fragment
layout (A: row g / g + 8, columns 2t + {0, 1} (+ 8); B: rows 2t + {0, 1} (+ 8),
column g; C/D: rows g / g + 8, columns 2t + {0, 1}; g = lane / 4, t = lane % 4),
with products and sums in float64 rounded to fp32 once: the device sums in fp32
in its own order, so compare with a tolerance, not bit for bit.

What it is for: addressing, loop bounds, register and fragment plumbing, the
unpacking arithmetic. What it cannot show: speed, or a misreading of the ISA
that this file shares with the kernel; the GPU tests settle those.
"""

from __future__ import annotations

import re

import numpy as np

LANES = 32


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(v: np.ndarray) -> np.ndarray:
    bits = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) & 0xFFFF


def _half_to_f32(bits: np.ndarray, bf16: bool) -> np.ndarray:
    if bf16:
        return _bf16_to_f32(bits)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def _f32_to_half(v: np.ndarray, bf16: bool) -> np.ndarray:
    if bf16:
        return _f32_to_bf16(v)
    return np.asarray(v, dtype=np.float16).view(np.uint16).astype(np.uint32)


class Memory:
    """Named byte buffers at made-up, widely spaced, 256-aligned addresses. A buffer
    added `after_wait` (one the kernel before may write: x, the outputs) may be
    touched only by lanes past `griddepcontrol.wait` (PDL, `radixlm/layers/pdl.py`)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[int, np.ndarray]] = []
        self.guarded: set[int] = set()

    def add(self, data: np.ndarray, after_wait: bool = False) -> int:
        base = (len(self.buffers) + 1) << 40
        self.buffers.append((base, np.frombuffer(np.ascontiguousarray(data).tobytes(),
                                                 dtype=np.uint8).copy()))
        if after_wait:
            self.guarded.add(base)
        return base

    def check_wait(self, addr: int, waited: bool) -> None:
        base = (addr >> 40) << 40
        assert waited or base not in self.guarded, f"{addr:#x} touched before the PDL wait"

    def buffer(self, base: int) -> np.ndarray:
        return next(buf for b, buf in self.buffers if b == base)

    def _find(self, addr: int, size: int) -> tuple[np.ndarray, int]:
        for base, buf in self.buffers:
            if base <= addr and addr + size <= base + len(buf):
                assert (addr - base) % size == 0, f"misaligned {size}-byte access"
                return buf, addr - base
        raise AssertionError(f"access to {addr:#x} ({size} bytes) outside every buffer")

    def load(self, addr: int, size: int) -> int:
        buf, off = self._find(addr, size)
        return int.from_bytes(buf[off:off + size].tobytes(), "little")

    def store(self, addr: int, size: int, value: int) -> None:
        buf, off = self._find(addr, size)
        buf[off:off + size] = np.frombuffer(value.to_bytes(size, "little"), dtype=np.uint8)


def _split(asm: str) -> list[str]:
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}")
    out = []
    for line in body[1:-1].split("\n"):
        line = line.strip()
        if not line:
            continue
        if line.endswith(":"):
            out.append(line)
            continue
        out += [s.strip() for s in line.split(";") if s.strip()]
    return out


class Warp:
    """One warp's registers (numpy arrays over its 32 lanes) running `asm`."""

    def __init__(self, asm: str, operands: list[int], warp: int, mem: Memory) -> None:
        self.code = _split(asm)
        self.labels = {ins[:-1]: i for i, ins in enumerate(self.code) if ins.endswith(":")}
        self.ops = operands
        self.mem = mem
        self.regs: dict[str, np.ndarray] = {}
        self.tid = warp * LANES + np.arange(LANES, dtype=np.uint64)
        self.lane = np.arange(LANES)
        self.waited = np.zeros(LANES, dtype=bool)  # past griddepcontrol.wait

    # -- operand values ------------------------------------------------------------------
    def val(self, tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok.startswith("$"):
            return np.full(LANES, self.ops[int(tok[1:])], dtype=np.uint64)
        if tok == "%tid.x":
            return self.tid.copy()
        if tok.startswith("0f"):
            return np.full(LANES, int(tok[2:], 16), dtype=np.uint64)
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return np.full(LANES, int(tok, 0) & (2 ** 64 - 1), dtype=np.uint64)
        return self.regs[tok].copy()

    def addr(self, tok: str) -> np.ndarray:
        m = re.fullmatch(r"\[(\w+)(?:\+(-?\d+))?\]", tok.strip())
        assert m, tok
        return self.regs[m.group(1)] + np.uint64(int(m.group(2) or 0))

    def f32(self, tok: str) -> np.ndarray:
        return (self.val(tok) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)

    def set(self, name: str, v: np.ndarray, active: np.ndarray, bits: int = 32) -> None:
        v = np.asarray(v, dtype=np.uint64) & np.uint64(2 ** bits - 1)
        old = self.regs.get(name, np.zeros(LANES, dtype=np.uint64))
        self.regs[name] = np.where(active, v, old)

    def set_f32(self, name: str, v: np.ndarray, active: np.ndarray) -> None:
        self.set(name, np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64),
                 active)

    # -- execution -----------------------------------------------------------------------
    def run(self, limit: int = 10 ** 7) -> None:
        pc, steps = 0, 0
        while pc < len(self.code):
            steps += 1
            assert steps < limit, "runaway loop"
            ins = self.code[pc]
            pc += 1
            if ins.endswith(":") or ins.startswith(".reg"):
                continue
            active = np.ones(LANES, dtype=bool)
            if ins.startswith("@"):
                pred, ins = ins.split(None, 1)
                neg = pred.startswith("@!")
                active = self.regs[pred[2:] if neg else pred[1:]].astype(bool)
                active = ~active if neg else active
            op, _, rest = ins.partition(" ")
            args = [a.strip() for a in re.split(r",(?![^{]*})", rest)] if rest else []
            if op.startswith("bra"):
                assert active.all() or not active.any(), "divergent branch"
                if active.all():
                    pc = self.labels[args[0]]
                continue
            self.step(op, args, active)

    def step(self, op: str, a: list[str], on: np.ndarray) -> None:
        m32 = np.uint64(0xFFFFFFFF)
        if op in ("mov.u32", "mov.f32", "mov.b32"):
            self.set(a[0], self.val(a[1]), on)
        elif op == "and.b32":
            self.set(a[0], self.val(a[1]) & self.val(a[2]), on)
        elif op == "shr.u32":
            self.set(a[0], (self.val(a[1]) & m32) >> self.val(a[2]), on)
        elif op == "shl.b32":
            self.set(a[0], (self.val(a[1]) & m32) << self.val(a[2]), on)
        elif op in ("add.u32", "add.u64"):
            self.set(a[0], self.val(a[1]) + self.val(a[2]), on, 64 if op.endswith("64") else 32)
        elif op == "sub.u32":  # wraps as the device's does
            self.set(a[0], (self.val(a[1]) - self.val(a[2])) & m32, on)
        elif op == "min.u32":
            self.set(a[0], np.minimum(self.val(a[1]) & m32, self.val(a[2]) & m32), on)
        elif op == "mul.lo.u32":
            self.set(a[0], (self.val(a[1]) & m32) * (self.val(a[2]) & m32), on)
        elif op == "mad.lo.u32":
            self.set(a[0], (self.val(a[1]) & m32) * (self.val(a[2]) & m32) + self.val(a[3]), on)
        elif op == "mul.wide.u32":
            self.set(a[0], (self.val(a[1]) & m32) * (self.val(a[2]) & m32), on, 64)
        elif op == "cvt.u64.u32":
            self.set(a[0], self.val(a[1]) & m32, on, 64)
        elif op == "prmt.b32":  # default mode: byte i of d = byte c[4i+2:4i] of {b, a}
            pool = ((self.val(a[2]) & m32) << np.uint64(32)) | (self.val(a[1]) & m32)
            sel = self.val(a[3])
            d = np.zeros(LANES, dtype=np.uint64)
            for i in range(4):
                nib = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
                byte = (pool >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
                byte = np.where(nib & np.uint64(8), np.where(byte & np.uint64(0x80),
                                                             np.uint64(0xFF), np.uint64(0)), byte)
                d |= byte << np.uint64(8 * i)
            self.set(a[0], d, on)
        elif op.startswith("setp."):
            cmp = op.split(".")[1]
            x, y = self.val(a[1]) & m32, self.val(a[2]) & m32
            r = {"ge": x >= y, "lt": x < y, "eq": x == y}[cmp]
            self.set(a[0], r.astype(np.uint64), on, 1)
        elif op.startswith("ld.global"):
            self.load(op, a, on)
        elif op == "st.global.f32":
            addr, v = self.addr(a[0]), self.val(a[1])
            for lane in self.lane[on]:
                self.mem.check_wait(int(addr[lane]), self.waited[lane])
                self.mem.store(int(addr[lane]), 4, int(v[lane]))
        elif op == "griddepcontrol.wait":
            self.waited |= on
        elif op == "griddepcontrol.launch_dependents":
            assert self.waited[on].all(), "PDL trigger before the wait"
        elif op == "cvt.f32.f16":
            self.set_f32(a[0], _half_to_f32(self.val(a[1]) & np.uint64(0xFFFF), False), on)
        elif op == "lop3.b32":
            x, y, z = (self.val(t) & m32 for t in a[1:4])
            lut = int(a[4], 0)
            r = np.zeros(LANES, dtype=np.uint64)
            for i in range(8):
                if lut >> i & 1:
                    r |= ((x if i & 4 else ~x) & (y if i & 2 else ~y) & (z if i & 1 else ~z))
            self.set(a[0], r & m32, on)
        elif op in ("sub.rn.bf16x2", "sub.rn.f16x2"):
            bf16 = "bf16" in op
            x, y = self.val(a[1]), self.val(a[2])
            out = np.zeros(LANES, dtype=np.uint64)
            for half in (0, 16):
                hx = _half_to_f32((x >> np.uint64(half)) & np.uint64(0xFFFF), bf16)
                hy = _half_to_f32((y >> np.uint64(half)) & np.uint64(0xFFFF), bf16)
                out |= _f32_to_half(hx.astype(np.float64) - hy, bf16).astype(np.uint64) << half
            self.set(a[0], out, on)
        elif op == "cvt.rn.f32.u32":
            self.set_f32(a[0], (self.val(a[1]) & m32).astype(np.float32), on)
        elif op in ("add.f32", "mul.f32"):
            x, y = self.f32(a[1]).astype(np.float64), self.f32(a[2])
            self.set_f32(a[0], (x + y if op == "add.f32" else x * y).astype(np.float32), on)
        elif op == "neg.f32":
            self.set_f32(a[0], -self.f32(a[1]), on)
        elif op == "fma.rn.f32":
            r = (self.f32(a[1]).astype(np.float64) * self.f32(a[2]) + self.f32(a[3]))
            self.set_f32(a[0], r.astype(np.float32), on)
        elif op.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            assert on.all(), "mma under a predicate"
            self.mma(a, "bf16" in op)
        else:
            raise NotImplementedError(op)

    def load(self, op: str, a: list[str], on: np.ndarray) -> None:
        addr = self.addr(a[1])
        for i in self.lane[on]:
            self.mem.check_wait(int(addr[i]), self.waited[i])
        if op.endswith(".v4.u32"):
            dst = [r.strip() for r in a[0].strip("{}").split(",")]
            for j, name in enumerate(dst):
                v = np.array([self.mem.load(int(addr[i]) + 4 * j, 4) if on[i] else 0
                              for i in range(LANES)], dtype=np.uint64)
                if j == 0:  # a 16-byte vector must be 16-byte aligned
                    for i in self.lane[on]:
                        assert int(addr[i]) % 16 == 0, "misaligned v4 load"
                self.set(name, v, on)
            return
        size = {"u8": 1, "b16": 2, "u32": 4, "f32": 4}[op.rsplit(".", 1)[1]]
        v = np.array([self.mem.load(int(addr[i]), size) if on[i] else 0 for i in range(LANES)],
                     dtype=np.uint64)
        self.set(a[0], v, on, 8 * size if size < 4 else 32)

    def mma(self, a: list[str], bf16: bool) -> None:
        d = [r.strip() for r in a[0].strip("{}").split(",")]
        ra = [r.strip() for r in a[1].strip("{}").split(",")]
        rb = [r.strip() for r in a[2].strip("{}").split(",")]
        rc = [r.strip() for r in a[3].strip("{}").split(",")]
        g, t = self.lane // 4, self.lane % 4
        A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        for i, name in enumerate(ra):  # reg i: rows g + 8 (i % 2), columns 2t + 8 (i // 2)
            v = self.val(name)
            for h in (0, 1):
                A[g + 8 * (i % 2), 2 * t + 8 * (i // 2) + h] = _half_to_f32(
                    (v >> np.uint64(16 * h)) & np.uint64(0xFFFF), bf16)
        for i, name in enumerate(rb):  # reg i: rows 2t + {0, 1} + 8 i, column g
            v = self.val(name)
            for h in (0, 1):
                B[2 * t + h + 8 * i, g] = _half_to_f32((v >> np.uint64(16 * h))
                                                       & np.uint64(0xFFFF), bf16)
        for i, name in enumerate(rc):  # reg i: row g + 8 (i // 2), column 2t + i % 2
            C[g + 8 * (i // 2), 2 * t + i % 2] = self.f32(name)
        D = (A @ B + C).astype(np.float32)
        for i, name in enumerate(d):
            self.set_f32(name, D[g + 8 * (i // 2), 2 * t + i % 2], np.ones(LANES, dtype=bool))


def run_block(asm: str, operands: list[int], warps: int, mem: Memory) -> None:
    """Every warp of one thread block runs `asm` with these operand values."""
    for w in range(warps):
        warp = Warp(asm, operands, w, mem)
        warp.run()
        assert warp.waited.all() or "griddepcontrol.wait" not in asm, "a lane never waited"


def run_mma_gemv(ptx: str, cfg, x, words, a, b, steps: int, int_a: int = 0,
                 int_b: int = 0, grid_shape: tuple[int, int] | None = None,
                 pair: bool = False):
    """A tensor-core GEMV's PTX (`int4_mma` / `fp8_mma`) over the grid that
    `mma_gemv_kernel` launches, each program with the operands it passes: x [M, K],
    the fragment-order `words` [tiles, chunks, 32, *] (or, with `grid_shape`
    (tiles, chunks a row), whatever the PTX reads instead), the format's two
    arrays `a`, `b` and two integers, `steps` loop steps split by `cfg.split`.
    `pair`: the PTX takes a warp's gate and up tiles (`int4_mma._PtxGroup`), so
    the grid covers the gate's tiles and $9 is their count; the sums come back in
    its pair order. Returns the split-K partial sums added: fp32 [M, N] (torch)."""
    import torch

    from radixlm.layers.quantization.triton_ops.mma_gemv import splits

    tiles, cpr = grid_shape or words.shape[:2]
    n, m = 16 * tiles, x.shape[0]
    per, split = splits(steps, cfg.split)
    mem = Memory()
    # Where the PTX holds the PDL wait, x and the sums may be touched only after it
    # (else Triton waits before the PTX starts).
    pdl = "griddepcontrol.wait" in ptx
    xa, wa = mem.add(x.view(torch.int16).numpy(), pdl), mem.add(words.numpy())
    aa, ba = mem.add(a.numpy()), mem.add(b.numpy())
    # NaN where no lane writes: a row or column the kernel skipped shows.
    ws = mem.add(np.full((split, m, n), np.nan, dtype=np.float32), pdl)
    warp_tiles = tiles // 2 if pair else tiles  # what $9 counts
    for pid_n in range(-(-warp_tiles // (cfg.warps * (1 if pair else cfg.nt)))):
        for pid_k in range(split):
            lo = pid_k * per
            ops = [0, xa, wa, aa, ba, ws + pid_k * m * n * 4, pid_n * cfg.warps, lo,
                   min(steps, lo + per), warp_tiles, cpr, n, int_a, int_b, m]
            run_block(ptx, ops, cfg.warps, mem)
    sums = mem.buffer(ws).view(np.float32).reshape(split, m, n).copy()
    return torch.from_numpy(sums).sum(0)
