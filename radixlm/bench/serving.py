"""Online serving benchmark against any OpenAI-compatible server.

    python -m radixlm.bench serving --base-url http://127.0.0.1:30000 \\
        --num-prompts 32 --random-input-len 128 --random-output-len 64 \\
        --request-rate 1 4 inf

Requests go to /v1/completions with `stream: true` and
`stream_options.include_usage`, so the same run works against radixlm, SGLang
or vLLM. Prompts are token-id lists (exact input lengths without a local
tokenizer); output lengths are pinned with the `ignore_eos`/`min_tokens`
extensions (drop them with --disable-ignore-eos for servers without them).
Token counts come from the server's `usage` (from the number of streamed
text pieces for a server that sends none, as llama-cpp-python's). Arrivals are Poisson at each
--request-rate (inf: all at once), optionally capped by --max-concurrency.
Datasets: `random` (independent prompts) and `generated-shared-prefix` (groups
of prompts behind one long shared system prefix, the radix cache's case).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np


@dataclass
class Request:
    prompt: list[int] | str  # token ids, or text for servers that take no ids
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    sent: float = 0.0  # seconds from the run's start to sending the request
    itl: list[float] = field(default_factory=list)


# ---- datasets ------------------------------------------------------------------------
def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo = max(1, int(length * ratio))
    return [rng.randint(lo, length) for _ in range(n)]


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Above 100: special and control tokens live at the low ids of most vocabularies.
    return [rng.randrange(100, vocab) for _ in range(n)]


def random_dataset(args: argparse.Namespace, rng: random.Random) -> list[Request]:
    ins = _lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    outs = _lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    return [Request(_ids(rng, i, args.vocab_size), o) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_dataset(args: argparse.Namespace, rng: random.Random) -> list[Request]:
    reqs = []
    for _ in range(args.gsp_num_groups):
        prefix = _ids(rng, args.gsp_system_prompt_len, args.vocab_size)
        for _ in range(args.gsp_prompts_per_group):
            question = _ids(rng, args.gsp_question_len, args.vocab_size)
            reqs.append(Request(prefix + question, args.gsp_output_len))
    rng.shuffle(reqs)
    return reqs


# ---- one request ---------------------------------------------------------------------
async def send(session: aiohttp.ClientSession, args: argparse.Namespace, model: str,
               req: Request, run_start: float = 0.0) -> Result:
    body: dict[str, Any] = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if not args.disable_ignore_eos:
        body.update(ignore_eos=True, min_tokens=req.output_len)
    res = Result()
    pieces = 0
    t0 = last = time.perf_counter()
    res.sent = t0 - run_start
    try:
        async with session.post(_url(args, "/v1/completions"), json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for raw in r.content:  # one line at a time
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    pieces += 1
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or pieces
        res.ok = res.ttft > 0
        res.error = "" if res.ok else "no text came back"
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        res.error = repr(e)
    return res


def _session(args: argparse.Namespace, timeout: float) -> aiohttp.ClientSession:
    """aiohttp, not httpx: 41-45 us of client CPU per streamed event against
    httpx's 107-111 (one client process, a local server, 3 runs each), so fewer
    client processes keep up with a fast server. `timeout` bounds connecting and
    each wait for data."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No cap on connections. Idle ones expire well before the server's keep-alive
    # timeout (uvicorn's 5 s): reusing one the server is closing at that instant
    # fails the request (seen once in 512 at 16 req/s).
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    limits = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    return aiohttp.ClientSession(headers=headers, connector=conn, timeout=limits,
                                 read_bufsize=1 << 20)  # room for long SSE lines


def _url(args: argparse.Namespace, path: str) -> str:
    return args.base_url.rstrip("/") + path


# ---- one run -------------------------------------------------------------------------
# A client process busier than this is near saturation: it reads the stream late
# and sends late, which shows as server slowness. On 2 x H200, dp=2 streaming
# ~17k tokens/s into 4 client processes (3 s CPU samples up to 83-98%)
# measured 1.74-1.92x dp=1; into 8 (up to 48-68%), 1.98-2.01x (the httpx
# client, before aiohttp).
CLIENT_BUSY_WARN = 0.8


