"""The scheduler process: the I/O-free `Scheduler` behind two ZMQ sockets.

Loop: block on the request socket while idle (no busy spin), drain every
pending message without blocking while busy, run one `step()`, push its
token outputs to the detokenizer. A request whose handling fails gets an
error finish (HTTP status inside) and the loop goes on; a failure inside
`step()` leaves the batch state unknown, so it is fatal: log it and exit
non-zero, and the parent's watchdog takes the server down.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import zmq

from radixlm.config import ServerArgs
from radixlm.protocol import (
    AbortReq,
    BatchTokenOut,
    ControlReply,
    ControlReq,
    GenerateReq,
    LoadReport,
    ProcessReady,
    TokenOut,
    decode_to_scheduler,
    encode,
)
from radixlm.server.ipc import (
    IpcPaths,
    exit_now,
    install_child_signals,
    parent_alive,
    pull_socket,
    push_socket,
)
from radixlm.server.proctitle import scheduler_title, set_process_title
from radixlm.utils import release_free_heap

logger = logging.getLogger("radixlm.scheduler")

IDLE_POLL_MS = 1000  # idle wake-up period: check that the parent still lives
# The KV invariant is checked (and freed heap memory returned to the OS) once
# the loop has been idle this long. The check
# walks the whole radix tree (21 ms with 384k cached tokens on a CPU core):
# run at once, it delayed a request's last output and the next request.
IDLE_CHECK_DELAY_MS = 50
EXIT_STEP_FAILED = 3
EXIT_PARENT_GONE = 4


def error_finish(msg: GenerateReq, message: str, status: int) -> TokenOut:
    """The one message a refused request gets: an abort that carries an HTTP status."""
    return TokenOut(rid=msg.rid, new_token_ids=[], prompt_tokens=len(msg.input_ids),
                    completion_tokens=0, cached_tokens=0,
                    finish_reason={"type": "abort", "message": message, "status_code": status})


@dataclass(frozen=True)
class Placement:
    """Where one scheduler rank runs: its replica, its rank in the replica's
    tensor-parallel group, its GPU, and the group's rendezvous address."""

    dp_rank: int = 0
    tp_rank: int = 0
    gpu_id: int | None = None
    dist_init_method: str | None = None  # tcp://host:port, with tp_size > 1

    @property
    def name(self) -> str:
        return f"scheduler DP{self.dp_rank} TP{self.tp_rank}"


