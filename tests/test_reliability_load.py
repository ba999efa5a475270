"""Load and cancellation against the real server (issue 9, scenarios 1 and 2).

Load: rounds of concurrent short streaming requests (chat and completions,
n = 1..4) all finish with exact usage; after each round the KV accounting is
back to idle and the server's memory (RSS of the main process and its
children) does not grow from round to round. Cancellation storm: streaming
clients that disconnect at random (seeded) times leave no KV held, and the
server answers a new request at once.

The default suite runs small variants on the shared server; the full ones
(500 requests x 4 rounds, a 200-client storm) are marked slow:
`python -m pytest -m slow tests/test_reliability_load.py`.
Each test prints one line per round (RSS, timings) to the terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest
from server_utils import ServerProcess, default_server

pytestmark = pytest.mark.timeout(900)

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Tell me one fact about {w}." for w in (
    "Paris", "the sea", "owls", "copper", "Mars", "tea", "glaciers", "chess", "bees", "rain")]
# Finished requests' bookkeeping is checked exactly (assert_idle); RSS is the
# coarse guard for leaks outside it. It is noisy here: glibc's per-thread arenas
# move by 60-130 MB between rounds of the same load on this 2-core machine, up
# or down (CI saw 1673, 1611, 1741 MB). So the last round is held against the
# highest earlier round, not the one before: a leak pushes every round higher,
# noise does not. 128 MB over 80 requests is 1.6 MB a request (the slow
# variant, 500 x 4: 256 KB).
RSS_SLACK_MB = 128.0


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


# ---- one streamed call -----------------------------------------------------------------
@dataclass
class Outcome:
    status: int | str = 0  # HTTP status, or "disconnected" / an exception's name
    finishes: dict[int, list[str]] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    done: bool = False  # saw data: [DONE]
    error: str = ""


def request_body(kind: str, prompt: str, n: int, max_tokens: int, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "n": n, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "temperature": 0.8, "seed": seed}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream_call(client: httpx.AsyncClient, kind: str, body: dict[str, Any],
                      out: Outcome) -> Outcome:
    """Fills `out` as the stream goes, so a cancelled call leaves what it saw."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode(errors="replace")[:300]
            return out
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
                for choice in chunk["choices"]:
                    if choice["finish_reason"] is not None:
                        out.finishes.setdefault(choice["index"], []).append(
                            choice["finish_reason"])
    return out