async def run_rate(args: argparse.Namespace, model: str, reqs: list[Request],
                   rate: float, seed: int = 0) -> tuple[list[Result], float, float]:
    """(results, duration, the share of the run this process spent on the CPU)."""
    rng = np.random.default_rng(args.seed + seed)
    gate = asyncio.Semaphore(args.max_concurrency or len(reqs))
    async with _session(args, args.timeout) as client:
        t0, cpu0 = time.perf_counter(), time.process_time()

        async def gated(req: Request) -> Result:
            async with gate:
                return await send(client, args, model, req, t0)

        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(gated(req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        return results, duration, (time.process_time() - cpu0) / max(duration, 1e-9)


def _run_share(args: argparse.Namespace, model: str, reqs: list[Request], rate: float,
               seed: int, start_at: float) -> tuple[list[Result], float, float]:
    """One client process's share: its requests, from a common wall-clock start."""
    time.sleep(max(0.0, start_at - time.time()))
    results, _, busy = asyncio.run(run_rate(args, model, reqs, rate, seed))
    return results, time.time(), busy


def run_rate_processes(args: argparse.Namespace, model: str, reqs: list[Request],
                       rate: float) -> tuple[list[Result], float, float]:
    """The run split over --client-processes event loops: one Python process parses
    SSE events too slowly for a server that streams >10k tokens/s, and the client
    must not be what is measured. Requests are dealt round-robin; each process
    draws Poisson arrivals at rate/k, and the sum of k such streams is again a
    Poisson stream at `rate`."""
    k = args.client_processes
    if args.max_concurrency:  # the cap is the run's, shared out
        args = argparse.Namespace(**vars(args) | {"max_concurrency":
                                                  math.ceil(args.max_concurrency / k)})
    start_at = time.time() + 3.0  # every process imported and waiting by then
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=k, mp_context=ctx) as pool:
        futures = [pool.submit(_run_share, args, model, reqs[i::k], rate / k, i, start_at)
                   for i in range(k)]
        done = [f.result() for f in futures]
    # Back in submission order, so results line up with `reqs`.
    results: list[Result] = [Result()] * len(reqs)
    for i, (share, _, _) in enumerate(done):
        results[i::k] = share
    return results, max(end for _, end, _ in done) - start_at, max(b for _, _, b in done)


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def stats(name: str, values: list[float]) -> dict[str, float]:
        if not values:
            return {f"{name}_mean_ms": 0.0, f"{name}_p50_ms": 0.0, f"{name}_p99_ms": 0.0}
        a = np.asarray(values) * ms
        return {f"{name}_mean_ms": float(a.mean()), f"{name}_p50_ms": float(np.percentile(a, 50)),
                f"{name}_p99_ms": float(np.percentile(a, 99))}

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration,
           "input_throughput": sum(r.prompt_tokens for r in ok) / duration,
           "output_throughput": sum(r.output_tokens for r in ok) / duration,
           "total_input_tokens": sum(r.prompt_tokens for r in ok),
           "total_output_tokens": sum(r.output_tokens for r in ok)}
    out.update(stats("ttft", [r.ttft for r in ok]))
    out.update(stats("tpot", tpot))
    out.update(stats("itl", [x for r in ok for x in r.itl]))
    out.update(stats("e2e", [r.e2e for r in ok]))
    # When the load really arrived: a slow client shows as a late last send.
    out["last_sent_s"] = max((r.sent for r in results), default=0.0)
    out["first_token_s"] = min((r.sent + r.ttft for r in ok), default=0.0)
    return out


ROWS = [("completed", "Successful requests", "{:.0f}"), ("failed", "Failed requests", "{:.0f}"),
        ("duration_s", "Duration (s)", "{:.2f}"),
        ("total_input_tokens", "Input tokens", "{:.0f}"),
        ("total_output_tokens", "Output tokens", "{:.0f}"),
        ("request_throughput", "Request throughput (req/s)", "{:.3f}"),
        ("input_throughput", "Input throughput (tok/s)", "{:.1f}"),
        ("output_throughput", "Output throughput (tok/s)", "{:.1f}"),
        ("last_sent_s", "Last request sent at (s)", "{:.2f}"),
        ("first_token_s", "First token at (s)", "{:.2f}"),
        ("client_busy", "Busiest client process CPU", "{:.0%}")] + [
        (f"{m}_{s}_ms", f"{label} {s} (ms)", "{:.1f}")
        for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
        for s in ("mean", "p50", "p99")]


def print_table(rates: list[float], summaries: list[dict[str, float]]) -> None:
    header = ["Request rate (req/s)"] + [("inf" if math.isinf(r) else f"{r:g}") for r in rates]
    rows = [[label] + [fmt.format(s[key]) for s in summaries] for key, label, fmt in ROWS]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


# ---- CLI -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m radixlm.bench serving",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("random", "generated-shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths drawn from [ratio * len, len]")
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="random token ids are drawn below this")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests/s, Poisson arrivals; inf sends all at once; several values "
                        "run one after another")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--client-processes", type=int, default=1,
                   help="spread the requests over this many client processes (each with "
                        "its own event loop) for servers faster than one Python client: "
                        "enough that the table's busiest client process CPU stays well "
                        "below 100%%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-json", default=None, help="also write the figures here")
    return p


async def first_model(args: argparse.Namespace) -> str:
    async with _session(args, 60.0) as c, c.get(_url(args, "/v1/models")) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def amain(args: argparse.Namespace) -> int:
    model = args.model or await first_model(args)
    rng = random.Random(args.seed)
    reqs = (random_dataset if args.dataset == "random" else shared_prefix_dataset)(args, rng)
    print(f"model {model}, dataset {args.dataset}, {len(reqs)} prompts, "
          f"max concurrency {args.max_concurrency or 'unlimited'}", flush=True)
    if args.warmup_requests:
        warm = [Request(r.prompt[:16], 4) for r in reqs[:args.warmup_requests]]
        await run_rate(args, model, warm, math.inf)
    summaries = []
    for rate in args.request_rate:
        if args.client_processes > 1:
            results, duration, busy = await asyncio.to_thread(run_rate_processes, args,
                                                              model, reqs, rate)
        else:
            results, duration, busy = await run_rate(args, model, reqs, rate)
        errors = [r.error for r in results if not r.ok]
        if errors:
            print(f"rate {rate}: {len(errors)} failed, first: {errors[0]}", file=sys.stderr)
        if busy > CLIENT_BUSY_WARN:
            print(f"rate {rate}: a client process was on the CPU {busy:.0%} of the run; "
                  "the client may be what these figures measure: raise --client-processes",
                  file=sys.stderr)
        summaries.append(summarize(results, duration) | {"client_busy": busy})
    print_table(args.request_rate, summaries)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args) | {"request_rate": [str(r) for r in args.request_rate]},
                       "results": summaries}, f, indent=2)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return asyncio.run(amain(args))

