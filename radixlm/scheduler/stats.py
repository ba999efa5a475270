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
    # Request results dropped as stale (launched before a multi-token step was read).
    num_stale_results: int = 0
    # Verify steps: requests verified with drafts, draft tokens proposed, and how
    # many the target kept (acceptance length: 1 + accepted / verified).
    num_spec_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
