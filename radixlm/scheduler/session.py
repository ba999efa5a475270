"""Sessions: requests that continue the context of an earlier request.

SGLang's session API. `open_session` creates a session; a generate request
whose `session_params` are `{"id": sid, "rid": prev}` runs on the previous
request's prompt + output ids followed by its own input ids, so a client
never re-sends the conversation. The KV is reused through the prefix cache:
a finished request's computed tokens are inserted into the radix tree when
its KV is released (`KVManager.release`), and the continuation's prompt
starts with exactly those tokens. Without the cache the context is
recomputed; the result is the same.

Each session keeps the tree of its requests (a request's parent is the one
it continued), as SGLang's `SessionController` does:

- `{"id": sid}` (no rid): a request with no history, a root of the tree.
- `rid`: continue that request, which must have finished (else refused).
  `offset` cuts the context at that position first (a Python slice end;
  0 and None mean the whole context, as in SGLang), and
  `drop_previous_output` uses the previous prompt without its output.
- `replace=True` with `rid`: the new request replaces everything that
  continued `rid` (those requests are aborted if still running and leave
  the session) and may continue `rid` even while it runs (it is then
  aborted and its output so far is the context).
- `replace=True` without `rid`: the session's whole history is dropped.

`capacity_of_str_len` bounds the input of every request of the session, in
tokens (the session's context length); 0 means no bound beyond the model's
context, since clients written for SGLang (which does not enforce it) send 0.

Everything here is deterministic given the scheduler's state and the
messages (tensor-parallel ranks run it in lockstep): no clocks, no OS
randomness (ids the caller does not choose come from a seeded generator).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.scheduler.req import Req

MAX_SESSIONS = 1 << 16  # bounds the bookkeeping a client can make the scheduler hold
MAX_SESSION_ID_LEN = 256


@dataclass(frozen=True)
class SessionParams:
    """A generate request's `session_params`, type-checked."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionParams:
        """Raises ValueError naming the bad field; unknown keys are ignored (newer
        SGLang clients send more)."""
        sid = d.get("id")
        if not isinstance(sid, str) or not sid:
            raise ValueError("session_params.id must be the session id that open_session "
                             "returned")
        rid = d.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise ValueError("session_params.rid must be a request id (string) or null")
        offset = d.get("offset")
        if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
            raise ValueError("session_params.offset must be an integer or null")
        flags = {}
        for name in ("replace", "drop_previous_output"):
            value = d.get(name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"session_params.{name} must be a boolean or null")
            flags[name] = bool(value)
        return cls(sid, rid, offset, **flags)


@dataclass(eq=False)
class _Node:
    req: Req
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)


@dataclass(frozen=True)
class Continuation:
    """A checked session request: its full input ids and where it attaches.
    `SessionController.commit` applies it once the request is accepted."""

    session: Session
    params: SessionParams
    parent: _Node | None
    input_ids: list[int]


class Session:
    def __init__(self, session_id: str, capacity: int) -> None:
        self.id = session_id
        self.capacity = capacity
        self.nodes: dict[str, _Node] = {}  # rid -> node, insertion order (deterministic)

    def continuation(self, rid: str, params: SessionParams, new_ids: list[int],
                     bos_id: int | None) -> Continuation:
        """The input of request `rid` under `params`; raises ValueError, changing nothing."""
        if rid in self.nodes:
            raise ValueError(f"request id {rid!r} was already used in session {self.id!r}")
        parent = None if params.rid is None else self.nodes.get(params.rid)
        if params.rid is not None and parent is None:
            raise ValueError(f"request {params.rid!r} is not part of session {self.id!r}")
        ids = list(new_ids)
        if parent is not None:
            ids = self._context(parent.req, params) + _strip_bos(ids, bos_id)
        if self.capacity and len(ids) > self.capacity:
            raise ValueError(f"the request's input in session {self.id!r} would be {len(ids)} "
                             f"tokens, more than the session's capacity_of_str_len of "
                             f"{self.capacity}")
        return Continuation(self, params, parent, ids)

    def _context(self, prev: Req, params: SessionParams) -> list[int]:
        if not prev.finished and not params.replace:
            raise ValueError(f"request {prev.rid!r} of session {self.id!r} has not finished: "
                             f"continue it once it has (or pass replace=true to abort it)")
        context = list(prev.origin_input_ids)
        if not params.drop_previous_output:
            context += prev.output_ids[:prev.sampling_params.max_new_tokens]
        if params.offset:  # 0 and None: the whole context (SGLang's reading)
            if not -len(context) <= params.offset <= len(context):
                raise ValueError(f"session_params.offset {params.offset} is outside the "
                                 f"previous context of {len(context)} tokens")
            context = context[:params.offset]
        return context

    def drop_subtree(self, node: _Node, abort: Callable[[str], None]) -> None:
        """Remove `node` and its descendants, aborting those still running."""
        for child in node.children:
            self.drop_subtree(child, abort)
        node.children = []
        if not node.req.finished:
            abort(node.req.rid)
        self.nodes.pop(node.req.rid, None)


