"""Counters the scheduler's parts keep, reported by `get_server_info` and the stats log."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stats:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_retractions: int = 0
    num_preemptions: int = 0  # retractions in favour of a higher-priority request
    num_finished: int = 0
