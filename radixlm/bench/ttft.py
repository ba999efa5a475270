"""Time to first token of one short streamed request: over HTTP vs the engine alone.

    python -m radixlm.bench ttft [--num-requests 20 --input-len 16 --output-len 4] \\
        [server options, e.g. --model-path M --load-format dummy --dtype bfloat16]

One run, three parts, one after the other (nothing else runs meanwhile, and
each part has the device to itself):

1. The server (`python -m radixlm.launch_server` with the server options) gets
   the requests one at a time, streamed, on one kept-alive connection: first to
   /generate with `return_timing`, whose stamps break the time down hop by hop
   (API process, scheduler, detokenizer; one monotonic clock for the host),
   then the same prompts to /v1/completions (TTFT only).
2. The offline Engine, same options, in a child process: the time from
   `generate(stream=True)` to its first chunk, the same prompts.
3. The table: HTTP TTFT, the engine's, the difference, and the breakdown. The
   scheduler's own "steps to the first token" is the engine-side prefill
   measured inside the server in the same run.

Each request has its own random prompt (fixed seed), so no request hits the
radix cache. `--cached-tokens N` first fills the radix cache with N tokens of
other prompts, as a server that has run a while holds them (costs that grow
with the tree then show). `--base-url` measures a running server instead (parts 1 and 3;
no engine). A server without `return_timing` (an older radixlm) still gets
its HTTP TTFT measured; the breakdown is then left out.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

READY_TIMEOUT_S = 900.0
FILL_BATCH = 32  # prompts per call when filling the cache

# Every stamp in the order a request passes them, with what the time from the
# previous stamp to it is; "client_*" are the client's own.
STAMPS = [
    ("client_send", ""),
    ("received", "HTTP in: uvicorn, guard, FastAPI body parsing"),
    ("tokenized", "input normalization (tokenizer thread for text)"),
    ("sent", "validation, n-expansion, encode, ZMQ send"),
    ("sched_recv", "ZMQ to the scheduler, its wake-up"),
    ("step_start", "scheduler: until its next step starts"),
    ("first_token", "scheduler: steps to the first token (prefill)"),
    ("sched_send", "scheduler: after the step, encode and send"),
    ("detok_recv", "ZMQ to the detokenizer, its wake-up"),
    ("detok_send", "detokenizer: text, encode, send"),
    ("api_recv", "ZMQ to the API process, its event loop"),
    ("first_write", "API: route wakes, response starts, first frame"),
    ("client_first_event", "SSE frame to the client's read"),
]
PREFILL_HOP = "scheduler: steps to the first token (prefill)"


@dataclass
class Sample:
    ttft: float = 0.0  # client send -> first SSE event
    ttft_text: float = 0.0  # client send -> first event with output text (0: none)
    first_tokens: int = 0  # output tokens the first event carried
    stamps: dict[str, float] = field(default_factory=dict)


# ---- prompts -------------------------------------------------------------------------------
def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Above 100: special and control tokens live at the low ids of most vocabularies.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def sampling(output_len: int) -> dict[str, Any]:
    return {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}


# ---- the HTTP client -------------------------------------------------------------------
class Client:
    """One kept-alive HTTP/1.1 connection with Nagle off, as a benchmark client
    should have; http.client reads the chunked SSE body line by line."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                               timeout=600)
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> tuple[int, bytes]:
        self._connect()
        self.conn.request("GET", path, headers=self.headers)
        r = self.conn.getresponse()
        return r.status, r.read()

    def stream(self, path: str, body: dict[str, Any]) -> tuple[Sample, list[dict[str, Any]]]:
        """Send `body`, read the SSE events; returns the timing and the events."""
        data = json.dumps(body).encode()
        self._connect()
        sample, events = Sample(), []
        t0 = time.monotonic()
        self.conn.request("POST", path, body=data, headers=self.headers)
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.monotonic()
            event = json.loads(line[6:])
            if not events:
                sample.ttft = now - t0
                sample.first_tokens = _num_tokens(event)
                sample.stamps.update(client_send=t0, client_first_event=now)
            if not sample.ttft_text and _text(event):
                sample.ttft_text = now - t0
            events.append(event)
        r.read()
        return sample, events

    def _connect(self) -> None:
        if self.conn.sock is None:
            self.conn.connect()
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.conn.close()


