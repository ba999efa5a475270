"""Where a single-stream decode step's time goes: a torch.profiler trace of the
scheduler over steady-state decode steps, summarised per step (GPU busy and
idle time, kernels by kind and by name, host events).

    python benchmarks/decode_profile.py --model-path benchmarks/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 [--quantization fp8] [--steps 40]
    python benchmarks/decode_profile.py --shape qwen3-30b-a3b     # a MoE shape
    python benchmarks/decode_profile.py --model-path ... --batch 256 --prompt-len 512
    python benchmarks/decode_profile.py --model-path ... --enable-deterministic-inference \
        --replay-draft 2,3                                       # speculative verify steps

`--shape` takes a config of `moe_decode.SHAPES` (dummy bf16 weights). Under PDL
(the default on Hopper) a kernel starts while the one before it runs and waits
inside, so the per-kernel spans overlap and add up to more than GPU busy;
the summary's "added" column gives each kernel the time its end lies past the
one before (it sums to GPU busy), and `--disable-pdl` each kernel's own time
(and a slower step). The
summary is of rank 0 from the 5th CUDA-graph replay on, so prefill and
warm-up are out; kernels inside a replayed graph are traced one by one.
`profile_decode(engine, name)` is the same for a running engine (multi_gpu.py
uses it at tp=2).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

KERNEL_KINDS = [("all-reduce", ("allreduce", "all_reduce")), ("broadcast", ("broadcast",)),
                ("all-gather", ("allgather", "all_gather")),
                ("attention", ("attn", "attention", "decode_kernel", "flash")),
                ("moe", ("moe", "align", "expert")),
                ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "splitk", "matmul"))]


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def log(*args: object) -> None:
    print(*args, flush=True)


def profile_decode(engine, name: str, steps: int = 40, top: int = 8,
                   prompt_len: int = 128, vocab: int = 32000,
                   replay: tuple[int, int] | None = None, batch: int = 1) -> None:
    """Trace `steps` decode steps of `batch` streams on every rank and print rank
    0's per-step breakdown (`top` kernels by time). The prompts are prefilled
    and cached first, so the traced run's prefill is one token a stream.
    `replay` (k, L): verify steps instead, drafts replayed from a plain run so
    each verify keeps L - 1 of k (`bench speculative simulated`'s drafter;
    in-process engines only; one stream)."""
    assert replay is None or batch == 1
    out_dir = tempfile.mkdtemp(prefix="radixlm-prof-")
    greedy = {"temperature": 0.0, "ignore_eos": True}
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(100, vocab - 100, (batch, prompt_len), generator=g).tolist()
    ids = prompts[0] if batch == 1 else prompts
    # Enough tokens for `steps` traced steps past warm-up, at 1 or L tokens a step.
    length = (steps + 16) * (1 if replay is None else replay[1])
    plain = engine.generate(input_ids=ids, sampling_params={
        **greedy, "max_new_tokens": 8 if replay is None else length})
    if replay is not None:  # the warm-up run is the continuation the drafts replay
        from radixlm.bench.speculative import ReplayDrafter

        engine.scheduler.drafter = ReplayDrafter(plain["output_ids"], *replay, vocab)
    engine.start_profile(output_dir=out_dir, num_steps=steps)
    engine.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": length})
    engine.flush_cache()
    paths: list[str] = []
    for _ in range(100):  # the rank writes the trace when its step count runs out
        paths = sorted(glob.glob(os.path.join(out_dir, "*-TP-0.trace.json")))
        if paths:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    if not paths:
        log(f"{name}: no trace written")
        return
    log(f"{name}: profile of {steps} scheduler steps on rank 0 ({paths[0]}):")
    for line in summarize_trace(paths[0], top):
        log("    " + line)


def summarize_trace(path: str, top: int = 8) -> list[str]:
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches = sorted(e["ts"] for e in events if e.get("name") == "cudaGraphLaunch")
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    if len(launches) < 12 or not gpu:
        return [f"too few graph replays traced ({len(launches)})"]
    # Steady state: from the 5th replay to the last, skipping the prefill.
    first, last = launches[4], launches[-1]
    n = len(launches) - 5
    window = [e for e in gpu if first <= e["ts"] < last]
    added = added_time(window, first)
    busy = sum(dur for _, dur in added.values())  # the union of the busy intervals
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in window:
        for table, key in ((by_kind, kernel_kind(e["name"])), (by_name, e["name"][:90])):
            table[key][0] += 1
            table[key][1] += e["dur"]
    host: dict[str, float] = defaultdict(float)
    for e in events:
        if first <= e["ts"] < last and e.get("cat") in ("cuda_runtime", "cpu_op",
                                                        "user_annotation"):
            host[e["name"][:60]] += e["dur"]
    span = (last - first) / n
    lines = [f"wall per step {span:.0f} us (replay to replay), GPU busy {busy / n:.0f} us, "
             f"GPU idle {span - busy / n:.0f} us, {len(window) / n:.0f} kernels/step"]
    for kind, (count, dur) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{kind:>10}: {count / n:6.1f} kernels/step, {dur / n:7.0f} us/step")
    lines.append("top kernels (us/step, calls/step, us/call):")
    for key, (count, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {dur / n:7.0f} {count / n:5.1f} {dur / count:6.1f}  {key}")
    lines.append("added to the step past the kernel before (us/step, calls/step, us/call):")
    for key, (count, dur) in sorted(added.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {dur / n:7.0f} {count / n:5.1f} {dur / count:6.1f}  {key}")
    lines.append("top host events (us/step):")
    for key, dur in sorted(host.items(), key=lambda kv: -kv[1])[:10]:
        lines.append(f"  {dur / n:7.0f}  {key}")
    return lines


def added_time(window: list[dict], start: float) -> dict[str, list[float]]:
    """Per kernel name: (calls, time) where each kernel's time is how far its end
    lies past the latest end before it in the stream (from `start`; 0 if it ended
    earlier). Under PDL a kernel starts early and waits, so its span includes the
    kernel before it; this attributes the step's end-to-end time instead: the sum
    over the window is the union of the busy intervals, and a kernel whose work hid
    under its predecessor's adds only what ran after that predecessor ended."""
    added: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    end = start
    for e in window:  # in start order (one stream: ends in the same order)
        f = e["ts"] + e["dur"]
        row = added[e["name"][:90]]
        row[0] += 1
        row[1] += max(0.0, f - max(end, e["ts"]))
        end = max(end, f)
    return added


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default=None, help="a config of moe_decode.SHAPES")
    p.add_argument("--model-path", default=None)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--disable-pdl", action="store_true",
                   help="each kernel's own time: under PDL a kernel's span includes its wait "
                        "for the one before it")
    p.add_argument("--enable-norm-fold", action="store_true",
                   help="fold the RMSNorms into the projections (layers/norm_fold.py)")
    p.add_argument("--replay-draft", default=None, metavar="K,L",
                   help="profile verify steps of k replayed drafts keeping L - 1 each "
                        "(SIMULATED acceptance)")
    p.add_argument("--batch", type=int, default=1, help="streams decoding together")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    import radixlm

    with tempfile.TemporaryDirectory() as d:
        path, vocab = args.model_path, 32000
        if args.shape:
            from moe_decode import SHAPES

            Path(d, "config.json").write_text(json.dumps(SHAPES[args.shape]))
            path, vocab = d, SHAPES[args.shape]["vocab_size"]
        kwargs = dict(model_path=path, load_format=args.load_format, dtype=args.dtype,
                      skip_tokenizer_init=True, context_length=4096,
                      kv_cache_dtype=args.kv_cache_dtype,
                      enable_deterministic_inference=args.enable_deterministic_inference,
                      disable_pdl=args.disable_pdl, enable_norm_fold=args.enable_norm_fold)
        if args.quantization:
            kwargs["quantization"] = args.quantization
        with radixlm.Engine(**kwargs) as engine:
            replay = tuple(map(int, args.replay_draft.split(","))) if args.replay_draft else None
            profile_decode(engine, args.shape or os.path.basename(path), args.steps, args.top,
                           prompt_len=args.prompt_len, vocab=vocab, replay=replay,
                           batch=args.batch)


if __name__ == "__main__":
    main()
