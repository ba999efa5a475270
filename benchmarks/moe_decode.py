"""Single-stream MoE decode on the GPU: ours beside HF `generate`, and against the
roofline of the bytes a decode step reads, in one run.

    python benchmarks/moe_decode.py                      # Qwen3-30B-A3B's shape
    python benchmarks/moe_decode.py --shape mixtral-8x7b
    python benchmarks/moe_decode.py --offline            # + 256 x 512/256 throughput
    python benchmarks/moe_decode.py --quantization fp8   # + ours in online FP8

Dummy bf16 weights of the real model's shape (`--load-format dummy`: N(0, 0.02),
from config.json alone). Ours: the offline Engine (CUDA graphs, the default
MoE backend), a 32-token prompt, then 257 greedy tokens with EOS ignored; the
decode rate is 256 / (time to 257 tokens - time to the first), min / median /
max of 3 runs. HF: transformers' model of the same config on the GPU (its own
random init), `generate` of 33 tokens after the same prompt, 2 runs.

Roofline: the bytes one decode step at batch 1 must read (every layer's
attention weights, the k selected experts' gate/up/down, the router, the LM
head, one embedding row, and the KV of the context so far at its mean length),
at the rate a device-to-device copy moves bytes on this GPU (read + write of
2 GiB, measured here). Our tok/s as a fraction of that is the headline.
`--quantization fp8`: ours again with online FP8 weights (per-channel scales,
every linear layer and expert; the LM head stays bf16), its roofline from one
byte a weight plus the fp32 scales, beside ours in bf16 from the same run.
`--offline`: 256 prompts of 512 random tokens, 256 output tokens each, ours
(all at once) and HF `generate` (one padded batch), output tok/s.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # Qwen/Qwen3-30B-A3B's config.json (the fields that size it).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # mistralai/Mixtral-8x7B-v0.1's.
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}
PROMPT = 32
DECODE = 256
BF16 = 2


def step_bytes(c: dict, context: int, fp8: bool = False) -> dict[str, float]:
    """Bytes one decode step at batch 1 reads, by part, at `context` tokens of KV;
    `fp8`: the linear layers' and experts' weights one byte each plus an fp32
    scale per output channel."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    experts = c.get("num_experts") or c["num_local_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    k = c["num_experts_per_tok"]
    w = 1 if fp8 else BF16
    scales = 4 if fp8 else 0  # per output channel
    return {
        "attention weights": layers * ((h * (q + 2 * kv) + q * h) * w
                                       + (q + 2 * kv + h) * scales),
        "selected experts": layers * k * (3 * h * inter * w + (2 * inter + h) * scales),
        "routers (fp32)": layers * experts * h * 4,
        "LM head + embedding row": (c["vocab_size"] + 1) * h * BF16,
        "KV": layers * 2 * kv * context * BF16,
    }


def copy_rate() -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 10."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * (1 << 30) * BF16 / best


