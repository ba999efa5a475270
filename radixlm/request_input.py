"""An API call's generation input on its way to the scheduler.

Shared by every front end (the offline Engine, the HTTP server's
TokenizerManager, the Engine's proxy for multi-process schedulers) and the
scheduler itself, so one rule decides what input is acceptable.
"""

from __future__ import annotations

from typing import Any


def check_input(sizes: Any, input_ids: list[int], max_new_tokens: int) -> None:
    """ValueError (naming the limit) unless the prompt fits. `sizes` has `vocab_size`,
    `context_len` and `max_total_tokens`: a Scheduler, or the sizes a front end
    (TokenizerManager, the Engine's RemoteScheduler) learned from one."""
    n = len(input_ids)
    if n == 0:
        raise ValueError("the prompt is empty: at least one input token is required")
    bad = next((t for t in input_ids if not 0 <= t < sizes.vocab_size), None)
    if bad is not None:
        raise ValueError(f"input token id {bad} is outside the vocabulary "
                         f"[0, {sizes.vocab_size})")
    limit = min(sizes.context_len, sizes.max_total_tokens)
    if n >= limit:
        raise ValueError(f"the prompt has {n} tokens, but this model accepts at most "
                         f"{limit - 1} input tokens")
    if n + max_new_tokens > limit:
        raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"is {n + max_new_tokens} tokens, more than the limit of {limit} "
                         f"(context length {sizes.context_len}, KV pool "
                         f"{sizes.max_total_tokens} tokens)")
