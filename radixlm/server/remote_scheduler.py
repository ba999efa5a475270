"""The offline Engine's handle on scheduler processes (tensor/data parallelism).

With one rank the Engine runs its Scheduler in-process. With several it
spawns them as the server does (radixlm/server/workers.py) and drives them
through this proxy, which offers the few Scheduler members the Engine uses:
`add_request`, `abort`, `step`, `control`, `reqs`, `has_work`, `grammars` and
the sizes. The Engine validates each call (radixlm/request_input.py) before it
gets here; grammars only by `precheck`, since this process has no compiler (one
that fails to compile in the scheduler comes back as an abort with the reason).
The Engine binds the sockets the scheduler side pushes to: token outputs
(where the server's detokenizer would read) and replies (where the
TokenizerManager would).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import weakref
from typing import Any

import zmq

from radixlm.config import ServerArgs
from radixlm.constrained.spec import precheck
from radixlm.protocol import (
    AbortReq,
    BatchTokenOut,
    ControlReply,
    ControlReq,
    GenerateReq,
    ProcessReady,
    TokenOut,
    decode_to_detokenizer,
    decode_to_tokenizer,
    encode,
)
from radixlm.sampling_params import SamplingParams
from radixlm.server.ipc import IpcPaths, pull_socket, push_socket
from radixlm.server.workers import spawn_schedulers

logger = logging.getLogger(__name__)

POLL_MS = 100
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 5.0


class GrammarPrecheck:
    """The Engine validates grammars before submitting; remotely, only the checks
    that need no compiler run here (a grammar that fails to compile comes back
    as an abort with the reason)."""

    def __init__(self, backend_name: str) -> None:
        self.backend_name = backend_name

    def validate(self, params: SamplingParams) -> None:
        precheck(params, self.backend_name)


class RemoteScheduler:
    def __init__(self, args: ServerArgs, model_dir: str) -> None:
        self.args = args
        self.paths = IpcPaths.create()
        self.ctx = zmq.Context()
        self.outputs = pull_socket(self.ctx, self.paths.detokenizer)
        self.replies = pull_socket(self.ctx, self.paths.tokenizer)
        self.to_sched = push_socket(self.ctx, self.paths.scheduler)
        self.poller = zmq.Poller()
        self.poller.register(self.outputs, zmq.POLLIN)
        self.poller.register(self.replies, zmq.POLLIN)
        self.grammars = GrammarPrecheck(args.grammar_backend)
        self.reqs: dict[str, None] = {}  # outstanding request ids
        self.control_replies: dict[int, ControlReply] = {}
        self.next_control_id = 0
        self.procs = spawn_schedulers(args, model_dir, self.paths)
        # Also on garbage collection or interpreter exit: stop the ranks, close the
        # sockets (a zmq context collected with open sockets blocks forever).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.ctx, self.paths)
        info = self._wait_ready()
        self.vocab_size: int = info["vocab_size"]
        self.context_len: int = info["context_len"]
        self.max_total_tokens: int = info["max_total_tokens"]
        self.max_running_requests: int = info["max_running_requests"]
        self.hidden_size: int = info["hidden_size"]

    def _wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_alive()
            if self.replies.poll(POLL_MS):
                msg = decode_to_tokenizer(self.replies.recv())
                if isinstance(msg, ProcessReady) and msg.process == "scheduler":
                    return msg.info
        self.shutdown()
        raise RuntimeError(f"the scheduler processes were not ready in {READY_TIMEOUT_S:.0f} s")

    def _check_alive(self) -> None:
        dead = [(n, p.exitcode) for n, p in self.procs.items() if p.exitcode is not None]
        if dead:
            self.shutdown()
            raise RuntimeError(f"the {dead[0][0]} process died with exit code {dead[0][1]}")

    # ---- the Scheduler members the Engine uses -------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        if msg.rid in self.reqs:
            raise ValueError(f"duplicate request id {msg.rid!r}")
        self.reqs[msg.rid] = None
        self.to_sched.send(encode(msg))

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.to_sched.send(encode(AbortReq(rid, abort_all)))

    @property
    def has_work(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[TokenOut]:
        """Token outputs that arrived, waiting up to POLL_MS for some."""
        outs: list[TokenOut] = []
        for sock in self._poll():
            if sock is self.outputs:
                msg = decode_to_detokenizer(sock.recv())
                assert isinstance(msg, BatchTokenOut)
                outs += msg.outputs
            else:
                self._on_reply(sock.recv())
        for out in outs:
            if out.finish_reason is not None:
                self.reqs.pop(out.rid, None)
        return outs

    def control(self, method: str, **args: Any) -> Any:
        req_id = self.next_control_id
        self.next_control_id += 1
        self.to_sched.send(encode(ControlReq(req_id, method, args)))
        while req_id not in self.control_replies:
            if self.replies.poll(POLL_MS):
                self._on_reply(self.replies.recv())
            else:
                self._check_alive()
        reply = self.control_replies.pop(req_id)
        if not reply.success:
            raise RuntimeError(f"control method {method} failed: {reply.message}")
        return reply.result

    def _poll(self) -> list[zmq.Socket]:
        events = dict(self.poller.poll(POLL_MS))
        if not events:
            self._check_alive()
        return [s for s in (self.outputs, self.replies) if s in events]

    def _on_reply(self, frame: bytes) -> None:
        msg = decode_to_tokenizer(frame)
        if isinstance(msg, ControlReply):
            self.control_replies[msg.req_id] = msg

    # ---- lifetime ------------------------------------------------------------------
    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs: dict[str, Any], ctx: zmq.Context, paths: IpcPaths) -> None:
    for proc in procs.values():
        if proc.exitcode is None and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
    for proc in procs.values():
        proc.join(STOP_TIMEOUT_S)
        if proc.exitcode is None:
            proc.kill()
            proc.join(STOP_TIMEOUT_S)
    ctx.destroy(linger=0)
    paths.cleanup()
