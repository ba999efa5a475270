"""Constrained decoding overhead: JSON-schema requests vs the same requests free.

    python -m radixlm.bench.constrained --num-prompts 32 --max-new-tokens 128

A grammar ends each output where its JSON closes, so `ignore_eos` cannot make
the two runs equal in length. Instead the free run gives every request exactly
the number of tokens its constrained twin produced (`ignore_eos`, per-request
`max_new_tokens`): same prompts, same tokens per request, so the same batch
shapes step by step, and the tok/s ratio isolates the grammar's cost (mask
fill, mask apply, matcher updates). Greedy, fixed prompts; the cache is
flushed before every run so each one prefills the same prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from radixlm.config import ServerArgs

THINGS = ["laptop", "bicycle", "coffee mug", "backpack", "desk lamp", "guitar", "tent",
          "camera", "sofa", "kettle", "umbrella", "watch", "skateboard", "blender", "drone",
          "printer", "microwave", "headphones", "bookshelf", "kayak", "telescope", "scooter",
          "violin", "toaster", "monitor", "sneakers", "jacket", "suitcase", "hammock",
          "keyboard", "aquarium", "chess set"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "in_stock": {"type": "boolean"},
        "color": {"enum": ["black", "white", "red", "blue", "green", "silver"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "size": {"type": "object", "properties": {
            "width_cm": {"type": "integer", "minimum": 1, "maximum": 500},
            "height_cm": {"type": "integer", "minimum": 1, "maximum": 500}},
            "required": ["width_cm", "height_cm"]},
    },
    "required": ["name", "id", "price", "in_stock", "color", "tags", "size"],
}


@dataclass
class Run:
    name: str
    seconds: float
    output_tokens: int
    grammar_seconds: float = 0.0
    forwards: int = 0  # model forwards: equal counts mean equal batch shapes

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def prompts(engine: Any, n: int) -> list[str]:
    things = [THINGS[i % len(THINGS)] + (f" #{i // len(THINGS) + 1}" if i >= len(THINGS)
                                         else "") for i in range(n)]
    return [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe a {t} for an online shop as JSON."}],
        tokenize=False, add_generation_prompt=True) for t in things]


class GrammarTimer:
    """Wall time spent in the scheduler's grammar hooks (mask + matcher updates)."""

    def __init__(self, grammars: Any) -> None:
        self.seconds = 0.0
        for name in ("mask_logits", "advance"):
            setattr(grammars, name, self._timed(getattr(grammars, name)))

    def _timed(self, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def run(engine: Any, texts: list[str], params: list[dict[str, Any]], name: str,
        timer: GrammarTimer) -> tuple[Run, list[dict[str, Any]]]:
    engine.flush_cache()
    timer.seconds = 0.0
    forwards = engine.scheduler.forward_ct
    t0 = time.perf_counter()
    outs = engine.generate(texts, params)
    dt = time.perf_counter() - t0
    return Run(name, dt, sum(len(o["output_ids"]) for o in outs), timer.seconds,
               engine.scheduler.forward_ct - forwards), outs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m radixlm.bench.constrained")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each kind, interleaved; the median is reported")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    from radixlm.engine import Engine

    engine = Engine(**vars(ServerArgs.from_cli_args(args)))
    texts = prompts(engine, args.num_prompts)
    timer = GrammarTimer(engine.scheduler.grammars)
    t0 = time.perf_counter()
    engine.scheduler.grammars.backend.compile("json_schema", json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    grammar = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0,
               "json_schema": json.dumps(SCHEMA)}
    _, outs = run(engine, texts, [grammar] * len(texts), "warm-up", timer)
    lengths = [len(o["output_ids"]) for o in outs]
    free = [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0} for n in lengths]
    valid = sum(_parses(o["text"]) for o in outs)
    runs: dict[str, list[Run]] = {"json_schema": [], "free, same lengths": []}
    for _ in range(args.repeats):  # interleaved, so load from other processes hits both
        runs["json_schema"].append(run(engine, texts, [grammar] * len(texts), "json_schema",
                                       timer)[0])
        runs["free, same lengths"].append(run(engine, texts, free, "free", timer)[0])
    report(runs, args, lengths, valid, compile_s, str(engine.scheduler.device))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def report(runs: dict[str, list[Run]], args: argparse.Namespace, lengths: list[int],
           valid: int, compile_s: float, device: str) -> None:
    med = {k: sorted(v, key=lambda r: r.seconds)[len(v) // 2] for k, v in runs.items()}
    base = med["free, same lengths"]
    print(f"\n{'run':<22}{'output tokens':>15}{'forwards':>10}{'seconds':>10}{'tok/s':>10}"
          f"{'ratio':>8}{'grammar s':>11}")
    for name, r in med.items():
        print(f"{name:<22}{r.output_tokens:>15}{r.forwards:>10}{r.seconds:>10.2f}"
              f"{r.tok_s:>10.1f}{r.tok_s / base.tok_s:>7.2f}x{r.grammar_seconds:>11.2f}")
    con = med["json_schema"]
    best = {k: max(r.tok_s for r in v) for k, v in runs.items()}
    spread = {k: f"{min(r.tok_s for r in v):.1f}-{best[k]:.1f}" for k, v in runs.items()}
    print(f"workload: {args.num_prompts} concurrent chat prompts, greedy, json_schema with "
          f"7 fields (nested object, array, enum, bounded numbers), max_new_tokens "
          f"{args.max_new_tokens}; output lengths {min(lengths)}-{max(lengths)} "
          f"(mean {statistics.mean(lengths):.1f}); {valid}/{len(lengths)} outputs parse; "
          f"device {device}")
    best_overhead = 1 - best["json_schema"] / best["free, same lengths"]
    print(f"overhead: {1 - con.tok_s / base.tok_s:.1%} lower tok/s with the grammar (median "
          f"runs; best runs: {best_overhead:.1%}; goal <= 20%); time in grammar hooks "
          f"{con.grammar_seconds / con.seconds:.1%} of the run; schema compile (cold) "
          f"{compile_s * 1000:.1f} ms; tok/s range over {args.repeats} runs: {spread}")


if __name__ == "__main__":
    main()
