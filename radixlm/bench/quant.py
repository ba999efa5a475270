"""Quantized weights beside the unquantized model, in one run.

    python -m radixlm.bench quant --quantizations none,fp8,awq [--num-prompts 1]
        [--input-len 128 --output-len 256] [SERVER ARGS]

For each quantization in turn (a fresh Engine with the same server
arguments, the previous one shut down and its memory returned), the workload
of `one-batch` (--num-prompts 1: single-stream decode) or `offline` (more
prompts: output throughput): random prompts from a fixed seed, EOS ignored.
With `--load-format dummy` every method makes its own random weights (FP8:
the random floats quantized at load; AWQ / GPTQ: rounded to int4). Printed
per quantization: the bytes of weights one decode step reads (every parameter
but the input embedding table, of which a step reads a row per token), decode
tok/s and its share of the HBM roofline (copy bandwidth / those bytes, single
stream), output tok/s, and both ratios to the first quantization listed (the
peer, normally `none`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

from radixlm.bench.offline import measure_copy_bandwidth, random_prompts, run_ours
from radixlm.config import ServerArgs


@dataclasses.dataclass
class Row:
    quantization: str
    step_bytes: int
    decode_tok_s: float
    output_tok_s: float
    prefill_s: float
    roofline_tok_s: float | None


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters one decode step reads: all but an untied input embedding."""
    embed = model.model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if tied or p is not embed)


def run_one(server_args: ServerArgs, quantization: str, args: argparse.Namespace) -> Row:
    from radixlm.engine import Engine

    engine = Engine(**{**vars(server_args), "quantization": quantization})
    try:
        runner = engine.scheduler.worker.runner
        prompts = random_prompts(args.num_prompts, args.input_len, engine.scheduler.vocab_size,
                                 args.seed)
        result, ttft = run_ours(engine, prompts, args.output_len)
        result.prefill_seconds, result.num_seqs = ttft, args.num_prompts
        nbytes = step_bytes(runner.model)
        device = runner.device
        del runner  # the engine's memory must go with it, for the next method's
        roofline = None
        if device.type == "cuda":
            roofline = measure_copy_bandwidth(device) / nbytes * args.num_prompts
        return Row(quantization, nbytes, result.decode_tok_s, result.tok_s, ttft, roofline)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlm.bench quant",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantizations", default="none,fp8,awq",
                        help="comma-separated --quantization values; the first is the peer")
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.tp_size * server_args.dp_size > 1:
        parser.error("one device: the table reads the in-process model runner")
    rows = [run_one(server_args, q, args) for q in args.quantizations.split(",")]
    peer = rows[0]
    print(f"\nworkload: {args.num_prompts} x {args.input_len} in / {args.output_len} out, "
          f"dtype {server_args.dtype}, load format {server_args.load_format}")
    print(f"{'quantization':<14}{'GB/step':>9}{'decode tok/s':>14}{'ratio':>8}{'roofline':>10}"
          f"{'output tok/s':>14}{'ratio':>8}{'prefill s':>11}")
    for r in rows:
        share = f"{r.decode_tok_s / r.roofline_tok_s:.0%}" if r.roofline_tok_s else "-"
        print(f"{r.quantization:<14}{r.step_bytes / 1e9:>9.2f}{r.decode_tok_s:>14.1f}"
              f"{r.decode_tok_s / peer.decode_tok_s:>7.2f}x{share:>10}{r.output_tok_s:>14.1f}"
              f"{r.output_tok_s / peer.output_tok_s:>7.2f}x{r.prefill_s:>11.3f}")
    print("roofline: the copy bandwidth over GB/step, times the prompts (decode bound by "
          "reading the weights once per step)")
