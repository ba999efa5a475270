"""Grammar backend on xgrammar: JSON schema, regex and EBNF compiled to a
pushdown automaton over the tokenizer's vocabulary, with per-token masks
precomputed at compile time (so a mask costs tens of microseconds per row)."""

from __future__ import annotations

import re
from typing import Any

import torch
import xgrammar as xgr
from torch import Tensor

from radixlm.constrained.base import GrammarBackend, GrammarMatcher
from radixlm.constrained.spec import check_json_schema

# The compiled-grammar cache is bounded so a stream of distinct schemas cannot
# grow the scheduler's memory without limit.
CACHE_LIMIT_BYTES = 256 << 20
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need
# only the sentence after it.
_CPP_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?\S+\.(cc|h):\d+:\s*")


class XGrammarMatcher(GrammarMatcher):
    supports_rollback = True

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.m = matcher

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self.m.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 compile_threads: int = 1) -> None:
        """`vocab_size` is the model's (the LM head's width), which may differ from
        the tokenizer's length: xgrammar masks the ids the tokenizer lacks."""
        super().__init__(compile_threads)
        self._vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=compile_threads,
                                            cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._batch = xgr.BatchGrammarMatcher(max_threads=compile_threads)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        if kind == "json_schema":
            check_json_schema(spec)
        try:
            return self._compile(kind, spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{kind} is invalid: {clean_error(e)}") from None

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        if kind == "json_schema":
            # Fixed separators and no free whitespace: small models otherwise tend
            # to fill the token budget with newlines between fields.
            return self.compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "ebnf":
            return self.compiler.compile_grammar(spec)
        raise ValueError(f"unknown grammar kind {kind!r}")

    def matcher(self, grammar: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(grammar))

    def allocate_bitmask(self, rows: int) -> Tensor:
        return xgr.allocate_token_bitmask(rows, self._vocab_size)

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Tensor,
                      rows: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        handles = [m.m for m in matchers if isinstance(m, XGrammarMatcher)]
        assert len(handles) == len(matchers), "matchers of another backend"
        self._batch.batch_fill_next_token_bitmask(handles, bitmask, rows)

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        width = min(logits.shape[1], self._vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
        if logits.shape[1] > self._vocab_size:  # padded LM head: no real token there
            idx = torch.tensor(rows, device=logits.device)
            logits[idx, self._vocab_size:] = float("-inf")


def clean_error(e: BaseException) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__
