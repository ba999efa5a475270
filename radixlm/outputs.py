"""One sequence's output, accumulated from the scheduler's incremental messages.

`SeqOutput` folds the `StrOut` messages of one sequence (one scheduler request)
into SGLang's result shape: `text`, `output_ids`, `meta_info` and `index`. The
offline Engine and the server's API layers both build their results with it;
the server asks for JSON-safe floats (`finite`), the Engine keeps -inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from radixlm.protocol import StrOut

# JSON has no -inf; vLLM reports impossible tokens' logprobs as this instead.
MIN_LOGPROB = -9999.0


def finite(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else MIN_LOGPROB


@dataclass
class SeqOutput:
    """Everything known so far about one sequence (one scheduler request)."""

    rid: str
    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    return_logprob: bool = False
    embedding: list[float] | None = None  # --is-embedding
    timing: dict[str, float] | None = None  # stamps of its way through the server, if asked
    spec_verify_ct: int = 0  # speculative decoding: verify steps with drafts
    spec_accepted_drafts: int = 0

    def update(self, out: StrOut) -> None:
        t = out.token
        self.text += out.new_text
        self.output_ids += t.new_token_ids
        if t.output_logprobs is not None:
            self.output_logprobs += t.output_logprobs
        if t.output_top_logprobs is not None:
            self.output_top_logprobs += t.output_top_logprobs
        if t.input_logprobs is not None:
            self.input_logprobs = t.input_logprobs
            self.input_top_logprobs = t.input_top_logprobs
        self.prompt_tokens = t.prompt_tokens
        self.completion_tokens = t.completion_tokens
        self.cached_tokens = t.cached_tokens
        self.spec_verify_ct = t.spec_verify_ct
        self.spec_accepted_drafts = t.spec_accepted_drafts
        self.finish_reason = t.finish_reason
        if t.embedding is not None:
            self.embedding = t.embedding
        if t.timing is not None:
            self.timing = {**(self.timing or {}), **t.timing}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def error_status(self) -> int | None:
        """The HTTP status of a sequence the server refused or failed (else None)."""
        fr = self.finish_reason
        return fr.get("status_code") if fr else None

    @property
    def error_message(self) -> str:
        return str((self.finish_reason or {}).get("message", "request failed"))

    def meta_info(self, json_safe: bool = True) -> dict[str, Any]:
        """`json_safe`: logprobs of -inf become MIN_LOGPROB (JSON has no -inf)."""
        pairs = _safe_pairs if json_safe else _copy_pairs
        meta: dict[str, Any] = {
            "id": self.rid, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens}
        if self.return_logprob:
            meta["output_token_logprobs"] = pairs(self.output_logprobs)
            meta["output_top_logprobs"] = [pairs(x) for x in self.output_top_logprobs]
            if self.input_logprobs is not None:
                meta["input_token_logprobs"] = pairs(self.input_logprobs)
                meta["input_top_logprobs"] = [pairs(x) for x in self.input_top_logprobs or []]
        if self.timing is not None:
            meta["timing"] = dict(self.timing)
        if self.spec_verify_ct:
            meta["spec_verify_ct"] = self.spec_verify_ct
            meta["spec_accepted_drafts"] = self.spec_accepted_drafts
            # Tokens per verify step (the drafts it kept and its own one).
            meta["spec_accept_length"] = 1 + self.spec_accepted_drafts / self.spec_verify_ct
        return meta

    def native(self, json_safe: bool = True) -> dict[str, Any]:
        """SGLang's /generate and Engine.generate result (and stream chunk):
        cumulative text and ids; `embedding` when the model serves embeddings."""
        result = {"text": self.text, "output_ids": list(self.output_ids),
                  "meta_info": self.meta_info(json_safe), "index": self.index}
        if self.embedding is not None:
            result["embedding"] = self.embedding
        return result


def _safe_pairs(pairs: list[list[Any]]) -> list[list[Any]]:
    return [[finite(p[0]), *p[1:]] for p in pairs]


def _copy_pairs(pairs: list[list[Any]]) -> list[list[Any]]:
    return [list(p) for p in pairs]
