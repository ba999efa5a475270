"""Triton kernel tests on the CPU: a test file's checks run again in a child pytest
under Triton's interpreter (`TRITON_INTERPRET=1` must be set before Triton's
kernels are first jitted, so a fresh process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.environ.get("TRITON_INTERPRET") == "1"
in_interpreter = pytest.mark.skipif(not HERE, reason="runs in test_under_interpreter's child")


def run_file_under_interpreter(path: str, select: str | None = None,
                               min_passed: int = 1) -> None:
    """Runs the test file `path` (with `select`: its `-k` selection) in a child pytest
    under the interpreter; fails with its output if any of its tests fail or fewer
    than `min_passed` pass (a selection renames left empty). Skips when already in
    the child."""
    if HERE:
        pytest.skip("already under the interpreter: the checks run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           path, *(["-k", select] if select else [])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= min_passed, done.stdout[-3000:]
