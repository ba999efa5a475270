"""The same CPU engine workloads on two source trees, alternating, in one run.

    python benchmarks/cpu_ab.py --trees /path/to/before /path/to/after [--runs 3] [-- ENGINE FLAGS]

Each run of a tree is a fresh process (PYTHONPATH=the tree) that builds one
Engine (the embedded model unless ENGINE FLAGS say otherwise), warms it up and
times, with ignore_eos and fixed random prompts:
  - prefill: one 512-token prompt, one output token (prompt tok/s);
  - single stream: one 128-token prompt, 64 output tokens (decode tok/s after
    the first token);
  - concurrency 8: eight 128-token prompts in one call, 64 tokens each (output tok/s);
  - batch prefill: 32 prompts of 256 tokens, one output token each (prompt tok/s).
Trees alternate (A B A B ...), so drift on a shared machine hits both; the
table gives min / median / max over the runs and the ratio of the medians
(second tree / first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = ("prefill", "single stream", "concurrency 8", "batch prefill")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


def _timed(engine, prompts: list[list[int]], new_tokens: int) -> float:
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=sp)
    return time.perf_counter() - start


def measure(engine_args: list[str]) -> dict[str, float]:
    """One process's figures (run inside the child)."""
    import radixlm
    from radixlm.config import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(engine_args))
    kwargs = {k: v for k, v in vars(args).items() if v != getattr(ServerArgs(), k)}
    with radixlm.Engine(**{"log_level": "warning", **kwargs}) as e:
        worker = e.scheduler.worker  # the vocabulary moved from the worker to its runner
        vocab = getattr(worker, "vocab_size", None) or worker.runner.vocab_size
        long, short = _prompts(1, 512, vocab, 1), _prompts(8, 128, vocab, 2)
        batch = _prompts(32, 256, vocab, 3)
        _timed(e, short[:2], 4)  # warm-up
        e.flush_cache()
        out = {"prefill": 512 / _timed(e, long, 1)}
        e.flush_cache()
        first = _timed(e, short[:1], 1)
        e.flush_cache()
        out["single stream"] = 63 / max(_timed(e, short[:1], 64) - first, 1e-9)
        e.flush_cache()
        out["concurrency 8"] = 8 * 64 / _timed(e, short, 64)
        e.flush_cache()
        out["batch prefill"] = 32 * 256 / _timed(e, batch, 1)
    return out


def main() -> None:
    argv = sys.argv[1:]
    engine_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, required=True, help="two source trees: A B")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        print("RESULT " + json.dumps(measure(engine_args)))
        return
    figures: dict[str, dict[str, list[float]]] = {t: {w: [] for w in WORKLOADS}
                                                  for t in opts.trees}
    for run in range(opts.runs):
        for tree in opts.trees:
            env = {**os.environ, "PYTHONPATH": tree}
            cmd = [sys.executable, os.path.abspath(__file__), "--trees", *opts.trees,
                   "--child", "--", *engine_args]
            proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True,
                                  check=True)
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            for w, v in json.loads(line[len("RESULT "):]).items():
                figures[tree][w].append(v)
            print(f"run {run + 1} {tree}: " + ", ".join(
                f"{w} {figures[tree][w][-1]:.1f}" for w in WORKLOADS), flush=True)
    a, b = opts.trees
    print(f"\ntok/s, min / median / max of {opts.runs} runs; A = {a}, B = {b}")
    print("| workload | A | B | B / A (medians) |\n|---|---|---|---|")
    for w in WORKLOADS:
        fa, fb = figures[a][w], figures[b][w]

        def fmt(f: list[float]) -> str:
            return f"{min(f):.1f} / {statistics.median(f):.1f} / {max(f):.1f}"

        print(f"| {w} | {fmt(fa)} | {fmt(fb)} | "
              f"{statistics.median(fb) / statistics.median(fa):.3f} |")


if __name__ == "__main__":
    main()
