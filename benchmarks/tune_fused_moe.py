"""Tune the fused MoE's block configs on this GPU and write a config table.

For each token count, then each shape (so every shape's decode is tuned before any
prefill): BLOCK_M from the heuristic's and its neighbours;
for each, the gate/up tile swept over a small candidate grid with the down tile
fixed, then the down tile with the best gate/up (coordinate descent); every
candidate times the whole `fused_experts` call (CUDA graph of GROUP calls on
different routings, median of REPS replays, as benchmarks/fused_moe.py times).
The committed and the heuristic's configs compete too; candidates are fitted to
the shape first (`fit_config`) and each distinct one is timed once; those that fail
to compile (out of shared memory) are skipped. Bounded: at most ~50 timings per
(shape, T), and --time-limit seconds in all: the case running then keeps the best
config timed so far, later ones their committed configs.

Output: the committed table with this device's tuned entries replaced, written to
--out (default $OUT/fused_moe_configs.json when $OUT is set, else printed only),
and one line per case: the committed config's time, the heuristic's, the best and
its config. Copy the file over radixlm/layers/moe/triton_ops/fused_moe_configs.json
to adopt it.

    python benchmarks/tune_fused_moe.py --tokens 1 64 512 4096 --time-limit 150
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import fused_moe as bench  # noqa: E402  (benchmarks/fused_moe.py: shapes, routings, timing)

from radixlm.layers.moe.triton_ops.configs import (  # noqa: E402
    TABLE_PATH,
    ConfigTable,
    GemmTile,
    MoEConfig,
    default_table,
    fit_config,
    get_config,
    heuristic_config,
    shape_key,
)
from radixlm.layers.moe.triton_ops.fused_moe import fused_experts  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# (block_n, block_k, group_m, num_warps, num_stages)
SMALL_M_TILES = [(16, 128, 1, 4, 4), (16, 256, 1, 4, 4), (32, 128, 1, 4, 4), (32, 256, 1, 4, 3),
                 (64, 64, 1, 4, 5), (64, 128, 1, 4, 4), (64, 256, 1, 8, 3), (128, 128, 1, 8, 3),
                 (128, 64, 1, 4, 4)]
LARGE_M_TILES = [(64, 64, 8, 4, 4), (64, 128, 8, 4, 3), (128, 64, 8, 4, 4), (128, 64, 8, 8, 4),
                 (128, 128, 8, 8, 3), (256, 64, 8, 8, 3), (256, 64, 16, 8, 4), (128, 32, 8, 4, 5)]
GATE_UP_MAX_N = 128  # the fused tile holds 2 x block_n accumulator columns


def candidates(block_m: int, gate_up: bool) -> list[GemmTile]:
    """The grid for one GEMM, without tiles whose fp32 accumulators pass 128 registers
    per thread (ptxas spills them at sm_90: BLOCK_M 128, fused 2 x 128 columns, 4 warps)."""
    tiles = [GemmTile(*c) for c in (SMALL_M_TILES if block_m <= 32 else LARGE_M_TILES)]
    acc_cols = 2 if gate_up else 1
    return [c for c in tiles if (not gate_up or c.block_n <= GATE_UP_MAX_N)
            and block_m * c.block_n * acc_cols <= 128 * 32 * c.num_warps]


class Tuner:
    def __init__(self, name: str, t: int, deadline: float, gen: torch.Generator, layer):
        self.e, self.h, self.inter, self.k = bench.SHAPES[name]
        self.t, self.deadline = t, deadline
        self.w13, self.w2 = layer
        self.routings = bench.make_routings(t, self.e, self.k, bench.GROUP, gen)
        self.x = torch.randn(t, self.h, generator=gen, device=bench.DEV).to(bench.DT)
        self.outs = [torch.empty_like(self.x) for _ in self.routings]
        self.timings = 0
        self.scores: dict[MoEConfig, float] = {}

    def time(self, cfg: MoEConfig) -> float:
        """Median seconds per call, inf where the config does not compile."""
        self.timings += 1
        # direct=False: the configs are the aligned path's; auto would time the direct
        # path at decode sizes, which takes no config.
        fns = [lambda r=r, o=o: fused_experts(self.x, self.w13, self.w2, r[0], r[1], out=o,
                                              config=cfg, direct=False)
               for r, o in zip(self.routings, self.outs)]
        try:
            return bench.time_graph(fns)[1]
        except Exception as exc:  # out of resources etc.: not a candidate
            print(f"    skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            torch.cuda.synchronize()
            return float("inf")

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def fit(self, cfg: MoEConfig) -> MoEConfig:
        return fit_config(cfg, self.h, self.inter, bench.DT)

    def score(self, cfg: MoEConfig) -> float:
        """Median seconds per call of the fitted config, each timed once."""
        cfg = self.fit(cfg)
        if cfg not in self.scores:
            self.scores[cfg] = self.time(cfg)
        return self.scores[cfg]

    def tune(self, start: list[MoEConfig]) -> bool:
        """Score `start`, then coordinate descent from the heuristic's BLOCK_M and its
        neighbours; False when the time ran out before the end."""
        for cfg in start:
            self.score(cfg)
        base = heuristic_config(self.t, self.e, self.k, bench.DT)
        for block_m in sorted({max(16, base.block_m // 2), base.block_m,
                               min(128, base.block_m * 2)}):
            cfg = replace(base, block_m=block_m)
            for part in ("gate_up", "down"):
                trials = [replace(cfg, **{part: tile})
                          for tile in candidates(block_m, part == "gate_up")]
                for trial in trials:
                    if self.out_of_time():
                        return False
                    self.score(trial)
                cfg = min(trials, key=self.score)
        return True

    def best(self) -> tuple[MoEConfig, float]:
        cfg = min(self.scores, key=self.scores.get)
        return cfg, self.scores[cfg]


def describe(cfg: MoEConfig) -> str:
    def tile(t: GemmTile) -> str:
        return f"{t.block_n}/{t.block_k}/g{t.group_m}/w{t.num_warps}/s{t.num_stages}"
    return f"BM{cfg.block_m} gate_up {tile(cfg.gate_up)} down {tile(cfg.down)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(bench.SHAPES), choices=list(bench.SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=list(BUCKETS))
    ap.add_argument("--time-limit", type=float, default=150.0, help="seconds for all cases")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "fused_moe_configs.json")
                    if os.environ.get("OUT") else None)
    args = ap.parse_args()
    deadline = time.monotonic() + args.time_limit
    device = torch.cuda.get_device_name()
    data = json.loads(TABLE_PATH.read_text())
    table = ConfigTable.from_json(data)
    gen = torch.Generator(device=bench.DEV).manual_seed(0)
    log = [f"tuning on {device}, torch {torch.__version__}, limit {args.time_limit:.0f} s"]
    print(log[0], flush=True)
    layers = {name: bench.make_layer(*bench.SHAPES[name][:3]) for name in args.shapes}
    complete = True
    for t in args.tokens:  # every shape's decode first: the steps that dominate serving
        for name in args.shapes:
            e, h, inter, k = bench.SHAPES[name]
            tuner = Tuner(name, t, deadline, gen, layers[name])
            committed = get_config(t, e, h, inter, k, bench.DT, bench.DEV, default_table())
            heuristic = heuristic_config(t, e, k, bench.DT)
            complete = tuner.tune([committed, heuristic])
            cfg, t_best = tuner.best()
            key = shape_key(e, h, inter, bench.DT)
            table.entries.setdefault(device, {}).setdefault(key, {})[t] = cfg
            t_committed, t_heuristic = tuner.score(committed), tuner.score(heuristic)
            line = (f"{name:<14} T={t:<5} committed {t_committed * 1e6:8.1f} us  heuristic "
                    f"{t_heuristic * 1e6:8.1f} us  best {t_best * 1e6:8.1f} us "
                    f"({t_committed / t_best:.2f}x faster)  {describe(cfg)}  "
                    f"[{tuner.timings} timings{'' if complete else ', out of time'}]")
            print(line, flush=True)
            log.append(line)
            if not complete:
                break
        if not complete:
            break
    comment = (f"Tuned by benchmarks/tune_fused_moe.py on {device} (torch {torch.__version__}) "
               f"where listed; other entries as committed before. {data.get('_comment', '')}")
    text = table.dumps(comment)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".log").write_text("\n".join(log) + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
