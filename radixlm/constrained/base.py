"""The grammar backend seam (seed 001's "finite state machine analyzer").

A backend turns a grammar spec into a compiled grammar once, and gives each
request its own matcher over it. Contract, i.e. what the scheduler may assume:

- `compile(kind, spec)` returns an opaque, immutable compiled grammar, or raises
  ValueError whose message starts with the parameter's name ("regex is invalid:
  ..."). It is thread-safe: the scheduler calls it from a compile pool
  (`compile_async`) so a slow grammar never stalls the decode loop. Equal specs
  may share one compiled grammar (backends cache).
- `matcher(grammar)` returns a fresh `GrammarMatcher` in the start state.
- A matcher belongs to one request and is used only by the scheduler thread. Its
  state is exactly the tokens it accepted: a retracted request keeps its output
  ids and therefore its matcher, unchanged.
- Bitmasks are int32 CPU tensors `[rows, ceil(vocab_size / 32)]`, bit t of a row
  set = token t allowed. `apply_bitmask` masks the logits in place on their own
  device; columns past the tokenizer's vocabulary (padded LM heads) are always
  disallowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch import Tensor


class GrammarMatcher(ABC):
    """Per-request grammar state."""

    supports_rollback: bool = False

    @abstractmethod
    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row]; the state is unchanged."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (when supports_rollback)."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")


class GrammarBackend(ABC):
    name: str = "base"

    def __init__(self, compile_threads: int = 1) -> None:
        self.compile_threads = compile_threads
        self._pool: ThreadPoolExecutor | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Width of the bitmask in tokens: the model's vocabulary size."""

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar; ValueError naming the problem otherwise."""

    @abstractmethod
    def matcher(self, grammar: Any) -> GrammarMatcher:
        ...

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> Tensor:
        ...

    @abstractmethod
    def apply_bitmask(self, logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
        """logits[r, t] = -inf where bitmask[r] forbids t, for r in rows, in place."""

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Tensor,
                      rows: list[int]) -> None:
        """matchers[i] fills bitmask[rows[i]]; backends may batch this."""
        for m, row in zip(matchers, rows, strict=True):
            m.fill_bitmask(bitmask, row)

    def compile_async(self, kind: str, spec: str) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.compile_threads,
                                            thread_name_prefix="grammar-compile")
        return self._pool.submit(self.compile, kind, spec)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
