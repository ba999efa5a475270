"""Quantized-weight CPU kernels beside torch's matmuls, in one run:
`python -m radixlm.bench.cpu_qgemm [--rows 1,8,64] [--isas avx512_vnni,avx2] [--formats ...]`.

1. Model pass: every linear one token of SmolLM2-135M runs (30 layers of
   qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, then the LM head
   576->49152), for M rows at once: ours on the embedded GGUF's formats (Q4_1
   layers, Q8_0 head), against torch on the same weights dequantized: fp32
   F.linear (radixlm's fp32 path) and bf16 through oneDNN's prepacked layout
   (radixlm's bf16 path; for prefill it is also the lower bound of "dequantize a
   tile to bf16 and call oneDNN", whose dequantization it does not count).
   Reported: ms per pass, tokens/s if matmuls were all a step did (M / pass),
   and weight GB/s (bytes each pass must read / time).
2. One thread, weights in cache: arithmetic rate at M = 1..256 against
   oneDNN bf16 (the prefill question: int8 dots, or dequantize to bf16?).
3. Per format: a 4096 x 4096 product at M = 1 and 8 against the same two
   torch peers, with enough copies of each weight to exceed the L3 cache, so
   each call streams its weight from memory as a model's layers do.

Random weights (seeded GGUF blocks of realistic scales); timings are medians
of repeated passes after a warm-up; threads are torch's (torch.get_num_threads()).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from radixlm.layers.cpu_ops import qgemm, qpack

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
HEAD = (49152, 576)
BLOCK_BYTES = {"q4_0": (18, 32), "q4_1": (20, 32), "q8_0": (34, 32), "q4_k": (144, 256),
               "q5_k": (176, 256), "q6_k": (210, 256)}
GGUF_NAMES = {v: k for k, v in qpack.GGUF_FORMATS.items()}


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight in oneDNN's blocked layout, as radixlm's PrepackedLinearMethod keeps it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """radixlm's CPU bf16 product (PrepackedLinearMethod.apply)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block_bytes, block_values = BLOCK_BYTES[fmt]
    count = n * k // block_values
    b = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    scale_at = {"q6_k": [208], "q4_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2]}.get(fmt, [0])
    for col in scale_at:
        b[:, col:col + 2] = (rng.uniform(1e-4, 2e-3, count).astype(np.float16)
                             .view(np.uint8).reshape(count, 2))
    return b.reshape(n, -1)


class Weight:
    """One weight in the three forms compared."""

    def __init__(self, fmt: str, n: int, k: int, rng: np.random.Generator,
                 dense: bool = True) -> None:
        if fmt == "int8":
            self.packed = qpack.pack_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(
                int(rng.integers(1 << 30)))) * 0.02)
        else:
            self.packed = qpack.pack_gguf(random_blocks(fmt, n, k, rng), GGUF_NAMES[fmt], n, k)
        if dense:
            self.fp32 = qgemm.dequantize(self.packed)
            self.bf16 = self.fp32.to(torch.bfloat16)
            self.onednn = prepack(self.bf16)


def median_ms(fn: Callable[[], object], min_seconds: float = 1.0, min_reps: int = 5) -> float:
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def model_weights(layer_fmt: str, head_fmt: str) -> list[Weight]:
    rng = np.random.default_rng(0)
    weights = [Weight(layer_fmt, n, k, rng) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    return weights + [Weight(head_fmt, *HEAD, rng)]


def serially(fn: Callable[[], object]) -> Callable[[], None]:
    """fn with the threading before our pool: fewer than 8 rows on the calling
    thread, more on torch's OpenMP threads."""
    def run() -> None:
        rows, _ = qgemm.set_threading()
        qgemm.set_threading(pool_rows=0)
        try:
            fn()
        finally:
            qgemm.set_threading(pool_rows=rows)
    return run


def pass_fns(weights: list[Weight], m: int, isas: list[str],
             serial: bool = False) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=gen) for k in {w.packed.in_features for w in weights}}
    xs16 = {k: x.to(torch.bfloat16) for k, x in xs.items()}

    def ours(isa: str, x_by_k: dict[int, torch.Tensor]) -> Callable[[], None]:
        return lambda: [qgemm.linear(x_by_k[w.packed.in_features], w.packed, isa=isa)
                        for w in weights]

    fns = {f"ours {isa} fp32 act": ours(isa, xs) for isa in isas}
    if serial:
        fns.update({f"ours {isa} fp32 act, old threading": serially(ours(isa, xs))
                    for isa in isas})
    fns[f"ours {isas[0]} bf16 act"] = ours(isas[0], xs16)
    fns["torch fp32"] = lambda: [F.linear(xs[w.packed.in_features], w.fp32) for w in weights]
    fns["torch bf16 oneDNN"] = lambda: [onednn_linear(xs16[w.packed.in_features], w.onednn)
                                        for w in weights]
    return fns


