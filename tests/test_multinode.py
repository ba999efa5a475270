"""Two nodes on this machine: two `radixlm serve` processes with `--nnodes 2
--node-rank 0|1 --tp-size 2 --dist-init-addr 127.0.0.1:PORT` (gloo), one
tensor-parallel rank each. Greedy output through node 0's HTTP API equals
tp=1's; node 1 serves no HTTP; killing either node makes the other exit
non-zero with an error that says what happened, within seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_utils import DEFAULT_ARGS, REPO, ServerProcess, default_server

from radixlm.server.workers import free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was"]
EXIT_TIMEOUT = 60.0  # a lost peer is noticed at the next collective: about a second


class FollowerNode:
    """Node 1: started first (node 0 waits for it at the rendezvous), never ready
    in the HTTP sense."""

    def __init__(self, args: list[str]) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="radixlm-node1-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlm.launch_server", *args],
                                     cwd=REPO, stdout=fd, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(fd)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        Path(self.log_path).unlink(missing_ok=True)


def start_nodes() -> tuple[ServerProcess, FollowerNode, int]:
    port = free_port()
    node_port = free_port()
    common = [*DEFAULT_ARGS, "--nnodes", "2", "--tp-size", "2",
              "--dist-init-addr", f"127.0.0.1:{port}"]
    follower = FollowerNode([*common, "--node-rank", "1", "--port", str(node_port)])
    try:
        leader = ServerProcess([*common, "--node-rank", "0"])
    except BaseException:
        follower.stop()
        raise
    return leader, follower, node_port


def wait_exit(proc: subprocess.Popen[Any], timeout: float = EXIT_TIMEOUT) -> tuple[int, float]:
    t0 = time.monotonic()
    code = proc.wait(timeout)
    return code, time.monotonic() - t0


def listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def completion(server: ServerProcess, prompt: str) -> tuple[str, list[int]]:
    with server.client() as c:
        r = c.post("/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0}})
    r.raise_for_status()
    out = r.json()
    return out["text"], out["meta_info"].get("output_ids") or []


def test_two_nodes_match_tp1_and_node0_notices_node1_dying() -> None:
    leader, follower, node_port = start_nodes()
    try:
        single = default_server()
        for prompt in PROMPTS:
            assert completion(leader, prompt) == completion(single, prompt), prompt
        assert listening_ports(follower.proc.pid) == set()
        with socket.socket() as s:  # nothing answers on the port node 1 was given
            assert s.connect_ex(("127.0.0.1", node_port)) != 0
        titles = {" ".join(p.cmdline()).strip() for p in psutil.Process(
            follower.proc.pid).children()}
        assert "radixlm::scheduler_DP0_TP1" in titles, titles
        assert " ".join(psutil.Process(follower.proc.pid).cmdline()).strip() == "radixlm::node1"
        follower.proc.send_signal(signal.SIGKILL)
        code, seconds = wait_exit(leader.proc)
        log = leader.log()
        assert code != 0 and seconds < EXIT_TIMEOUT
        assert "the scheduler DP0 TP0 process" in log and "died" in log, log[-3000:]
        assert "a rank on another node is lost" in log
    finally:
        leader.kill()
        follower.stop()


def test_node1_notices_node0_dying() -> None:
    leader, follower, _ = start_nodes()
    try:
        leader.proc.send_signal(signal.SIGKILL)
        code, seconds = wait_exit(follower.proc)
        log = follower.log()
        assert code != 0 and seconds < EXIT_TIMEOUT, log[-3000:]
        assert "lost tensor-parallel rank 0" in log, log[-3000:]
        assert "the scheduler DP0 TP1 process" in log and "died" in log
        assert "a rank on another node is lost" in log
    finally:
        leader.kill()
        follower.stop()


@pytest.fixture(autouse=True)
def _no_stray_nodes() -> Any:
    yield
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        assert "--nnodes 2" not in cmd or p.pid == os.getpid(), f"left running: {cmd}"