class SessionController:
    """The scheduler's open sessions."""

    def __init__(self, seed: int, bos_id: int | None) -> None:
        self.sessions: dict[str, Session] = {}
        self.bos_id = bos_id  # stripped from a continuation's input: the context has one
        self._ids = random.Random(f"radixlm-sessions-{seed}")

    def open(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """Open a session and return its id; ValueError on a bad capacity or id, an id
        already open, or too many open sessions."""
        if not isinstance(capacity_of_str_len, int) or isinstance(capacity_of_str_len, bool) \
                or capacity_of_str_len < 0:
            raise ValueError(f"capacity_of_str_len must be an integer >= 0 (0: no limit), got "
                             f"{capacity_of_str_len!r}")
        if session_id is None:
            session_id = f"{self._ids.getrandbits(128):032x}"
        if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
            raise ValueError(f"session_id must be a string of 1 to {MAX_SESSION_ID_LEN} "
                             f"characters")
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        if len(self.sessions) >= MAX_SESSIONS:
            raise ValueError(f"too many open sessions ({MAX_SESSIONS}): close some first")
        self.sessions[session_id] = Session(session_id, capacity_of_str_len)
        return session_id

    def close(self, session_id: str) -> None:
        """Forget the session. Its running requests finish normally; their KV is
        released by the scheduler as for any request (nothing is freed here)."""
        if self.sessions.pop(session_id, None) is None:
            raise ValueError(f"session {session_id!r} is not open")

    def continuation(self, rid: str, session_params: dict[str, Any],
                     new_ids: list[int]) -> Continuation:
        """Check a session request; raises ValueError (unknown or closed session,
        unknown or unfinished previous request, capacity), changing nothing."""
        params = SessionParams.from_dict(session_params)
        session = self.sessions.get(params.id)
        if session is None:
            raise ValueError(f"session {params.id!r} is not open (unknown or closed)")
        return session.continuation(rid, params, new_ids, self.bos_id)

    @staticmethod
    def commit(cont: Continuation, req: Req, abort: Callable[[str], None]) -> None:
        """Attach the accepted request to its session; apply `replace` (aborting the
        requests it supersedes through `abort(rid)`)."""
        session, parent = cont.session, cont.parent
        if cont.params.replace:
            if parent is None:
                for node in [n for n in session.nodes.values() if n.parent is None]:
                    session.drop_subtree(node, abort)
            else:
                for child in parent.children:
                    session.drop_subtree(child, abort)
                parent.children = []
                if not parent.req.finished:
                    abort(parent.req.rid)
        node = _Node(req, parent)
        if parent is not None:
            parent.children.append(node)
        session.nodes[req.rid] = node


def auto_bos_id(tokenizer: Any) -> int | None:
    """The BOS id if the tokenizer prepends it to every encoding (then a
    continuation's own BOS is dropped, as SGLang does), else None: a BOS id
    that is also an ordinary token (SmolLM2's <|im_start|>) must stay."""
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if bos is None:
        return None
    try:
        return bos if tokenizer.encode("a")[:1] == [bos] else None
    except Exception:  # an exotic tokenizer: never strip
        return None


def _strip_bos(ids: list[int], bos_id: int | None) -> list[int]:
    return ids[1:] if bos_id is not None and ids[:1] == [bos_id] else ids