def _num_tokens(event: dict[str, Any]) -> int:
    if "output_ids" in event:  # /generate: cumulative ids
        return len(event["output_ids"])
    return 1 if _text(event) else 0


def _text(event: dict[str, Any]) -> str:
    if "text" in event and "choices" not in event:
        return event["text"]
    return "".join(c.get("text") or "" for c in event.get("choices") or [])


def fill_batches(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """The --cached-tokens prompts, in batches of FILL_BATCH."""
    fill = prompts(args.cached_tokens // args.fill_len, args.fill_len, vocab, args.seed + 1)
    return [fill[i:i + FILL_BATCH] for i in range(0, len(fill), FILL_BATCH)]


def fill_http(base_url: str, api_key: str | None, batches: list[list[list[int]]]) -> None:
    client = Client(base_url, api_key)
    try:
        for batch in batches:
            client.stream("/generate", {"input_ids": batch, "stream": True,
                                        "sampling_params": sampling(1)})
    finally:
        client.close()


def run_http(base_url: str, api_key: str | None, ids: list[list[int]],
             openai_ids: list[list[int]], output_len: int,
             warmup: int) -> tuple[list[Sample], list[Sample]]:
    """(/generate samples with stamps, /v1/completions samples), one request at a
    time; each route gets its own prompts (a repeated one would hit the cache)."""
    client = Client(base_url, api_key)
    native, openai = [], []
    try:
        for i, prompt in enumerate(ids):
            body = {"input_ids": prompt, "sampling_params": sampling(output_len),
                    "stream": True, "return_timing": True}
            sample, events = client.stream("/generate", body)
            sample.stamps.update(events[-1]["meta_info"].get("timing") or {})
            if i >= warmup:
                native.append(sample)
            time.sleep(0.02)  # let every process go idle again, as between users
        for i, prompt in enumerate(openai_ids):
            body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True}
            sample, _ = client.stream("/v1/completions", body)
            if i >= warmup:
                openai.append(sample)
            time.sleep(0.02)
    finally:
        client.close()
    return native, openai


# ---- the server --------------------------------------------------------------------------
@contextlib.contextmanager
def launched_server(server_argv: list[str]) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, log_path = tempfile.mkstemp(prefix="radixlm-ttft-server-", suffix=".log")
    cmd = [sys.executable, "-m", "radixlm.launch_server", *server_argv, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log_path)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        os.unlink(log_path)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n"
                                   f"{f.read()[-3000:]}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            client = Client(url)
            status, _ = client.get("/health")
            client.close()
            if status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready in {READY_TIMEOUT_S:.0f} s")


def vocab_size(base_url: str, api_key: str | None) -> int:
    client = Client(base_url, api_key)
    try:
        status, body = client.get("/get_model_info")
    finally:
        client.close()
    if status != 200:
        raise RuntimeError(f"/get_model_info: HTTP {status}")
    return int(json.loads(body)["vocab_size"])


# ---- the engine alone --------------------------------------------------------------------
def engine_ttft(server_argv: list[str], ids: list[list[int]], output_len: int, warmup: int,
                fill: list[list[list[int]]]) -> list[float]:
    """In a child process, so the device is the engine's alone and freed after."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_engine_ttft, (server_argv, ids, output_len, warmup, fill))


def _engine_ttft(server_argv: list[str], ids: list[list[int]], output_len: int,
                 warmup: int, fill: list[list[list[int]]]) -> list[float]:
    import dataclasses

    import radixlm
    from radixlm.config import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(server_argv))
    times = []
    with radixlm.Engine(**dataclasses.asdict(args)) as engine:
        for batch in fill:
            engine.generate(input_ids=batch, sampling_params=sampling(1))
        for i, prompt in enumerate(ids):
            t0 = time.monotonic()
            stream = engine.generate(input_ids=prompt, sampling_params=sampling(output_len),
                                     stream=True)
            next(stream)
            if i >= warmup:
                times.append(time.monotonic() - t0)
            stream.close()  # aborts the rest
            time.sleep(0.02)
    return times


# ---- the table ------------------------------------------------------------------------------
def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    qs = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 \
        else values * 9
    return f"{statistics.median(values) * 1e3:8.2f} ms  [p10 {qs[0] * 1e3:.2f}, " \
           f"p90 {qs[-1] * 1e3:.2f}]"


def breakdown(samples: list[Sample]) -> list[tuple[str, list[float]]]:
    """Time per hop, in passing order. A stamp a sample lacks merges its hop into
    the next (a one-token stream's only event is rendered before its first write,
    so it cannot carry that stamp)."""
    hops: dict[str, list[float]] = {}
    for s in samples:
        prev, skipped = None, []
        for name, label in STAMPS:
            if name not in s.stamps:
                skipped.append(label)
                continue
            if prev is not None:
                hops.setdefault(" + ".join([*skipped, label]), []).append(
                    s.stamps[name] - s.stamps[prev])
            prev, skipped = name, []
    order = {label: i for i, (_, label) in enumerate(STAMPS)}
    return sorted(hops.items(), key=lambda kv: order.get(kv[0].split(" + ")[-1], 0))


def report(native: list[Sample], openai: list[Sample], engine: list[float],
           args: argparse.Namespace) -> None:
    print(f"\nTTFT of one streamed request at a time: {len(native)} requests per row, "
          f"{args.input_len} input tokens, {args.output_len} output tokens, "
          f"{args.cached_tokens} tokens cached before (median [p10, p90])")
    http = [s.ttft for s in native]
    print(f"  HTTP /generate, send -> first SSE event   {_ms(http)}")
    print(f"  HTTP /v1/completions, send -> first event {_ms([s.ttft for s in openai])}")
    texts = [s.ttft_text for s in openai if s.ttft_text]
    print(f"  HTTP /v1/completions, send -> first text  {_ms(texts)} "
          f"({len(texts)}/{len(openai)} had text)")
    first = statistics.median([s.first_tokens for s in native]) if native else 0
    print(f"  tokens in the first /generate event: median {first:g}")
    if engine:
        print(f"  offline Engine, generate -> first chunk   {_ms(engine)}")
        diff = statistics.median(http) - statistics.median(engine)
        print(f"  difference (HTTP - engine, medians)       {diff * 1e3:8.2f} ms")
    rows = breakdown(native)
    if not rows:
        print("  (the server sent no timing stamps: no breakdown)")
        return
    print("\nWhere the HTTP time goes (/generate; median per hop, one clock for all "
          "processes):")
    for label, values in rows:
        print(f"  {label:<60} {_ms(values)}")
    total = sum(statistics.median(v) for _, v in rows)
    print(f"  {'sum of the medians':<60} {total * 1e3:8.2f} ms")
    inside = dict(rows).get(PREFILL_HOP)
    if inside:
        diff = statistics.median(http) - statistics.median(inside)
        print(f"  {'HTTP TTFT - the scheduler prefill (medians)':<60} {diff * 1e3:8.2f} ms")


# ---- main ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixlm.bench ttft",
        description="TTFT over HTTP vs the engine alone, with a per-hop breakdown. "
                    "Options it does not know are server options (launch_server's).")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first requests not counted")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cached-tokens", type=int, default=0,
                   help="first fill the radix cache with this many tokens of other prompts")
    p.add_argument("--fill-len", type=int, default=768, help="length of those prompts")
    p.add_argument("--base-url", default=None,
                   help="measure this running server (no launch, no engine)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-engine", action="store_true", help="skip the offline Engine")
    return p


def main(argv: list[str]) -> None:
    args, server_argv = build_parser().parse_known_args(argv)
    n = args.num_requests + args.warmup
    if args.base_url:
        url_cm: contextlib.AbstractContextManager[str] = contextlib.nullcontext(args.base_url)
    else:
        url_cm = launched_server(server_argv)
    with url_cm as url:
        vocab = vocab_size(url, args.api_key)
        ids = prompts(2 * n, args.input_len, vocab, args.seed)
        ids, openai_ids = ids[:n], ids[n:]
        fill = fill_batches(args, vocab)
        fill_http(url, args.api_key, fill)
        native, openai = run_http(url, args.api_key, ids, openai_ids, args.output_len,
                                  args.warmup)
    engine = [] if args.base_url or args.no_engine else \
        engine_ttft(server_argv, ids, args.output_len, args.warmup, fill)
    report(native, openai, engine, args)
