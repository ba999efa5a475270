"""The TokenizerManager: the asyncio front end of the scheduler process.

It turns each API call into a `request_input.GenerateInput`, validates it once
(as the offline Engine does; see radixlm/request_input.py), runs the n > 1
warm-up, sends the requests to the scheduler, and routes the detokenizer's
text back to the API call that owns them. One API call is one `RequestGroup`;
its sequences are numbered input-major (prompt i, sample j -> i * n + j), the
`index` the APIs report. Grammars are only prechecked here (no compiler in
this process): one that fails to compile comes back from the scheduler as a
400 abort.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from radixlm.config import ServerArgs
from radixlm.constrained.spec import precheck
from radixlm.protocol import (
    AbortReq,
    BatchStrOut,
    ControlReply,
    ControlReq,
    GenerateReq,
    ProcessReady,
    StrOut,
    TokenOut,
    decode_to_tokenizer,
    encode,
)
from radixlm.request_input import GenerateInput, Limits, PromptJob, new_id
from radixlm.sampling_params import SamplingParams
from radixlm.server.errors import APIError, from_value_error
from radixlm.server.io import SeqOutput
from radixlm.server.ipc import IpcPaths, pull_socket, push_socket
from radixlm.server.request_dump import RequestDumper
from radixlm.server.update_gate import UpdateGate

logger = logging.getLogger(__name__)

CHILDREN = ("scheduler", "detokenizer")
# The parameters a validation message may start with (they name the 400's `param`).
SAMPLING_NAMES = {f for f in SamplingParams.__dataclass_fields__}


@dataclass
class RequestGroup:
    """The sequences of one API call and the queue their progress arrives on."""

    gid: str
    seqs: list[SeqOutput]
    # Every id /abort_request may name (the call's, each prompt's, each sample's)
    # -> the sequences it covers.
    members: dict[str, list[int]]
    internal: bool = False  # warm-up and health probes stay out of the metrics
    stream: bool = False  # only streamed sequences report per-token timing
    created: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue[tuple[int, StrOut]] = field(default_factory=asyncio.Queue)
    unfinished: int = 0
    first_token_at: dict[int, float] = field(default_factory=dict)
    last_token_at: dict[int, float] = field(default_factory=dict)
    manager: TokenizerManager | None = None

    async def events(self) -> AsyncIterator[tuple[int, StrOut]]:
        """(index, message) until every sequence finished. Leaving early (client
        gone, cancellation) aborts what is still running, freeing its KV."""
        try:
            while any(not s.finished for s in self.seqs):
                idx, out = await self.queue.get()
                self.seqs[idx].update(out)
                yield idx, out
        finally:
            if self.manager is not None and any(not s.finished for s in self.seqs):
                self.manager.abort_group(self)

    async def collect(self) -> list[SeqOutput]:
        """Wait for all sequences; a refused or failed one raises its APIError."""
        async for _ in self.events():
            pass
        raise_if_failed(self.seqs)
        return self.seqs


def raise_if_failed(seqs: list[SeqOutput]) -> None:
    for s in seqs:
        if s.error_status is not None:
            raise APIError(s.error_status, s.error_message)


_T = TypeVar("_T")


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer: Any, paths: IpcPaths,
                 metrics: Any = None) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.actx = zmq.asyncio.Context()
        self.recv_sock = pull_socket(self.actx, paths.tokenizer)
        # Sends go through a plain socket: they never block (no HWM) and can be
        # made from `finally` blocks of cancelled tasks, where awaiting is unsafe.
        self.sctx = zmq.Context()
        self.to_scheduler = push_socket(self.sctx, paths.scheduler)
        self.aliases: dict[str, RequestGroup] = {}
        self.seq_owner: dict[str, tuple[RequestGroup, int]] = {}
        self.control_futures: dict[int, asyncio.Future[ControlReply]] = {}
        self.control_ids = itertools.count()
        self.ready_msgs: dict[str, ProcessReady] = {}
        self.ready = asyncio.Event()
        self.limits: Limits | None = None
        self.accepting = True
        self.dead_reason: str | None = None
        self.recv_task: asyncio.Task[None] | None = None
        # Runtime control (server/control_api.py): weight updates pause admission here;
        # finished requests are dumped with --dump-requests-folder.
        self.update_gate = UpdateGate()
        self.dumper = RequestDumper(args.dump_requests_folder, args.dump_requests_threshold)
        # Prompt encoding and chat templates run here, off the event loop (below).
        self.tokenize_thread = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="radixlm-tokenize")

    async def tokenize(self, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args) (encoding prompts, rendering chat templates) on the one tokenizer
        thread. A long prompt then does not stall the event loop that streams every
        other request's tokens; one thread keeps encodes serialized. HF fast
        tokenizers release the GIL while encoding and take only shared borrows of
        their Rust state unless truncation/padding settings change, which they do
        not after the start-up warm-up, so decodes on the loop may run meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize_thread, functools.partial(fn, *args))

    # ---- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self.recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def close(self) -> None:
        self.dumper.close()
        self.tokenize_thread.shutdown(wait=False, cancel_futures=True)
        if self.recv_task is not None:
            self.recv_task.cancel()
        self.recv_sock.close(linger=0)
        self.to_scheduler.close(linger=0)
        self.actx.term()
        self.sctx.term()

    @property
    def num_live_seqs(self) -> int:
        return len(self.seq_owner)

    @property
    def num_tracked_ids(self) -> int:
        """Request ids (groups and their aliases) still mapped: 0 when idle, or
        finished requests are leaking here."""
        return len(self.aliases)

    @property
    def child_pids(self) -> dict[str, int]:
        return {name: msg.pid for name, msg in self.ready_msgs.items()}

    async def _recv_loop(self) -> None:
        while True:
            data = await self.recv_sock.recv()
            try:
                self._handle(decode_to_tokenizer(data), time.monotonic())
            except Exception:  # one bad message must not stop every other request
                logger.exception("failed to handle a message from a child process")

    def _handle(self, msg: Any, received: float = 0.0) -> None:
        if isinstance(msg, BatchStrOut):
            for out in msg.outputs:
                if out.token.timing is not None:
                    out.token.timing["api_recv"] = received
                self._dispatch(out)
        elif isinstance(msg, ControlReply):
            fut = self.control_futures.pop(msg.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, ProcessReady):
            self._on_ready(msg)

    def _on_ready(self, msg: ProcessReady) -> None:
        self.ready_msgs[msg.process] = msg
        if msg.process == "scheduler":
            self.limits = Limits.from_info(msg.info)
        if all(name in self.ready_msgs for name in CHILDREN):
            self.ready.set()

    def _dispatch(self, out: StrOut) -> None:
        owner = self.seq_owner.get(out.token.rid)
        if owner is None:
            return  # a sequence whose group already ended (e.g. failed elsewhere)
        group, idx = owner
        self.dumper.on_output(out)
        now = time.monotonic()
        if out.token.new_token_ids:
            self._record_timing(group, idx, len(out.token.new_token_ids), now)
        finish = out.token.finish_reason
        group.queue.put_nowait((idx, out))
        if finish is None:
            return
        del self.seq_owner[out.token.rid]
        if finish.get("status_code") == 500:
            self._send(AbortReq(rid=out.token.rid))  # e.g. the detokenizer gave up on it
        group.unfinished -= 1
        if self.metrics is not None and not group.internal:
            self.metrics.on_finish(out.token, now - group.created, finish.get("type", ""))
        if group.unfinished == 0:
            self._forget(group)

    def _record_timing(self, group: RequestGroup, idx: int, n_tokens: int, now: float) -> None:
        if self.metrics is None or group.internal or not group.stream:
            return
        if idx not in group.first_token_at:
            group.first_token_at[idx] = now
            self.metrics.on_first_token(now - group.created)
        else:
            self.metrics.on_tokens(now - group.last_token_at[idx], n_tokens)
        group.last_token_at[idx] = now

    def _forget(self, group: RequestGroup) -> None:
        for alias in group.members:
            if self.aliases.get(alias) is group:
                del self.aliases[alias]

    # ---- requests -----------------------------------------------------------------
    def new_id(self, prefix: str = "") -> str:
        return new_id(prefix)

    def check_grammar(self, params: SamplingParams) -> None:
        precheck(params, self.args.grammar_backend)

    def require_limits(self) -> Limits:
        if self.limits is None or self.dead_reason is not None:
            raise APIError(503, self.dead_reason or "the server is still starting")
        return self.limits

    def check_admission(self, num_new: int) -> None:
        if not self.accepting:
            raise APIError(503, "the server is shutting down")
        limits = self.require_limits()
        limit = self.args.max_queued_requests
        if limit is None:
            return
        queued = max(0, self.num_live_seqs - limits.max_running_requests)
        if queued + num_new > limit:
            raise APIError(503, f"the server is overloaded: {queued} requests queued, "
                                f"--max-queued-requests is {limit}")

    async def submit(self, jobs: list[PromptJob], *, gid: str, stream: bool = False,
                     return_logprob: bool = False, top_logprobs_num: int = 0,
                     logprob_start_len: int = -1, internal: bool = False,
                     timing: dict[str, float] | None = None) -> RequestGroup:
        """Validate, warm shared prompts (n > 1), send; the caller then reads
        `group.events()` or `group.collect()`. Bad input raises a 400 APIError.
        `timing`: the caller's stamps so far; each sequence then collects the
        stamps of its way to its first output (`SeqOutput.timing`)."""
        call = GenerateInput(gid, jobs, stream=stream, return_logprob=return_logprob,
                             top_logprobs_num=top_logprobs_num,
                             logprob_start_len=logprob_start_len,
                             return_timing=timing is not None)
        limits = self.require_limits()
        try:
            call.validate(limits, self.check_grammar,
                          priority_scheduling=self.args.enable_priority_scheduling)
        except ValueError as e:
            raise from_value_error(e, SAMPLING_NAMES) from None
        members = call.members()
        *warmups, reqs = call.stages(radix_cache=not self.args.disable_radix_cache)
        frames = [encode_request(r) for r in reqs]  # may refuse: nothing is registered yet
        self._admit(list(members), len(reqs))
        await self.update_gate.wait_open()  # a weight update is running: wait for it
        for stage in warmups:
            await self._warm_up(stage)
            # Again: other calls ran during the warm-up. Without the second admission
            # check, calls admitted meanwhile overfill the queue, and the scheduler
            # refuses some samples of a call whose stream has already started.
            self._admit(list(members), len(reqs))
        group = self._start(gid, reqs, frames, members, stream=stream,
                            return_logprob=return_logprob, internal=internal, timing=timing)
        if not internal:
            self.dumper.on_submit(reqs)
        return group

    def _admit(self, ids: list[str], num_new: int) -> None:
        for rid in ids:
            if rid in self.aliases or rid in self.seq_owner:
                raise APIError(400, f"request id {rid!r} is already in use", "rid")
        self.check_admission(num_new)

    def _start(self, gid: str, reqs: list[GenerateReq], frames: list[bytes],
               members: dict[str, list[int]], *, stream: bool, return_logprob: bool,
               internal: bool, timing: dict[str, float] | None = None) -> RequestGroup:
        """Register the group and send its frames (reqs[i] is sequence i)."""
        if timing is not None:
            timing = {**timing, "sent": time.monotonic()}
        seqs = [SeqOutput(rid=r.rid, index=i, return_logprob=return_logprob,
                          prompt_tokens=len(r.input_ids),
                          timing=dict(timing) if timing is not None else None)
                for i, r in enumerate(reqs)]
        group = RequestGroup(gid, seqs, members, internal=internal, stream=stream,
                             manager=self, unfinished=len(reqs))
        self._register(group)
        for frame in frames:
            self._send_frame(frame)
        return group

    def _register(self, group: RequestGroup) -> None:
        for alias in group.members:
            self.aliases[alias] = group
        for i, s in enumerate(group.seqs):
            self.seq_owner[s.rid] = (group, i)

    async def _warm_up(self, reqs: list[GenerateReq]) -> None:
        """Run the prefill-only warm-ups to completion. Any failure here (a 400 the
        scheduler found) is the call's failure."""
        gid = new_id("warm-")
        members = {gid: list(range(len(reqs))), **{r.rid: [i] for i, r in enumerate(reqs)}}
        group = self._start(gid, reqs, [encode_request(r) for r in reqs], members,
                            stream=False, return_logprob=False, internal=True)
        await group.collect()

    def abort_group(self, group: RequestGroup, indices: list[int] | None = None) -> None:
        for i in range(len(group.seqs)) if indices is None else indices:
            rid = group.seqs[i].rid
            if rid in self.seq_owner:
                self._send(AbortReq(rid=rid))

    def abort(self, rid: str | None = None, abort_all: bool = False) -> bool:
        """True when something was aborted (or abort_all was sent)."""
        if abort_all:
            self._send(AbortReq(abort_all=True))
            return True
        group = self.aliases.get(rid or "")
        if group is None:
            return False
        self.abort_group(group, group.members[rid or ""])
        return True

    def _send(self, msg: Any) -> None:
        self._send_frame(encode(msg))

    def _send_frame(self, frame: bytes) -> None:
        try:
            self.to_scheduler.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.error("could not send to the scheduler: %s", e)

    # ---- control calls --------------------------------------------------------------
    async def control(self, method: str, timeout: float = 30.0, **args: Any) -> ControlReply:
        self.require_limits()
        req_id = next(self.control_ids)
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self.control_futures[req_id] = fut
        self._send(ControlReq(req_id=req_id, method=method, args=args))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise APIError(503, f"the scheduler did not answer {method} within "
                                f"{timeout:.0f} s") from None
        finally:
            self.control_futures.pop(req_id, None)

    # ---- failure ---------------------------------------------------------------------
    def fail_all(self, message: str, status: int = 503) -> None:
        """A child died: end every live sequence with an error, never silence."""
        self.dead_reason = message
        for rid, (group, idx) in list(self.seq_owner.items()):
            tok = TokenOut(rid=rid, new_token_ids=[], prompt_tokens=group.seqs[idx].prompt_tokens,
                           completion_tokens=group.seqs[idx].completion_tokens,
                           cached_tokens=group.seqs[idx].cached_tokens,
                           finish_reason={"type": "abort", "message": message,
                                          "status_code": status})
            self._dispatch(StrOut(token=tok, new_text=""))
        for fut in self.control_futures.values():
            if not fut.done():
                fut.set_exception(APIError(status, message))


def encode_request(req: GenerateReq) -> bytes:
    """The wire frame of one request. msgpack holds 64-bit integers only, and
    validation lets some larger ones through (a seed or top_k of 10**30): that
    is the client's 400. It used to surface as a 500 after the request was
    registered, leaving a sequence that never finished (a drain waited on it,
    and it counted against --max-queued-requests forever)."""
    try:
        return encode(req)
    except OverflowError as e:
        raise APIError(400, f"an integer in the request is out of range ({e})") from None
