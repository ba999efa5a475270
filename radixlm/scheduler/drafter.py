"""The drafter seam: who proposes the tokens a verify step checks (speculative decoding).

Before each decode step the scheduler asks its drafter (if it has one) for draft
tokens per running request; the decode manager reserves a KV slot for each,
the worker verifies them in one forward (`ForwardMode.VERIFY`) and keeps those
the target model agrees with plus one token of its own, and the KV slots of the
rest go back (`KVManager.truncate`). Drafts change how many forwards a request
takes, never its tokens: a drafter may propose anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from radixlm.scheduler.req import Req


class Drafter(ABC):
    """Contract:
    - `propose(reqs)` returns {rid: draft tokens} for some of the running
      requests (absent or empty: that request decodes normally). It may read
      each request's `origin_input_ids` and `output_ids`.
    - With `needs_host_tokens` it reads the newest tokens on the host, so the
      scheduler runs its steps synchronously (no overlap).
    - Under tensor parallelism every rank calls it with the same state and must
      return the same drafts.
    """

    needs_host_tokens = True

    @abstractmethod
    def propose(self, reqs: list[Req]) -> dict[str, list[int]]: ...
