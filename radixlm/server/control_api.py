"""Runtime-control endpoints (SGLang's names): weight updates, weights by name,
memory release/resume, profiling, /configure_logging.

Each is a thin front end over a scheduler control method (see
radixlm/scheduler/control.py). A success answers the method's
`{"success": true, "message": ...}` (plus its extra fields) with 200; a refusal
answers 400 with the same two fields *and* OpenAI's error object, so SGLang
clients (which read `success`/`message`) and OpenAI-style clients (which read
`error`) both understand it.

Weight updates close the update gate first (server/update_gate.py, SGLang's
model-update lock): new generate requests wait at the gate, and the update
waits for the running ones to finish (or aborts them with
`abort_all_requests`), so no request sees two sets of weights.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from radixlm.config import LOG_LEVELS, WEIGHT_UPDATE_GROUP
from radixlm.server.errors import APIError

if TYPE_CHECKING:
    from radixlm.server.http_server import ServerState
    from radixlm.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# Loading a checkpoint (or converting a GGUF) and joining a trainer's group can
# take minutes; the scheduler answers when done.
UPDATE_TIMEOUT = 1800.0
# How long a weight update waits for running requests before giving up.
DRAIN_TIMEOUT = 600.0


# ---- request bodies ----------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False


class UpdateWeightsFromTensorRequest(_Body):
    serialized_named_tensors: str  # base64 of safetensors bytes (never pickle)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitWeightsUpdateGroupRequest(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = WEIGHT_UPDATE_GROUP
    backend: str | None = None  # default: nccl on a GPU, gloo on the CPU
    timeout_s: float = 120.0


class DestroyWeightsUpdateGroupRequest(_Body):
    group_name: str = WEIGHT_UPDATE_GROUP


class UpdateWeightsFromDistributedRequest(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = WEIGHT_UPDATE_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False


class GetWeightsByNameRequest(_Body):
    name: str
    truncate_size: int = 100


class MemoryOccupationRequest(_Body):
    tags: list[str] | None = None


class ProfileRequest(_Body):
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None


class ConfigureLoggingRequest(_Body):
    log_level: str | None = None
    dump_requests_folder: str | None = None  # "" turns dumping off
    dump_requests_threshold: int | None = None


class ControlError(APIError):
    """An APIError whose body also carries SGLang's `success: false` and `message`."""

    def body(self) -> dict[str, Any]:
        return {**super().body(), "success": False, "message": self.message}


# ---- the gate ------------------------------------------------------------------------------
def _updating(state: ServerState, abort_all: bool) -> AbstractAsyncContextManager[None]:
    """The update gate closed around a weight update: new requests wait, running
    ones are aborted (`abort_all`) or waited for first."""
    return state.tm.update_gate.closed(functools.partial(_stop_requests, state.tm, abort_all))


async def _stop_requests(tm: TokenizerManager, abort_all: bool,
                         timeout: float = DRAIN_TIMEOUT) -> None:
    if abort_all and tm.num_live_seqs:
        tm.abort(abort_all=True)
    await _drain(tm, timeout)


