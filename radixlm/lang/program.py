"""`@function` programs, their runs, and the default backend."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixlm.lang.backend import Backend, EngineBackend
from radixlm.lang.interpreter import ProgramState

_default_backend: Backend | None = None
_lock = threading.Lock()
# Sampling defaults a run may set for the gen() calls that leave them unset.
RUN_DEFAULTS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                "frequency_penalty", "presence_penalty", "seed")


def as_backend(backend: Any) -> Backend:
    """A Backend as is; a `radixlm.Engine` wrapped (one EngineBackend per engine,
    so all programs on it share one driver thread and their batches)."""
    if isinstance(backend, Backend):
        return backend
    if hasattr(backend, "scheduler") and hasattr(backend, "tokenizer"):
        with _lock:
            if getattr(backend, "_lang_backend", None) is None:
                backend._lang_backend = EngineBackend(backend)
            return backend._lang_backend
    raise TypeError(f"expected a Backend (RuntimeEndpoint, EngineBackend) or a radixlm.Engine, "
                    f"got {type(backend).__name__}")


def set_default_backend(backend: Any) -> None:
    global _default_backend
    _default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend


class SglFunction:
    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Call the program on an existing state (one program inside another)."""
        return self.func(s, *args, **kwargs)

    def run(self, *args: Any, backend: Any = None, stream: bool = False,
            max_new_tokens: int = 128, **kwargs: Any) -> ProgramState:
        """Run once. Keyword arguments named in RUN_DEFAULTS are sampling defaults;
        the rest go to the program. `stream=True` returns at once: read the text
        with `state.text_iter()`."""
        defaults, program_kwargs = _split_defaults({"max_new_tokens": max_new_tokens, **kwargs})
        state = ProgramState(_resolve(backend), defaults, stream=stream)
        if stream:
            threading.Thread(target=self._execute, args=(state, args, program_kwargs, False),
                             daemon=True, name="radixlm-lang-program").start()
            return state
        self._execute(state, args, program_kwargs, raise_errors=True)
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None,
                  num_threads: int | str = "auto", max_new_tokens: int = 128,
                  **defaults: Any) -> list[ProgramState]:
        """Run once per argument dict, `num_threads` programs at a time (their
        requests batch together). A failed program's state raises its error when
        read."""
        sampling, rest = _split_defaults({"max_new_tokens": max_new_tokens, **defaults})
        if rest:
            raise TypeError(f"run_batch() got unknown keyword(s): {', '.join(sorted(rest))}; "
                            f"program arguments go in batch_kwargs")
        be = _resolve(backend)
        threads = min(len(batch_kwargs), 64) if num_threads == "auto" else int(num_threads)
        states = [ProgramState(be, sampling) for _ in batch_kwargs]
        with ThreadPoolExecutor(max(threads, 1), thread_name_prefix="radixlm-lang") as pool:
            list(pool.map(lambda sk: self._execute(sk[0], (), sk[1], False),
                          zip(states, batch_kwargs)))
        return states

    def _execute(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any],
                 raise_errors: bool) -> None:
        try:
            self.func(state, *args, **kwargs)
        except BaseException as e:
            if raise_errors:
                raise
            state._error = state._error or e
        finally:
            state.end()
        if raise_errors:
            state.sync()


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator: `@function def prog(s, question): s += ...`."""
    if func is None:
        return SglFunction
    return SglFunction(func)


def _resolve(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise RuntimeError("no backend: call set_default_backend(...) or pass backend=")
    return _default_backend


def _split_defaults(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    sampling = {k: v for k, v in kwargs.items() if k in RUN_DEFAULTS and v is not None}
    return sampling, {k: v for k, v in kwargs.items() if k not in RUN_DEFAULTS}
