"""`bench llamacpp-serving`: a server that dies during the run is an error that
names its exit (and, for llama.cpp's SIGSEGV, the AMX-backend crash), not a
table of failed requests."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from radixlm.bench.llamacpp_serving import Server, check_alive


def _server(tmp_path: Path, name: str, code: str) -> Server:
    log = tmp_path / f"{name}.log"
    log.write_text("loaded\n")
    s = Server(name, [sys.executable, "-c", code], {}, 0, log_path=str(log))
    s.proc = subprocess.Popen(s.cmd)
    return s


def test_a_dead_peer_is_an_error(tmp_path: Path) -> None:
    s = _server(tmp_path, "llama.cpp", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    s.proc.wait(30)
    assert s.proc.returncode == -signal.SIGSEGV
    with pytest.raises(RuntimeError, match=r"exited with -11 during the run \(SIGSEGV.*AMX"):
        check_alive(s)


def test_a_live_server_passes(tmp_path: Path) -> None:
    s = _server(tmp_path, "radixlm", "import time; time.sleep(30)")
    try:
        check_alive(s)
    finally:
        s.proc.kill()
        s.proc.wait()
