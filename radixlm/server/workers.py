"""Spawning the scheduler side: one process per tensor-parallel rank of each
data-parallel replica, plus the DP controller when there are replicas.

Shared by the HTTP server's launcher and the multi-process offline Engine.
Ranks of replica d take GPUs base_gpu_id + d * ranks_per_node + local_rank.
Multi-node (`--nnodes`): every node runs this with its `--node-rank`; node 0
hosts rank 0 (the leader, which alone talks to the front end) and the others
run followers only; all meet at `--dist-init-addr`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
from multiprocessing.process import BaseProcess

from radixlm.config import ServerArgs
from radixlm.server.dp_controller import run_dp_controller
from radixlm.server.ipc import IpcPaths
from radixlm.server.scheduler_process import Placement, run_scheduler_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_init_methods(args: ServerArgs) -> list[str | None]:
    """Rendezvous address of each replica's tensor-parallel group."""
    if args.tp_size == 1:
        return [None] * args.dp_size
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        return [f"tcp://{host}:{int(port) + d}" for d in range(args.dp_size)]
    return [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.dp_size)]


def placements(args: ServerArgs) -> list[Placement]:
    """The scheduler ranks that run on this node."""
    per_node = args.tp_size // args.nnodes
    inits = dist_init_methods(args)
    out = []
    for dp in range(args.dp_size):
        for local in range(per_node):
            out.append(Placement(dp_rank=dp, tp_rank=args.node_rank * per_node + local,
                                 gpu_id=args.base_gpu_id + dp * per_node + local,
                                 dist_init_method=inits[dp]))
    return out


def spawn_schedulers(args: ServerArgs, model_dir: str, paths: IpcPaths) -> dict[str, BaseProcess]:
    """Start (and return, by name) this node's scheduler ranks and, on node 0 with
    dp_size > 1, the DP controller."""
    # OpenMP threads that spin while waiting collapse throughput as soon as
    # another process wants a core; the children read this before importing torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("spawn")
    parent = os.getpid()
    args_dict = dataclasses.asdict(args)
    procs: dict[str, BaseProcess] = {}
    if args.dp_size > 1 and args.node_rank == 0:
        procs["dp-controller"] = ctx.Process(
            target=run_dp_controller, name="radixlm-dp-controller",
            args=(args_dict, paths, parent), daemon=True)
    single = args.tp_size == 1 and args.dp_size == 1
    for p in placements(args):
        name = "scheduler" if single else p.name
        procs[name] = ctx.Process(
            target=run_scheduler_process, name=f"radixlm-{name.replace(' ', '-')}",
            args=(args_dict, model_dir, paths, parent, dataclasses.asdict(p)), daemon=True)
    for proc in procs.values():
        proc.start()
    return procs
