"""Control methods of the scheduler: everything that is not generation.

`Scheduler.control(method, **args)` is the one entry point. Callers (the
offline Engine, the scheduler process on behalf of HTTP endpoints, the
data-parallel controller) name a method; only the names in
`CONTROL_METHODS` are reachable, so a peer can never call an arbitrary
attribute. Every method returns plain JSON-like data; by convention a
mutation answers `{"success": bool, "message": str, ...}`.

In tensor-parallel runs every rank executes the same control call in the
same step (rank 0 broadcasts it), so methods must be deterministic given
the scheduler's state and their arguments.
"""

from __future__ import annotations

from typing import Any

from radixlm.scheduler.runtime_control import RuntimeControlMixin

# Method name -> name of the implementing attribute on the scheduler.
CONTROL_METHODS: dict[str, str] = {
    "get_server_info": "server_info",
    "flush_cache": "_control_flush_cache",
    "check_invariants": "_control_check_invariants",
    "abort": "_control_abort",
    "open_session": "_control_open_session",
    "close_session": "_control_close_session",
    # Runtime control (scheduler/runtime_control.py).
    **{name: f"_control_{name}" for name in (
        "update_weights_from_disk", "update_weights_from_tensor", "init_weights_update_group",
        "destroy_weights_update_group", "update_weights_from_distributed", "get_weights_by_name",
        "release_memory_occupation", "resume_memory_occupation", "start_profile",
        "stop_profile", "configure_logging")},
}


class ControlMixin(RuntimeControlMixin):
    """Mixed into `Scheduler`; relies on its `flush_cache`, `abort`, ... methods."""

    def control(self, method: str, **args: Any) -> Any:
        """Run the control method `method`; raises KeyError for an unknown name and
        whatever the method raises (TypeError for bad arguments, ValueError, ...)."""
        attr = CONTROL_METHODS.get(method)
        if attr is None:
            raise KeyError(f"unknown control method {method!r}")
        return getattr(self, attr)(**args)

    def _control_flush_cache(self) -> dict[str, Any]:
        ok, message = self.flush_cache()  # type: ignore[attr-defined]
        return {"success": ok, "message": message}

    def _control_check_invariants(self) -> dict[str, Any]:
        self.check_invariants()  # type: ignore[attr-defined]
        return {"success": True}

    def _control_open_session(self, capacity_of_str_len: int,
                              session_id: str | None = None) -> dict[str, Any]:
        """SGLang's open_session; `session_id` None: the scheduler picks one
        (deterministically: callers that want a random one pass it)."""
        try:
            sid = self.sessions.open(capacity_of_str_len, session_id)  # type: ignore[attr-defined]
        except ValueError as e:
            return {"success": False, "message": str(e), "session_id": None}
        return {"success": True, "message": "", "session_id": sid}

    def _control_close_session(self, session_id: str) -> dict[str, Any]:
        try:
            self.sessions.close(session_id)  # type: ignore[attr-defined]
        except ValueError as e:
            return {"success": False, "message": str(e)}
        return {"success": True, "message": ""}

    def _control_abort(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        self.abort(rid, abort_all)  # type: ignore[attr-defined]
        return {"success": True}