class SchedulerLoop:
    """Runs one scheduler rank. Rank 0 of a replica (the leader) owns the sockets:
    it receives requests, shares them with its followers (TpSync), and sends
    results and replies. Followers see the same inputs in the same order and step
    in lockstep, so their scheduling matches the leader's without further talk."""

    def __init__(self, scheduler: Any, args: ServerArgs, paths: IpcPaths, parent_pid: int,
                 placement: Placement = Placement()) -> None:
        self.scheduler = scheduler
        self.args = args
        self.parent_pid = parent_pid
        self.dp_rank = placement.dp_rank
        self.sync = getattr(scheduler, "tp_sync", None)  # None: a single rank
        self.leader = self.sync is None or self.sync.is_leader
        self.errors: list[TokenOut] = []
        self.stats = StatsLogger(scheduler, args.stats_interval if self.leader else 0)
        self.num_received = 0
        self.last_load: tuple[int, int] | None = None
        # GenerateReq.return_timing: stamps per rid until its first output leaves.
        self.timed: dict[str, dict[str, float]] = {}
        self.received_at = 0.0
        self.check_due = False  # went idle; check the KV invariant in the next quiet moment
        self.ctx = zmq.Context()
        if self.leader:
            data_parallel = args.dp_size > 1
            self.recv_sock = pull_socket(self.ctx, paths.replica(self.dp_rank) if data_parallel
                                         else paths.scheduler)
            self.to_detok = push_socket(self.ctx, paths.detokenizer)
            # Replies and ready notes go to the DP controller when there is one.
            self.to_tok = push_socket(self.ctx, paths.controller if data_parallel
                                      else paths.tokenizer)
            self.poller = zmq.Poller()
            self.poller.register(self.recv_sock, zmq.POLLIN)

    # ---- messages in ------------------------------------------------------------
    def handle(self, data: bytes) -> None:
        try:
            msg = decode_to_scheduler(data)
        except Exception as e:  # a malformed frame is the sender's bug; keep serving
            logger.error("dropping an undecodable message: %s", e)
            return
        if isinstance(msg, GenerateReq):
            self.num_received += 1
            if msg.return_timing and self.leader:
                self.timed[msg.rid] = {"sched_recv": self.received_at}
            self._add(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid, msg.abort_all)
        elif isinstance(msg, ControlReq):
            self._control(msg)

    def _queued(self) -> int:
        """Waiting requests that the next step cannot admit for lack of a slot."""
        s = self.scheduler
        free_slots = max(0, s.max_running_requests - len(s.running))
        return max(0, len(s.waiting) - free_slots)

    def _add(self, msg: GenerateReq) -> None:
        limit = self.args.max_queued_requests
        if limit is not None and self._queued() >= limit:
            self.errors.append(error_finish(
                msg, f"the server is overloaded: {limit} requests are already queued", 503))
            return
        try:
            self.scheduler.add_request(msg)
        except ValueError as e:
            self.errors.append(error_finish(msg, str(e), 400))
        except Exception as e:
            logger.exception("request %s could not be queued", msg.rid)
            self.errors.append(error_finish(msg, f"internal error: {e}", 500))

    def _control(self, msg: ControlReq) -> None:
        try:
            reply = ControlReply(msg.req_id, True,
                                 result=self.scheduler.control(msg.method, **msg.args))
        except KeyError as e:
            reply = ControlReply(msg.req_id, False, message=str(e.args[0]))
        except Exception as e:  # e.g. a failed invariant: report it, keep serving
            logger.exception("control method %s failed", msg.method)
            reply = ControlReply(msg.req_id, False, message=f"{type(e).__name__}: {e}")
        if self.leader:
            self.to_tok.send(encode(reply))

    def receive(self) -> list[bytes]:
        """The leader's pending frames, waiting up to a second for one while idle
        (so followers, blocked in the broadcast, hear from it at least that often;
        IDLE_CHECK_DELAY_MS when an invariant check is due)."""
        frames: list[bytes] = []
        if self.leader:
            busy = self.scheduler.has_work or bool(self.errors)
            timeout = 0 if busy else IDLE_CHECK_DELAY_MS if self.check_due else IDLE_POLL_MS
            while self.poller.poll(timeout):
                if not frames:
                    self.received_at = time.monotonic()
                frames.append(self.recv_sock.recv())
                timeout = 0
        if self.sync is not None:
            frames = self.sync.broadcast_obj(frames) or []
        return frames

    # ---- the loop ---------------------------------------------------------------
    def run_once(self) -> None:
        frames = self.receive()
        for frame in frames:
            self.handle(frame)
        if self.check_due and not frames and not self.scheduler.has_work:
            # Idle, and nothing came for a while (every rank sees the same frames):
            # every KV slot must be free or held by the tree.
            self.check_due = False
            self.scheduler.check_invariants()
            release_free_heap()
        outs = self.errors
        self.errors = []
        if self.scheduler.has_work:
            if self.timed:
                self._stamp("step_start")
            outs += self.scheduler.step()  # an exception here ends the process
            if self.timed:
                self._stamp("first_token")
            self.stats.maybe_log()
            self.check_due = self.check_due or not self.scheduler.has_work
        if self.leader:
            if outs:
                if self.timed:
                    self._attach_timing(outs)
                self.to_detok.send(encode(BatchTokenOut(outs)))
            if self.args.dp_size > 1:
                self._report_load()

    def _stamp(self, stage: str) -> None:
        """`stage` now, for every timed request that has not passed it yet (the
        first step after a request arrives starts its way to its first output;
        "first_token" is overwritten at each step until that output leaves)."""
        now = time.monotonic()
        for stamps in self.timed.values():
            if stage == "first_token" or stage not in stamps:
                stamps[stage] = now

    def _attach_timing(self, outs: list[TokenOut]) -> None:
        now = time.monotonic()
        for out in outs:
            stamps = self.timed.pop(out.rid, None)
            if stamps is not None:
                stamps.setdefault("first_token", now)  # refused before any step
                stamps["sched_send"] = now
                out.timing = stamps

    def _report_load(self) -> None:
        reqs = self.scheduler.reqs.values()
        load = (len(reqs), sum(len(r.origin_input_ids) + len(r.output_ids) for r in reqs))
        if load != self.last_load:
            self.last_load = load
            self.to_tok.send(encode(LoadReport(self.dp_rank, *load, self.num_received)))

    def run_forever(self) -> None:
        while True:
            self.run_once()
            if not self.scheduler.has_work and not parent_alive(self.parent_pid):
                logger.error("the server process is gone; exiting")
                sys.exit(EXIT_PARENT_GONE)


