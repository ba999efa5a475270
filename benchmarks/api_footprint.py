"""Resident memory of `radixlm serve`'s processes, this tree against another.

    flock -x /tmp/radixlm-bench.lock python benchmarks/api_footprint.py \\
        --peer before=/tmp/radixlm-before [--runs 3] [-- server options]

Each run starts the server of every tree in turn (alternating, a fresh set of
processes each time: `python -m radixlm.launch_server` with PYTHONPATH set to
the tree), waits for "The server is ready", reads the API process's RSS
(psutil) and whether it maps libtorch, sends a few /generate and chat
requests, reads it again with the children's, and stops the server. The
table gives min / median / max over the runs and the ratio to the peer.
Server options default to the embedded model with a small KV pool.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parents[1]
DEFAULT_OPTIONS = ["--max-total-tokens", "4096", "--context-length", "512"]
READY_TIMEOUT_S = 600.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def _mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def measure(tree: Path, options: list[str]) -> dict[str, Any]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    fd, log_name = tempfile.mkstemp(prefix="api-footprint-", suffix=".log")
    log = Path(log_name)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.launch_server", "--port", str(port),
                             *options], cwd=tree, env=env, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    try:
        while "The server is ready" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.perf_counter() - start > READY_TIMEOUT_S:
                raise RuntimeError(f"{tree}: the server did not start:\n"
                                   f"{log.read_text()[-3000:]}")
            time.sleep(0.2)
        ready_s = time.perf_counter() - start
        result = {"ready_s": ready_s, "api_ready": _mib(proc.pid),
                  "api_torch": _maps_torch(proc.pid)}
        url = f"http://127.0.0.1:{port}"
        for i in range(4):
            _post(url + "/generate", {"text": f"Request {i}: the capital of France is",
                                      "sampling_params": {"max_new_tokens": 16}})
            _post(url + "/v1/chat/completions", {"max_tokens": 16, "messages": [
                {"role": "user", "content": f"Say hello {i} times."}]})
        result["api_served"] = _mib(proc.pid)
        result["api_torch"] |= _maps_torch(proc.pid)
        for child in psutil.Process(proc.pid).children():
            name = child.name()
            if name.startswith("radixlm::"):
                result[name.removeprefix("radixlm::")] = _mib(child.pid)
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        log.unlink()


def _spread(values: list[float]) -> str:
    return f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", required=True, help="NAME=PATH of the tree to compare with")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("options", nargs="*", help="server options (after --)")
    args = parser.parse_args()
    peer_name, _, peer_path = args.peer.partition("=")
    trees = {"ours": HERE, peer_name: Path(peer_path).resolve()}
    options = args.options or DEFAULT_OPTIONS
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, tree in trees.items():
            runs[name].append(measure(tree, options))
            print(f"run {i + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    keys = sorted({k for rs in runs.values() for r in rs for k in r} - {"api_torch"},
                  key=lambda k: (not k.startswith("api"), k))
    print(f"\nserver options: {' '.join(options)}; {args.runs} runs, MiB (ready_s: seconds), "
          "min / median / max")
    print("| | " + " | ".join(trees) + f" | ours / {peer_name} (median) |")
    print("|---|" + "---|" * (len(trees) + 1))
    for key in keys:
        cells = [_spread([r[key] for r in runs[n] if key in r]) if any(key in r for r in runs[n])
                 else "-" for n in trees]
        ours = [r[key] for r in runs["ours"] if key in r]
        theirs = [r[key] for r in runs[peer_name] if key in r]
        ratio = (f"{statistics.median(ours) / statistics.median(theirs):.2f}x"
                 if ours and theirs else "-")
        print(f"| {key} | " + " | ".join(cells) + f" | {ratio} |")
    print("| API process maps libtorch | " + " | ".join(
        str(any(r["api_torch"] for r in runs[n])) for n in trees) + " | |")


if __name__ == "__main__":
    main()
