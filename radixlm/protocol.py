"""Every message that crosses a process boundary, in one place.

Typed msgspec structs, encoded with msgpack. A tagged union per direction
means a peer can only ever decode these types: no pickle, no arbitrary
objects, nothing executable.

Flow: TokenizerManager --(ToScheduler)--> Scheduler --(ToDetokenizer)-->
DetokenizerManager --(ToTokenizer)--> TokenizerManager. Control replies go
from the Scheduler straight back to the TokenizerManager.
"""

from __future__ import annotations

from typing import Any

import msgspec


class GenerateReq(msgspec.Struct, tag=True):
    """One sequence to generate (n > 1 is expanded into n of these by the caller)."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams fields, validated by the sender
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: no prompt logprobs
    session_params: dict[str, Any] | None = None
    # Higher runs first under --enable-priority-scheduling (SGLang's and vLLM's field).
    priority: int = 0
    # Prefix-cache namespace (cache/base.py), set by the front end: requests share
    # cached KV only within one (an adapter, a set of images); 0 is plain text.
    namespace: int = 0
    # Stamp this request's way to its first output (TokenOut.timing).
    return_timing: bool = False
    # The prompt as embeddings instead of tokens (SGLang's `input_embeds`): float32
    # little-endian, row-major [len(input_ids), hidden]; `input_ids` are placeholders.
    input_embeds: bytes | None = None


class AbortReq(msgspec.Struct, tag=True):
    rid: str | None = None
    abort_all: bool = False


class ControlReq(msgspec.Struct, tag=True):
    """A call of a scheduler method by name with JSON-like arguments.

    `method` is looked up in the scheduler's explicit allow-list of control
    methods (flush_cache, get_server_info, ...); anything else is refused.
    """

    req_id: int
    method: str
    args: dict[str, Any] = {}


class ControlReply(msgspec.Struct, tag=True):
    req_id: int
    success: bool
    result: Any = None
    message: str = ""


class TokenOut(msgspec.Struct):
    """Progress of one request since the previous message about it."""

    rid: str
    new_token_ids: list[int]
    finish_reason: dict[str, Any] | None  # {"type": "stop"|"length"|"abort", "matched": ...}
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Logprobs of the new tokens: [logprob, token_id] and, when asked, top-k lists.
    output_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]]] | None = None
    input_logprobs: list[list[Any]] | None = None  # sent once, with the first message
    input_top_logprobs: list[list[list[Any]]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: list[str] = []  # stop strings: the detokenizer holds back text that may start one
    embedding: list[float] | None = None  # --is-embedding: the pooled, normalized vector
    # Speculative decoding, so far: verify steps with drafts, drafts kept.
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    # GenerateReq.return_timing: on the request's first output only, time.monotonic()
    # (one clock for every process of the host) at each hop: "sched_recv" (its frame
    # read), "step_start" (the first step after that began), "first_token" (the step
    # that produced this output ended), "sched_send" (this batch encoded and sent),
    # "detok_recv", "detok_send"; the API process adds its own (radixlm/bench/ttft.py).
    timing: dict[str, float] | None = None


class BatchTokenOut(msgspec.Struct, tag=True):
    outputs: list[TokenOut]


class StrOut(msgspec.Struct):
    """TokenOut plus the text it decodes to."""

    token: TokenOut
    new_text: str


class BatchStrOut(msgspec.Struct, tag=True):
    outputs: list[StrOut]


class ProcessReady(msgspec.Struct, tag=True):
    """Sent once by a child process to the TokenizerManager when it can serve.

    `info` carries what the front end needs to validate requests itself
    (the scheduler's max_total_tokens, context_len, vocab_size, ...)."""

    process: str  # "scheduler" | "detokenizer"
    pid: int
    info: dict[str, Any] = {}


class LoadReport(msgspec.Struct, tag=True):
    """A data-parallel replica's load, sent to the controller when it changes.

    `num_received` counts the GenerateReqs the replica has taken in so far, so
    the controller knows which of the requests it routed are not counted yet."""

    dp_rank: int
    num_reqs: int  # running + queued
    num_tokens: int  # their prompt + generated tokens
    num_received: int


ToScheduler = GenerateReq | AbortReq | ControlReq
ToDetokenizer = BatchTokenOut
ToTokenizer = BatchStrOut | ControlReply | ProcessReady
ToController = ControlReply | ProcessReady | LoadReport

_encoder = msgspec.msgpack.Encoder()
_types = {"sched": ToScheduler, "detok": ToDetokenizer, "tok": ToTokenizer,
          "ctrl": ToController}
_decoders = {k: msgspec.msgpack.Decoder(t) for k, t in _types.items()}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _decoders["sched"].decode(data)


def decode_to_detokenizer(data: bytes) -> ToDetokenizer:
    return _decoders["detok"].decode(data)


def decode_to_tokenizer(data: bytes) -> ToTokenizer:
    return _decoders["tok"].decode(data)


def decode_to_controller(data: bytes) -> ToController:
    return _decoders["ctrl"].decode(data)
