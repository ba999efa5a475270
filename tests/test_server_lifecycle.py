"""Process life: API key and queue limit, SIGTERM drain, a dead scheduler.

These start their own server (the drain test ends it) and, last, kill the
shared one's scheduler (a later user of `default_server()` gets a new one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from server_utils import ServerProcess, default_server

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"


def _stream_finish(server: ServerProcess, max_tokens: int, out: list[Any]) -> None:
    """Run one streamed completion; record (status, last finish_reason, saw [DONE])."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    try:
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            finish, done = None, False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        finish = chunk["choices"][0]["finish_reason"] or finish
            out.append((r.status_code, finish, done))
    except httpx.HTTPError as e:
        out.append(("error", repr(e), False))


def _wait_running(server: ServerProcess, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.server_info()["num_running_requests"] < n:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def guarded() -> Any:
    server = ServerProcess(["--max-running-requests", "2", "--max-queued-requests", "1",
                            "--shutdown-timeout", "3", "--max-total-tokens", "4096",
                            "--context-length", "256", "--num-threads", "1"],
                           api_key="s3cret")
    yield server
    server.kill()


def test_api_key(guarded: ServerProcess) -> None:
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        assert c.get("/health").status_code == 200  # open for load balancers
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    bad = openai.OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = guarded.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_queue_limit(guarded: ServerProcess) -> None:
    """2 run, 1 waits (--max-running-requests 2, --max-queued-requests 1): the
    next request is a 503, and the server serves again once they are gone."""
    results: list[Any] = []
    threads = [threading.Thread(target=_stream_finish, args=(guarded, 200, results))
               for _ in range(3)]
    for t in threads:
        t.start()
    _wait_running(guarded, 2)
    with guarded.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
        c.post("/abort_request", json={"abort_all": True}).raise_for_status()
    for t in threads:
        t.join(60)
    assert [r[1] for r in results] == ["abort"] * 3
    guarded.wait_idle()
    r = guarded.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_sigterm_drains(guarded: ServerProcess) -> None:
    """New work is refused at once; a short running request finishes, a long one is
    aborted after --shutdown-timeout (3 s); both streams end with [DONE]; exit 0."""
    results: list[Any] = []
    threads = [threading.Thread(target=_stream_finish, args=(guarded, n, results))
               for n in (200, 6)]
    for t in threads:
        t.start()
    _wait_running(guarded, 2)
    t0 = time.monotonic()
    guarded.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with guarded.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
    assert guarded.proc.wait(60) == 0
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 30
    assert sorted(results, key=str) == [(200, "abort", True), (200, "length", True)]
    assert "draining" in guarded.log()


def test_dead_scheduler_takes_the_server_down() -> None:
    server = default_server()
    pid = server.server_info()["process_pids"]["scheduler"]
    results: list[Any] = []
    t = threading.Thread(target=_stream_finish, args=(server, 200, results))
    t.start()
    _wait_running(server, 1)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        code = server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        pytest.fail("the server hung after its scheduler died")
    elapsed = time.monotonic() - t0
    t.join(30)
    assert code != 0 and elapsed < 20
    assert "the scheduler process" in server.log() and "died" in server.log()
    assert results and results[0][0] in (200, "error")
    if results[0][0] == 200:  # the stream ended with an abort, not silence
        assert results[0][1] == "abort" and results[0][2]
