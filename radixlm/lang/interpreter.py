"""Program state and its executor.

`s += expr` only queues `expr`; a worker thread per state executes the queue
in order. So a program's Python code runs ahead of the model, and forks,
each with its own worker, generate at the same time (their requests meet in
one batch). Reading the state (`s["x"]`, `s.text()`, `s.fork()`) waits for
the queued work; an error in it is raised there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.lang.backend import Backend
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import Gen, Role, Select, role_begin, role_end

_STOP = object()  # ends a worker thread / a text stream


class ProgramState:
    def __init__(self, backend: Backend, defaults: dict[str, Any], stream: bool = False,
                 text: str = "") -> None:
        self.backend = backend
        self.template: ChatTemplate = backend.chat_template()
        self.defaults = defaults  # sampling params that gen() calls leave unset
        self.stream = stream
        self._text = text
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, Any] = {}
        self._messages: list[dict[str, str]] = []
        self._role: tuple[str, int] | None = None  # open role and where its content starts
        self._ops: queue.Queue[Any] = queue.Queue()
        self._events: queue.Queue[Any] = queue.Queue()  # (var name or None, text) for text_iter
        self._error: BaseException | None = None
        self._children: list[ProgramState] = []
        self._worker = threading.Thread(target=self._work, daemon=True,
                                        name="radixlm-lang-state")
        self._worker.start()

    # ---- building -----------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        self._ops.put(expr)
        return self

    @contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        self += role_begin(role)
        yield
        self += role_end(role)

    def system(self) -> Any:
        """`with s.system(): s += ...` wraps what is added inside in the role."""
        return self._role_block("system")

    def user(self) -> Any:
        return self._role_block("user")

    def assistant(self) -> Any:
        return self._role_block("assistant")

    def fork(self, n: int) -> ForkGroup:
        """n states that continue from this one's text (variables copied too)."""
        self.sync()
        forks = []
        for _ in range(n):
            child = ProgramState(self.backend, self.defaults, text=self._text)
            child._vars, child._messages = dict(self._vars), list(self._messages)
            child._role = self._role
            forks.append(child)
        self._children += forks
        return ForkGroup(self, forks, len(self._text), dict(self._vars))

    # ---- reading ------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for everything queued so far; raise the first error it hit."""
        self._ops.join()
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> BaseException | None:
        self._ops.join()
        return self._error

    def __getitem__(self, name: str) -> Any:
        self.sync()
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._vars[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self.sync()
        return self._meta[name]

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self._messages)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced (all of it, or only variable `var_name`'s);
        for a streamed run, until the program ends."""
        while True:
            item = self._events.get()
            if item is _STOP:
                self._events.put(_STOP)  # a second iterator also ends
                break
            name, chunk = item
            if var_name is None or name == var_name:
                yield chunk
        self.sync()

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text[-60:]!r}, vars={list(self._vars)})"

    # ---- ending -------------------------------------------------------------------
    def end(self) -> None:
        """Called when the program returns: finish the queue, stop the workers."""
        for child in self._children:
            child.end()
        self._ops.put(_STOP)
        self._worker.join()
        self._events.put(_STOP)

    # ---- execution (worker thread) ------------------------------------------------------
    def _work(self) -> None:
        while True:
            expr = self._ops.get()
            try:
                if expr is _STOP:
                    return
                if self._error is None:  # after an error, drain without running
                    self._exec(expr)
            except BaseException as e:
                self._error = e
            finally:
                self._ops.task_done()

    def _exec(self, expr: Any) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Role):
            self._exec_role(expr)
        elif isinstance(expr, (list, tuple)):
            for part in expr:
                self._exec(part)
        else:
            raise TypeError(f"cannot add {type(expr).__name__} to a program state; add "
                            f"str, gen(), select(), a role, or a list of them")

    def _append(self, text: str, var: str | None = None) -> None:
        self._text += text
        self._events.put((var, text))

    def _exec_role(self, expr: Role) -> None:
        if expr.marker in ("both", "begin"):
            if self._role is not None:
                raise ValueError(f"{expr.role}() inside {self._role[0]}(): roles do not nest")
            self._append(self.template.prefix(expr.role))
            self._role = (expr.role, len(self._text))
        if expr.body is not None:
            self._exec(expr.body)
        if expr.marker in ("both", "end"):
            if self._role is None or self._role[0] != expr.role:
                raise ValueError(f"{expr.role} role ended but not begun")
            self._messages.append({"role": expr.role, "content": self._text[self._role[1]:]})
            self._role = None
            self._append(self.template.suffix(expr.role))

    def _gen(self, expr: Gen) -> None:
        params = {**self.defaults, **expr.params}
        out: list[str] = []
        meta: dict[str, Any] = {}
        for chunk, last_meta in self.backend.generate(self._text, params, self.stream):
            if chunk:
                out.append(chunk)
                self._append(chunk, expr.name)
            meta = last_meta or meta
        if expr.name is not None:
            self._vars[expr.name] = "".join(out)
            self._meta[expr.name] = meta

    def _select(self, expr: Select) -> None:
        scores = self.backend.score_choices(self._text, list(expr.choices))
        best = max(range(len(scores)), key=scores.__getitem__)
        self._append(expr.choices[best], expr.name)
        if expr.name is not None:
            self._vars[expr.name] = expr.choices[best]
            self._meta[expr.name] = {"normalized_prompt_logprobs": scores,
                                     "choices": list(expr.choices)}


class ForkGroup(list):
    """The states `fork(n)` made; `join()` waits for them."""

    def __init__(self, parent: ProgramState, forks: list[ProgramState], base_len: int,
                 base_vars: dict[str, Any]) -> None:
        super().__init__(forks)
        self.parent = parent
        self.base_len = base_len  # the parent's text length when it forked
        self.base_vars = base_vars

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every fork. "gather_variable": each variable a fork set becomes
        a list (one value per fork) in the parent; "concate_and_append": the text
        the forks added is appended to the parent, fork by fork."""
        for f in self:
            f.sync()
        if mode == "gather_variable":
            names = {k for f in self for k, v in f._vars.items()
                     if k not in self.base_vars or self.base_vars[k] is not v}
            for k in sorted(names):
                self.parent.set_var(k, [f._vars.get(k) for f in self])
        elif mode == "concate_and_append":
            self.parent += "".join(f._text[self.base_len:] for f in self)
            self.parent.sync()
        else:
            raise ValueError(f"join mode must be gather_variable or concate_and_append, "
                             f"got {mode!r}")