class StatsLogger:
    """One line every `interval` seconds while busy: load, memory, hit rate, speed."""

    def __init__(self, scheduler: Any, interval: float) -> None:
        self.scheduler = scheduler
        self.interval = interval
        self.last_time = time.monotonic()
        self.last_tokens = 0
        self.last_verifies = self.last_accepted = 0

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self.last_time < self.interval:
            return
        info = self.scheduler.server_info()
        tokens = info.get("num_generated_tokens", 0)
        rate = (tokens - self.last_tokens) / (now - self.last_time)
        usage = info["kv_tokens_in_use"] / max(info["kv_tokens_total"], 1)
        verifies = info.get("num_spec_verifies", 0) - self.last_verifies
        accepted = info.get("num_accepted_drafts", 0) - self.last_accepted
        spec = f", accept len: {1 + accepted / verifies:.2f}" if verifies else ""
        logger.info("running: %d, queued: %d, token usage: %.2f, cache hit rate: %.1f%%, "
                    "gen throughput: %.1f tok/s%s", info["num_running_requests"],
                    info["num_queued_requests"], usage, 100 * info["cache_hit_rate"], rate, spec)
        self.last_time, self.last_tokens = now, tokens
        self.last_verifies += verifies
        self.last_accepted += accepted


def build_scheduler(args: ServerArgs, model_dir: str, gpu_id: int | None = None) -> Any:
    from radixlm.models.loader import load_config
    from radixlm.scheduler.scheduler import Scheduler
    from radixlm.tokenizer import get_tokenizer

    tokenizer = None if args.skip_tokenizer_init else \
        get_tokenizer(args.tokenizer_path or model_dir)
    config = load_config(model_dir, args.context_length)
    return Scheduler(args, model_dir, config, tokenizer, gpu_id)


def ready_info(scheduler: Any, dp_rank: int = 0) -> dict[str, Any]:
    return {"max_total_tokens": scheduler.max_total_tokens,
            "max_running_requests": scheduler.max_running_requests,
            "context_len": scheduler.context_len, "vocab_size": scheduler.vocab_size,
            "hidden_size": scheduler.hidden_size, "dp_rank": dp_rank}


def init_tp_rank(args: ServerArgs, placement: Placement) -> None:
    """Join the replica's tensor-parallel group (NCCL on GPUs, gloo on the CPU)."""
    if args.tp_size == 1:
        return
    from radixlm.distributed import init_distributed
    from radixlm.runtime.model_runner import resolve_device

    device = resolve_device(args.device, placement.gpu_id)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    assert placement.dist_init_method is not None
    init_distributed("nccl" if device.type == "cuda" else "gloo", placement.dist_init_method,
                     args.tp_size, placement.tp_rank, args.dist_timeout,
                     custom_all_reduce=not args.disable_custom_all_reduce,
                     allreduce_fusion=not args.disable_allreduce_fusion, ep_size=args.ep_size)


def run_scheduler_process(args_dict: dict[str, Any], model_dir: str, paths: IpcPaths,
                          parent_pid: int, placement_dict: dict[str, Any] | None = None) -> None:
    """Entry point of the spawned process (arguments are plain data)."""
    import os

    install_child_signals()
    args = ServerArgs(**args_dict)
    placement = Placement(**(placement_dict or {}))
    set_process_title(scheduler_title(placement.dp_rank, placement.tp_rank))
    single = args.tp_size == 1 and args.dp_size == 1
    configure_child_logging(args.log_level, "scheduler" if single else placement.name)
    init_tp_rank(args, placement)
    scheduler = build_scheduler(args, model_dir, placement.gpu_id)
    loop = SchedulerLoop(scheduler, args, paths, parent_pid, placement)
    gc.freeze()  # the start-up heap (torch, the model) stays out of every collection
    if loop.leader:
        info = ready_info(scheduler, placement.dp_rank)
        loop.to_tok.send(encode(ProcessReady("scheduler", os.getpid(), info)))
    code = EXIT_STEP_FAILED
    try:
        loop.run_forever()
    except SystemExit as e:  # SIGUSR1 from the parent, or the parent is gone
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:
        if not loop.leader and "closed by peer" in str(e):
            # Rank 0 went first (a shutdown, or it died): the launcher's watchdog
            # tells the two apart, so no traceback here.
            logger.warning("lost tensor-parallel rank 0 (%s); exiting", e)
        else:
            logger.exception("the scheduler loop failed; exiting")
    loop.ctx.destroy(linger=0)
    exit_now(code)


def configure_child_logging(level: str, name: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [{name}] %(levelname)s %(message)s")
