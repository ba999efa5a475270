"""The data-parallel controller: one process in front of `dp_size` replicas.

It takes the TokenizerManager's requests, routes each generation request to
one replica (radixlm/server/load_balance.py), sends aborts and control calls
to every replica, and merges their replies into one (server info is summed).
Replicas send their token outputs straight to the detokenizer; their replies,
ready notes and load reports come back here.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import zmq

from radixlm.config import ServerArgs
from radixlm.protocol import (
    AbortReq,
    ControlReply,
    ControlReq,
    GenerateReq,
    LoadReport,
    ProcessReady,
    decode_to_controller,
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
from radixlm.server.load_balance import LoadBalancer
from radixlm.server.proctitle import set_process_title

logger = logging.getLogger("radixlm.dp_controller")

IDLE_POLL_MS = 1000
# Summed over replicas in get_server_info; every other field is replica 0's.
SUMMED_INFO = ("kv_tokens_total", "kv_tokens_free", "kv_tokens_cached", "kv_tokens_in_use",
               "num_running_requests", "num_queued_requests", "max_running_requests",
               "num_retractions", "num_prompt_tokens", "num_cached_tokens",
               "num_generated_tokens", "num_spec_verifies", "num_draft_tokens",
               "num_accepted_drafts")


class DataParallelController:
    def __init__(self, args: ServerArgs, paths: IpcPaths) -> None:
        self.args = args
        self.num_replicas = args.dp_size
        self.ctx = zmq.Context()
        self.from_tok = pull_socket(self.ctx, paths.scheduler)
        self.from_replicas = pull_socket(self.ctx, paths.controller)
        self.to_replicas = [push_socket(self.ctx, paths.replica(i))
                            for i in range(self.num_replicas)]
        self.to_tok = push_socket(self.ctx, paths.tokenizer)
        self.poller = zmq.Poller()
        self.poller.register(self.from_tok, zmq.POLLIN)
        self.poller.register(self.from_replicas, zmq.POLLIN)
        self.ready: dict[int, dict[str, Any]] = {}
        self.balancer = LoadBalancer(args.load_balance_method, self.num_replicas)
        self.replies: dict[int, list[ControlReply]] = {}
        self.controls: dict[int, str] = {}  # req_id -> method, while replies are due
        self.sessions: dict[str, int] = {}  # session id -> its replica

    # ---- from the TokenizerManager ------------------------------------------------
    def on_request(self, frame: bytes) -> None:
        try:
            msg = decode_to_scheduler(frame)
        except Exception as e:
            logger.error("dropping an undecodable message: %s", e)
            return
        if isinstance(msg, GenerateReq):
            self.to_replicas[self._replica_for(msg)].send(frame)
        elif isinstance(msg, AbortReq):
            for sock in self.to_replicas:
                sock.send(frame)
        elif isinstance(msg, ControlReq):
            if msg.method == "close_session":
                self.sessions.pop(msg.args.get("session_id"), None)
            self.controls[msg.req_id] = msg.method
            self.replies[msg.req_id] = []
            for sock in self.to_replicas:
                sock.send(frame)

    def _replica_for(self, msg: GenerateReq) -> int:
        """A session's requests all go where its first one went: the replica that
        holds its history (every replica knows the open session ids)."""
        sid = (msg.session_params or {}).get("id")
        if sid is None:
            return self.balancer.route(msg.input_ids, msg.namespace)
        if sid not in self.sessions:
            self.sessions[sid] = self.balancer.route(msg.input_ids, msg.namespace)
        else:
            self.balancer.assign(self.sessions[sid], msg.input_ids, msg.namespace)
        return self.sessions[sid]

    # ---- from the replicas ---------------------------------------------------------
    def on_replica(self, frame: bytes) -> None:
        msg = decode_to_controller(frame)
        if isinstance(msg, LoadReport):
            self.balancer.report(msg.dp_rank, msg.num_reqs, msg.num_tokens, msg.num_received)
        elif isinstance(msg, ControlReply):
            self._on_reply(msg)
        elif isinstance(msg, ProcessReady):
            self._on_ready(msg)

    def _on_ready(self, msg: ProcessReady) -> None:
        self.ready[msg.info.get("dp_rank", 0)] = msg.info
        if len(self.ready) < self.num_replicas:
            return
        infos = list(self.ready.values())
        capacity = min(i["max_total_tokens"] for i in infos)
        self.balancer = LoadBalancer(self.args.load_balance_method, self.num_replicas, capacity)
        # A request must fit any replica; the front end queues against all of them.
        info = {**infos[0], "max_total_tokens": capacity,
                "max_running_requests": sum(i["max_running_requests"] for i in infos)}
        logger.info("all %d replicas ready; routing by %s", self.num_replicas,
                    self.args.load_balance_method)
        self.to_tok.send(encode(ProcessReady("scheduler", os.getpid(), info)))

    def _on_reply(self, msg: ControlReply) -> None:
        got = self.replies.get(msg.req_id)
        if got is None:
            return
        got.append(msg)
        if len(got) == self.num_replicas:
            del self.replies[msg.req_id]
            method = self.controls.pop(msg.req_id)
            self.to_tok.send(encode(self.merge(method, msg.req_id, got)))

    def merge(self, method: str, req_id: int, replies: list[ControlReply]) -> ControlReply:
        failed = [r for r in replies if not r.success]
        if failed:
            return ControlReply(req_id, False, message=failed[0].message)
        results = [r.result for r in replies]
        if method == "get_server_info":
            return ControlReply(req_id, True, result=self.merge_info(results))
        first = results[0]
        if isinstance(first, dict) and "success" in first:
            messages = dict.fromkeys(str(r.get("message", "")) for r in results)
            first = {**first, "success": all(r.get("success") for r in results),
                     "message": "; ".join(m for m in messages if m)}
        return ControlReply(req_id, True, result=first)

    def merge_info(self, infos: list[dict[str, Any]]) -> dict[str, Any]:
        merged = dict(infos[0])
        for key in SUMMED_INFO:
            if all(key in i for i in infos):
                merged[key] = sum(i[key] for i in infos)
        prompt = merged.get("num_prompt_tokens", 0) + merged.get("num_cached_tokens", 0)
        merged["cache_hit_rate"] = merged.get("num_cached_tokens", 0) / prompt if prompt else 0.0
        merged["dp"] = {
            "load_balance_method": self.balancer.method,
            "routed": [load.num_routed for load in self.balancer.loads],
            "cache_routed": self.balancer.num_cache_routed,
            "replicas": infos,
        }
        return merged

    # ---- the loop ---------------------------------------------------------------------
    def run_forever(self, parent_pid: int) -> None:
        while True:
            events = dict(self.poller.poll(IDLE_POLL_MS))
            if not events and not parent_alive(parent_pid):
                logger.error("the server process is gone; exiting")
                sys.exit(4)
            while self.from_replicas.poll(0):
                self.on_replica(self.from_replicas.recv())
            while self.from_tok.poll(0):
                self.on_request(self.from_tok.recv())


def run_dp_controller(args_dict: dict[str, Any], paths: IpcPaths, parent_pid: int) -> None:
    """Entry point of the spawned controller process."""
    from radixlm.server.scheduler_process import configure_child_logging

    install_child_signals()
    set_process_title("dp_controller")
    args = ServerArgs(**args_dict)
    configure_child_logging(args.log_level, "dp-controller")
    controller = DataParallelController(args, paths)
    code = 1
    try:
        controller.run_forever(parent_pid)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception:
        logger.exception("the data-parallel controller failed; exiting")
    controller.ctx.destroy(linger=0)
    exit_now(code)
