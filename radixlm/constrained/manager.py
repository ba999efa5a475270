"""The scheduler's side of constrained decoding.

A request with a grammar waits here (not in the waiting queue) while its grammar
compiles on the backend's thread pool, and joins the waiting queue once the
compile is done (at once, if the same grammar was compiled recently); a grammar
that fails to compile finishes its request with an abort carrying the error and
HTTP status 400. At sampling time the manager
masks the logits of grammar rows and advances each matcher by the sampled token.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch
from torch import Tensor

from radixlm.constrained.base import GrammarBackend
from radixlm.constrained.spec import grammar_spec, precheck
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.req import Req

logger = logging.getLogger(__name__)

# Compiled grammars kept by (kind, spec): a request whose grammar was compiled
# recently (by the Engine's validation, or an earlier request with the same
# schema) skips the compile pool and joins the waiting queue at once. Small,
# since the backend has its own (byte-bounded) cache behind this one.
RECENT_GRAMMARS = 64


class GrammarManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend] | None, backend_name: str,
                 max_rows: int, unavailable: str | None = None) -> None:
        """`make_backend` builds the backend when the first grammar arrives (the
        xgrammar one costs a CPU scheduler ~40 MiB, resident for good, and
        ~0.3 s once); None: grammars are refused, with `unavailable` as the
        reason."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.backend_name = backend_name
        self.unavailable = unavailable
        self.max_rows = max_rows
        self.pending: list[tuple[Req, Future[Any]]] = []
        self._recent: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._recent_lock = threading.Lock()  # validate() runs on callers' threads
        self.bitmask: Tensor | None = None

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use; only called once `check_servable`
        has let a grammar in."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    if self._make_backend is None:
                        raise ValueError(f"constrained decoding is unavailable: "
                                         f"{self.unavailable}")
                    try:
                        backend = self._make_backend()
                    except Exception as e:  # refuse grammars from now on, serve the rest
                        logger.exception("the %s grammar backend failed to start",
                                         self.backend_name)
                        self._make_backend = None
                        self.unavailable = f"the {self.backend_name} backend failed to start: {e}"
                        raise ValueError(f"constrained decoding is unavailable: "
                                         f"{self.unavailable}") from e
                    bitmask = backend.allocate_bitmask(self.max_rows)
                    if torch.cuda.is_available():
                        bitmask = bitmask.pin_memory()  # async copies to the GPU
                    self.bitmask, self._backend = bitmask, backend
        return self._backend

    # ---- admission --------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        """Cheap checks: ValueError if the grammar is malformed or cannot be served."""
        precheck(params, self.backend_name)
        self.check_servable(params)

    def check_servable(self, params: SamplingParams) -> None:
        """At add_request (the front end ran `precheck`): ValueError if this scheduler
        cannot serve a grammar at all."""
        spec = grammar_spec(params)
        if spec is not None and self._make_backend is None:
            raise ValueError(f"{spec[0]} needs constrained decoding, which is unavailable: "
                             f"{self.unavailable}")

    def validate(self, params: SamplingParams) -> None:
        """Full check (compiles, synchronously) for callers that can afford to wait,
        e.g. the offline Engine before submitting; the request then finds its grammar
        among the recent ones and skips the compile pool."""
        self.check(params)
        spec = grammar_spec(params)
        if spec is not None:
            self._remember(spec, self.backend.compile(*spec))

    def submit(self, req: Req) -> bool:
        """True if the request must wait for its grammar to compile (started here);
        False if it can be scheduled now (no grammar, or one compiled recently)."""
        spec = grammar_spec(req.sampling_params)
        if spec is None:
            return False
        compiled = self._recall(spec)
        if compiled is not None:
            req.grammar = self.backend.matcher(compiled)
            return False
        self.pending.append((req, self.backend.compile_async(*spec)))
        return True

    def _remember(self, spec: tuple[str, str], compiled: Any) -> None:
        with self._recent_lock:
            self._recent[spec] = compiled
            self._recent.move_to_end(spec)
            while len(self._recent) > RECENT_GRAMMARS:
                self._recent.popitem(last=False)

    def _recall(self, spec: tuple[str, str]) -> Any:
        with self._recent_lock:
            compiled = self._recent.get(spec)
            if compiled is not None:
                self._recent.move_to_end(spec)
            return compiled

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def poll(self, timeout: float = 0.0) -> tuple[list[Req], list[Req]]:
        """(ready, failed) requests whose compile finished, waiting up to `timeout`
        seconds for one when none has. Ready ones hold a fresh matcher; failed ones
        are finished with an abort that carries status 400."""
        if timeout > 0 and not any(f.done() for _, f in self.pending):
            wait([f for _, f in self.pending], timeout, return_when=FIRST_COMPLETED)
        return self._collect({r.rid for r, f in self.pending if f.done()})

    def poll_selected(self, rids: list[str]) -> tuple[list[Req], list[Req]]:
        """Like `poll`, for exactly the requests `rids`, waiting for their compiles:
        a tensor-parallel follower admits what rank 0's `poll` admitted."""
        wanted = set(rids)
        wait([f for r, f in self.pending if r.rid in wanted])
        return self._collect(wanted)

    def _collect(self, rids: set[str]) -> tuple[list[Req], list[Req]]:
        ready, failed, still = [], [], []
        for req, fut in self.pending:
            if req.rid not in rids:
                still.append((req, fut))
            elif self._attach(req, fut):
                ready.append(req)
            else:
                failed.append(req)
        self.pending = still
        return ready, failed

    def _attach(self, req: Req, fut: Future[Any]) -> bool:
        try:
            compiled = fut.result()
            req.grammar = self.backend.matcher(compiled)
            spec = grammar_spec(req.sampling_params)
            assert spec is not None
            self._remember(spec, compiled)
            return True
        except ValueError as e:
            req.finished_reason = {"type": "abort", "message": str(e), "status_code": 400}
        except Exception as e:  # a backend bug must fail the request, not the scheduler
            logger.exception("grammar compile failed for request %s", req.rid)
            req.finished_reason = {"type": "abort", "message": f"grammar compile failed: {e}",
                                   "status_code": 500}
        return False

    def discard(self, req: Req) -> None:
        """Forget a request that finished or was aborted while compiling."""
        self.pending = [(r, f) for r, f in self.pending if r is not req]

    # ---- sampling ---------------------------------------------------------------
    def mask_logits(self, reqs: list[Req], logits: Tensor,
                    drafts: list[list[int]] | None = None) -> Tensor:
        """The logits with grammar rows masked: float32, in place when already float32.
        `drafts` (a verify batch): request i has len(drafts[i]) + 1 rows, row j
        masked for the state after its drafts 0..j - 1 (the matcher is walked
        through them and rolled back; rows after a draft the grammar refuses
        keep the refusing state's mask: they cannot be kept)."""
        if drafts is None:
            rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
            matchers = [reqs[i].grammar for i in rows]
        else:
            rows, matchers = self._verify_rows(reqs, drafts)
        if not rows:
            return logits
        backend = self.backend
        if self.bitmask is None or self.bitmask.shape[0] < logits.shape[0]:  # verify rows
            self.bitmask = backend.allocate_bitmask(logits.shape[0])
            if torch.cuda.is_available():
                self.bitmask = self.bitmask.pin_memory()
        bitmask = self.bitmask
        logits = logits.float()
        if drafts is None:
            backend.fill_bitmasks(matchers, bitmask, rows)
        else:
            self._fill_verify(reqs, drafts, bitmask)
        backend.apply_bitmask(logits, bitmask[:logits.shape[0]], rows)
        return logits

    @staticmethod
    def _verify_rows(reqs: list[Req], drafts: list[list[int]]) -> tuple[list[int], list[Any]]:
        rows, matchers, at = [], [], 0
        for req, d in zip(reqs, drafts):
            if req.grammar is not None:
                rows += range(at, at + len(d) + 1)
                matchers.append(req.grammar)
            at += len(d) + 1
        return rows, matchers

    @staticmethod
    def _fill_verify(reqs: list[Req], drafts: list[list[int]], bitmask: Tensor) -> None:
        at = 0
        for req, d in zip(reqs, drafts):
            m = req.grammar
            if m is not None:
                walked = 0
                for j in range(len(d) + 1):
                    if walked < j or m.is_terminated():  # a refused or final draft before
                        bitmask[at + j] = bitmask[at + j - 1]
                        continue
                    m.fill_bitmask(bitmask, at + j)
                    if j < len(d) and m.accept_token(d[j]):
                        walked += 1
                if walked:
                    m.rollback(walked)
            at += len(d) + 1

    @staticmethod
    def advance(req: Req, token_id: int) -> None:
        """Feed the sampled token to the request's matcher; finish the request when
        the grammar terminates (or, never expected, refuses the token)."""
        m = req.grammar
        if m is None:
            return
        if not m.accept_token(token_id):
            # Only reachable when every token was masked (e.g. min_new_tokens banned
            # the stop token the grammar required), so the sampler picked a forbidden one.
            req.finished_reason = {"type": "abort", "message": (
                f"the grammar allows no token at output position {len(req.output_ids) - 1} "
                f"(min_new_tokens or logit_bias may conflict with it)")}
        elif m.is_terminated():
            req.finished_reason = {"type": "stop", "matched": token_id}

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()


def create_grammar_manager(name: str, tokenizer: Any, vocab_size: int,
                           stop_token_ids: frozenset[int], max_rows: int) -> GrammarManager:
    if name == "none":
        return GrammarManager(None, name, max_rows, "the server runs with --grammar-backend none")
    if tokenizer is None:
        return GrammarManager(None, name, max_rows, "there is no tokenizer "
                                                    "(skip_tokenizer_init)")
    if name == "xgrammar":
        def make_backend() -> GrammarBackend:
            from radixlm.constrained.xgrammar_backend import XGrammarBackend

            return XGrammarBackend(tokenizer, vocab_size, sorted(stop_token_ids))

        return GrammarManager(make_backend, name, max_rows)
    raise ValueError(f"grammar_backend must be one of xgrammar, none; got {name!r}")
