"""Shapes shared by the API layers: per-sequence output accumulation (SGLang's
`text`/`output_ids`/`meta_info` dict), SSE framing, JSON-safe floats.

`SeqOutput` is the server's equivalent of the offline Engine's `_accumulate`:
it folds the incremental `StrOut` messages of one sequence into the
cumulative result that non-streaming responses and native stream chunks show.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request, Response

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
        self.finish_reason = t.finish_reason

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

    def meta_info(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens}
        if self.return_logprob:
            meta["output_token_logprobs"] = _safe_pairs(self.output_logprobs)
            meta["output_top_logprobs"] = [_safe_pairs(x) for x in self.output_top_logprobs]
            if self.input_logprobs is not None:
                meta["input_token_logprobs"] = _safe_pairs(self.input_logprobs)
                meta["input_top_logprobs"] = [_safe_pairs(x)
                                              for x in self.input_top_logprobs or []]
        return meta

    def native(self) -> dict[str, Any]:
        """SGLang's /generate result (and stream chunk): cumulative text and ids."""
        return {"text": self.text, "output_ids": list(self.output_ids),
                "meta_info": self.meta_info(), "index": self.index}


def _safe_pairs(pairs: list[list[Any]]) -> list[list[Any]]:
    return [[finite(p[0]), *p[1:]] for p in pairs]


_encoder = msgspec.json.Encoder()


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON. msgspec encodes a streamed chunk several times faster
    than json.dumps, which was ~12% of the API process's time while streaming.
    Callers pass finite floats only (see `finite`): JSON has no inf or NaN."""
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (its body was read already,
    so the next ASGI message can only be the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Run a route handler so that a client disconnect cancels it.

    Starlette does not cancel a handler whose client went away; cancelling it
    here unwinds the `finally` blocks of the request groups it waits on, which
    abort their sequences in the scheduler and free the KV. Streaming responses
    are covered separately: Starlette cancels their body iterator.
    The handler must take the raw request as keyword `raw_request`."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request: Request = kwargs["raw_request"]
        work = asyncio.ensure_future(handler(*args, **kwargs))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            gone.cancel()
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    return wrapper
