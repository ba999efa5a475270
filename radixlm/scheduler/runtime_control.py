"""Runtime control methods of the scheduler (issue 8): weight updates, weights
by name, memory release/resume, profiling, log level.

Reached only through `Scheduler.control` (names in control.py's
`CONTROL_METHODS`). Arguments and results are plain data (safetensors bytes
for tensors); every method answers `{"success": bool, "message": str, ...}`
and reports bad input as success False with the reason rather than raising.
The model-touching work is per model runner, so with tensor parallelism each
rank runs the same call on its own shard.

Weight updates need the scheduler idle: with requests queued or running they
are refused unless `abort_all_requests=True` (the HTTP front end first pauses
admission and waits for running requests, as SGLang does). On success the
prefix cache is flushed (its KV came from the old weights).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixlm.config import LOG_LEVELS, WEIGHT_UPDATE_GROUP

if TYPE_CHECKING:
    from radixlm.runtime.memory_occupation import MemoryOccupation
    from radixlm.runtime.profiler import Profiler
    from radixlm.runtime.weight_updater import WeightUpdater



def _ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def _fail(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": False, "message": message, **extra}


class RuntimeControlMixin:
    """Mixed into `Scheduler` through ControlMixin; uses its `runner`, `reqs`,
    `args`, `abort` and `flush_cache`."""

    runner: Any
    reqs: dict[str, Any]
    args: Any

    # ---- per-scheduler helpers, created on first use ----------------------------------
    def _runtime_part(self, key: str, factory: Any) -> Any:
        # Lazily, so Scheduler.__init__ (shared with colleagues' work) needs no edit.
        part = self.__dict__.get(key)
        if part is None:
            part = self.__dict__[key] = factory()
        return part

    @property
    def weight_updater(self) -> WeightUpdater:
        from radixlm.runtime.weight_updater import WeightUpdater

        r = self.runner
        return self._runtime_part("_weight_updater", lambda: WeightUpdater(
            r.model, r.config, r.device, self.args.model_path))

    @property
    def memory(self) -> MemoryOccupation:
        from radixlm.runtime.memory_occupation import MemoryOccupation

        return self._runtime_part("_memory_occupation", lambda: MemoryOccupation(self.runner))

    @property
    def profiler(self) -> Profiler:
        from radixlm.runtime.profiler import Profiler

        return self._runtime_part("_profiler", lambda: Profiler(self.runner.device))

    def check_accepting(self) -> None:
        """Raises ValueError while memory is released (generation needs it back)."""
        part = self.__dict__.get("_memory_occupation")
        if part is not None and part.is_released:
            released = ", ".join(sorted(part.released))
            raise ValueError(f"the server has released its memory ({released}): call "
                             "resume_memory_occupation before generating")

    def profile_step(self) -> None:
        """After every scheduler step: lets a `num_steps` profile stop by itself."""
        part = self.__dict__.get("_profiler")
        if part is not None and part.active:
            part.step()

    def _busy_message(self, what: str, abort_all: bool) -> str | None:
        """None when idle (after aborting everything if `abort_all`), else why not."""
        if not self.reqs:
            return None
        if abort_all:
            self.abort(abort_all=True)  # type: ignore[attr-defined]
            return None
        return (f"cannot {what} while {len(self.reqs)} request(s) are running or queued: wait "
                "for them to finish or pass abort_all_requests=True")

    def _weights_released(self) -> bool:
        part = self.__dict__.get("_memory_occupation")
        return part is not None and "weights" in part.released

    def _weights_blocked(self, what: str, abort_all: bool) -> str | None:
        if self._weights_released():
            return f"cannot {what}: the weights are released; call resume_memory_occupation"
        return self._busy_message(what, abort_all)

    def _after_update(self, message: str, flush_cache: bool) -> dict[str, Any]:
        if flush_cache:
            ok, why = self.flush_cache()  # type: ignore[attr-defined]
            if not ok:  # cannot happen: the scheduler was made idle first
                return _fail(f"{message}, but the cache flush failed: {why}")
        return _ok(message)

    # ---- weights ---------------------------------------------------------------------
    def _control_update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                          abort_all_requests: bool = False) -> dict[str, Any]:
        from radixlm.runtime.weight_updater import WeightUpdateError

        busy = self._weights_blocked("update weights", abort_all_requests)
        if busy:
            return _fail(busy)
        try:
            self.weight_updater.update_from_disk(model_path, load_format)
        except WeightUpdateError as e:
            return _fail(f"failed to update weights from {model_path!r}: {e}; the previous "
                         "weights are kept")
        return self._after_update(f"updated weights from {model_path}", True)

    def _control_update_weights_from_tensor(self, serialized_named_tensors: bytes,
                                            load_format: str | None = None,
                                            flush_cache: bool = True,
                                            abort_all_requests: bool = False) -> dict[str, Any]:
        from radixlm.runtime.weight_updater import WeightUpdateError, deserialize_named_tensors

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
            self.weight_updater.update_from_tensors(named)
        except WeightUpdateError as e:
            return _fail(f"failed to update weights from tensors: {e}")
        return self._after_update(f"updated {len(named)} tensor(s)", flush_cache)

    def _control_init_weights_update_group(self, master_address: str, master_port: int,
                                           rank_offset: int, world_size: int,
                                           group_name: str = WEIGHT_UPDATE_GROUP,
                                           backend: str | None = None,
                                           timeout_s: float = 120.0) -> dict[str, Any]:
        from radixlm.runtime.weight_updater import WeightUpdateError

        try:
            self.weight_updater.init_group(master_address, master_port, rank_offset, world_size,
                                           group_name, backend, timeout_s)
        except WeightUpdateError as e:
            return _fail(str(e))
        return _ok(f"joined weight update group {group_name!r}")

    def _control_destroy_weights_update_group(
            self, group_name: str = WEIGHT_UPDATE_GROUP) -> dict[str, Any]:
        from radixlm.runtime.weight_updater import WeightUpdateError

        try:
            self.weight_updater.destroy_group(group_name)
        except WeightUpdateError as e:
            return _fail(str(e))
        return _ok(f"left weight update group {group_name!r}")

    def _control_update_weights_from_distributed(
            self, names: list[str], dtypes: list[str], shapes: list[list[int]],
            group_name: str = WEIGHT_UPDATE_GROUP, flush_cache: bool = True,
            abort_all_requests: bool = False) -> dict[str, Any]:
        from radixlm.runtime.weight_updater import WeightUpdateError

        busy = self._weights_blocked("update weights", abort_all_requests)
        if busy:
            return _fail(busy)
        try:
            self.weight_updater.update_from_distributed(names, dtypes, shapes, group_name)
        except WeightUpdateError as e:
            return _fail(f"failed to update weights from the distributed group: {e}")
        return self._after_update(f"updated {len(names)} tensor(s) from group {group_name!r}",
                                  flush_cache)

    def _control_get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, Any]:
        from radixlm.runtime.weight_updater import WeightUpdateError

        if self._weights_released():
            return _fail("the weights are released; call resume_memory_occupation",
                         values=None)
        try:
            values = self.weight_updater.get_weights_by_name(name, truncate_size)
        except WeightUpdateError as e:
            return _fail(str(e), values=None)
        return _ok("", values=values)

    # ---- memory ------------------------------------------------------------------------
    def _control_release_memory_occupation(self, tags: list[str] | None = None
                                           ) -> dict[str, Any]:
        from radixlm.runtime.memory_occupation import normalize_tags

        try:
            wanted = normalize_tags(tags)
        except ValueError as e:
            return _fail(str(e))
        busy = self._busy_message("release memory", False)
        if busy:
            return _fail(busy)
        ok, why = self.flush_cache()  # type: ignore[attr-defined]  # the tree indexes the KV
        if not ok:
            return _fail(why)
        done = self.memory.release(wanted)
        return _ok(f"released {', '.join(done)}" if done else "already released")

    def _control_resume_memory_occupation(self, tags: list[str] | None = None
                                          ) -> dict[str, Any]:
        from radixlm.runtime.memory_occupation import normalize_tags

        try:
            wanted = normalize_tags(tags)
        except ValueError as e:
            return _fail(str(e))
        done = self.memory.resume(wanted)
        if done:
            self.flush_cache()  # type: ignore[attr-defined]  # fresh, empty KV buffers
        return _ok(f"resumed {', '.join(done)}" if done else "nothing was released")

    # ---- profiling and logging -----------------------------------------------------------
    def _control_start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                               activities: list[str] | None = None,
                               with_stack: bool | None = None, record_shapes: bool | None = None,
                               profile_id: str | None = None) -> dict[str, Any]:
        try:
            path = self.profiler.start(output_dir, num_steps, activities, with_stack,
                                       record_shapes, profile_id)
        except (ValueError, OSError) as e:
            return _fail(str(e))
        return _ok(f"profiling started; the trace will be written to {path}", trace_path=path)

    def _control_stop_profile(self) -> dict[str, Any]:
        try:
            path = self.profiler.stop()
        except ValueError as e:
            return _fail(str(e))
        return _ok(f"trace written to {path}", trace_path=path)

    def _control_configure_logging(self, log_level: str | None = None) -> dict[str, Any]:
        if log_level is None:
            return _ok("log level unchanged")
        if str(log_level).lower() not in LOG_LEVELS:
            return _fail(f"log_level={log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
        logging.getLogger("radixlm").setLevel(str(log_level).upper())
        return _ok(f"log level set to {str(log_level).lower()}")
