"""The server's front end: `priority` on every generation route, per-hop timing
stamps, and an API process that never imports the scheduler."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import REPO, ServerProcess, default_server, tiny_dummy_model

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "user", "content": "Hi"}]
ROUTES = {
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 1},
}
STAGES = ["received", "tokenized", "sent", "sched_recv", "step_start", "first_token",
          "sched_send", "detok_recv", "detok_send", "api_recv", "first_write"]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


def _error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    return err


# ---- priority ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("bad", [True, 1.5, "1", {"p": 1}, 1 << 64])
def test_a_priority_that_is_no_integer_is_a_400(server: ServerProcess, path: str,
                                                bad: Any) -> None:
    with server.client() as c:
        err = _error(c.post(path, json={**ROUTES[path], "priority": bad}))
    assert err["param"] == "priority" and err["message"].startswith("priority must be"), err


@pytest.mark.parametrize("path", list(ROUTES))
def test_an_integer_priority_is_accepted(server: ServerProcess, path: str) -> None:
    with server.client() as c:
        r = c.post(path, json={**ROUTES[path], "priority": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_priority_without_priority_scheduling_is_a_400(server: ServerProcess,
                                                          path: str) -> None:
    with server.client() as c:
        err = _error(c.post(path, json={**ROUTES[path], "priority": 3}))
    assert err["param"] == "priority" and "--enable-priority-scheduling" in err["message"]


def test_native_priority_per_input(server: ServerProcess) -> None:
    body = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}}
    with server.client() as c:
        assert c.post("/generate", json={**body, "priority": [0, 0]}).status_code == 200
        err = _error(c.post("/generate", json={**body, "priority": [0]}))
        assert err["param"] == "priority" and "1 priority for 2 inputs" in err["message"]
        err = _error(c.post("/generate", json={**body, "priority": [0, 2.0]}))
        assert err["param"] == "priority"


# ---- timing stamps ---------------------------------------------------------------------------
def _stream_events(c: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


def test_return_timing_stamps_every_hop_in_order(server: ServerProcess) -> None:
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "stream": True}
    with server.client() as c:
        timed = _stream_events(c, {**body, "return_timing": True})
        plain = _stream_events(c, body)
        whole = c.post("/generate", json={**body, "stream": False,
                                          "return_timing": True}).json()
    timing = timed[-1]["meta_info"]["timing"]
    assert list(timing) == STAGES or set(timing) == set(STAGES), timing
    values = [timing[s] for s in STAGES]
    assert values == sorted(values), timing
    assert all("timing" not in e["meta_info"] for e in plain)
    # Unstreamed: no SSE write, every other hop.
    assert set(whole["meta_info"]["timing"]) == set(STAGES) - {"first_write"}


# ---- the API process's imports -------------------------------------------------------------
# Runs the launcher as `python -m radixlm.launch_server` would, and writes the
# modules it imported over its whole life (requests included) when it exits.
RECORD_MODULES = """
import atexit, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
runpy.run_module("radixlm.launch_server", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def tiny_model(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_dummy_model(model_dir, tmp_path_factory.mktemp("tiny"))


def test_the_api_process_does_not_import_the_scheduler(tiny_model: str,
                                                        tmp_path: Path) -> None:
    modules = tmp_path / "modules.txt"
    server = ServerProcess(["--model-path", tiny_model, "--load-format", "dummy",
                            "--enable-metrics", "--max-total-tokens", "2048"],
                           launcher=[sys.executable, "-c", RECORD_MODULES, str(modules)])
    try:
        with server.client() as c:
            for path, body in ROUTES.items():
                assert c.post(path, json=body).status_code == 200
            stream = {**ROUTES["/v1/chat/completions"], "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=stream) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            assert c.post("/generate", json={**ROUTES["/generate"],
                                              "sampling_params": {"n": 2, "max_new_tokens": 1,
                                                                  "regex": "a+"}}
                          ).status_code == 200
            assert c.get("/health_generate").status_code == 200
            assert c.get("/metrics").status_code == 200
        assert server.stop(signal.SIGTERM) == 0
    finally:
        server.kill()
    loaded = modules.read_text().split()
    assert "radixlm.server.tokenizer_manager" in loaded  # it did record the API process
    assert not [m for m in loaded if m == "radixlm.scheduler" or
                m.startswith("radixlm.scheduler.")]
    assert "radixlm.constrained.manager" not in loaded


def test_the_probe_sees_a_scheduler_import() -> None:
    """The recorder above would notice: the same script in a process that does
    import the scheduler lists it."""
    code = RECORD_MODULES.replace(
        'runpy.run_module("radixlm.launch_server", run_name="__main__", alter_sys=True)',
        "import radixlm.scheduler.req")
    out = subprocess.run([sys.executable, "-c", code, "/dev/stdout"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "radixlm.scheduler.req" in out.split()
