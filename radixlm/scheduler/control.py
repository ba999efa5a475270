"""The scheduler's control component: everything that is not generation.

`Scheduler.control(method, **args)` is the one entry point; it calls
`SchedulerControl.call`. Callers (the offline Engine, the scheduler process
on behalf of HTTP endpoints, the data-parallel controller) name a method;
only the names in `CONTROL_METHODS` are reachable, so a peer can never call
an arbitrary attribute. Every method returns plain JSON-like data; a mutation
answers `{"success": bool, "message": str, ...}` and reports bad input as
success False with the reason rather than raising.

What it covers: the cache and invariants, aborts, sessions, and runtime
control (see docs/runtime_control.md): weight updates (from disk, tensors as
safetensors bytes, or a trainer's torch.distributed group), weights by name,
memory release/resume, profiling, log level. The model-touching work is per
model runner, so with tensor parallelism each rank runs the same call on its
own shard, in the same step (rank 0 broadcasts it): methods must be
deterministic given the scheduler's state and their arguments.

Weight updates need the scheduler idle: with requests queued or running they
are refused unless `abort_all_requests=True` (the HTTP front end first pauses
admission and waits for running requests, as SGLang does). On success the
prefix cache is flushed (its KV came from the old weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from radixlm.config import LOG_LEVELS, WEIGHT_UPDATE_GROUP
from radixlm.runtime.memory_occupation import MemoryOccupation, normalize_tags
from radixlm.runtime.profiler import Profiler
from radixlm.runtime.weight_updater import (
    WeightUpdateError,
    WeightUpdater,
    deserialize_named_tensors,
)


@dataclass(frozen=True)
class RuntimeControls:
    """The model-touching parts of control, one set per model runner: built by the
    model worker (`Worker.runtime_controls`), driven from here."""

    weights: WeightUpdater
    memory: MemoryOccupation
    profiler: Profiler

    @classmethod
    def for_runner(cls, runner: Any, model_path: str | None) -> RuntimeControls:
        memory = MemoryOccupation(runner)
        return cls(WeightUpdater(runner.model, runner.config, runner.device, model_path,
                                 on_derived_moved=memory.refresh_graphs),
                   memory, Profiler(runner.device))


class Controlled(Protocol):
    """What the control component needs of its scheduler."""

    args: Any  # ServerArgs
    worker: Any  # its model worker (`Worker`): the runtime controls
    reqs: dict[str, Any]
    sessions: Any  # SessionController

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None: ...

    def flush_cache(self) -> tuple[bool, str]: ...

    def server_info(self) -> dict[str, Any]: ...

    def check_invariants(self) -> None: ...

# Method name -> name of the implementing method of SchedulerControl.
CONTROL_METHODS: dict[str, str] = {
    "get_server_info": "_server_info",
    "flush_cache": "_flush_cache",
    "check_invariants": "_check_invariants",
    "abort": "_abort",
    "open_session": "_open_session",
    "close_session": "_close_session",
    **{name: f"_{name}" for name in (
        "update_weights_from_disk", "update_weights_from_tensor", "init_weights_update_group",
        "destroy_weights_update_group", "update_weights_from_distributed", "get_weights_by_name",
        "release_memory_occupation", "resume_memory_occupation", "start_profile",
        "stop_profile", "configure_logging")},
}


def _ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def _fail(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": False, "message": message, **extra}


class SchedulerControl:
    """Constructed by the scheduler it controls, with the runtime-control parts of
    its model worker (weight updater, memory occupation, profiler)."""

    def __init__(self, scheduler: Controlled) -> None:
        self.scheduler = scheduler
        controls = scheduler.worker.runtime_controls()
        self.weights = controls.weights
        self.memory = controls.memory
        self.profiler = controls.profiler

    def call(self, method: str, **args: Any) -> Any:
        """Run the control method `method`; raises KeyError for an unknown name and
        whatever the method raises (TypeError for bad arguments, ValueError, ...)."""
        name = CONTROL_METHODS.get(method)
        if name is None:
            raise KeyError(f"unknown control method {method!r}")
        return getattr(self, name)(**args)

    # ---- hooks of the scheduler loop ---------------------------------------------------
    def check_accepting(self) -> None:
        """Raises ValueError while memory is released (generation needs it back)."""
        if self.memory.is_released:
            released = ", ".join(sorted(self.memory.released))
            raise ValueError(f"the server has released its memory ({released}): call "
                             "resume_memory_occupation before generating")

    def after_step(self) -> None:
        """Lets a `num_steps` profile stop by itself."""
        if self.profiler.active:
            self.profiler.step()

    # ---- cache, requests, sessions -----------------------------------------------------
    def _server_info(self) -> dict[str, Any]:
        return self.scheduler.server_info()

    def _flush_cache(self) -> dict[str, Any]:
        ok, message = self.scheduler.flush_cache()
        return {"success": ok, "message": message}

    def _check_invariants(self) -> dict[str, Any]:
        self.scheduler.check_invariants()
        return {"success": True}

    def _abort(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        self.scheduler.abort(rid, abort_all)
        return {"success": True}

    def _open_session(self, capacity_of_str_len: int,
              session_id: str | None = None) -> dict[str, Any]:
        """SGLang's open_session; `session_id` None: the scheduler picks one
        (deterministically: callers that want a random one pass it)."""
        try:
            sid = self.scheduler.sessions.open(capacity_of_str_len, session_id)
        except ValueError as e:
            return {"success": False, "message": str(e), "session_id": None}
        return {"success": True, "message": "", "session_id": sid}

    def _close_session(self, session_id: str) -> dict[str, Any]:
        try:
            self.scheduler.sessions.close(session_id)
        except ValueError as e:
            return {"success": False, "message": str(e)}
        return {"success": True, "message": ""}

    # ---- helpers -------------------------------------------------------------------------
    def _busy_message(self, what: str, abort_all: bool) -> str | None:
        """None when idle (after aborting everything if `abort_all`), else why not."""
        reqs = self.scheduler.reqs
        if not reqs:
            return None
        if abort_all:
            self.scheduler.abort(abort_all=True)
            return None
        return (f"cannot {what} while {len(reqs)} request(s) are running or queued: wait "
                "for them to finish or pass abort_all_requests=True")

    def _weights_released(self) -> bool:
        return "weights" in self.memory.released

    def _weights_blocked(self, what: str, abort_all: bool) -> str | None:
        if self._weights_released():
            return f"cannot {what}: the weights are released; call resume_memory_occupation"
        return self._busy_message(what, abort_all)

    def _after_update(self, message: str, flush_cache: bool) -> dict[str, Any]:
        if flush_cache:
            ok, why = self.scheduler.flush_cache()
            if not ok:  # cannot happen: the scheduler was made idle first
                return _fail(f"{message}, but the cache flush failed: {why}")
        return _ok(message)

    # ---- weights ---------------------------------------------------------------------
    def _update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                  abort_all_requests: bool = False) -> dict[str, Any]:
        busy = self._weights_blocked("update weights", abort_all_requests)
        if busy:
            return _fail(busy)
        try:
            self.weights.update_from_disk(model_path, load_format)
        except WeightUpdateError as e:
            return _fail(f"failed to update weights from {model_path!r}: {e}; the previous "
                         "weights are kept")
        return self._after_update(f"updated weights from {model_path}", True)

    def _update_weights_from_tensor(self, serialized_named_tensors: bytes,
                                    load_format: str | None = None,
                                    flush_cache: bool = True,
                                    abort_all_requests: bool = False) -> dict[str, Any]:
        if load_format not in (None, "safetensors"):
            return _fail(f"load_format={load_format!r}: tensors arrive as safetensors bytes "
                         "(pass null or 'safetensors')")
        if not isinstance(serialized_named_tensors, bytes):
            return _fail("serialized_named_tensors must be safetensors bytes")
        busy = self._weights_blocked("update weights", abort_all_requests)
        if busy:
            return _fail(busy)
        try:
            named = deserialize_named_tensors(serialized_named_tensors)
            self.weights.update_from_tensors(named)
        except WeightUpdateError as e:
            return _fail(f"failed to update weights from tensors: {e}")
        return self._after_update(f"updated {len(named)} tensor(s)", flush_cache)

    def _init_weights_update_group(self, master_address: str, master_port: int,
                                   rank_offset: int, world_size: int,
                                   group_name: str = WEIGHT_UPDATE_GROUP,
                                   backend: str | None = None,
                                   timeout_s: float = 120.0) -> dict[str, Any]:
        try:
            self.weights.init_group(master_address, master_port, rank_offset, world_size,
                                    group_name, backend, timeout_s)
        except WeightUpdateError as e:
            return _fail(str(e))
        return _ok(f"joined weight update group {group_name!r}")

    def _destroy_weights_update_group(
            self, group_name: str = WEIGHT_UPDATE_GROUP) -> dict[str, Any]:
        try:
            self.weights.destroy_group(group_name)
        except WeightUpdateError as e:
            return _fail(str(e))
        return _ok(f"left weight update group {group_name!r}")

    def _update_weights_from_distributed(
            self, names: list[str], dtypes: list[str], shapes: list[list[int]],
            group_name: str = WEIGHT_UPDATE_GROUP, flush_cache: bool = True,
            abort_all_requests: bool = False) -> dict[str, Any]:
        busy = self._weights_blocked("update weights", abort_all_requests)
        if busy:
            return _fail(busy)
        try:
            self.weights.update_from_distributed(names, dtypes, shapes, group_name)
        except WeightUpdateError as e:
            return _fail(f"failed to update weights from the distributed group: {e}")
        return self._after_update(f"updated {len(names)} tensor(s) from group {group_name!r}",
                                  flush_cache)

    def _get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, Any]:
        if self._weights_released():
            return _fail("the weights are released; call resume_memory_occupation",
                         values=None)
        try:
            values = self.weights.get_weights_by_name(name, truncate_size)
        except WeightUpdateError as e:
            return _fail(str(e), values=None)
        return _ok("", values=values)

    # ---- memory ------------------------------------------------------------------------
    def _release_memory_occupation(self, tags: list[str] | None = None
                                   ) -> dict[str, Any]:
        try:
            wanted = normalize_tags(tags)
        except ValueError as e:
            return _fail(str(e))
        busy = self._busy_message("release memory", False)
        if busy:
            return _fail(busy)
        ok, why = self.scheduler.flush_cache()  # the tree indexes the KV
        if not ok:
            return _fail(why)
        done = self.memory.release(wanted)
        return _ok(f"released {', '.join(done)}" if done else "already released")

    def _resume_memory_occupation(self, tags: list[str] | None = None
                                  ) -> dict[str, Any]:
        try:
            wanted = normalize_tags(tags)
        except ValueError as e:
            return _fail(str(e))
        done = self.memory.resume(wanted)
        if done:
            self.scheduler.flush_cache()  # fresh, empty KV buffers
        return _ok(f"resumed {', '.join(done)}" if done else "nothing was released")

    # ---- profiling and logging -----------------------------------------------------------
    def _start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                       activities: list[str] | None = None,
                       with_stack: bool | None = None, record_shapes: bool | None = None,
                       profile_id: str | None = None) -> dict[str, Any]:
        try:
            path = self.profiler.start(output_dir, num_steps, activities, with_stack,
                                       record_shapes, profile_id)
        except (ValueError, OSError) as e:
            return _fail(str(e))
        return _ok(f"profiling started; the trace will be written to {path}", trace_path=path)

    def _stop_profile(self) -> dict[str, Any]:
        try:
            path = self.profiler.stop()
        except ValueError as e:
            return _fail(str(e))
        return _ok(f"trace written to {path}", trace_path=path)

    def _configure_logging(self, log_level: str | None = None) -> dict[str, Any]:
        if log_level is None:
            return _ok("log level unchanged")
        if str(log_level).lower() not in LOG_LEVELS:
            return _fail(f"log_level={log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
        logging.getLogger("radixlm").setLevel(str(log_level).upper())
        return _ok(f"log level set to {str(log_level).lower()}")
