"""The body of OpenAI's Responses API (`POST /v1/responses`) and its
translation into a chat request, field by field after OpenAI's reference.

What the server cannot honour is refused with a 400 naming the field
(built-in tools, background mode, reasoning effort, images and files in the
input, ...), never ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixlm.server.errors import APIError
from radixlm.server.openai_protocol import MAX_N, ChatCompletionRequest


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default: the response can be read back by id
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    # SGLang's constrained-decoding extensions, as on the chat route.
    regex: str | None = None
    ebnf: str | None = None
    # Refused unless left unset (see `refuse_unsupported`).
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)


# Fields this server cannot honour, and the value that means "not asked for".
_UNSUPPORTED = {"background": (None, False), "reasoning": (None,), "top_logprobs": (None, 0),
                "max_tool_calls": (None,), "conversation": (None,), "prompt": (None,),
                "include": (None, []), "truncation": (None, "disabled"), "n": (1,)}
TEXT_PARTS = ("input_text", "output_text", "text")


def refuse_unsupported(req: ResponsesRequest) -> None:
    for name, unset in _UNSUPPORTED.items():
        if getattr(req, name) not in unset:
            raise APIError(400, f"{name} is not supported by this server", name)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (without `instructions`)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"),
                             "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last["content"]:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else _text(output, f"input[{i}].output")})
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise APIError(400, f"input[{i}].type {kind!r} is not supported (message, "
                                f"function_call, function_call_output, reasoning)",
                           f"input[{i}].type")
    return messages


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}[{j}]: only text parts are supported, got {kind!r}",
                           f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's nested ones."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}].type {t.get('type')!r} is not supported: only "
                                f"function tools", f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or '
                                '{"type": "function", "name": ...}', "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got "
                        f"{kind!r}", "text.format.type")


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[
        ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request to run, and the conversation so far without the
    instructions (what a later `previous_response_id` continues)."""
    refuse_unsupported(req)
    conversation = history + chat_messages(req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if not conversation:
        raise APIError(400, "input must not be empty", "input")
    body = {"model": req.model, "messages": system + conversation,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls, "stream": req.stream,
            "response_format": response_format(req.text), "user": req.user,
            "regex": req.regex, "ebnf": req.ebnf}
    try:
        return ChatCompletionRequest.model_validate(body), conversation
    except ValidationError as e:  # a malformed input item or tool, by its chat field
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", where) from None
