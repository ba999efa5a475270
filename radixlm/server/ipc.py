"""ZMQ endpoints between the server's processes, and small socket helpers.

Each process binds the one socket it reads from (PULL) and connects PUSH
sockets to the others. All endpoints are `ipc://` files in a private temp
directory (mode 0700), so nothing listens on the network.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class IpcPaths:
    scheduler: str  # the scheduler reads requests here
    detokenizer: str  # the detokenizer reads token ids here
    tokenizer: str  # the TokenizerManager reads text, control replies and ready notes here
    controller: str  # data parallelism: the controller reads the replicas' replies here
    root: str

    @classmethod
    def create(cls) -> IpcPaths:
        root = tempfile.mkdtemp(prefix="radixlm-ipc-")
        os.chmod(root, 0o700)
        return cls(scheduler=f"ipc://{root}/scheduler", detokenizer=f"ipc://{root}/detokenizer",
                   tokenizer=f"ipc://{root}/tokenizer", controller=f"ipc://{root}/controller",
                   root=root)

    def replica(self, dp_rank: int) -> str:
        """Where data-parallel replica `dp_rank`'s scheduler reads requests."""
        return f"ipc://{self.root}/scheduler-{dp_rank}"

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    return sock


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    # No high-water mark: a send must never block the sender's loop; the peers
    # drain continuously, and a dead peer is noticed by the parent's watchdog.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def parent_alive(parent_pid: int) -> bool:
    """A child re-parented to init (or a subreaper) has lost its server."""
    return os.getppid() == parent_pid


def install_child_signals() -> None:
    """Children ignore SIGINT/SIGTERM: a Ctrl-C or a service manager signals the
    whole group, and the server must keep its scheduler while it drains. The
    parent stops a child with SIGUSR1 (a clean exit), SIGKILL if that stalls."""
    import signal
    import sys

    def stop(*_: object) -> None:
        sys.exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, stop)
    die_with_parent()


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: with torch loaded it takes
    seconds, and a child has nothing left to flush but its log."""
    import logging
    import multiprocessing.util
    import sys

    # What multiprocessing itself runs at a child's exit: it releases named
    # semaphores (tqdm's lock), else the resource tracker warns of a leak.
    multiprocessing.util._exit_function()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere),
    so a SIGKILLed server leaves no orphan holding the model's memory."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
