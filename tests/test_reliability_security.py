"""Security (issue 9, scenario 7).

- Sockets: the server's processes listen on 127.0.0.1 only (the HTTP port);
  with `--host 0.0.0.0` only that HTTP socket moves. The ZMQ endpoints are
  ipc:// files in a directory only the owner can enter.
- Nothing received is unpickled or evaluated: the package source has no
  pickle/marshal/eval/exec (an AST scan), and a pickle whose loading would
  leave a mark, sent straight to every process's ipc socket, is logged and
  dropped while the server keeps serving.
- `--api-key` guards every route the app has (enumerated from /openapi.json)
  but /health and /metrics, compared in constant time.
- Oversized headers are refused (431, or 400 from the HTTP parser), not a crash.
"""

from __future__ import annotations

import ast
import os
import pickle
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import zmq
from server_utils import REPO, ServerProcess, default_server

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
PACKAGE = REPO / "radixlm"
IPC_PREFIX = "radixlm-ipc-"


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


def server_processes(server: ServerProcess) -> list[psutil.Process]:
    main = psutil.Process(server.proc.pid)
    return [main, *main.children(recursive=True)]


def sockets(proc: psutil.Process, kind: str) -> list[Any]:
    getter = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6
    return getter(kind=kind)


def listening_inet(server: ServerProcess) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket and bound UDP socket."""
    out = []
    for proc in server_processes(server):
        for conn in sockets(proc, "inet"):
            if conn.status == psutil.CONN_LISTEN or (conn.status == psutil.CONN_NONE
                                                      and conn.laddr):
                out.append((proc.pid, conn.laddr.ip, conn.laddr.port))
    return out


def ipc_endpoints(server: ServerProcess) -> dict[str, int]:
    """Path of each bound ipc socket of the server -> the pid that binds it."""
    out = {}
    for proc in server_processes(server):
        for conn in sockets(proc, "unix"):
            if isinstance(conn.laddr, str) and IPC_PREFIX in conn.laddr:
                out[conn.laddr] = proc.pid
    return out


def assert_still_serving(server: ServerProcess) -> None:
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


# ---- sockets ----------------------------------------------------------------------------
def test_only_the_http_port_listens_and_on_loopback(server: ServerProcess) -> None:
    assert listening_inet(server) == [(server.proc.pid, "127.0.0.1", server.port)]


def test_zmq_endpoints_are_ipc_files_in_a_private_directory(server: ServerProcess) -> None:
    endpoints = ipc_endpoints(server)
    pids = server.server_info()["process_pids"]
    names = {Path(p).name: pid for p, pid in endpoints.items()}
    # Each process binds the one socket it reads from.
    assert names == {"scheduler": pids["scheduler"], "detokenizer": pids["detokenizer"],
                     "tokenizer": server.proc.pid}, endpoints
    (root,) = {Path(p).parent for p in endpoints}
    st = root.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid(), oct(st.st_mode)


# ---- nothing received is executed --------------------------------------------------------
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                  "joblib"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}
UNSAFE_METHODS = {"recv_pyobj", "send_pyobj", "recv_serialized", "loads_pickle"}


def unsafe_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNSAFE_MODULES:
                found.append(f"from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in UNSAFE_BUILTINS:
                found.append(f"{f.id}()")
            elif isinstance(f, ast.Attribute) and f.attr in UNSAFE_METHODS:
                found.append(f".{f.attr}()")
            elif (isinstance(f, ast.Attribute) and f.attr == "load"
                  and isinstance(f.value, ast.Name) and f.value.id in ("torch", "yaml")):
                found.append(f"{f.value.id}.load()")  # both unpickle/construct objects
            found += [f"{k.arg}=True" for k in node.keywords
                      if k.arg == "allow_pickle" and isinstance(k.value, ast.Constant)
                      and k.value.value is True]
    return found


def test_source_never_unpickles_or_evaluates() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = unsafe_uses(ast.parse(path.read_text(), str(path)))
        if uses:
            offenders[str(path.relative_to(REPO))] = uses
    assert offenders == {}
    # The scan does find what it looks for.
    assert unsafe_uses(ast.parse("import pickle\nsock.recv_pyobj()\neval('1')")) == [
        "pickle", ".recv_pyobj()", "eval()"]


def test_api_key_is_compared_in_constant_time() -> None:
    source = (PACKAGE / "server" / "http_server.py").read_text()
    assert "hmac.compare_digest(" in source
    assert "== self.api_key" not in source and "api_key ==" not in source


class _LeavesAMark:
    """Unpickling this creates a directory: proof that something unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.path,))


