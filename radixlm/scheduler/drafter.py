"""The drafter seam: who proposes the tokens a verify step checks (speculative decoding).

Before each decode step the scheduler asks its drafter (if it has one) for draft
tokens per running request; the decode manager reserves a KV slot for each,
the worker verifies them in one forward (`ForwardMode.VERIFY`) and keeps those
the target model agrees with plus one token of its own, and the KV slots of the
rest go back (`KVManager.truncate`). Drafts change how many forwards a request
takes, never its tokens: a drafter may propose anything.

The drafters themselves live in `radixlm/speculative/` (one module each, chosen
by `--speculative-algorithm`); a drafter that runs a model on the device
(`speculative/model_drafter.py`) also has hooks the worker calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from radixlm.scheduler.req import Req


class Drafter(ABC):
    """Contract:
    - `propose(reqs)` returns {rid: draft tokens} for some of the running
      requests (absent or empty: that request decodes normally); a
      `speculative.tree.DraftTree` instead of a list proposes a tree (each
      draft with its parent row; the verify keeps its longest agreeing path,
      on backends with tree attention). It may read
      each request's `origin_input_ids` and `output_ids`. A drafter whose
      `drafts_on_device` is set returns placeholders there: only how many
      counts (the KV slots the verify takes); the worker's drafter writes the
      real tokens into the verify batch (`ScheduleBatch.drafts`) before the
      verify forward.
    - With `needs_host_tokens` it reads the newest tokens on the host, so the
      scheduler runs its steps synchronously (no overlap).
    - `forget(rid)`: the request finished or was aborted; its state can go.
    - Under tensor parallelism every rank calls it with the same state and must
      return the same drafts.
    """

    needs_host_tokens = True
    drafts_on_device = False

    @abstractmethod
    def propose(self, reqs: list[Req]) -> dict[str, Any]: ...

    def forget(self, rid: str) -> None:
        """Drop what the drafter keeps for a request that ended (default: nothing kept)."""
        return None


def drafts_within(num_reqs: int, num_drafts: int, max_verify_tokens: int) -> int:
    """How many drafts each of `num_reqs` requests may verify in a forward of at most
    `max_verify_tokens` rows (each request's newest token and its drafts; 0: no
    limit): `num_drafts` or fewer, 0 when not even one fits. A large batch makes
    the forward compute-bound, where verified rows cost what decoded ones do and
    rejected drafts are pure loss."""
    if not max_verify_tokens or not num_reqs:
        return num_drafts
    return max(0, min(num_drafts, max_verify_tokens // num_reqs - 1))
