"""Start the real server (`python -m radixlm.launch_server`) as a subprocess.

    with ServerProcess(["--enable-metrics"]) as server:
        httpx.get(server.url + "/health")

`default_server()` starts one shared server per test session (the model is
loaded once for all the server tests) and stops it at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from hf_reference import EXACT_ARGS

from radixlm.server.workers import free_port

READY_TIMEOUT = 300.0  # a cold start converts the GGUF once; a busy 2-core box is slow
REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    def __init__(self, args: list[str] | None = None, api_key: str | None = None,
                 launcher: list[str] | None = None) -> None:
        """`launcher`: the command that runs launch_server's main (default
        `python -m radixlm.launch_server`); the server options follow it."""
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        args = list(args or [])
        if "--model-path" not in args:  # the embedded model: as HF computes it, unless told
            args = [*EXACT_ARGS, *args]
        cmd = [*(launcher or [sys.executable, "-m", "radixlm.launch_server"]),
               "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        fd, self.log_path = tempfile.mkstemp(prefix="radixlm-server-", suffix=".log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=fd, stderr=subprocess.STDOUT,
                                     env=env)
        os.close(fd)
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise

    # ---- lifecycle -------------------------------------------------------------
    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            if "The server is ready" in self.log():
                return
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready in {timeout:.0f} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        Path(self.log_path).unlink(missing_ok=True)

    # ---- requests ------------------------------------------------------------------
    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120.0, **kw)

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                             max_retries=0, timeout=120.0)

    def server_info(self) -> dict[str, Any]:
        with self.client() as c:
            r = c.get("/get_server_info")
            r.raise_for_status()
            return r.json()

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Server info once nothing runs or waits (aborts land asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            idle = info["num_running_requests"] == 0 and info["num_queued_requests"] == 0
            # The API process forgets a request when its finish arrives, after the
            # scheduler has.
            forgotten = info.get("api_live_seqs", 0) == 0 and info.get("api_tracked_ids", 0) == 0
            if (idle and forgotten and info["kv_tokens_in_use"] == 0) or \
                    time.monotonic() > deadline:
                return info
            time.sleep(0.1)


# Small and fast defaults for the shared test server: a modest KV pool and a
# short context keep start-up quick and make "fill the context" tests cheap;
# one torch thread because the test machine's two cores are shared with the
# test process (and the offline Engine compared against uses one too);
# metrics on so /metrics can be tested.
DEFAULT_ARGS = ["--enable-metrics", "--max-total-tokens", "8192", "--context-length", "256",
                "--num-threads", "1", "--stats-interval", "5", *EXACT_ARGS]
_default: ServerProcess | None = None


def default_server() -> ServerProcess:
    global _default
    if _default is None or _default.proc.poll() is not None:
        _default = ServerProcess(DEFAULT_ARGS)
        atexit.register(_default.__exit__, None, None, None)
    return _default


def tiny_dummy_model(model_dir: str, out: Path, **config_changes: Any) -> str:
    """SmolLM2's tokenizer (from `model_dir`) on a two-layer config (updated by
    `config_changes`), for servers started with `--load-format dummy`: they start
    in seconds."""
    import json
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, out / name)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    config.update(config_changes)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)
