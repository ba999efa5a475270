"""Request bodies of the OpenAI-compatible API (pydantic), field by field after
OpenAI's reference and vLLM's `protocol.py`, plus the native /generate body.

Unknown fields are accepted and ignored, as vLLM does, so clients written
for newer API versions keep working. Values are range-checked later, by
`SamplingParams.validate`, so every route reports the same message for the
same mistake.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingExtensions(_Lenient):
    """vLLM's extensions to OpenAI's sampling fields (same names)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (SGLang's extension names); at most one of them, and
    # not with a chat request's JSON response_format.
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None


# SamplingParams enforces the same range later; it is checked here too because
# the API layer sizes per-choice lists from `n` before that (an `n` of 10**30
# used to build a list of that length and block the event loop for good).
MAX_N = 128


class _CommonRequest(SamplingExtensions):
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Higher runs first under --enable-priority-scheduling (vLLM's and SGLang's field).
    # Any: request_input.check_priority refuses bools and floats (a typed field coerces).
    priority: Any = None


class CompletionRequest(_CommonRequest):
    # The order matters: pydantic's smart union tries for an exact match.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; null: up to the context length
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Lenient):
    type: str
    text: str | None = None


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # accepted; forced calls are always constrained exactly


class ChatTool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(_Lenient):
    """A call the assistant made earlier in the conversation."""

    name: str
    # OpenAI sends a JSON string; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}};
    # checked by tool_calls.plan_tools, whose messages are clearer than a union's.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateRequest(_Lenient):
    """SGLang's native /generate body."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    # {"id", "rid", "offset", "replace"}: continue a session (radixlm/scheduler/session.py)
    session_params: dict[str, Any] | list[dict[str, Any]] | None = None
    # An integer, or one per input (SGLang's shape); request_input.check_priority
    # refuses bools and floats, which a typed field would coerce.
    priority: Any = None
    return_timing: bool = False  # meta_info.timing: stamps per hop (bench ttft)
    # One vector (hidden size) per prompt position, or one such list per input:
    # shapes are checked by request_input, which names what is wrong.
    input_embeds: Any = None


class TokenizeRequest(_Lenient):
    text: str | None = None
    prompt: str | None = None  # vLLM's name for the same field
    add_special_tokens: bool = True


class DetokenizeRequest(_Lenient):
    tokens: list[int]
    skip_special_tokens: bool = False


class AbortRequest(_Lenient):
    rid: str | None = None
    abort_all: bool = False


class OpenSessionRequest(_Lenient):
    capacity_of_str_len: int  # the most input tokens of a session request (0: no limit)
    session_id: str | None = None


class CloseSessionRequest(_Lenient):
    session_id: str


Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = Role.__args__  # type: ignore[attr-defined]
