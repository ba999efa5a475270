"""Quantized weights against the float model they came from: perplexity on a
fixed text and greedy agreement, on real weights (default: the embedded SmolLM2).

    python -m radixlm.bench quant-perplexity [--formats none,fp8,awq,gptq]
        [--group-size 64] [--new-tokens 32] [SERVER ARGS]
    python -m radixlm.bench quant-perplexity --formats none,none:fp8,awq,awq:fp8

`none` is the float model (a .gguf file is first converted, dequantized, to
an HF directory); `fp8` quantizes it at load (per-channel FP8 weights,
per-token activation scales where the GPU quantizes them); `awq` and `gptq`
load int4 checkpoints this script writes from the float weights by
round-to-nearest in the tools' layouts (AWQ: asymmetric, zero points; GPTQ:
symmetric, v1), groups of --group-size input features: a baseline of int4
weights without AWQ's activation-aware scales or GPTQ's error feedback,
which only lower the perplexity further. `FORMAT:fp8` (e.g. `none:fp8`,
`awq:fp8`) adds `--lm-head-quantization fp8`: the LM head in FP8. Prints,
per format, the perplexity of the text (teacher-forced) and its change
against `none`, and how many greedy tokens of ten fixed prompts agree with
`none` before the first divergence (EOS ignored).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from radixlm.bench.gguf_agreement import PROMPTS, TEXT, first_divergence, greedy, perplexity
from radixlm.bench.quant import split_entry
from radixlm.config import ServerArgs

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_int4(src: str, dst: Path, fmt: str, group: int) -> str:
    """The float checkpoint `src` as an int4 checkpoint in `fmt` (RTN), at `dst`."""
    from safetensors.torch import save_file

    from radixlm.layers.quantization.int4 import awq_tensors, gptq_tensors
    from radixlm.models.loader import iter_safetensors

    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    tensors = {}
    for name, t in iter_safetensors(src):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            made = awq_tensors(t, group) if fmt == "awq" else gptq_tensors(t, group)
            tensors.update({f"{module}.{k}": v for k, v in made.items()})
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if fmt == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
         "sym": True, "checkpoint_format": "gptq"})
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def linear_weight_bytes(engine: Any) -> int:
    """Bytes of the projections' parameters (quantized codes and scales included)."""
    model = engine.scheduler.worker.runner.model
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "proj" in n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlm.bench quant-perplexity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="none,fp8,awq,gptq",
                        help="comma-separated; FORMAT:HEAD also sets --lm-head-quantization "
                        "HEAD (none:fp8: float layers, the LM head in FP8)")
    parser.add_argument("--group-size", type=int, default=64,
                        help="int4 group size (SmolLM2's 576 features are not groups of 128)")
    parser.add_argument("--new-tokens", type=int, default=32)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.quantization not in (None, "auto"):
        parser.error("--quantization is this benchmark's to set (--formats)")
    from radixlm.engine import Engine
    from radixlm.models.loader import prepare_model_dir

    model_dir = prepare_model_dir(server_args.model_path, server_args.load_format)
    formats = args.formats.split(",")
    results = {}
    with tempfile.TemporaryDirectory(prefix="radixlm-int4-") as tmp:
        for fmt in formats:
            layers, head = split_entry(fmt, server_args)
            path, quantization = model_dir, layers
            if layers in ("awq", "gptq"):
                path = write_int4(model_dir, Path(tmp) / layers, layers, args.group_size)
                quantization = "auto"
            kwargs = {**vars(server_args), "model_path": path, "quantization": quantization,
                      "load_format": "auto",
                      "lm_head_quantization": head}
            with Engine(**kwargs) as engine:
                nbytes = linear_weight_bytes(engine)
                tokens, gaps = greedy(engine, PROMPTS, args.new_tokens)
                results[fmt] = (perplexity(engine, TEXT), tokens, nbytes)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    base_ppl, base_tokens, _ = results[formats[0]]
    print(f"\nmodel {server_args.model_path or 'embedded SmolLM2-135M'} ({model_dir}), dtype "
          f"{server_args.dtype}, device {server_args.device}; int4: RTN, group "
          f"{args.group_size}")
    print(f"| format | linear weights MB | perplexity | vs {formats[0]} | greedy tokens agreeing "
          f"before the first divergence (mean / min of {len(PROMPTS)}, of {args.new_tokens}) "
          "| identical sequences |")
    print("|---|---|---|---|---|---|")
    for fmt in formats:
        ppl, tokens, nbytes = results[fmt]
        agree = [first_divergence(a, b) for a, b in zip(tokens, base_tokens, strict=True)]
        same = sum(n == args.new_tokens for n in agree)
        print(f"| {fmt} | {nbytes / 1e6:.1f} | {ppl:.3f} | {ppl / base_ppl - 1:+.2%} | "
              f"{sum(agree) / len(agree):.1f} / {min(agree)} | {same} |")
