"""Offline benchmarks: our Engine beside HF transformers `generate` in the same run.

    python -m radixlm.bench offline   --num-prompts 64 --input-len 256 --output-len 128
    python -m radixlm.bench one-batch --input-len 128 --output-len 256
    python -m radixlm.bench shared-prefix --num-groups 8 --group-size 8 --prefix-len 512

Prompts are random token ids from a fixed seed; every request ignores EOS so
both sides produce exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import torch

from radixlm.config import ServerArgs


@dataclass
class Result:
    name: str
    seconds: float
    output_tokens: int
    prefill_seconds: float = 0.0  # the same workload with one output token

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, over the time after prefill."""
        return (self.output_tokens - self.num_seqs) / max(self.seconds - self.prefill_seconds,
                                                          1e-9)

    num_seqs: int = 1


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Stay clear of the low ids, where special tokens live.
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


def run_ours(engine, prompts: list[list[int]], output_len: int) -> tuple[Result, float]:
    """Returns the result and the time to the first token (prefill) of the workload."""
    sp = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    engine.generate(input_ids=prompts[0][:16], sampling_params={**sp, "max_new_tokens": 4})
    engine.flush_cache()
    # The workload's own prefill once untimed: kernels compiled on first use at a row
    # count (Triton's, e.g. the FP8 GEMM's tiles by M) must not land in the TTFT.
    engine.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": 1})
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": 1})
    ttft = time.perf_counter() - t0
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    return Result("radixlm", dt, sum(len(o["output_ids"]) for o in outs)), ttft


