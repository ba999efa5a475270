"""Mixed chunked prefill (`--enable-mixed-chunk`): prefill chunks and the running
decodes share forwards, and greedy outputs are identical to running them apart,
on each CPU attention backend, with and without the prefix cache."""

from __future__ import annotations

import pytest
from hf_reference import EXACT

import radixlm
from radixlm.forward_batch import ForwardMode

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3,
    "List five facts about the moon.",
    "Explain why the sky is blue in two sentences. " * 4,
    "Translate 'good morning' into French, Spanish and German.",
    "What is the capital of Australia? Answer briefly. " * 2,
]
SP = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _generate(mixed: bool, **kw: object) -> tuple[list[list[int]], list[ForwardMode]]:
    modes: list[ForwardMode] = []
    with radixlm.Engine(**EXACT, chunked_prefill_size=32, max_prefill_tokens=32,
                        enable_mixed_chunk=mixed, **kw) as e:
        forward = e.scheduler.worker.forward
        e.scheduler.worker.forward = lambda b: modes.append(b.mode) or forward(b)
        outs = e.generate(PROMPTS, SP)
        e.scheduler.check_invariants()
    return [o["output_ids"] for o in outs], modes


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_mixed_chunk_matches_separate_batches(backend: str) -> None:
    plain, plain_modes = _generate(False, attention_backend=backend)
    mixed, mixed_modes = _generate(True, attention_backend=backend)
    assert ForwardMode.MIXED not in plain_modes
    assert mixed_modes.count(ForwardMode.MIXED) >= 3
    assert mixed == plain


def test_mixed_chunk_without_the_prefix_cache() -> None:
    plain, _ = _generate(False, disable_radix_cache=True)
    mixed, modes = _generate(True, disable_radix_cache=True)
    assert ForwardMode.MIXED in modes and mixed == plain
