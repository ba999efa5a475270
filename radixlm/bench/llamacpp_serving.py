"""Our server against llama.cpp's (llama-cpp-python) on one GGUF, in one run.

    python -m radixlm.bench llamacpp-serving --llamacpp-python /path/venv/bin/python \\
        --threads 2 --concurrency 1 8 32 -- --quantization gguf --dtype bfloat16

Starts llama-cpp-python's OpenAI server on the GGUF (`python -m llama_cpp.server`,
from the interpreter that has it: the `bench-llamacpp` extra, often its own
venv), streams the same prompts at each concurrency (random token ids decoded to
text: its server takes no token ids; all sent at once, at most C in flight,
64 output tokens pinned with min_tokens; it sends no usage, so its tokens are
counted as streamed pieces),
stops it, then does the same against `radixlm.launch_server` with the
arguments after `--` (and, one after another, with each `--variant`'s
arguments instead: other configurations of ours in the same run). Same GGUF,
same thread count. llama.cpp runs without
our OMP_WAIT_POLICY=PASSIVE (it slows its OpenMP decode by a third). Its
server serves one request at a time: by default a new request interrupts the
streaming one (`interrupt_requests`, the default, as a user gets it);
`--peer-queue` adds a run with interrupt_requests off (requests wait their
turn). Prints one table, ours beside the peer's and the ratio, and the
resident memory of each serving process (ours: the scheduler's, beside the
issue's budget: the GGUF file x 1.5 + the KV pool).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import psutil

from radixlm.bench import serving

READY_TIMEOUT = 600.0


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    proc: subprocess.Popen | None = None
    log_path: str = ""
    rows: dict[int, dict[str, float]] = field(default_factory=dict)
    rss_mb: float = 0.0
    extra: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-{self.name}-", suffix=".log")
        self.proc = subprocess.Popen(self.cmd, stdout=fd, stderr=subprocess.STDOUT, env=self.env)
        os.close(fd)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log "
                                   f"{self.log_path}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready after {READY_TIMEOUT:.0f} s")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    from radixlm.server.workers import free_port

    return free_port()


def peer_server(args: argparse.Namespace, queue: bool) -> Server:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    port = _free_port()
    cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.model,
           "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           "--n_ctx", str(args.peer_ctx), "--host", "127.0.0.1", "--port", str(port)]
    if queue:
        cmd += ["--interrupt_requests", "False"]
    return Server("llama.cpp" + (" (queued)" if queue else ""), cmd, env, port)


def our_server(args: argparse.Namespace, extra: list[str], name: str = "radixlm") -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--model-path", args.model,
           "--num-threads", str(args.threads), "--port", str(port), *extra]
    return Server(name, cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, port)


def client_args(args: argparse.Namespace, server: Server, concurrency: int) -> argparse.Namespace:
    n = max(args.min_prompts, 2 * concurrency)
    return serving.build_parser().parse_args([
        "--base-url", server.url, "--num-prompts", str(n),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--max-concurrency", str(concurrency), "--vocab-size", str(args.vocab_size),
        "--seed", str(args.seed), "--timeout", "300"])


def text_prompts(args: argparse.Namespace, reqs: list[serving.Request]) -> list[serving.Request]:
    from radixlm.models.loader import prepare_model_dir
    from radixlm.tokenizer import get_tokenizer

    tok = get_tokenizer(prepare_model_dir(args.model))
    return [serving.Request(tok.decode(r.prompt), r.output_len) for r in reqs]


async def measure(args: argparse.Namespace, server: Server) -> None:
    for c in args.concurrency:
        cargs = client_args(args, server, c)
        model = await serving.first_model(cargs)
        reqs = text_prompts(args, serving.random_dataset(cargs, random.Random(cargs.seed)))
        await serving.run_rate(cargs, model, [serving.Request(reqs[0].prompt[:16], 4)], math.inf)
        results, duration, busy = await serving.run_rate(cargs, model, reqs, math.inf)
        row = serving.summarize(results, duration) | {"client_busy": busy}
        errors = [r.error for r in results if not r.ok]
        if errors:
            row["first_error"] = errors[0][:160]
        server.rows[c] = row
        print(f"{server.name} c={c}: {row['output_throughput']:.1f} tok/s, "
              f"{row['failed']:.0f} failed", flush=True)


def rss_mb(server: Server, model: str) -> tuple[float, str]:
    """The serving process's resident memory (ours: the scheduler's), and a note
    (ours: the KV pool's bytes and the budget file x 1.5 + KV pool)."""
    if not server.name.startswith("radixlm"):
        return psutil.Process(server.proc.pid).memory_info().rss / 2**20, ""
    info = httpx.get(server.url + "/get_server_info", timeout=30.0).json()
    pids = [pid for name, pid in info["process_pids"].items() if "scheduler" in name]
    rss = sum(psutil.Process(pid).memory_info().rss for pid in pids) / 2**20
    pool = kv_pool_mib(info["server_args"]["dtype"], model, info["kv_tokens_total"])
    budget = os.path.getsize(model) / 2**20 * 1.5 + pool
    floor = torch_floor_mib()
    return rss, (f"(KV pool {info['kv_tokens_total']} tokens = {pool:.0f} MiB; rest "
                 f"{rss - pool:.0f} MiB, of which a bare `import torch` holds {floor:.0f}; "
                 f"budget file x 1.5 + pool = {budget:.0f} MiB: "
                 f"{'within' if rss <= budget else 'over'})")


def torch_floor_mib() -> float:
    """The RSS of a fresh interpreter that only imports torch: what any process
    running torch holds before it loads a model."""
    code = "import torch, psutil; print(psutil.Process().memory_info().rss)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.split()[-1]) / 2**20


def kv_pool_mib(dtype_name: str, model: str, tokens: int) -> float:
    """The KV pool's size as the scheduler sizes it (same config, same dtype rule)."""
    from radixlm.cache.kv_spec import MHA, KVSpec
    from radixlm.models.decoder import head_dim_of
    from radixlm.models.gguf_packed import record_stored_dtype
    from radixlm.models.loader import gguf_source, load_config, prepare_model_dir, resolve_dtype

    config = load_config(prepare_model_dir(model))
    if (gguf := gguf_source(model)) is not None:
        record_stored_dtype(config, gguf)  # as the runner does, for dtype auto
    dtype = resolve_dtype(dtype_name, config, "cpu")
    d = head_dim_of(config)
    per_token = KVSpec(MHA, config.num_hidden_layers, config.num_key_value_heads, d,
                       d).layer_bytes(dtype) * config.num_hidden_layers
    return tokens * per_token / 2**20


def check_alive(server: Server) -> None:
    """Raise if the server died during the run (its requests then all failed)."""
    rc = server.proc.poll() if server.proc is not None else None
    if rc is None:
        return
    hint = ""
    if rc == -11 and not server.name.startswith("radixlm"):
        hint = (" (SIGSEGV: a llama.cpp built with its AMX backend, `AMX_INT8 = 1` in the "
                "log, faults in ldtilecfg on this machine; use a build without it)")
    raise RuntimeError(f"{server.name} exited with {rc} during the run{hint}; log "
                       f"{server.log_path}:\n{server.log()[-3000:]}")


def run(args: argparse.Namespace, server: Server) -> None:
    print(f"starting {server.name}: {' '.join(server.cmd)}", flush=True)
    server.start()
    try:
        asyncio.run(measure(args, server))
        check_alive(server)
        server.rss_mb, server.extra = rss_mb(server, args.model)
    finally:
        server.stop()


def tok_s(server: Server, concurrency: int) -> float:
    return server.rows[concurrency]["output_throughput"]


def print_table(servers: list[Server], concurrency: list[int]) -> None:
    """Per concurrency: each server's output tok/s (failed requests), ITL and
    TTFT p50; then each of ours against the peer (the first server)."""
    peer = servers[0]
    heads = "".join(f" c={c} tok/s (failed) | ITL p50 ms | TTFT p50 ms |" for c in concurrency)
    print(f"\n| server |{heads}")
    print("|---|" + "---|---|---|" * len(concurrency))
    for s in servers:
        cells = "".join(f" {s.rows[c]['output_throughput']:.1f} ({s.rows[c]['failed']:.0f}) | "
                        f"{s.rows[c]['itl_p50_ms']:.1f} | {s.rows[c]['ttft_p50_ms']:.0f} |"
                        for c in concurrency)
        print(f"| {s.name} |{cells}")
    base1 = peer.rows.get(1, {}).get("output_throughput", 0.0)
    for s in servers[1:]:
        same = ", ".join(f"c={c} {tok_s(s, c) / max(tok_s(peer, c), 1e-9):.2f}x"
                         for c in concurrency)
        print(f"{s.name} / {peer.name}, same concurrency: {same}")
        if base1:
            print(f"{s.name} / {peer.name} at concurrency 1: " + ", ".join(
                f"c={c} {s.rows[c]['output_throughput'] / base1:.2f}x" for c in concurrency))
    for s in servers:
        tokens = ", ".join(f"c={c} {s.rows[c]['total_output_tokens']:.0f}" for c in concurrency)
        print(f"{s.name}: output tokens {tokens}; resident memory {s.rss_mb:.0f} MiB "
              f"{s.extra}".rstrip())
        for c, row in s.rows.items():
            if "first_error" in row:
                print(f"  c={c} first error: {row['first_error']}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, ours_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m radixlm.bench llamacpp-serving",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--llamacpp-python", required=True,
                   help="an interpreter with llama-cpp-python[server]")
    p.add_argument("--model", default=None, help="the GGUF (default: the embedded model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--min-prompts", type=int, default=16,
                   help="prompts per run: this many, or twice the concurrency")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-ctx", type=int, default=2048, help="llama.cpp's n_ctx")
    p.add_argument("--peer-queue", action="store_true",
                   help="also run llama.cpp with interrupt_requests off")
    p.add_argument("--variant", action="append", default=[], metavar="ARGS",
                   help="another configuration of ours, run after the one after `--`: its "
                        "arguments as one string (repeatable)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    args.radixlm_args = ours_args
    if args.model is None:
        from radixlm.models.loader import default_model_path
        args.model = default_model_path()
    peers = [peer_server(args, queue=False)]
    if args.peer_queue:
        peers.append(peer_server(args, queue=True))
    ours = [our_server(args, ours_args, "radixlm " + " ".join(ours_args))]
    ours += [our_server(args, shlex.split(v), f"radixlm {v}") for v in args.variant]
    servers = [*peers, *ours]
    for server in servers:
        run(args, server)
    print_table(servers, args.concurrency)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "servers": {
                s.name: {"cmd": s.cmd, "rss_mib": s.rss_mb, "memory": s.extra, "rows": s.rows}
                for s in servers}}, f, indent=2, default=str)
    return 0
