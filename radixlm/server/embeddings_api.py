"""Embeddings over HTTP: OpenAI's /v1/embeddings and SGLang's native /encode.

Served by a server started with `--is-embedding` (the vectors come from
radixlm/scheduler/embedding.py: the pooled final hidden state, L2-normalized).
On a generation server these routes answer 400, and on an embedding server
the generation routes do (`refuse_generation`).

/v1/embeddings follows OpenAI: `input` is a string, a list of strings, a list
of token ids or a list of such lists; `encoding_format` "float" (a list of
numbers) or "base64" (the little-endian float32 bytes, which the `openai`
client asks for by default); `dimensions` must be the model's hidden size
(vectors are not truncated); usage counts prompt tokens.
/encode takes `text` or `input_ids` (one or a batch) and answers
`{"embedding", "meta_info"}` per input, a list for a batch (SGLang's shape).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from radixlm.config import ServerArgs
from radixlm.sampling_params import SamplingParams
from radixlm.server.errors import APIError
from radixlm.server.io import SeqOutput, with_cancellation
from radixlm.server.native_api import NativeServing
from radixlm.server.tokenizer_manager import PromptJob, TokenizerManager, raise_if_failed

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings call


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # The order matters: pydantic's smart union tries for an exact match.
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EncodeRequest(BaseModel):
    """SGLang's native /encode body."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None


def refuse_generation(args: ServerArgs) -> None:
    """Generation routes call this first: an embedding server has no sampler path."""
    if args.is_embedding:
        raise APIError(400, "this server serves embeddings (--is-embedding), not text "
                            "generation: use /v1/embeddings or /encode")


class EmbeddingServing:
    def __init__(self, tm: TokenizerManager, tokenizer: Any, native: NativeServing,
                 args: ServerArgs, model_dir: str) -> None:
        self.tm = tm
        self.tokenizer = tokenizer
        self.native = native  # /encode takes /generate's inputs and rids
        self.openai = native.openai
        self.args = args
        self.model_dir = model_dir
        self._hidden_size: int | None = None

    def require_embedding_server(self) -> None:
        if not self.args.is_embedding:
            raise APIError(400, "this server generates text; start it with --is-embedding to "
                                "serve embeddings")

    @property
    def hidden_size(self) -> int:
        """The embedding dimension (read once from the model's config)."""
        if self._hidden_size is None:
            from radixlm.models.model_source import config_dict

            self._hidden_size = int(config_dict(self.model_dir)["hidden_size"])
        return self._hidden_size

    async def embed(self, inputs: list[list[int]],
                    rids: list[str], gid: str) -> list[tuple[list[float], SeqOutput]]:
        """Vector and finished sequence per input, in order; a refused or failed
        input raises its APIError (the call fails whole, as OpenAI's does)."""
        params = SamplingParams.from_dict({"max_new_tokens": 0})
        jobs = [PromptJob(rid, ids, params) for rid, ids in zip(rids, inputs, strict=True)]
        group = await self.tm.submit(jobs, gid=gid)
        vectors: list[list[float] | None] = [None] * len(jobs)
        async for idx, out in group.events():
            if out.token.embedding is not None:
                vectors[idx] = out.token.embedding
        raise_if_failed(group.seqs)
        for vec, seq in zip(vectors, group.seqs, strict=True):
            if vec is None:  # aborted (/abort_request, shutdown) before it was computed
                raise APIError(503, f"request {seq.rid} ended without an embedding: "
                                    f"{seq.error_message}")
        return [(vec, seq) for vec, seq in zip(vectors, group.seqs, strict=True)
                if vec is not None]

    # ---- /v1/embeddings -----------------------------------------------------------------
    def openai_inputs(self, value: str | list[str] | list[int] | list[list[int]]
                      ) -> list[list[int]]:
        if isinstance(value, str):
            value = [value]
        if not value:
            raise APIError(400, "input must not be empty", "input")
        if len(value) > MAX_INPUTS and not isinstance(value[0], int):
            raise APIError(400, f"input has {len(value)} items; at most {MAX_INPUTS} per "
                                f"call", "input")
        if isinstance(value[0], int):
            return [list(value)]  # type: ignore[arg-type]
        if isinstance(value[0], str):
            return [self.tokenizer.encode(t) for t in value]  # type: ignore[union-attr]
        return [list(x) for x in value]  # type: ignore[arg-type]

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        self.require_embedding_server()
        self.openai.check_model(req.model)
        if req.dimensions is not None and req.dimensions != self.hidden_size:
            raise APIError(400, f"dimensions={req.dimensions} is not supported: this model's "
                                f"embeddings have {self.hidden_size} dimensions", "dimensions")
        inputs = await self.tm.tokenize(self.openai_inputs, req.input)
        gid = self.tm.new_id("embd-")
        results = await self.embed(inputs, [f"{gid}-{i}" for i in range(len(inputs))], gid)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(vec) if req.encoding_format == "base64" else vec}
                for i, (vec, _) in enumerate(results)]
        tokens = sum(seq.prompt_tokens for _, seq in results)
        return {"object": "list", "data": data, "model": self.openai.served_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # ---- /encode ------------------------------------------------------------------------
    async def encode(self, req: EncodeRequest) -> Response:
        self.require_embedding_server()
        inputs, single = await self.native.prompts(req)
        gid, rids = self.native.rids(req.rid, len(inputs))
        results = [{"embedding": vec, "meta_info": seq.meta_info()}
                   for vec, seq in await self.embed(inputs, rids, gid)]
        return JSONResponse(results[0] if single else results)


def _base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def add_embedding_routes(app: FastAPI, serving: EmbeddingServing) -> None:
    @app.post("/v1/embeddings")
    @with_cancellation
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> dict[str, Any]:
        return await serving.embeddings(request)

    @app.post("/encode")
    @with_cancellation
    async def encode(request: EncodeRequest, raw_request: Request) -> Response:
        return await serving.encode(request)
