"""Scheduling benchmarks: the same workload under two scheduler settings, in one run.

    python -m radixlm.bench mixed-chunk --num-decodes 32 --long-len 4096
    python -m radixlm.bench priority --num-queued 64

mixed-chunk: `--num-decodes` requests are decoding when one `--long-len` prompt
arrives (`--rounds` times per engine, the last reported: the first rounds
compile kernels for the shapes the workload brings). Reported for
`--enable-mixed-chunk` off and on: the decodes' inter-token latency (p50,
p99, max) over the tokens that arrived while the long prompt was prefilled,
the long request's TTFT, and decode throughput over the whole round.

priority: the queue is full of long low-priority requests (`--num-queued`,
`--max-running-requests` of them run at a time) when one short request
arrives; its TTFT at equal priority and at a higher one (same engine), and at
a higher one with `--priority-preemption` (a second engine).

Prompts are random token ids from a fixed seed; requests ignore EOS. The engine
is driven step by step in-process, so the times are the scheduler's own (no
HTTP, no detokenizer).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.bench.offline import random_prompts
from radixlm.protocol import GenerateReq

_ids = itertools.count()


def _req(ids: list[int], new_tokens: int, priority: int = 0) -> GenerateReq:
    return GenerateReq(rid=f"b{next(_ids)}", input_ids=ids, priority=priority, stream=True,
                       sampling_params={"max_new_tokens": new_tokens, "ignore_eos": True,
                                        "temperature": 0.0})


@dataclass
class Timeline:
    """Token arrival times per request, as the scheduler's steps return them."""

    arrivals: dict[str, list[float]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def step(self, sched: Any) -> None:
        if not sched.has_work:
            raise RuntimeError("the scheduler went idle before the workload's condition held")
        outs = sched.step()
        now = time.perf_counter()
        for out in outs:
            times = self.arrivals.setdefault(out.rid, [])
            times += [now] * len(out.new_token_ids)
            if out.finish_reason is not None:
                self.finished.add(out.rid)

    def first(self, rid: str) -> float:
        return self.arrivals[rid][0]


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _engine(args: argparse.Namespace, **kw: Any) -> Any:
    import radixlm

    return radixlm.Engine(args.model_path, load_format=args.load_format, dtype=args.dtype,
                          skip_tokenizer_init=True, chunked_prefill_size=args.chunk,
                          max_total_tokens=args.max_total_tokens, **kw)


def _release_device_memory() -> None:
    """Between two engines in one process: the first one's pools and graphs go."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _warm(engine: Any, vocab: int) -> None:
    ids = random_prompts(2, 64, vocab, seed=99)
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    engine.flush_cache()


# ---- mixed chunked prefill ----------------------------------------------------------------
def mixed_chunk_trial(args: argparse.Namespace, mixed: bool) -> dict[str, float]:
    """The workload `--rounds` times on one engine; the last round's figures (the
    first ones also compile kernels for the shapes the workload brings)."""
    with _engine(args, enable_mixed_chunk=mixed,
                 max_running_requests=args.num_decodes + 1) as engine:
        _warm(engine, engine.scheduler.vocab_size)
        for seed in range(args.rounds):
            result = _mixed_chunk_round(engine, args, seed)
            engine.flush_cache()
    del engine
    _release_device_memory()
    return result


def _mixed_chunk_round(engine: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    sched = engine.scheduler
    vocab = sched.vocab_size
    decodes = [_req(ids, args.decode_len) for ids in
               random_prompts(args.num_decodes, args.prompt_len, vocab, seed=3 * seed + 1)]
    long = _req(random_prompts(1, args.long_len, vocab, seed=3 * seed + 2)[0], args.long_out)
    tl = Timeline()
    t0 = time.perf_counter()
    for r in decodes:
        sched.add_request(r)
    while len(sched.running) < len(decodes) or any(
            len(tl.arrivals.get(r.rid, [])) < args.warm_tokens for r in decodes):
        tl.step(sched)
    arrived = time.perf_counter()
    sched.add_request(long)
    while long.rid not in tl.arrivals:
        tl.step(sched)
    ttft_done = tl.first(long.rid)
    while sched.has_work:
        tl.step(sched)
    total = time.perf_counter() - t0
    sched.check_invariants()
    gaps = []
    for r in decodes:
        times = tl.arrivals[r.rid]
        # Intervals that end after the long prompt arrived and start before its first token.
        gaps += [b - a for a, b in zip(times, times[1:]) if b > arrived and a < ttft_done
                 and b > a]
    tokens = sum(len(tl.arrivals[r.rid]) for r in decodes)
    return {"itl_p50_ms": 1e3 * _percentile(gaps, 0.5), "itl_p99_ms": 1e3 * _percentile(gaps, 0.99),
            "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
            "ttft_ms": 1e3 * (ttft_done - arrived), "decode_tok_s": tokens / total}


def run_mixed_chunk(args: argparse.Namespace) -> None:
    rows = [("off", mixed_chunk_trial(args, False)), ("on", mixed_chunk_trial(args, True))]
    print(f"\n{args.num_decodes} decoding requests ({args.prompt_len} in / {args.decode_len} out) "
          f"when a {args.long_len}-token prompt arrives; --chunked-prefill-size {args.chunk}")
    print(f"{'mixed chunk':<12}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'ITL max ms':>12}"
          f"{'long TTFT ms':>14}{'decode tok/s':>14}")
    for name, r in rows:
        print(f"{name:<12}{r['itl_p50_ms']:>12.1f}{r['itl_p99_ms']:>12.1f}{r['itl_max_ms']:>12.1f}"
              f"{r['ttft_ms']:>14.1f}{r['decode_tok_s']:>14.1f}")
    off, on = rows[0][1], rows[1][1]
    print(f"ratio on/off: ITL p99 {on['itl_p99_ms'] / off['itl_p99_ms']:.2f}x, long TTFT "
          f"{on['ttft_ms'] / off['ttft_ms']:.2f}x")


# ---- priority ----------------------------------------------------------------------------
def priority_trial(engine: Any, args: argparse.Namespace, priority: int, seed: int) -> float:
    sched = engine.scheduler
    vocab = sched.vocab_size
    queued = [_req(ids, args.decode_len)
              for ids in random_prompts(args.num_queued, args.prompt_len, vocab, seed=seed)]
    probe = _req(random_prompts(1, 32, vocab, seed=seed + 1)[0], 8, priority)
    tl = Timeline()
    for r in queued:
        sched.add_request(r)
    while len(sched.running) < args.max_running_requests:
        tl.step(sched)
    arrived = time.perf_counter()
    sched.add_request(probe)
    while probe.rid not in tl.arrivals:
        tl.step(sched)
    ttft = tl.first(probe.rid) - arrived
    engine.abort_request(abort_all=True)
    while sched.has_work:
        tl.step(sched)
    engine.flush_cache()
    return 1e3 * ttft


def run_priority(args: argparse.Namespace) -> None:
    rows = []
    for preempt in (False, True):
        with _engine(args, enable_priority_scheduling=True, priority_preemption=preempt,
                     max_running_requests=args.max_running_requests) as engine:
            _warm(engine, engine.scheduler.vocab_size)
            for name, priority in (("equal (0)", 0), ("higher (10)", 10)):
                if preempt and not priority:
                    continue  # equal priority never preempts: the same as without
                xs = [priority_trial(engine, args, priority, seed=10 + i)
                      for i in range(args.repeats)]
                rows.append((name + (", preemption" if preempt else ""), xs))
        del engine
        _release_device_memory()
    print(f"\nprobe request (32 in / 8 out) behind {args.num_queued} queued requests "
          f"({args.prompt_len} in / {args.decode_len} out, {args.max_running_requests} run at "
          f"a time); TTFT over {args.repeats} trials")
    print(f"{'probe priority':<26}{'TTFT median ms':>16}{'TTFT max ms':>14}{'vs equal':>10}")
    base = statistics.median(rows[0][1])
    for name, xs in rows:
        print(f"{name:<26}{statistics.median(xs):>16.1f}{max(xs):>14.1f}"
              f"{statistics.median(xs) / base:>9.3f}x")


def main(argv: list[str], mode: str) -> None:
    p = argparse.ArgumentParser(prog=f"python -m radixlm.bench {mode}")
    p.add_argument("--model-path", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-len", type=int, default=256)
    if mode == "mixed-chunk":
        p.add_argument("--num-decodes", type=int, default=32)
        p.add_argument("--long-len", type=int, default=4096)
        p.add_argument("--long-out", type=int, default=8)
        p.add_argument("--warm-tokens", type=int, default=4,
                       help="every decode has this many tokens before the long prompt")
        p.add_argument("--rounds", type=int, default=2,
                       help="workload repeats per engine; the last one is reported")
        run_mixed_chunk(p.parse_args(argv))
    else:
        p.add_argument("--num-queued", type=int, default=64)
        p.add_argument("--max-running-requests", type=int, default=8)
        p.add_argument("--repeats", type=int, default=3)
        run_priority(p.parse_args(argv))