def bench_model(rows: list[int], isas: list[str], serial: bool = False) -> None:
    weights = model_weights("q4_1", "q8_0")
    nbytes = {"ours": sum(w.packed.nbytes for w in weights),
              "torch fp32": sum(w.fp32.numel() * 4 for w in weights),
              "torch bf16 oneDNN": sum(w.bf16.numel() * 2 for w in weights)}
    print(f"\n## Model pass: SmolLM2-135M linears (Q4_1 layers, Q8_0 head), "
          f"{torch.get_num_threads()} threads; our pool below {qgemm.set_threading()[0]} rows, "
          f"spin {qgemm.set_threading()[1]} us")
    print(f"weight bytes per pass: ours {nbytes['ours'] / 1e6:.1f} MB, bf16 "
          f"{nbytes['torch bf16 oneDNN'] / 1e6:.1f} MB, fp32 {nbytes['torch fp32'] / 1e6:.1f} MB\n")
    print("| M | system | ms / pass | tok/s (matmuls only) | weight GB/s | vs torch bf16 |")
    print("|---|---|---|---|---|---|")
    for m in rows:
        results = {name: median_ms(fn) for name, fn in pass_fns(weights, m, isas, serial).items()}
        peer = results["torch bf16 oneDNN"]
        for name, ms in results.items():
            size = nbytes[name] if name.startswith("torch") else nbytes["ours"]
            print(f"| {m} | {name} | {ms:.2f} | {m / ms * 1e3:.0f} | {size / ms / 1e6:.1f} | "
                  f"{peer / ms:.2f}x |")


def rotating(pool: list, fn: Callable[[object], object]) -> Callable[[], object]:
    """fn over the pool's items in turn: each call reads a weight the last calls did not."""
    state = {"i": 0}

    def run() -> object:
        state["i"] = (state["i"] + 1) % len(pool)
        return fn(pool[state["i"]])
    return run


def copies_past_l3(nbytes: int) -> int:
    return max(2, int(np.ceil(96e6 / nbytes)))


