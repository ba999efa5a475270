"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`.

A request is translated into a chat request (responses_protocol.py) and
generated like one, with the same template, sampling, tool plans and
parsers; the output becomes Responses' items: `reasoning` (a reasoning
parser's text), `message` (`output_text`) and `function_call`. A stream sends
OpenAI's events, each numbered by `sequence_number`: `response.created`,
`response.in_progress`, per item `response.output_item.added`, its deltas
(`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`) and their `.done` events,
`response.output_item.done`, and last `response.completed` (or
`response.incomplete` at the token limit, `response.failed` on an abort).

`store` (OpenAI's default: true) keeps a finished response in memory, bounded
(the oldest goes first), so it can be read back and continued with
`previous_response_id`; with `store: false` nothing is kept and its id is
unknown afterwards.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.server.chat_output import OutputParser, OutputStream
from radixlm.server.errors import APIError
from radixlm.server.io import dumps, with_cancellation
from radixlm.server.openai_api import (
    OpenAIServing,
    finish_reason,
    first_event,
    grammar_error,
)
from radixlm.server.openai_protocol import ChatCompletionRequest
from radixlm.server.responses_protocol import ResponsesRequest, to_chat_request
from radixlm.server.tokenizer_manager import PromptJob
from radixlm.server.tool_calls import ToolCallReader, ToolPlan

MAX_STORED = 1024
# The chat fields that constrain the output, by this endpoint's names (it has no json_schema).
RESPONSES_GRAMMARS = {"response_format": "text.format", "regex": "regex", "ebnf": "ebnf"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # input and output as chat messages


class ResponseStore:
    """Stored responses by id, the oldest evicted past `capacity`."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            status = 400 if param else 404
            raise APIError(status, f"no stored response with id {response_id!r} (it was "
                                   f"made with store false, deleted, or evicted)", param)
        return stored


# ---- the output as items -------------------------------------------------------------------
class ChatDeltas:
    """One output's chat-style deltas (reasoning_content / content / tool_calls
    pieces), from whichever reader its plan calls for."""

    def __init__(self, plan: ToolPlan, parser: OutputParser | None) -> None:
        self.plan = plan
        self.stream = OutputStream(parser) if parser else None
        self.reader = ToolCallReader(plan) if plan.forcing else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.stream is not None:
            return self.stream.feed(text)
        if self.reader is not None:
            return [{"tool_calls": [d]} for d in self.reader.feed(text)]
        return [{"content": text}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        if self.stream is not None:
            return self.stream.finish()
        if self.reader is not None:
            self.reader.finish()
            return [{"content": self.reader.content}] if self.reader.content else []
        return []


@dataclass
class ItemBuilder:
    """Turns chat-style deltas into Responses items and the events of a stream."""

    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    current: dict[str, Any] | None = None  # the item being written
    call_items: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool call index ->

    def add(self, delta: dict[str, Any]) -> None:
        if "reasoning_content" in delta:
            self._text_delta("reasoning", "reasoning_text", delta["reasoning_content"])
        elif "content" in delta:
            self._text_delta("message", "output_text", delta["content"])
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                item = self._start({"type": "function_call", "id": new_id("fc"),
                                    "call_id": tc["id"], "name": tc["function"]["name"],
                                    "arguments": "", "status": "in_progress"})
                self.call_items[tc["index"]] = item
            else:
                item = self.call_items[tc["index"]]
                item["arguments"] += tc["function"]["arguments"]
                self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.items.index(item),
                            delta=tc["function"]["arguments"])

    def close(self, status: str = "completed") -> None:
        item = self.current
        if item is None:
            return
        self.current = None
        index = self.items.index(item)
        if item["type"] == "function_call":
            self._event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=index, name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            kind = "response.output_text" if part["type"] == "output_text" \
                else "response.reasoning_text"
            self._event(f"{kind}.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"],
                        **({"logprobs": []} if part["type"] == "output_text" else {}))
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=part)
        item["status"] = status
        self._event("response.output_item.done", output_index=index, item=item)

    def _text_delta(self, kind: str, part_type: str, text: str) -> None:
        item = self.current
        if item is None or item["type"] != kind:
            part: dict[str, Any] = {"type": part_type, "text": ""}
            if part_type == "output_text":
                part["annotations"] = []
                part["logprobs"] = []
            if kind == "message":
                item = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}
            else:
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}
            self._start(item)
            item["content"].append(part)
            self._event("response.content_part.added", item_id=item["id"],
                        output_index=self.items.index(item), content_index=0,
                        part={k: v for k, v in part.items() if k != "logprobs"})
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" \
            else "response.reasoning_text.delta"
        self._event(name, item_id=item["id"], output_index=self.items.index(item),
                    content_index=0, delta=text,
                    **({"logprobs": []} if kind == "message" else {}))

    def _start(self, item: dict[str, Any]) -> dict[str, Any]:
        self.close()
        self.items.append(item)
        self.current = item
        self._event("response.output_item.added", output_index=len(self.items) - 1,
                    item={**item, "content": []} if "content" in item else dict(item))
        return item

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})


# ---- serving ---------------------------------------------------------------------------------
@dataclass
class Job:
    """One response being made."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    plan: ToolPlan
    conversation: list[dict[str, Any]]
    response: dict[str, Any]
    builder: ItemBuilder = field(default_factory=ItemBuilder)


class ResponsesServing:
    def __init__(self, openai: OpenAIServing, store: ResponseStore | None = None) -> None:
        self.openai = openai
        self.store = store or ResponseStore()

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Response:
        history = self.store.get(req.previous_response_id, "previous_response_id").conversation \
            if req.previous_response_id else []
        chat, conversation = to_chat_request(req, history)
        api = self.openai
        plan = api._check_chat(chat, RESPONSES_GRAMMARS)
        ids = await api.tm.tokenize(api.render_chat, chat, plan)
        max_new = req.max_output_tokens if req.max_output_tokens is not None \
            else api.default_max_tokens(len(ids))
        job = Job(req, chat, plan, conversation, self._skeleton(req))
        try:
            return await self._respond(job, api.sampling_params(chat, max_new, plan.schema()),
                                       ids)
        except APIError as e:  # a grammar that did not compile names the request's field
            raise grammar_error(e, chat, plan, RESPONSES_GRAMMARS) from None

    async def _respond(self, job: Job, params: Any, ids: list[int]) -> Response:
        api, req, rid = self.openai, job.req, job.response["id"]
        group = await api.tm.submit([PromptJob(rid, ids, params)], gid=rid, stream=req.stream)
        deltas = ChatDeltas(job.plan, api.parsers.for_plan(job.plan))
        if req.stream:
            # The first message decides the HTTP status (a refused request is a 4xx).
            events, first = await first_event(group)
            return StreamingResponse(self._events(job, group, events, first, deltas),
                                     media_type="text/event-stream")
        seq = (await group.collect())[0]
        for d in deltas.feed(seq.text) + deltas.finish():
            job.builder.add(d)
        self._finish(job, seq)
        return JSONResponse(job.response)

    def _skeleton(self, req: ResponsesRequest) -> dict[str, Any]:
        return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "error": None, "incomplete_details": None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.openai.served_name, "output": [],
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": None, "summary": None}, "store": req.store,
                "temperature": req.temperature, "top_p": req.top_p,
                "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
                "tools": req.tools or [], "truncation": "disabled", "usage": None,
                "user": req.user, "metadata": req.metadata or {}}

    def _finish(self, job: Job, seq: Any) -> None:
        """Close the items and fill in status and usage; store it if asked."""
        fr = finish_reason(seq.finish_reason)
        status = {"length": "incomplete", "abort": "failed"}.get(fr or "", "completed")
        job.builder.close("incomplete" if status == "incomplete" else "completed")
        r = job.response
        r["output"] = job.builder.items
        r["status"] = status
        if status == "incomplete":
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "failed":
            r["error"] = {"code": "server_error",
                          "message": (seq.finish_reason or {}).get("message") or "aborted"}
        reasoning = "".join(i["content"][0]["text"] for i in job.builder.items
                            if i["type"] == "reasoning")
        reasoning_tokens = len(self.openai.tokenizer.encode(reasoning, add_special_tokens=False)
                               ) if reasoning else 0
        r["usage"] = {"input_tokens": seq.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": seq.cached_tokens},
                      "output_tokens": seq.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                      "total_tokens": seq.prompt_tokens + seq.completion_tokens}
        if job.req.store and status != "failed":
            self.store.put(Stored(r, job.conversation + _as_messages(job.builder.items)))

    async def _events(self, job: Job, group: Any, events: AsyncIterator[Any], first: Any,
                      deltas: ChatDeltas) -> AsyncIterator[bytes]:
        """The SSE stream; closing it (a client gone) aborts the request."""
        seq_no = 0

        def frames(events: list[dict[str, Any]]) -> bytes:
            nonlocal seq_no
            out = []
            for e in events:
                e["sequence_number"] = seq_no
                seq_no += 1
                out.append(b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n")
            return b"".join(out)

        b = job.builder

        def add(out: Any) -> None:
            for d in deltas.feed(out.new_text):
                b.add(d)
            if out.token.finish_reason is not None:
                for d in deltas.finish():
                    b.add(d)

        try:
            add(first[1])
            yield frames([{"type": "response.created", "response": dict(job.response)},
                          {"type": "response.in_progress", "response": dict(job.response)},
                          *b.events])
            b.events.clear()
            async for _, out in events:
                add(out)
                if b.events:
                    yield frames(b.events)
                    b.events.clear()
            self._finish(job, group.seqs[0])
            final = {"completed": "response.completed", "incomplete": "response.incomplete",
                     "failed": "response.failed"}[job.response["status"]]
            yield frames([*b.events, {"type": final, "response": job.response}])
        finally:
            await events.aclose()


def _as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a continuation shows the model
    (reasoning is left out, as the families' own templates do)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def add_responses_routes(app: FastAPI, responses: ResponsesServing,
                         refuse: Any = lambda: None) -> None:
    @app.post("/v1/responses")
    @with_cancellation
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        refuse()
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.store.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        responses.store.get(response_id)
        del responses.store.items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}
