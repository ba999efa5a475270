"""torch.profiler traces of the scheduler (SGLang's /start_profile, /stop_profile).

`start` begins recording (CPU, plus CUDA kernels on a GPU); `stop` writes one
Chrome trace per tensor-parallel rank, `{output_dir}/{profile_id}-TP-{rank}.trace.json`
(open it in Perfetto or chrome://tracing). With `num_steps` the recording
stops by itself after that many scheduler steps.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixlm import distributed as tp

logger = logging.getLogger(__name__)

PROFILER_DIR_ENV = "RADIXLM_TORCH_PROFILER_DIR"
ACTIVITIES = {"CPU": "CPU", "GPU": "CUDA", "CUDA": "CUDA"}


def default_output_dir() -> str:
    return os.environ.get(PROFILER_DIR_ENV) or str(Path(tempfile.gettempdir()) / "radixlm-profiles")


class Profiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.prof: torch.profiler.profile | None = None
        self.path: Path | None = None
        self.steps_left: int | None = None
        self.auto_stopped: str | None = None  # a num_steps trace not yet reported by stop

    @property
    def active(self) -> bool:
        return self.prof is not None

    def start(self, output_dir: str | None = None, num_steps: int | None = None,
              activities: list[str] | None = None, with_stack: bool | None = None,
              record_shapes: bool | None = None, profile_id: str | None = None) -> str:
        """Begin recording; returns where the trace will go. ValueError on bad
        arguments or when already recording."""
        if self.prof is not None:
            raise ValueError("the profiler is already running; call stop_profile first")
        self.auto_stopped = None
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
        kinds = self._activities(activities)
        out = Path(output_dir or default_output_dir())
        out.mkdir(parents=True, exist_ok=True)
        profile_id = profile_id or str(time.time())
        self.path = out / f"{profile_id}-TP-{tp.get_tp_rank()}.trace.json"
        self.steps_left = num_steps
        self.prof = torch.profiler.profile(activities=kinds, with_stack=bool(with_stack),
                                           record_shapes=bool(record_shapes))
        self.prof.start()
        logger.info("profiling started; the trace will be written to %s", self.path)
        return str(self.path)

    def _activities(self, names: list[str] | None) -> list[Any]:
        on_gpu = self.device.type == "cuda"
        names = names or (["CPU", "GPU"] if on_gpu else ["CPU"])
        if isinstance(names, str) or not isinstance(names, list):
            raise ValueError(f"activities must be a list such as ['CPU', 'GPU'], got {names!r}")
        kinds = []
        for name in names:
            kind = ACTIVITIES.get(str(name).upper())
            if kind is None:
                raise ValueError(f"unknown profiler activity {name!r}: expected CPU or GPU")
            if kind == "CUDA" and not on_gpu:
                raise ValueError("activity GPU needs the model on a CUDA device")
            kinds.append(getattr(torch.profiler.ProfilerActivity, kind))
        return list(dict.fromkeys(kinds))

    def stop(self) -> str:
        """Stop and write the trace; returns its path (that of a num_steps profile
        which stopped by itself, once). ValueError when not recording."""
        if self.prof is None and self.auto_stopped is not None:
            path, self.auto_stopped = self.auto_stopped, None
            return path
        if self.prof is None or self.path is None:
            raise ValueError("the profiler is not running; call start_profile first")
        prof, path = self.prof, self.path
        self.prof, self.path, self.steps_left = None, None, None
        prof.stop()
        prof.export_chrome_trace(str(path))
        logger.info("profiling stopped; trace written to %s", path)
        return str(path)

    def step(self) -> None:
        """Called after every scheduler step: counts down `num_steps`."""
        if self.prof is None or self.steps_left is None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.auto_stopped = self.stop()
