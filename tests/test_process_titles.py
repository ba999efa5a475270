"""`ps` names every process of a running server (setproctitle)."""

from __future__ import annotations

import subprocess

from server_utils import default_server


def ps_title(pid: int) -> str:
    return subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_ps_shows_the_titles() -> None:
    server = default_server()
    pids = server.server_info()["process_pids"]
    titles = {ps_title(pid) for pid in pids.values()}
    assert titles == {"radixlm::scheduler_DP0_TP0", "radixlm::detokenizer"}, pids
    assert ps_title(server.proc.pid) == "radixlm::api"
