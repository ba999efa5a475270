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

# Method name -> name of the implementing attribute on the scheduler.
CONTROL_METHODS: dict[str, str] = {
    "get_server_info": "server_info",
    "flush_cache": "_control_flush_cache",
    "check_invariants": "_control_check_invariants",
    "abort": "_control_abort",
}


class ControlMixin:
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

    def _control_abort(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        self.abort(rid, abort_all)  # type: ignore[attr-defined]
        return {"success": True}
