"""Generated shared-prefix workload: radix cache on vs off, same run.

    python -m radixlm.bench shared-prefix --num-groups 32 --group-size 16 \
        --prefix-len 1024 --question-len 128 --output-len 128

Each group shares a system prompt of random tokens; each request adds its own
question. The peer is the same engine with --disable-radix-cache, or, with
`--peer round-robin` (data parallelism: `--dp-size 2 --load-balance-method
cache_aware`), the same replicas routed round-robin.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import time

import torch

from radixlm.config import ServerArgs


def build_workload(num_groups: int, group_size: int, prefix_len: int, question_len: int,
                   vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefixes = torch.randint(100, vocab - 1, (num_groups, prefix_len), generator=g).tolist()
    prompts = []
    for p in prefixes:
        for _ in range(group_size):
            prompts.append(p + torch.randint(100, vocab - 1, (question_len,),
                                             generator=g).tolist())
    random.Random(seed).shuffle(prompts)  # arrival order mixes the groups
    return prompts


def run(server_args: ServerArgs, prompts: list[list[int]], output_len: int) -> dict:
    from radixlm.engine import Engine
    engine = Engine(**vars(server_args))
    sp = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    engine.generate(input_ids=[1, 2, 3, 4], sampling_params={**sp, "max_new_tokens": 2})
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    info = engine.get_server_info()
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next engine sizes its KV pool from free memory
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt,
            "hit_rate": info["cache_hit_rate"], "routed": info.get("dp", {}).get("routed")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlm.bench shared-prefix")
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer", choices=("no-radix-cache", "round-robin"),
                        default="no-radix-cache")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    from radixlm.models.loader import load_config, prepare_model_dir
    config = load_config(prepare_model_dir(server_args.model_path, server_args.load_format))
    prompts = build_workload(args.num_groups, args.group_size, args.prefix_len,
                             args.question_len, config.vocab_size, args.seed)
    on = run(server_args, prompts, args.output_len)
    if args.peer == "round-robin":
        peer_name = "round_robin routing"
        peer_args = dataclasses.replace(server_args, load_balance_method="round_robin")
    else:
        peer_name = "--disable-radix-cache"
        peer_args = dataclasses.replace(server_args, disable_radix_cache=True)
    off = run(peer_args, prompts, args.output_len)
    ours_name = (f"{server_args.load_balance_method} routing" if args.peer == "round-robin"
                 else "radix cache")
    print(f"\nworkload: {args.num_groups} groups x {args.group_size} requests, prefix "
          f"{args.prefix_len} + question {args.question_len} tokens, {args.output_len} out")
    print(f"{'system':<24}{'seconds':>10}{'tok/s':>10}{'hit rate':>10}{'ratio':>8}")
    for name, r in ((ours_name, on), (peer_name, off)):
        print(f"{name:<24}{r['seconds']:>10.2f}{r['tok_s']:>10.1f}{r['hit_rate']:>10.1%}"
              f"{r['tok_s'] / off['tok_s']:>7.2f}x")