def test_pickle_sent_to_every_ipc_socket_is_dropped(server: ServerProcess) -> None:
    endpoints = ipc_endpoints(server)
    assert len(endpoints) == 3
    log_start = len(server.log())
    with tempfile.TemporaryDirectory() as tmp:
        mark = os.path.join(tmp, "unpickled")
        payloads = [pickle.dumps(_LeavesAMark(mark), protocol=p) for p in (2, 5)]
        ctx = zmq.Context()
        try:
            for path in endpoints:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 2000)
                sock.connect(f"ipc://{path}")
                for payload in payloads:
                    sock.send(payload)
                sock.close()  # lingers until sent
        finally:
            ctx.term()
        deadline = time.monotonic() + 10
        while server.log()[log_start:].count("dropping an undecodable message") < 4:
            assert time.monotonic() < deadline, server.log()[log_start:][-3000:]
            time.sleep(0.1)
        assert_still_serving(server)
        assert not os.path.exists(mark), "a process unpickled what it received"
    log = server.log()[log_start:]
    assert "[scheduler] ERROR dropping an undecodable message" in log
    assert "[detokenizer] ERROR dropping an undecodable message" in log
    assert "failed to handle a message from a child process" in log  # the main process
    assert all(p.is_running() for p in server_processes(server))


# ---- headers ---------------------------------------------------------------------------
def test_oversized_headers_in_small_chunks_get_the_guards_431(server: ServerProcess) -> None:
    """A 100 KB header block that arrives a few KB at a time is refused by our guard
    (431, JSON error) and not by the HTTP parser's buffer limit (400, reset)."""
    request = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-filler: " + b"a" * 100_000
               + b"\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for i in range(0, len(request), 4096):
            sock.sendall(request[i:i + 4096])
            time.sleep(0.002)  # each chunk its own read on the server
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b"headers" in reply


def test_oversized_headers_are_refused(server: ServerProcess) -> None:
    with server.client() as c:
        r = c.get("/v1/models", headers={"x-filler": "a" * 100_000})
        assert r.status_code == 431 and "headers" in r.json()["error"]["message"], r.text
        r = c.get("/v1/models", headers=[(f"x-h{i}", "v" * 64) for i in range(2000)])
        assert r.status_code in (400, 431), r.text[:200]
        # Far larger: uvicorn's parser answers 400 and closes the connection,
        # sometimes before the client has sent it all (a reset on our side).
        try:
            r = c.get("/v1/models", headers={"x-filler": "a" * 4_000_000})
            assert r.status_code in (400, 431), r.text[:200]
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            pass
    assert_still_serving(server)


# ---- API key and --host -------------------------------------------------------------
KEY = "k-" + "x" * 30
# Probes and read-only load figures: /metrics and the status page that shows the
# same figures (radixlm/server/http_server.py OPEN_PATHS).
OPEN = {"/health", "/metrics", "/dashboard", "/dashboard/data"}


@pytest.fixture(scope="module")
def guarded() -> Any:
    server = ServerProcess(["--host", "0.0.0.0", "--enable-metrics", "--max-total-tokens", "2048",
                            "--context-length", "256", "--num-threads", "1"], api_key=KEY)
    yield server
    server.stop()


def app_routes(server: ServerProcess) -> list[tuple[str, str]]:
    with server.client() as c:
        spec = c.get("/openapi.json").json()
    routes = [(method.upper(), path.replace("{model_id}", MODEL))
              for path, ops in spec["paths"].items() for method in ops]
    # FastAPI's own pages are not in the schema.
    return routes + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")]


def test_api_key_guards_every_route_but_health_and_metrics(guarded: ServerProcess) -> None:
    routes = app_routes(guarded)
    assert len(routes) >= 15 and ("POST", "/v1/chat/completions") in routes
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
             {"Authorization": KEY}, {"X-Api-Key": KEY}]
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        for method, path in routes:
            for headers in wrong:
                r = c.request(method, path, headers=headers, json={})
                if path in OPEN:
                    assert r.status_code == 200, (method, path, r.status_code)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                err = r.json()["error"]
                assert err["code"] == 401 and "API key" in err["message"]
                assert r.headers["www-authenticate"] == "Bearer"
        # With the key the same routes are reachable (whatever their answer to {}).
        for method, path in routes:
            r = c.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, json={})
            assert r.status_code != 401, (method, path)


def test_host_flag_moves_only_the_http_socket(guarded: ServerProcess) -> None:
    assert listening_inet(guarded) == [(guarded.proc.pid, "0.0.0.0", guarded.port)]
    assert len(ipc_endpoints(guarded)) == 3  # the processes still talk over ipc:// only
