"""Quantized weights beside the unquantized model, in one run.

    python -m radixlm.bench quant --quantizations none,fp8,awq,awq:fp8 [--num-prompts 1]
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
peer, normally `none`). An entry `Q:HEAD` also sets --lm-head-quantization HEAD
(`awq:fp8`: AWQ layers, the LM head in FP8).

`--repeats N` (default 3) goes over the list N times, every other round in
reverse order: on an H100 the engines a process ran before moved a figure by
up to 7 % (FP8 second in both orders: 275.8 decode tok/s after bf16, 294.3
after AWQ; BENCHMARKS.md 2026-12-06), so one pass in one order biases the
ratios. Figures are min / median / max of the rounds; ratios and the
roofline share are of the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics

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
    """Bytes one decode step reads: every parameter but the input embedding table,
    and the LM head as its products read it (a tied head's FP8 codes, not the
    shared float table)."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    embed = model.model.embed_tokens.weight
    head = getattr(model, "lm_head", None)
    nbytes = sum(size(p) for p in model.parameters() if p is not embed)
    if head is not None and head.weight is embed:  # tied: its codes, else the float table
        fp8 = getattr(head, "fp8", None)
        nbytes += size(embed) if fp8 is None else size(fp8.weight) + size(fp8.scales)
    return nbytes


def split_entry(entry: str, server_args: ServerArgs) -> tuple[str, str]:
    """(weight format, --lm-head-quantization) of a benchmark's list entry:
    'FORMAT' or 'FORMAT:HEAD' (e.g. 'awq:fp8'); without HEAD, the server's."""
    layers, _, head = entry.partition(":")
    return layers, head or server_args.lm_head_quantization


def run_one(server_args: ServerArgs, entry: str, args: argparse.Namespace) -> Row:
    """One engine for a `--quantizations` entry (`split_entry`)."""
    from radixlm.engine import Engine

    quantization, head = split_entry(entry, server_args)
    engine = Engine(**{**vars(server_args), "quantization": quantization,
                       "lm_head_quantization": head})
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
        return Row(entry, nbytes, result.decode_tok_s, result.tok_s, ttft, roofline)
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
                        help="comma-separated --quantization values, each optionally "
                        "with :HEAD, the --lm-head-quantization (awq:fp8); the first is "
                        "the peer")
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over the list, every other one in reverse order")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.tp_size * server_args.dp_size > 1:
        parser.error("one device: the table reads the in-process model runner")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    order = args.quantizations.split(",")
    runs: dict[str, list[Row]] = {q: [] for q in order}
    for i in range(args.repeats):
        for q in order if i % 2 == 0 else order[::-1]:
            runs[q].append(run_one(server_args, q, args))
    print_table(order, runs, args, server_args)


def spread(values: list[float], fmt: str) -> str:
    """'median' for one value, else 'min / median / max'."""
    if len(values) == 1:
        return format(values[0], fmt)
    return " / ".join(format(v, fmt) for v in
                      (min(values), statistics.median(values), max(values)))


def print_table(order: list[str], runs: dict[str, list[Row]], args: argparse.Namespace,
                server_args: ServerArgs) -> None:
    def median(q: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs[q])

    peer = order[0]
    print(f"\nworkload: {args.num_prompts} x {args.input_len} in / {args.output_len} out, "
          f"dtype {server_args.dtype}, load format {server_args.load_format}; "
          f"{args.repeats} round(s), alternate ones in reverse order")
    print(f"{'quantization':<14}{'GB/step':>9}  {'decode tok/s':<24}{'ratio':>7}{'roofline':>10}"
          f"  {'output tok/s':<24}{'ratio':>7}{'prefill s':>11}")
    for q in order:
        rows = runs[q]
        decode = median(q, "decode_tok_s")
        rooflines = [r.roofline_tok_s for r in rows if r.roofline_tok_s]
        share = f"{decode / statistics.median(rooflines):.0%}" if rooflines else "-"
        print(f"{q:<14}{rows[0].step_bytes / 1e9:>9.2f}  "
              f"{spread([r.decode_tok_s for r in rows], '.1f'):<24}"
              f"{decode / median(peer, 'decode_tok_s'):>6.2f}x{share:>10}  "
              f"{spread([r.output_tok_s for r in rows], '.1f'):<24}"
              f"{median(q, 'output_tok_s') / median(peer, 'output_tok_s'):>6.2f}x"
              f"{median(q, 'prefill_s'):>11.3f}")
    print("roofline: the copy bandwidth over GB/step, times the prompts (decode bound by "
          "reading the weights once per step); ratios of medians")
