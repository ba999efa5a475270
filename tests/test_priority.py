"""Priority scheduling (`--enable-priority-scheduling`, request field `priority`,
higher first) and `--priority-preemption` (a waiting high-priority request may
retract lower-priority running ones, which resume and lose nothing)."""

from __future__ import annotations

from typing import Any

import pytest
from hf_reference import EXACT

import radixlm
from radixlm.protocol import GenerateReq

SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _req(engine: Any, rid: str, text: str, priority: int = 0,
         max_new_tokens: int = 8) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=engine.tokenizer.encode(text),
                       sampling_params={**SP, "max_new_tokens": max_new_tokens},
                       priority=priority)


def _run(engine: Any, reqs: list[GenerateReq], before: int = 0,
         late: list[GenerateReq] = ()) -> tuple[list[str], dict[str, list[int]]]:
    """Submit `reqs`, step `before` times, submit `late`, run to the end; returns the
    finish order and each request's tokens."""
    sched = engine.scheduler
    for r in reqs:
        sched.add_request(r)
    order: list[str] = []
    tokens: dict[str, list[int]] = {}

    def collect() -> None:
        for out in sched.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                order.append(out.rid)

    for _ in range(before):
        collect()
    for r in late:
        sched.add_request(r)
    while sched.has_work:
        collect()
    sched.check_invariants()
    return order, tokens


def test_priority_is_refused_without_priority_scheduling() -> None:
    with radixlm.Engine(**EXACT) as e:
        with pytest.raises(ValueError, match="enable-priority-scheduling"):
            e.scheduler.add_request(_req(e, "p", "Hello", priority=3))
        assert not e.scheduler.reqs
        order, _ = _run(e, [_req(e, "zero", "Hello", priority=0)])
        assert order == ["zero"]


def test_higher_priority_is_admitted_first() -> None:
    with radixlm.Engine(**EXACT, enable_priority_scheduling=True,
                        max_running_requests=1, schedule_policy="fcfs") as e:
        reqs = [_req(e, f"low{i}", f"Tell me about the number {i}.") for i in range(3)]
        reqs.insert(2, _req(e, "high", "Tell me about the sea.", priority=5))
        reqs.append(_req(e, "mid", "Tell me about the sky.", priority=1))
        order, _ = _run(e, reqs)
    assert order == ["high", "mid", "low0", "low1", "low2"]  # ties keep arrival order


@pytest.mark.parametrize("limit", ["slots", "memory"])
def test_preemption_retracts_lower_priority_and_loses_nothing(limit: str) -> None:
    kw: dict[str, Any] = {"max_running_requests": 2} if limit == "slots" else \
        {"max_total_tokens": 100}
    texts = {"low0": "Describe a quiet morning in a small village by the sea, " * 2,
             "low1": "Describe a busy afternoon in a large city by the river, " * 2,
             "high": "Name three colours. " * 10}  # too long to fit beside both
    with radixlm.Engine(**EXACT) as ref:
        expected = {rid: ref.generate(t, {**SP, "max_new_tokens": 24 if rid != "high" else 8}
                                      )["output_ids"] for rid, t in texts.items()}
    with radixlm.Engine(**EXACT, enable_priority_scheduling=True,
                        priority_preemption=True, **kw) as e:
        lows = [_req(e, rid, texts[rid], max_new_tokens=24) for rid in ("low0", "low1")]
        high = _req(e, "high", texts["high"], priority=10)
        order, tokens = _run(e, lows, before=3, late=[high])
        assert e.scheduler.stats.num_preemptions >= 1
        assert e.scheduler.stats.num_retractions >= 1
    assert order[0] == "high"
    assert tokens == expected  # the retracted requests resumed where they were


def test_preemption_needs_priority_scheduling() -> None:
    with pytest.raises(ValueError, match="priority_preemption needs"):
        radixlm.Engine(**EXACT, priority_preemption=True)
