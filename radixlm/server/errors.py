"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every failure the HTTP layer reports goes through `APIError`, so the native
and the OpenAI routes answer alike. Validation errors are 400, never 422
(OpenAI and vLLM clients expect 400).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

# OpenAI's error `type` per status (the Python client maps statuses the same way).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

logger = logging.getLogger("radixlm.server")

# Sampling-parameter names as the OpenAI API spells them.
OPENAI_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, HTTPStatus(status).phrase)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.err_type)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type or _TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def from_value_error(e: ValueError, known_params: set[str] | None = None) -> APIError:
    """A ValueError raised by input validation ("temperature must be >= 0, ...")
    becomes a 400 whose `param` is the one the error names (`request_input.InputError`)
    or else the parameter its message starts with."""
    message = str(e)
    param = getattr(e, "param", None)
    if param is None:
        first = message.split(" ", 1)[0]
        param = first if known_params and first in known_params else None
    if param is not None:
        public = OPENAI_PARAM_NAMES.get(param, param)
        if message.startswith(param + " "):
            message = public + message[len(param):]
        param = public
    return APIError(400, message, param)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as one readable line, and the field it is about."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('msg', '')}", None
    if not loc and err.get("type") == "missing":  # an empty body
        return "the request body is empty: send a JSON object", None
    if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
        return ("the request body must be a JSON object (send Content-Type: "
                "application/json)"), None
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return f"{where}{err.get('msg', 'invalid value')}", param


def request_id(scope: Mapping[str, Any]) -> str | None:
    """The id the access log gave this request (http_server.AccessLogMiddleware)."""
    state = scope.get("state")
    return state.get("request_id") if isinstance(state, Mapping) else None


def log_refusal(scope: Mapping[str, Any], status: int, message: str,
                param: str | None = None) -> None:
    """Why a request got an error status, with its id, so an operator can see
    why a client fails (the client gets the same message)."""
    where = f" (param {param})" if param else ""
    # A 500 is the server's fault, not the client's: it is an error.
    logger.log(logging.ERROR if status == 500 else logging.INFO, "request %s refused with "
               "%d%s: %s", request_id(scope) or "-", status, where, message)


def refusal(request: Request, err: APIError) -> JSONResponse:
    log_refusal(request.scope, err.status, err.message, err.param)
    return err.response()


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return refusal(request, exc)


async def request_validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc)
    return refusal(request, APIError(400, message, param))


async def value_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return refusal(request, from_value_error(
        exc if isinstance(exc, ValueError) else ValueError(str(exc))))
