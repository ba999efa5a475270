"""The FastAPI app: routes, the access log, the request guard (API key, body
size), error mapping.

Generation routes run under `with_cancellation`, so a client that goes away
cancels its handler and the request is aborted in the scheduler. The access log
and the guard are plain ASGI middleware (not BaseHTTPMiddleware), which would
buffer streaming responses and hide client disconnects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import re
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm import __version__
from radixlm.config import ServerArgs
from radixlm.sampling_params import SamplingParams
from radixlm.server.chat_output import chat_parsers
from radixlm.server.control_api import add_control_routes
from radixlm.server.dashboard import add_dashboard_routes
from radixlm.server.embeddings_api import (
    EmbeddingServing,
    add_embedding_routes,
    refuse_generation,
)
from radixlm.server.errors import (
    APIError,
    api_error_handler,
    error_body,
    log_refusal,
    refusal,
    request_validation_handler,
)
from radixlm.server.io import dumps, with_cancellation
from radixlm.server.metrics import Metrics
from radixlm.server.native_api import NativeServing
from radixlm.server.openai_api import OpenAIServing
from radixlm.server.openai_protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CloseSessionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    OpenSessionRequest,
    TokenizeRequest,
)
from radixlm.server.responses_api import ResponsesServing, add_responses_routes
from radixlm.server.tokenizer_manager import PromptJob, TokenizerManager

MAX_BODY_BYTES = 8 << 20
# Total size of the request headers. uvicorn's h11 parser refuses only much
# larger ones (about 1 MB, measured) and httptools has no limit of its own;
# 64 KiB is twice what nginx accepts by default, so no real client is refused.
MAX_HEADER_BYTES = 64 << 10
# Reachable without the API key: probes, and load figures (the dashboard's are /metrics').
OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard/data"})
HEALTH_GENERATE_TIMEOUT = 30.0
# A client's own X-Request-Id is kept when it is this plain (it goes into log lines).
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
access_logger = logging.getLogger("radixlm.access")


@dataclass
class ServerState:
    args: ServerArgs
    tm: TokenizerManager
    tokenizer: Any
    served_name: str
    model_dir: str
    metrics: Metrics | None = None
    warmup_ids: tuple[int, ...] = (1,)
    ready: bool = False
    draining: bool = False
    dead: str | None = None

    def unhealthy_reason(self) -> str | None:
        if self.dead:
            return self.dead
        if self.draining:
            return "the server is shutting down"
        return None if self.ready else "the server is starting"


# ---- the access log --------------------------------------------------------------------
class AccessLogMiddleware:
    """Gives every HTTP request an id (the client's X-Request-Id when it sends a
    plain one, else a new one), returns it in the X-Request-Id response header,
    and, when `enabled`, logs one line per request once its response is complete,
    as uvicorn's access log does, with the latency and the id added:

        127.0.0.1:50312 - "POST /v1/chat/completions HTTP/1.1" 400 Bad Request 3.1 ms req-1f...

    A stream's latency is its whole duration. The id is `scope["state"]["request_id"]`,
    which the error handlers log a refusal's reason with (errors.log_refusal)."""

    def __init__(self, app: ASGIApp, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given and _CLIENT_REQUEST_ID.fullmatch(given) \
            else f"req-{uuid.uuid4().hex[:24]}"
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.monotonic()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            if status is None:
                status = 500  # Starlette's outermost handler answers it
            raise
        finally:
            if self.enabled:
                self._log(scope, status, time.monotonic() - t0, rid)

    @staticmethod
    def _log(scope: Scope, status: int | None, seconds: float, rid: str) -> None:
        client = scope.get("client")
        addr = f"{client[0]}:{client[1]}" if client else "-"
        path = scope.get("raw_path", b"").decode("latin-1") or scope["path"]
        if scope.get("query_string") and "?" not in path:
            path += "?" + scope["query_string"].decode("latin-1")
        try:
            shown = f"{status} {HTTPStatus(status).phrase}" if status else "- (no response)"
        except ValueError:
            shown = str(status)
        access_logger.info('%s - "%s %s HTTP/%s" %s %.1f ms %s', addr, scope["method"], path,
                           scope.get("http_version", "1.1"), shown, seconds * 1e3, rid)


# ---- the guard -----------------------------------------------------------------------
class GuardMiddleware:
    """Header size limit, API key (constant-time compare) and request-body size
    limit, before routing."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int = MAX_BODY_BYTES):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers", ()))
        if header_bytes > MAX_HEADER_BYTES:
            await _send_error(scope, send, 431, f"the request headers ({header_bytes} bytes) "
                                                f"exceed the limit of {MAX_HEADER_BYTES} bytes")
            return
        if self.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            await _send_error(scope, send, 401, "invalid or missing API key (send the header "
                                                "'Authorization: Bearer <key>')")
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _send_error(scope, send, 413, self._too_large(int(declared)))
            return
        body = await self._read_body(receive)
        if body is None:
            return  # the client left before sending its body
        if len(body) > self.max_body:
            await _send_error(scope, send, 413, self._too_large(len(body)))
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  self.api_key)

    def _too_large(self, size: int) -> str:
        return f"the request body ({size} bytes) exceeds the limit of {self.max_body} bytes"

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or a prefix just over the limit (enough to refuse it)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False) or size > self.max_body:
                return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body to the app once, then the real channel (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(scope: Scope, send: Send, status: int, message: str) -> None:
    log_refusal(scope, status, message)
    body = dumps(error_body(status, message))
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return refusal(request, APIError(exc.status_code, _body_error_detail(exc)))


def _body_error_detail(exc: StarletteHTTPException) -> str:
    """FastAPI reports every body it cannot parse, other than invalid JSON syntax,
    as "There was an error parsing the body"; the cause it chains says why."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {cause}"
    if isinstance(cause, RecursionError):
        return "the request body's JSON is nested too deeply"
    if cause is not None and exc.status_code == 400:
        return f"the request body could not be parsed: {type(cause).__name__}: {cause}"
    return str(exc.detail)


async def _internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # Starlette raises the exception on after this answer: uvicorn logs its traceback.
    return refusal(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


# ---- the app -------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="radixlm", version=__version__)
    app.add_middleware(GuardMiddleware, api_key=state.args.api_key)
    # Added last, so it is outermost: the guard's refusals get their line too.
    app.add_middleware(AccessLogMiddleware, enabled=not state.args.disable_uvicorn_access_log)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, request_validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
    tm = state.tm
    openai = OpenAIServing(tm, state.tokenizer, state.served_name, state.args.model_path,
                           chat_parsers(state.args, state.tokenizer))
    native = NativeServing(tm, state.tokenizer, openai)
    add_embedding_routes(app, EmbeddingServing(tm, state.tokenizer, native, state.args,
                                               state.model_dir))
    _add_health_routes(app, state)
    _add_info_routes(app, state)
    add_control_routes(app, state)  # weights, memory, profiling, logging (control_api.py)
    add_dashboard_routes(app, state)  # dashboard.py
    add_responses_routes(app, ResponsesServing(openai),
                         lambda: refuse_generation(state.args))  # responses_api.py

    @app.post("/generate")
    @with_cancellation
    async def generate(request: GenerateRequest, raw_request: Request) -> Response:
        refuse_generation(state.args)
        return await native.generate(request, raw_request)

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        refuse_generation(state.args)
        return await openai.completions(request, raw_request)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat_completions(request: ChatCompletionRequest,
                               raw_request: Request) -> Response:
        refuse_generation(state.args)
        return await openai.chat(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return openai.list_models()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        return openai.get_model(model_id)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        return native.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        return native.detokenize(request)

    @app.post("/abort_request")
    async def abort_request(request: AbortRequest) -> dict[str, Any]:
        return native.abort(request)

    @app.post("/open_session")
    async def open_session(request: OpenSessionRequest) -> str:
        return await native.open_session(request)

    @app.post("/close_session")
    async def close_session(request: CloseSessionRequest) -> Response:
        await native.close_session(request)
        return Response(status_code=200)

    return app


def _add_health_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = state.unhealthy_reason()
        return Response(status_code=200) if reason is None else APIError(503, reason).response()

    @app.get("/health_generate")
    async def health_generate() -> Response:
        reason = state.unhealthy_reason()
        if reason is not None:
            raise APIError(503, reason)
        job = PromptJob(state.tm.new_id("health-"), list(state.warmup_ids),
                        SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0.0}))
        group = await state.tm.submit([job], gid=job.rid, internal=True)
        try:
            await asyncio.wait_for(group.collect(), HEALTH_GENERATE_TIMEOUT)
        except TimeoutError:
            raise APIError(503, f"no token generated within {HEALTH_GENERATE_TIMEOUT:.0f} s"
                           ) from None
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(404, "metrics are off; start the server with --enable-metrics")
        if state.dead is None:
            reply = await state.tm.control("get_server_info", timeout=5.0)
            if reply.success:
                state.metrics.set_scheduler_state(reply.result)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        limits = state.tm.require_limits()
        return {"model_path": state.args.model_path or state.served_name,
                "tokenizer_path": state.args.tokenizer_path or state.model_dir,
                "served_model_name": state.served_name,
                "is_generation": not state.args.is_embedding,
                "context_length": limits.context_len, "vocab_size": limits.vocab_size}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        reply = await state.tm.control("get_server_info")
        if not reply.success:
            raise APIError(500, reply.message)
        args = dataclasses.asdict(state.args)
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return {**reply.result, "server_args": args, "version": __version__,
                "served_model_name": state.served_name, "process_pids": state.tm.child_pids,
                "api_live_seqs": state.tm.num_live_seqs,
                "api_tracked_ids": state.tm.num_tracked_ids}

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        reply = await state.tm.control("flush_cache")
        if not reply.success:
            raise APIError(500, reply.message)
        if not reply.result["success"]:
            raise APIError(400, reply.result["message"])
        return reply.result