def server_rss_mb(server: ServerProcess) -> float:
    """Resident memory of the server: the main process and all its children."""
    main = psutil.Process(server.proc.pid)
    total = 0
    for p in [main, *main.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / 2 ** 20


def assert_idle(server: ServerProcess) -> dict[str, Any]:
    info = server.wait_idle()
    assert info["kv_tokens_in_use"] == 0, info
    # The API process forgets a request and its sequences once they finish.
    assert info["api_live_seqs"] == 0 and info["api_tracked_ids"] == 0, info
    assert info["num_running_requests"] == 0 and info["num_queued_requests"] == 0, info
    return info


# ---- 1. load -----------------------------------------------------------------------
def expected_prompt_tokens(server: ServerProcess) -> dict[tuple[str, str], int]:
    """Prompt sizes known independently of the load: /tokenize for completions,
    one unloaded chat call per prompt for the chat template's count."""
    out = {}
    with server.client() as c:
        for p in PROMPTS:
            out[("completions", p)] = c.post("/tokenize", json={"text": p}).json()["count"]
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": p}], "max_tokens": 1})
            out[("chat", p)] = r.json()["usage"]["prompt_tokens"]
    return out


def load_round(server: ServerProcess, num_requests: int, seed: int,
               prompt_tokens: dict[tuple[str, str], int]) -> Counter[str]:
    rng = random.Random(seed)
    calls = []
    for i in range(num_requests):
        kind = "chat" if i % 2 else "completions"
        prompt, n, max_tokens = rng.choice(PROMPTS), rng.randint(1, 4), rng.randint(4, 8)
        calls.append((kind, prompt, n, max_tokens, request_body(kind, prompt, n, max_tokens, i)))

    async def run() -> list[Outcome | BaseException]:
        limits = httpx.Limits(max_connections=num_requests + 10)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as c:
            return await asyncio.gather(*(stream_call(c, kind, body, Outcome())
                                          for kind, _, _, _, body in calls),
                                        return_exceptions=True)

    outcomes = asyncio.run(run())
    tally: Counter[str] = Counter()
    for (kind, prompt, n, max_tokens, _), o in zip(calls, outcomes, strict=True):
        assert isinstance(o, Outcome), repr(o)
        assert o.status == 200, (o.status, o.error)
        assert o.done, "a stream ended without [DONE]"
        # Each index finishes exactly once, by length (ignore_eos).
        assert o.finishes == {j: ["length"] for j in range(n)}, o.finishes
        want_prompt = prompt_tokens[(kind, prompt)]
        assert o.usage is not None
        assert o.usage["prompt_tokens"] == want_prompt, (kind, prompt, o.usage)
        assert o.usage["completion_tokens"] == n * max_tokens, (n, max_tokens, o.usage)
        assert o.usage["total_tokens"] == want_prompt + n * max_tokens
        tally["completed"] += 1
        tally["sequences"] += n
    return tally


def run_load(server: ServerProcess, capsys: Any, num_requests: int, rounds: int) -> None:
    prompt_tokens = expected_prompt_tokens(server)
    rss = []
    for k in range(rounds):
        t0 = time.monotonic()
        tally = load_round(server, num_requests, seed=k, prompt_tokens=prompt_tokens)
        elapsed = time.monotonic() - t0
        info = assert_idle(server)
        server.server_info()  # and the server still answers
        rss.append(server_rss_mb(server))
        with capsys.disabled():
            print(f"\n[load] round {k + 1}/{rounds}: {num_requests} requests "
                  f"({tally['sequences']} sequences) completed in {elapsed:.1f} s; "
                  f"kv_tokens_in_use={info['kv_tokens_in_use']}; "
                  f"server RSS {rss[-1]:.0f} MB")
        assert tally["completed"] == num_requests
    assert rounds >= 3, "noise needs two earlier rounds to show its range"
    assert rss[-1] <= max(rss[:-1]) + RSS_SLACK_MB, f"RSS grew across rounds: {rss}"


def test_load_rounds(server: ServerProcess, capsys: Any) -> None:
    run_load(server, capsys, num_requests=80, rounds=3)


@pytest.mark.slow
def test_load_rounds_full(server: ServerProcess, capsys: Any) -> None:
    run_load(server, capsys, num_requests=500, rounds=4)


# ---- 2. cancellation storm ------------------------------------------------------------
def cancellation_storm(server: ServerProcess, num_clients: int, seed: int) -> Counter[str]:
    """Streaming clients (long generations) that hang up after a random delay:
    some before the response starts, most mid-stream, a few never."""
    rng = random.Random(seed)
    plans = []
    for i in range(num_clients):
        kind = "chat" if i % 2 else "completions"
        body = request_body(kind, rng.choice(PROMPTS), rng.randint(1, 3), 64, seed * 1000 + i)
        plans.append((kind, body, rng.uniform(0.0, 3.0)))

    async def one(kind: str, body: dict[str, Any], hang_up_after: float) -> Outcome:
        out = Outcome()
        # One client each: hanging up must close this request's own connection.
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            try:
                await asyncio.wait_for(stream_call(c, kind, body, out), hang_up_after)
            except TimeoutError:
                out.status = "disconnected"
        return out

    async def run() -> list[Outcome | BaseException]:
        return await asyncio.gather(*(one(*p) for p in plans), return_exceptions=True)

    tally: Counter[str] = Counter()
    for o in asyncio.run(run()):
        assert isinstance(o, Outcome), repr(o)
        if o.status == "disconnected":
            tally["disconnected"] += 1
        else:
            assert o.status == 200 and o.done, (o.status, o.error)
            tally["completed"] += 1
    return tally


def run_storm(server: ServerProcess, capsys: Any, num_clients: int) -> None:
    t0 = time.monotonic()
    tally = cancellation_storm(server, num_clients, seed=num_clients)
    info = assert_idle(server)
    t1 = time.monotonic()
    with server.client() as c:  # the server serves a new request at once
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                   timeout=30)
    after = time.monotonic() - t1
    with capsys.disabled():
        print(f"\n[storm] {num_clients} clients in {t1 - t0:.1f} s: {dict(tally)}; "
              f"kv_tokens_in_use={info['kv_tokens_in_use']}; next request in {after:.2f} s; "
              f"server RSS {server_rss_mb(server):.0f} MB")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert after < 10.0, f"the server took {after:.1f} s to answer after the storm"
    assert tally["disconnected"] >= num_clients // 2, tally  # the storm really cancelled
    assert server.server_info()["kv_tokens_in_use"] == 0


def test_cancellation_storm(server: ServerProcess, capsys: Any) -> None:
    run_storm(server, capsys, num_clients=60)


@pytest.mark.slow
def test_cancellation_storm_full(server: ServerProcess, capsys: Any) -> None:
    run_storm(server, capsys, num_clients=200)
