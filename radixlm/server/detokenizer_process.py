"""The detokenizer process: token ids from the scheduler in, text out to the
TokenizerManager. Incremental decoding and stop-string hold-back live in
`runtime.detokenize.Detokenizer`; this module only moves its messages.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from typing import Any

import zmq

from radixlm.protocol import BatchStrOut, ProcessReady, StrOut, decode_to_detokenizer, encode
from radixlm.runtime.detokenize import Detokenizer
from radixlm.server.ipc import (
    IpcPaths,
    exit_now,
    install_child_signals,
    parent_alive,
    pull_socket,
    push_socket,
)
from radixlm.server.proctitle import set_process_title
from radixlm.server.scheduler_process import configure_child_logging

logger = logging.getLogger("radixlm.detokenizer")

IDLE_POLL_MS = 1000
EXIT_PARENT_GONE = 4


def detokenize_batch(detok: Detokenizer, outs: list[Any]) -> list[StrOut]:
    """One bad message (e.g. a token the tokenizer cannot decode) must not take
    the others down: it becomes an error finish for its own request."""
    results = []
    for out in outs:
        try:
            results.append(detok.process_one(out))
        except Exception as e:
            logger.exception("detokenizing request %s failed", out.rid)
            detok.abort(out.rid)
            out.finish_reason = {"type": "abort", "message": f"detokenization failed: {e}",
                                 "status_code": 500}
            results.append(StrOut(token=out, new_text=""))
    return results


def stamp_timing(results: list[StrOut], received: float) -> None:
    """GenerateReq.return_timing: this process's stamps on the first outputs."""
    sent = None
    for r in results:
        if r.token.timing is not None:
            sent = sent or time.monotonic()
            r.token.timing.update(detok_recv=received, detok_send=sent)


def run_detokenizer_process(tokenizer_path: str, paths: IpcPaths, parent_pid: int,
                            log_level: str) -> None:
    install_child_signals()
    set_process_title("detokenizer")
    configure_child_logging(log_level, "detokenizer")
    from radixlm.tokenizer import get_tokenizer

    detok = Detokenizer(get_tokenizer(tokenizer_path))
    ctx = zmq.Context()
    recv_sock = pull_socket(ctx, paths.detokenizer)
    to_tok = push_socket(ctx, paths.tokenizer)
    gc.freeze()  # the start-up heap (the tokenizer) stays out of every collection
    to_tok.send(encode(ProcessReady("detokenizer", os.getpid())))
    try:
        while True:
            if not recv_sock.poll(IDLE_POLL_MS):
                if not parent_alive(parent_pid):
                    sys.exit(EXIT_PARENT_GONE)
                continue
            data = recv_sock.recv()
            received = time.monotonic()
            try:
                batch = decode_to_detokenizer(data)
            except Exception as e:
                # Not from our scheduler (anything that can reach the socket can
                # write to it): dropping it beats taking every request down.
                logger.error("dropping an undecodable message: %s", e)
                continue
            results = detokenize_batch(detok, batch.outputs)
            stamp_timing(results, received)
            to_tok.send(encode(BatchStrOut(results)))
    except SystemExit as e:
        ctx.destroy(linger=0)
        exit_now(e.code if isinstance(e.code, int) else 1)
