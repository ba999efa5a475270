"""SGLang's native API: /generate, /tokenize, /detokenize, /abort_request,
/open_session, /close_session.

/generate takes `text`, `input_ids` or `input_embeds` (one vector of the model's
hidden size per prompt position: such a prompt shares no cached KV), one or a
batch; `sampling_params` one
dict or one per input; `rid` likewise. The answer mirrors the offline
Engine: one dict for one input (a list of n with n > 1), a flat input-major
list for a batch. Stream chunks carry the cumulative `text` and `output_ids`
of their sequence plus `meta_info` and `index` (input-major, as above); the
last chunk of every index carries `meta_info.finish_reason`.
`session_params` (one dict, or one per input) continues a session's earlier
request: see radixlm/scheduler/session.py. `priority` (an integer, or one per
input; higher runs first under --enable-priority-scheduling) likewise. The
call's shapes are normalized by `request_input.native_jobs`, as
Engine.generate's are. `return_timing` (radixlm's extension) adds
`meta_info.timing`: time.monotonic() stamps of each sequence's way through the
processes to its first output (`python -m radixlm.bench ttft` reads them).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixlm.protocol import StrOut
from radixlm.request_input import native_jobs, prompt_ids, prompt_inputs, rids_per_input
from radixlm.server.errors import APIError, from_value_error
from radixlm.server.openai_api import OpenAIServing
from radixlm.server.openai_protocol import (
    AbortRequest,
    CloseSessionRequest,
    DetokenizeRequest,
    GenerateRequest,
    OpenSessionRequest,
    TokenizeRequest,
)
from radixlm.server.tokenizer_manager import SAMPLING_NAMES, TokenizerManager

if TYPE_CHECKING:
    from radixlm.server.embeddings_api import EncodeRequest


class NativeServing:
    def __init__(self, tm: TokenizerManager, tokenizer: Any, openai: OpenAIServing) -> None:
        self.tm = tm
        self.tokenizer = tokenizer
        self.openai = openai  # for its stream plumbing

    # ---- /generate ----------------------------------------------------------------
    def inputs(self, req: GenerateRequest | EncodeRequest) -> tuple[list[list[int]], bool]:
        """Token ids per input (`text` or `input_ids`, one or a batch), and whether the
        call named a single input."""
        try:
            encode = self.tokenizer.encode if self.tokenizer is not None else None
            return prompt_ids(req.text, req.input_ids, encode)
        except ValueError as e:
            raise from_value_error(e) from None

    async def prompts(self, req: GenerateRequest | EncodeRequest) -> tuple[list[list[int]], bool]:
        """`inputs`, encoding text on the tokenizer thread (token ids need no hop)."""
        if req.text is None:
            return self.inputs(req)
        return await self.tm.tokenize(self.inputs, req)

    @staticmethod
    def rids(rid: str | list[str] | None, n: int) -> tuple[str, list[str]]:
        """The call's id and one id per input."""
        try:
            return rids_per_input(rid, n)
        except ValueError as e:
            raise from_value_error(e) from None

    async def generate(self, req: GenerateRequest, raw_request: Request) -> Response:
        received = time.monotonic()
        embeds = None
        if req.input_embeds is not None:
            try:
                inputs, embeds, single = prompt_inputs(req.text, req.input_ids,
                                                       req.input_embeds, None)
            except ValueError as e:
                raise from_value_error(e) from None
        else:
            inputs, single = await self.prompts(req)
        timing = {"received": received, "tokenized": time.monotonic()} \
            if req.return_timing else None
        try:
            gid, jobs = native_jobs(inputs, sampling_params=req.sampling_params, rid=req.rid,
                                    session_params=req.session_params, priority=req.priority,
                                    input_embeds=embeds)
        except ValueError as e:
            raise from_value_error(e, SAMPLING_NAMES) from None
        group = await self.tm.submit(
            jobs, gid=gid, stream=req.stream, return_logprob=req.return_logprob,
            top_logprobs_num=req.top_logprobs_num, logprob_start_len=req.logprob_start_len,
            timing=timing)
        if req.stream:
            def render(idx: int, _: StrOut) -> list[dict[str, Any]]:
                return [group.seqs[idx].native()]

            return await self.openai.respond_stream(group, render, _no_tail)
        seqs = await group.collect()
        results = [s.native() for s in seqs]
        return JSONResponse(results[0] if single and len(results) == 1 else results)

    # ---- sessions -----------------------------------------------------------------------
    async def open_session(self, req: OpenSessionRequest) -> str:
        """The new session's id (SGLang answers it as a bare JSON string)."""
        result = await self._session_control(
            "open_session", capacity_of_str_len=req.capacity_of_str_len,
            session_id=req.session_id or self.tm.new_id())
        return result["session_id"]

    async def close_session(self, req: CloseSessionRequest) -> None:
        await self._session_control("close_session", session_id=req.session_id)

    async def _session_control(self, method: str, **args: Any) -> dict[str, Any]:
        reply = await self.tm.control(method, **args)
        if not reply.success:
            raise APIError(500, reply.message)
        if not reply.result["success"]:
            raise APIError(400, reply.result["message"])
        return reply.result

    # ---- tokens -----------------------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        text = req.text if req.text is not None else req.prompt
        if text is None:
            raise APIError(400, "pass text (or prompt) to tokenize", "text")
        tokens = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        limits = self.tm.require_limits()
        return {"tokens": tokens, "count": len(tokens), "max_model_len": limits.max_seq_len}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        vocab = self.tm.require_limits().vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})",
                           "tokens")
        return {"text": self.tokenizer.decode(req.tokens,
                                              skip_special_tokens=req.skip_special_tokens)}

    # ---- abort ------------------------------------------------------------------------
    def abort(self, req: AbortRequest) -> dict[str, Any]:
        if not req.abort_all and req.rid is None:
            raise APIError(400, "pass rid or abort_all", "rid")
        if not self.tm.abort(req.rid, req.abort_all):
            raise APIError(404, f"no running request with id {req.rid!r}", "rid")
        return {"success": True}


def _no_tail() -> list[dict[str, Any]]:
    return []  # native streams end with [DONE] only