def bench_formats(formats: list[str], rows: list[int], isa: str) -> None:
    n = k = 4096
    print(f"\n## Per format: {n} x {k}, weights streamed from memory (copies > L3), isa {isa}\n")
    print("| format | M | ours ms | ours GB/s | torch bf16 ms | torch fp32 ms | vs bf16 | "
          "vs fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    for fmt in formats:
        proto = Weight(fmt, n, k, rng)
        packed = [proto.packed] + [Weight(fmt, n, k, rng, dense=False).packed
                                   for _ in range(copies_past_l3(proto.packed.nbytes) - 1)]
        bf16 = [prepack(proto.bf16.clone()) for _ in range(copies_past_l3(n * k * 2))]
        fp32 = [proto.fp32.clone() for _ in range(copies_past_l3(n * k * 4))]
        for m in rows:
            x = torch.randn(m, k)
            x16 = x.to(torch.bfloat16)
            ours = median_ms(rotating(packed, functools.partial(_ours, x, isa=isa)))
            t16 = median_ms(rotating(bf16, functools.partial(onednn_linear, x16)))
            t32 = median_ms(rotating(fp32, functools.partial(F.linear, x)))
            gbs = proto.packed.nbytes / ours / 1e6
            print(f"| {fmt} | {m} | {ours:.3f} | {gbs:.1f} | {t16:.3f} | {t32:.3f} | "
                  f"{t16 / ours:.2f}x | {t32 / ours:.2f}x |")
        del packed, bf16, fp32


def _ours(x: torch.Tensor, w: qgemm.QuantizedWeight, isa: str) -> torch.Tensor:
    return qgemm.linear(x, w, isa=isa)


def bench_compute(rows: list[int], isa: str) -> None:
    """One thread, L2-resident weights: arithmetic rate, ours (int8 dots) against
    oneDNN bf16 on weights already dequantized (what "dequantize a tile to bf16
    and call oneDNN" could reach at best, its dequantization not counted)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"\n## One thread, weights in cache: GMAC/s (Q4_1), isa {isa}\n")
    print("| shape (out x in) | M | ours GMAC/s | oneDNN bf16 GMAC/s | ours / bf16 |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(2)
    try:
        for n, k in [(3072, 576), (576, 1536)]:
            w = Weight("q4_1", n, k, rng)
            for m in rows:
                x16 = torch.randn(m, k).to(torch.bfloat16)
                ours = best_ms(functools.partial(_ours, x16, w.packed, isa=isa))
                bf16 = best_ms(functools.partial(onednn_linear, x16, w.onednn))
                gmac = m * n * k / 1e6
                print(f"| {n} x {k} | {m} | {gmac / ours:.0f} | {gmac / bf16:.0f} | "
                      f"{bf16 / ours:.2f}x |")
    finally:
        torch.set_num_threads(threads)


def best_ms(fn: Callable[[], object], reps: int = 9) -> float:
    """Fastest of `reps` calls: on a shared machine the minimum is the least disturbed."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def bench_llamacpp(python: str, prompt_len: int) -> None:
    """llama.cpp's whole-model speed on the embedded GGUF, same thread count."""
    from radixlm.models.loader import default_model_path

    script = Path(__file__).with_name("llamacpp_peer.py")
    cmd = [python, str(script), default_model_path(), "--threads", str(torch.get_num_threads()),
           "--prompt-len", str(prompt_len)]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                       text=True).stdout.strip().splitlines()[-1])
    print(f"\n## llama.cpp (llama-cpp-python, in-process), whole model, same GGUF, "
          f"{result['threads']} threads\n")
    print(f"prefill {result['prefill_tok_s']:.0f} tok/s ({prompt_len}-token prompt), "
          f"decode {result['decode_tok_s']:.1f} tok/s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024",
                   help="M values of the model pass (comma-separated)")
    p.add_argument("--isas", default=None,
                   help="ISA paths of the model pass (default: the fastest available)")
    p.add_argument("--formats", default=",".join(qgemm.FORMATS))
    p.add_argument("--format-rows", default="1,8")
    p.add_argument("--threads", type=int, default=None, help="torch's thread count")
    p.add_argument("--serial", action="store_true",
                   help="model pass: also ours with the threading before the pool (fewer than "
                   "8 rows on the calling thread, more on OpenMP), in the same run")
    p.add_argument("--pool-rows", type=int, default=None,
                   help="products of fewer rows run on our pool (qgemm.set_threading)")
    p.add_argument("--spin-us", type=int, default=None,
                   help="how long pool workers spin for the next product before they sleep")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-formats", action="store_true")
    p.add_argument("--skip-compute", action="store_true")
    p.add_argument("--llamacpp-python", default=None,
                   help="an interpreter with llama-cpp-python: also time llama.cpp on the "
                   "embedded GGUF (whole model) in the same run")
    p.add_argument("--llamacpp-prompt-len", type=int, default=256)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not qgemm.load():
        raise SystemExit("the quantized kernels did not build")
    qgemm.set_threading(args.pool_rows, args.spin_us)
    isas = args.isas.split(",") if args.isas else [qgemm.default_isa()]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"ISA paths available: {', '.join(qgemm.available_isas())}")
    if not args.skip_model:
        bench_model([int(m) for m in args.rows.split(",")], isas, args.serial)
    if not args.skip_compute:
        bench_compute([1, 8, 64, 256], isas[0])
    if args.llamacpp_python:
        bench_llamacpp(args.llamacpp_python, args.llamacpp_prompt_len)
    if not args.skip_formats:
        bench_formats(args.formats.split(","), [int(m) for m in args.format_rows.split(",")],
                      isas[0])


if __name__ == "__main__":
    main()