async def _drain(tm: TokenizerManager, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while tm.num_live_seqs:
        if loop.time() > deadline:
            raise ControlError(503, f"{tm.num_live_seqs} request(s) still running after "
                                f"{timeout:.0f} s; retry, or pass abort_all_requests=true")
        await asyncio.sleep(0.01)


# ---- helpers ---------------------------------------------------------------------------------
async def _control(state: ServerState, method: str, timeout: float = 30.0,
                   **args: Any) -> dict[str, Any]:
    reply = await state.tm.control(method, timeout=timeout, **args)
    if not reply.success:  # the method raised: a bug, not the caller's input
        raise ControlError(500, reply.message)
    return reply.result


def _answer(result: dict[str, Any]) -> JSONResponse:
    if result.get("success"):
        return JSONResponse(result)
    return failure(str(result.get("message") or "the request failed"))


def failure(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    """SGLang's `{"success": false, "message"}` and OpenAI's `error` object in one body."""
    return ControlError(status, message, param).response()


def _decode_base64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ControlError(400, f"serialized_named_tensors is not valid base64: {e}",
                       "serialized_named_tensors") from None


# ---- routes ----------------------------------------------------------------------------------
def add_control_routes(app: FastAPI, state: ServerState) -> None:
    _add_weight_routes(app, state)
    _add_distributed_routes(app, state)
    _add_memory_and_profile_routes(app, state)
    _add_logging_route(app, state)


def _add_weight_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        async with _updating(state, body.abort_all_requests):
            result = await _control(state, "update_weights_from_disk", UPDATE_TIMEOUT,
                                    model_path=body.model_path, load_format=body.load_format,
                                    abort_all_requests=body.abort_all_requests)
        if result["success"]:  # server info reports the weights now served
            state.args = state.args.replace(model_path=body.model_path,
                                            load_format=body.load_format or "auto")
        return _answer(result)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest) -> JSONResponse:
        data = _decode_base64(body.serialized_named_tensors)
        async with _updating(state, body.abort_all_requests):
            result = await _control(state, "update_weights_from_tensor", UPDATE_TIMEOUT,
                                    serialized_named_tensors=data, load_format=body.load_format,
                                    flush_cache=body.flush_cache,
                                    abort_all_requests=body.abort_all_requests)
        return _answer(result)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: GetWeightsByNameRequest) -> JSONResponse:
        result = await _control(state, "get_weights_by_name", name=body.name,
                                truncate_size=body.truncate_size)
        if not result["success"]:
            return failure(result["message"], param="name")
        return JSONResponse(result["values"])  # SGLang answers the bare list


def _add_distributed_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        # The scheduler blocks until the trainer and every rank have joined.
        return _answer(await _control(state, "init_weights_update_group",
                                      body.timeout_s + 30.0, **body.model_dump()))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(
            body: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        return _answer(await _control(state, "destroy_weights_update_group",
                                      group_name=body.group_name))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
            body: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        async with _updating(state, body.abort_all_requests):
            result = await _control(state, "update_weights_from_distributed", UPDATE_TIMEOUT,
                                    **body.model_dump())
        return _answer(result)


def _add_memory_and_profile_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: MemoryOccupationRequest | None = None
                                        ) -> JSONResponse:
        tags = body.tags if body is not None else None
        return _answer(await _control(state, "release_memory_occupation", tags=tags))

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: MemoryOccupationRequest | None = None
                                       ) -> JSONResponse:
        tags = body.tags if body is not None else None
        # Resuming may recapture CUDA graphs: give it time.
        return _answer(await _control(state, "resume_memory_occupation", UPDATE_TIMEOUT,
                                      tags=tags))

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(body: ProfileRequest | None = None) -> JSONResponse:
        args = (body or ProfileRequest()).model_dump()
        return _answer(await _control(state, "start_profile", profile_id=state.tm.new_id(),
                                      **args))

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> JSONResponse:
        # Writing a large trace takes a while.
        return _answer(await _control(state, "stop_profile", UPDATE_TIMEOUT))


def _add_logging_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/configure_logging")
    async def configure_logging(body: ConfigureLoggingRequest) -> JSONResponse:
        level = body.log_level.lower() if body.log_level is not None else None
        if level is not None and level not in LOG_LEVELS:
            return failure(f"log_level={body.log_level!r}: expected one of "
                           f"{', '.join(LOG_LEVELS)}", param="log_level")
        threshold = body.dump_requests_threshold
        if threshold is not None and threshold < 1:
            return failure(f"dump_requests_threshold must be >= 1, got {threshold}",
                           param="dump_requests_threshold")
        try:
            state.tm.dumper.configure(body.dump_requests_folder, threshold)
        except ValueError as e:
            return failure(str(e), param="dump_requests_folder")
        if level is not None:
            result = await _control(state, "configure_logging", log_level=level)
            if not result["success"]:
                return _answer(result)
            logging.getLogger("radixlm").setLevel(level.upper())
        state.args = state.args.replace(**_logging_changes(body, level))
        return JSONResponse({"success": True, "message": "logging configured"})


def _logging_changes(body: ConfigureLoggingRequest, level: str | None) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if level is not None:
        changes["log_level"] = level
    if body.dump_requests_folder is not None:
        changes["dump_requests_folder"] = body.dump_requests_folder or None
    if body.dump_requests_threshold is not None:
        changes["dump_requests_threshold"] = body.dump_requests_threshold
    return changes