def spread(xs: list[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"


def ours(model_dir: str, prompt: list[int], offline: list[list[int]] | None,
         quantization: str | None = None) -> dict:
    import radixlm

    out: dict = {}
    with radixlm.Engine(model_path=model_dir, load_format="dummy", dtype="bfloat16",
                        skip_tokenizer_init=True, context_length=4096,
                        quantization=quantization) as e:
        first = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        full = {"max_new_tokens": DECODE + 1, "temperature": 0.0, "ignore_eos": True}
        e.generate(input_ids=prompt, sampling_params=full)  # warm-up
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            e.generate(input_ids=prompt, sampling_params=first)
            t1 = time.perf_counter()
            res = e.generate(input_ids=prompt, sampling_params=full)
            t2 = time.perf_counter()
            rates.append(DECODE / ((t2 - t1) - (t1 - t0)))
        out["decode"] = rates
        # A digest of the greedy tokens: variants of a kernel must agree on it.
        out["ids_digest"] = hashlib.sha1(str(res["output_ids"]).encode()).hexdigest()[:12]
        runner = e.scheduler.worker.runner
        out["moe"] = [m.describe() for m in runner.model.modules()
                      if type(m).__name__ == "FusedMoE"][:1]
        out["cuda_graphs"] = runner.graph_runner is not None
        del runner
        if offline is not None:
            sp = {"max_new_tokens": DECODE, "temperature": 0.0, "ignore_eos": True}
            t = time.perf_counter()
            done = e.generate(input_ids=offline, sampling_params=sp)
            out["offline"] = sum(len(o["output_ids"]) for o in done) / (time.perf_counter() - t)
    del e  # the engine holds the model: HF's needs the memory next
    gc.collect()
    torch.cuda.empty_cache()
    return out


def hf(config_dir: str, prompt: list[int], offline: list[list[int]] | None) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    out: dict = {}
    x = torch.tensor([prompt], device="cuda")
    n = 33

    def generate(ids: torch.Tensor, new: int, model: torch.nn.Module = model) -> None:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False)

    with torch.no_grad():
        generate(x, 4)
        rates = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(x, 1)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            generate(x, n)
            torch.cuda.synchronize()
            rates.append((n - 1) / ((time.perf_counter() - t1) - (t1 - t0)))
        out["decode"] = rates
        if offline is not None:
            ids = torch.tensor(offline, device="cuda")  # equal lengths: no padding
            torch.cuda.synchronize()
            t = time.perf_counter()
            generate(ids, DECODE)
            torch.cuda.synchronize()
            out["offline"] = len(offline) * DECODE / (time.perf_counter() - t)
    del model, generate
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check)")
    p.add_argument("--offline", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="also ours with these weights, beside ours in bf16")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    g = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]
    prompt = torch.randint(100, vocab - 100, (PROMPT,), generator=g).tolist()
    offline = [torch.randint(100, vocab - 100, (512,), generator=g).tolist()
               for _ in range(256)] if args.offline else None
    rate = copy_rate()
    parts = step_bytes(config, PROMPT + DECODE // 2)
    total = sum(parts.values())
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(config))
        mine = ours(d, prompt, offline)
        quant = ours(d, prompt, offline, args.quantization) if args.quantization else None
        peer = None if args.skip_hf else hf(d, prompt, offline)
    roof = rate / total
    name = f"{args.shape} ({config['num_hidden_layers']} layers), {torch.cuda.get_device_name()}"
    print(f"\n{name}; MoE layers: {mine['moe'][0] if mine['moe'] else '-'}; "
          f"CUDA graphs: {mine['cuda_graphs']}")
    print(f"copy rate {rate / 1e12:.2f} TB/s; bytes per decode step {total / 1e9:.2f} GB (" +
          ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items()) +
          f"); roofline {roof:.0f} tok/s")
    print(f"greedy tokens' digest: {mine['ids_digest']}")
    print("| engine | decode tok/s (min / median / max) | of roofline |")
    print("|---|---|---|")
    med = statistics.median(mine["decode"])
    print(f"| radixlm | {spread(mine['decode'])} | {med / roof:.0%} |")
    if quant is not None:
        qparts = step_bytes(config, PROMPT + DECODE // 2, fp8=True)
        qroof = rate / sum(qparts.values())
        qmed = statistics.median(quant["decode"])
        print(f"| radixlm, {args.quantization} | {spread(quant['decode'])} | {qmed / qroof:.0%} "
              f"of its {qroof:.0f} tok/s ({sum(qparts.values()) / 1e9:.2f} GB a step) |")
        print(f"radixlm {args.quantization} / bf16: {qmed / med:.2f}x; its greedy tokens' "
              f"digest {quant['ids_digest']}")
    if peer is not None:
        pmed = statistics.median(peer["decode"])
        print(f"| HF generate | {spread(peer['decode'])} | {pmed / roof:.0%} |")
        print(f"radixlm / HF: {med / pmed:.1f}x")
    if offline is not None:
        line = f"offline 256 x 512/256: radixlm {mine['offline']:.0f} output tok/s"
        if quant is not None:
            line += (f", {args.quantization} {quant['offline']:.0f} "
                     f"({quant['offline'] / mine['offline']:.2f}x)")
        if peer is not None:
            line += f", HF {peer['offline']:.0f}: {mine['offline'] / peer['offline']:.1f}x"
        print(line)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"shape": args.shape, "config": config, "copy_rate": rate, "step_bytes": parts,
             "roofline": roof, "ours": mine, "quantized": quant, "hf": peer}, indent=1))


if __name__ == "__main__":
    main()