def load_hf(model_dir: str, config, dtype: torch.dtype, device: torch.device, dummy: bool):
    from transformers import AutoModelForCausalLM
    if dummy:  # random init directly on the device: an 8B init on the CPU takes minutes
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], output_len: int, device: torch.device,
           batch_size: int) -> Result:
    """HF static batching: equal-length prompts, so no padding is needed."""
    def gen(batch: list[list[int]], n: int) -> int:
        ids = torch.tensor(batch, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * len(batch)

    gen(prompts[:1], 2)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        gen(prompts[i:i + batch_size], 1)
    _sync(device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    total = sum(gen(prompts[i:i + batch_size], output_len)
                for i in range(0, len(prompts), batch_size))
    _sync(device)
    return Result("HF generate", time.perf_counter() - t0, total, ttft)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _sync(device)
    t0 = time.perf_counter()
    n = 10
    for _ in range(n):
        y.copy_(x)
    _sync(device)
    return 2 * x.numel() * n / (time.perf_counter() - t0)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def workload_bound_seconds(runner, n: int, input_len: int, output_len: int, bw: float,
                           flops: float) -> float:
    """Prefill FLOPs / matmul peak + sum over decode steps of (weights + KV read) / bw."""
    spec, attn = runner.kv_spec, runner.layers[0]
    params = sum(p.numel() for p in runner.model.parameters())
    embed = runner.model.model.embed_tokens.weight.numel()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    attn_dim = attn.num_heads * attn.head_dim
    prefill = n * (2 * (params - embed) * input_len  # linear layers (the head: last row only)
                   + 2 * spec.num_layers * attn_dim * input_len * input_len)  # QK^T + PV
    kv_token = spec.num_layers * spec.layer_bytes(runner.kv_dtype)
    kv_read = n * kv_token * sum(input_len + t for t in range(output_len))
    return prefill / flops + (output_len * weight_bytes + kv_read) / bw


def run_llamacpp(python: str, server_args: ServerArgs, input_len: int, output_len: int,
                 threads: int) -> Result:
    """llama.cpp's prefill and decode on our .gguf file (`llamacpp_peer.py`), as a Result
    of the same workload: one prompt of `input_len`, `output_len` tokens out."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from radixlm.models.loader import gguf_source

    gguf = gguf_source(server_args.model_path, server_args.load_format)
    if gguf is None:
        raise SystemExit("--llamacpp-python needs a .gguf model")
    script = Path(__file__).with_name("llamacpp_peer.py")
    # Its OpenMP decode is a third slower under our passive wait policy.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([python, str(script), str(gguf), "--threads", str(threads),
                          "--prompt-len", str(input_len), "--decode-len", str(output_len)],
                         env=env, check=True, capture_output=True, text=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    prefill_s = input_len / figures["prefill_tok_s"]
    seconds = prefill_s + (output_len - 1) / figures["decode_tok_s"]
    return Result("llama.cpp", seconds, output_len, prefill_seconds=prefill_s)


def print_table(rows: list[Result], peer: Result | None, extra: list[str]) -> None:
    print(f"\n{'system':<14}{'output tokens':>15}{'seconds':>10}{'tok/s':>10}{'ratio':>8}"
          f"{'prefill s':>11}{'decode tok/s':>14}{'ratio':>8}")
    for r in rows + ([peer] if peer else []):
        ratio = f"{r.tok_s / peer.tok_s:.2f}x" if peer else "-"
        dratio = f"{r.decode_tok_s / peer.decode_tok_s:.2f}x" if peer else "-"
        print(f"{r.name:<14}{r.output_tokens:>15}{r.seconds:>10.2f}{r.tok_s:>10.1f}{ratio:>8}"
              f"{r.prefill_seconds:>11.3f}{r.decode_tok_s:>14.1f}{dratio:>8}")
    for line in extra:
        print(line)


def main(argv: list[str] | None = None, mode: str = "offline") -> None:
    parser = argparse.ArgumentParser(prog=f"radixlm.bench {mode}")
    parser.add_argument("--num-prompts", type=int, default=64 if mode == "offline" else 1)
    parser.add_argument("--input-len", type=int, default=256 if mode == "offline" else 128)
    parser.add_argument("--output-len", type=int, default=128 if mode == "offline" else 256)
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="HF static batch size (default: all prompts at once)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-dtype", choices=("same", "float32", "bfloat16", "float16"),
                        default="same", help="the HF peer's dtype (default: ours)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llamacpp-python", default=None,
                        help="one-batch on a .gguf: also time llama.cpp in-process on the same "
                             "file and threads, through this interpreter (llama-cpp-python)")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    if mode == "one-batch":
        args.num_prompts = 1

    from radixlm.engine import Engine
    server_args = ServerArgs.from_cli_args(args)
    engine = Engine(**vars(server_args))
    # With tp/dp > 1 the model runs in rank processes: no runner here, so no
    # roofline and no HF peer (which would need the same devices).
    worker = getattr(engine.scheduler, "worker", None)
    runner = getattr(worker, "runner", None)
    if runner is None and not args.skip_hf:
        engine.shutdown()
        parser.error("with --tp-size/--dp-size > 1, pass --skip-hf")
    vocab = engine.scheduler.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    ours, ttft = run_ours(engine, prompts, args.output_len)
    ours.prefill_seconds, ours.num_seqs = ttft, args.num_prompts
    where = (f"device {runner.device}, dtype {runner.dtype}" if runner is not None else
             f"tp {server_args.tp_size} x dp {server_args.dp_size}, dtype {server_args.dtype}")
    extra = [f"workload: {args.num_prompts} x {args.input_len} in / {args.output_len} out, "
             + where]
    if runner is not None:  # the capacity --kv-cache-dtype / --mem-fraction-static gave
        extra.append(f"KV pool: {runner.kv_pool.size} tokens, "
                     f"{str(runner.kv_dtype).removeprefix('torch.')}")
    if runner is not None and runner.device.type == "cuda":
        bw = measure_copy_bandwidth(runner.device)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        bound = bw / weight_bytes * args.num_prompts
        if args.num_prompts > 1:
            flops = measure_matmul_flops(runner.device, runner.dtype)
            t = workload_bound_seconds(runner, args.num_prompts, args.input_len,
                                       args.output_len, bw, flops)
            out_tokens = args.num_prompts * args.output_len
            extra.append(f"workload roofline: {t:.2f} s = {out_tokens / t:.0f} output tok/s "
                         f"(matmul {flops / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s); ours "
                         f"= {ours.tok_s / (out_tokens / t):.0%} of it")
        extra.append(f"HBM roofline (weights {weight_bytes / 1e9:.2f} GB / copy bw "
                     f"{bw / 1e12:.2f} TB/s): {bound:.0f} tok/s decode (weights only); ours "
                     f"= {ours.decode_tok_s / bound:.0%} of it")
    peer = None
    if args.llamacpp_python:
        threads = server_args.num_threads or torch.get_num_threads()
        engine.shutdown()  # its cores are the peer's now
        peer = run_llamacpp(args.llamacpp_python, server_args, args.input_len, args.output_len,
                            threads)
        extra.append(f"llama.cpp peer: same GGUF, {threads} threads, in-process "
                     "(bench/llamacpp_peer.py)")
        ours_pf = args.num_prompts * args.input_len / ours.prefill_seconds
        peer_pf = args.input_len / peer.prefill_seconds
        extra.append(f"prefill tok/s: radixlm {ours_pf:.0f} (time to first token), llama.cpp "
                     f"{peer_pf:.0f}: {ours_pf / peer_pf:.2f}x")
    elif not args.skip_hf:
        from radixlm.models.loader import load_config, prepare_model_dir
        model_dir = prepare_model_dir(server_args.model_path, server_args.load_format)
        config = load_config(model_dir, server_args.context_length)
        model_device, model_dtype = runner.device, runner.dtype
        engine.shutdown()
        del engine, runner
        gc.collect()
        if model_device.type == "cuda":
            torch.cuda.empty_cache()
        if args.hf_dtype != "same":
            model_dtype = getattr(torch, args.hf_dtype)
        hf = load_hf(model_dir, config, model_dtype, model_device,
                     server_args.load_format == "dummy")
        peer = run_hf(hf, prompts, args.output_len, model_device,
                      args.hf_batch_size or args.num_prompts)
        peer.num_seqs = args.num_prompts
        extra.append(f"HF peer dtype: {model_dtype}")
    print_table([ours], peer, extra)
