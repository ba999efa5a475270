"""OpenMP's wait policy: radixlm makes torch's OpenMP threads sleep when idle,
which only works before torch loads its runtime; a CPU engine started after a
plain `import torch` says so (radixlm/__init__.py, ModelRunner._set_cpu_threads)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import radixlm
from radixlm.runtime.model_runner import ModelRunner

REPORT = "import os, radixlm; print(radixlm.OMP_BUSY_WAIT, os.environ['OMP_WAIT_POLICY'])"


def _run(first_import: str, policy: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    return subprocess.run([sys.executable, "-c", f"{first_import}; {REPORT}"], env=env,
                          capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize(("first", "policy", "expected"), [
    ("import torch", None, ["True", "PASSIVE"]),        # too late: torch's runtime spins
    ("import radixlm", None, ["False", "PASSIVE"]),     # in time
    ("import torch", "ACTIVE", ["False", "ACTIVE"]),    # the user's own choice stands
])
def test_busy_wait_is_detected_only_where_torch_came_first(first, policy, expected):
    assert _run(first, policy) == expected


@pytest.mark.parametrize("busy", [True, False])
def test_cpu_runner_warns_about_a_busy_waiting_runtime(monkeypatch, caplog, busy):
    monkeypatch.setattr(radixlm, "OMP_BUSY_WAIT", busy)
    runner = SimpleNamespace(args=SimpleNamespace(num_threads=None, tp_size=1, dp_size=1,
                                                  nnodes=1))
    with caplog.at_level(logging.WARNING, "radixlm.runtime.model_runner"):
        ModelRunner._set_cpu_threads(runner)
    assert any("OMP_WAIT_POLICY=PASSIVE" in r.getMessage() for r in caplog.records) == busy
