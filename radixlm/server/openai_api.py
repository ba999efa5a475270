"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Response shapes follow OpenAI's reference (checked against vLLM's). Choices
are numbered input-major (prompt i, sample j -> i * n + j). `finish_reason`
is "stop" (EOS, stop string, stop token) or "length"; a sequence ended by
/abort_request, a client-side abort, or server shutdown reports "abort" (vLLM's
spelling), so a stream never ends a choice in silence. `stop_reason` (a vLLM
extension) names the matched stop string. Usage counts each prompt once and
every generated token, including any cut by a stop string. A chat request that
forces a tool call (tool_calls.py), or whose free-form output holds calls that
the tool-call parser reads (`tool_choice: "auto"`, chat_output.py), answers
with `tool_calls` and finish_reason "tool_calls"; a reasoning parser adds
`reasoning_content`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.protocol import StrOut
from radixlm.request_input import MAX_TOP_LOGPROBS
from radixlm.sampling_params import SamplingParams
from radixlm.server.chat_output import ChatParsers, OutputStream
from radixlm.server.errors import APIError, from_value_error
from radixlm.server.io import SSE_DONE, SeqOutput, finite, sse
from radixlm.server.openai_protocol import (
    ROLES,
    ChatCompletionRequest,
    CompletionRequest,
    _CommonRequest,
)
from radixlm.server.tokenizer_manager import (
    SAMPLING_NAMES,
    PromptJob,
    RequestGroup,
    TokenizerManager,
)
from radixlm.server.tool_calls import (
    ToolCallReader,
    ToolPlan,
    calls_as_text,
    has_tool_messages,
    history_message,
    plan_tools,
    read_calls,
    schema_error,
)
from radixlm.server.tool_prompt import ToolPrompt

EventIter = AsyncIterator[tuple[int, StrOut]]


def finish_reason(fr: dict[str, Any] | None) -> str | None:
    if fr is None:
        return None
    return fr["type"] if fr["type"] in ("stop", "length") else "abort"


def response_format_schema(rf: dict[str, Any] | None,
                           names: dict[str, str] | None = None) -> str | dict[str, Any] | None:
    """OpenAI's response_format as a json_schema sampling parameter: "json_object"
    is any JSON object, "json_schema" carries its schema in json_schema.schema.
    `names`: the endpoint's names for the fields (errors name what the client sent)."""
    name = (names or CHAT_GRAMMARS)["response_format"]
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        schema = ((rf or {}).get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            where = "json_schema.schema" if name == "response_format" else "schema"
            raise APIError(400, f"{name}.{where} must be a JSON schema object", name)
        return schema
    raise APIError(400, f"{name}.type must be text, json_object or json_schema, "
                        f"got {kind!r}", name)


# The chat fields that constrain the output, by the chat endpoint's own names.
CHAT_GRAMMARS = {"response_format": "response_format", "json_schema": "json_schema",
                 "regex": "regex", "ebnf": "ebnf"}


def check_grammars(req: ChatCompletionRequest, plan: ToolPlan, names: dict[str, str]) -> None:
    """At most one grammar constrains the output. A response format constrains
    the assistant's message content, and a turn forced into a tool call has none:
    the call's own grammar is the only one that applies, so the two go together
    (as OpenAI accepts them). A raw-output grammar (json_schema, regex, ebnf) would
    have to hold for the call's text too, which contradicts the call's grammar."""
    given = {"response_format": response_format_schema(req.response_format, names) is not None,
             "json_schema": req.json_schema is not None, "regex": req.regex is not None,
             "ebnf": req.ebnf is not None}
    asked = [names.get(k, k) for k, v in given.items() if v]
    if len(asked) > 1:
        raise APIError(400, f"only one of {', '.join(names.values())} may be set, got "
                            f"{' and '.join(asked)}", asked[1])
    raw = [names.get(k, k) for k in ("json_schema", "regex", "ebnf") if given[k]]
    if plan.forcing and raw:
        raise APIError(400, f"{raw[0]} cannot be combined with a tool_choice that forces a "
                            f"tool call: the call's own grammar constrains the whole output",
                       raw[0])


def grammar_error(e: APIError, req: ChatCompletionRequest, plan: ToolPlan,
                  names: dict[str, str] = CHAT_GRAMMARS) -> APIError:
    """A json_schema error (the schema did not compile) reworded to name the
    field the schema came from: the tools of a forced call, or the response
    format by the endpoint's name; the client sent no json_schema there."""
    if plan.forcing:
        return schema_error(e, plan)
    if e.status != 400 or not e.message.startswith("json_schema ") \
            or req.json_schema is not None or req.response_format is None:
        return e
    name = names["response_format"]
    return APIError(400, name + e.message[len("json_schema"):], name)


def stop_reason(fr: dict[str, Any] | None) -> str | None:
    matched = (fr or {}).get("matched")
    return matched if isinstance(matched, str) else None


def tool_finish_reason(fr: dict[str, Any] | None, made_calls: bool) -> str | None:
    """"tool_calls" for a forced call that ended where its grammar ends; a call cut
    short (token limit, a stop string) keeps "length" / "stop"."""
    if made_calls and finish_reason(fr) == "stop" and stop_reason(fr) is None:
        return "tool_calls"
    return finish_reason(fr)


@dataclass
class Call:
    """What one completion call needs to render its choices."""

    id: str
    created: int
    model: str
    prompt_of: list[int]  # choice index -> prompt index
    prompt_texts: list[str] = field(default_factory=list)
    include_usage: bool = False

    def usage(self, seqs: list[SeqOutput]) -> dict[str, Any]:
        first: dict[int, SeqOutput] = {}
        for s in seqs:
            first.setdefault(self.prompt_of[s.index], s)
        prompt = sum(s.prompt_tokens for s in first.values())
        completion = sum(s.completion_tokens for s in seqs)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens
                                                                for s in first.values())}}
        verifies = sum(s.spec_verify_ct for s in seqs)
        if verifies:  # an extension (speculative decoding), as SGLang's meta_info has it
            usage["spec_verify_ct"] = verifies
            usage["spec_accepted_drafts"] = sum(s.spec_accepted_drafts for s in seqs)
        return usage


def _priority(req: _CommonRequest) -> int:
    """The body's `priority` as sent (None: 0); the TokenizerManager checks it."""
    return 0 if req.priority is None else req.priority


def _has_text(prompt: Any) -> bool:
    """Whether a completions prompt (any of OpenAI's four forms) holds a string."""
    return isinstance(prompt, str) or (isinstance(prompt, list)
                                       and any(isinstance(p, str) for p in prompt))


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, tokenizer: Any, served_name: str,
                 model_path: str | None, parsers: ChatParsers | None = None) -> None:
        self.tm = tm
        self.parsers = parsers or ChatParsers()
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.model_names = {served_name} | ({model_path} if model_path else set())
        self.model_path = model_path
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.tool_prompt = ToolPrompt(self.parsers.tool_parser)

    # ---- models -----------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def model_card(self) -> dict[str, Any]:
        limits = self.tm.limits
        return {"id": self.served_name, "object": "model", "created": self.created,
                "owned_by": "radixlm", "root": self.model_path or self.served_name,
                "parent": None, "max_model_len": limits.max_seq_len if limits else None}

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def get_model(self, model_id: str) -> dict[str, Any]:
        self.check_model(model_id)
        return self.model_card()

    # ---- shared ---------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def sampling_params(self, req: _CommonRequest, max_new_tokens: int,
                        schema: dict[str, Any] | None = None) -> SamplingParams:
        """`schema`: a JSON schema that replaces the request's own (forced tool calls)."""
        d = {"max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens, "n": req.n,
             "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
             "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
             "presence_penalty": req.presence_penalty,
             "frequency_penalty": req.frequency_penalty, "stop": req.stop,
             "stop_token_ids": req.stop_token_ids, "seed": req.seed,
             "logit_bias": req.logit_bias, "ignore_eos": req.ignore_eos,
             "skip_special_tokens": req.skip_special_tokens,
             "spaces_between_special_tokens": req.spaces_between_special_tokens,
             "no_stop_trim": req.include_stop_str_in_output,
             "regex": req.regex, "ebnf": req.ebnf,
             "json_schema": schema if schema is not None
             else req.json_schema if req.json_schema is not None
             else response_format_schema(getattr(req, "response_format", None))}
        try:
            return SamplingParams.from_dict({k: v for k, v in d.items()
                                             if v is not None or k == "seed"})
        except ValueError as e:
            raise from_value_error(e, SAMPLING_NAMES) from None

    def default_max_tokens(self, prompt_len: int) -> int:
        # Clamped at 0 so an over-long prompt is reported as such, with both lengths.
        return max(self.tm.require_limits().max_seq_len - prompt_len, 0)

    @staticmethod
    def check_stream_options(req: _CommonRequest) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options can only be set when stream is true",
                           "stream_options")

    async def respond_stream(self, group: RequestGroup,
                             render: Callable[[int, StrOut], list[dict[str, Any]]],
                             tail: Callable[[], list[dict[str, Any]]]) -> Response:
        """Wait for the first message before answering, so a request the scheduler
        refuses still gets its HTTP status; later failures end their choice with
        finish_reason "abort"."""
        events, first = await first_event(group)
        timing = group.seqs[first[0]].timing

        def wrote_first() -> None:
            if timing is not None:
                timing["first_write"] = time.monotonic()

        return StreamingResponse(_sse_body(events, first, render, tail, group.queue.empty,
                                           wrote_first), media_type="text/event-stream")

    # ---- /v1/completions --------------------------------------------------------------------
    def completion_prompts(self, prompt: Any) -> list[tuple[str, list[int]]]:
        """(text, token ids) per prompt, from any of OpenAI's four prompt forms."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p)))
            else:
                if not p:
                    raise APIError(400, "prompt must not be empty", "prompt")
                out.append((None, list(p)))
        return out

    def _check_completion(self, req: CompletionRequest) -> None:
        self.check_model(req.model)
        self.check_stream_options(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (it must equal n)", "best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                                f"{req.logprobs}", "logprobs")

    async def completions(self, req: CompletionRequest, raw_request: Request) -> Response:
        self._check_completion(req)
        if _has_text(req.prompt):
            prompts = await self.tm.tokenize(self.completion_prompts, req.prompt)
        else:  # token ids: nothing to encode, so no hop to the tokenizer thread
            prompts = self.completion_prompts(req.prompt)
        call = Call(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                    model=self.served_name, include_usage=bool(
                        req.stream_options and req.stream_options.include_usage),
                    prompt_of=[i for i in range(len(prompts)) for _ in range(req.n)])
        jobs = []
        for i, (_, ids) in enumerate(prompts):
            max_new = req.max_tokens if req.max_tokens is not None else \
                self.default_max_tokens(len(ids))
            rid = call.id if len(prompts) == 1 else f"{call.id}-{i}"
            jobs.append(PromptJob(rid, ids, self.sampling_params(req, max_new),
                                  priority=_priority(req)))
        want_lp = req.logprobs is not None
        group = await self.tm.submit(
            jobs, gid=call.id, stream=req.stream, return_logprob=want_lp,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if want_lp and req.echo else -1)
        if req.echo:
            call.prompt_texts = [t if t is not None else self.tokenizer.decode(ids)
                                 for t, ids in prompts]
        if req.stream:
            render = CompletionStream(self, req, call, group)
            return await self.respond_stream(group, render.chunks, render.tail)
        seqs = await group.collect()
        return JSONResponse({
            "id": call.id, "object": "text_completion", "created": call.created,
            "model": call.model, "system_fingerprint": None,
            "choices": [self._completion_choice(req, call, s) for s in seqs],
            "usage": call.usage(seqs)})

    def _completion_choice(self, req: CompletionRequest, call: Call,
                           seq: SeqOutput) -> dict[str, Any]:
        prefix = call.prompt_texts[call.prompt_of[seq.index]] if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            pairs, tops = seq.output_logprobs, seq.output_top_logprobs
            if req.echo and seq.input_logprobs is not None:
                pairs = seq.input_logprobs + pairs
                tops = (seq.input_top_logprobs or [[]] * len(seq.input_logprobs)) + tops
            logprobs, _ = self.completion_logprobs(pairs, tops, req.logprobs, 0)
        return {"index": seq.index, "text": prefix + seq.text, "logprobs": logprobs,
                "finish_reason": finish_reason(seq.finish_reason),
                "stop_reason": stop_reason(seq.finish_reason)}

    def completion_logprobs(self, pairs: list[list[Any]], tops: list[list[list[Any]]] | None,
                            k: int, offset: int) -> tuple[dict[str, Any], int]:
        """OpenAI's legacy logprobs object; the sampled token is always among the
        top entries (vLLM does the same). Returns it and the next text offset."""
        tokens, token_lps, top_lps, offsets = [], [], [], []
        for i, (lp, tid) in enumerate(pairs):
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(finite(lp))
            offsets.append(offset)
            offset += len(text)
            if lp is None:  # the first prompt token has no context to predict it
                top_lps.append(None)
                continue
            top = {self.token_text(t): finite(v) for v, t in (tops[i] if tops else [])[:k]}
            top.setdefault(text, finite(lp))
            top_lps.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_lps,
                "text_offset": offsets}, offset

    # ---- /v1/chat/completions -----------------------------------------------------------------
    def _check_chat(self, req: ChatCompletionRequest,
                    names: dict[str, str] = CHAT_GRAMMARS) -> ToolPlan:
        """`names`: the endpoint's own names of the chat fields that constrain the
        output (the Responses API calls response_format `text.format`)."""
        self.check_model(req.model)
        self.check_stream_options(req)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          can_parse=self.parsers.tool_parser is not None)
        check_grammars(req, plan, names)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                                    f"{req.top_logprobs}", "top_logprobs")
        return plan

    def render_chat(self, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model has no chat template; use /v1/completions",
                           "messages")
        messages = [self._message(i, m) for i, m in enumerate(req.messages)]
        if "tool_calls" not in str(template):
            # This template ignores earlier calls and would drop them silently
            # (SmolLM2's does): show them to the model as text instead.
            messages = calls_as_text(messages, results_too=False,
                                     write=self.tool_prompt.calls_text)
        messages = self.tool_prompt.messages(messages, plan.tools, template,
                                             self.tokenizer.apply_chat_template)
        # The tools go to templates that render them; others ignore the argument.
        kwargs = {**({"tools": plan.tools} if plan.tools else {}),
                  **(req.chat_template_kwargs or {})}
        try:
            text = self._apply_template(req, messages, kwargs)
        except Exception as e:  # jinja2 errors, raise_exception() in templates, bad kwargs
            if not has_tool_messages(messages):
                raise APIError(400, f"the chat template failed on these messages: {e}",
                               "messages") from None
            # Templates without tool support may refuse the "tool" role (or the
            # calls): fall back to tool results as text in user messages.
            text = self._text_fallback(req, messages, kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _apply_template(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                        kwargs: dict[str, Any]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, **kwargs)

    def _text_fallback(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                       kwargs: dict[str, Any]) -> str:
        try:
            return self._apply_template(req, calls_as_text(
                messages, results_too=True, write=self.tool_prompt.calls_text), kwargs)
        except Exception as e:
            raise APIError(400, f"the chat template failed on these messages (tool calls "
                                f"and results also as text): {e}", "messages") from None

    @staticmethod
    def _message(i: int, m: Any) -> dict[str, Any]:
        if m.role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                                f"{m.role!r}", f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: only text content parts are "
                                        f"supported, got {part.type!r}",
                                   f"messages[{i}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        return history_message(m, content or "")

    async def chat(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        plan = self._check_chat(req)
        ids = await self.tm.tokenize(self.render_chat, req, plan)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_new is None:
            max_new = self.default_max_tokens(len(ids))
        call = Call(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                    model=self.served_name, prompt_of=[0] * req.n, include_usage=bool(
                        req.stream_options and req.stream_options.include_usage))
        job = PromptJob(call.id, ids, self.sampling_params(req, max_new, plan.schema()),
                        priority=_priority(req))
        try:
            return await self._chat_response(req, plan, call, job)
        except APIError as e:
            raise grammar_error(e, req, plan) from None

    async def _chat_response(self, req: ChatCompletionRequest, plan: ToolPlan, call: Call,
                             job: PromptJob) -> Response:
        group = await self.tm.submit([job], gid=call.id, stream=req.stream,
                                     return_logprob=req.logprobs,
                                     top_logprobs_num=req.top_logprobs or 0)
        if req.stream:
            render = ChatStream(self, req, call, group, plan)
            return await self.respond_stream(group, render.chunks, render.tail)
        seqs = await group.collect()
        choices = [{"index": s.index, **self._chat_message(plan, s),
                    "logprobs": self.chat_logprobs(s.output_logprobs, s.output_top_logprobs,
                                                   req.top_logprobs or 0)
                    if req.logprobs else None,
                    "stop_reason": stop_reason(s.finish_reason)} for s in seqs]
        return JSONResponse({"id": call.id, "object": "chat.completion",
                             "created": call.created, "model": call.model,
                             "system_fingerprint": None, "choices": choices,
                             "usage": call.usage(seqs)})

    def _chat_message(self, plan: ToolPlan, seq: SeqOutput) -> dict[str, Any]:
        """A choice's message and finish_reason; a forced call's output is read
        back into `tool_calls` (content null), free-form output through the
        server's parsers, if any apply."""
        output = self.parsers.for_plan(plan)
        if output is not None:
            message = output.message(seq.text)
            return {"message": {"role": "assistant", "refusal": None, **message},
                    "finish_reason": tool_finish_reason(seq.finish_reason,
                                                        bool(message["tool_calls"]))}
        if not plan.forcing:
            return {"message": {"role": "assistant", "content": seq.text, "refusal": None,
                                "tool_calls": []},
                    "finish_reason": finish_reason(seq.finish_reason)}
        calls = read_calls(plan, seq.text)
        return {"message": {"role": "assistant", "content": calls.content, "refusal": None,
                            "tool_calls": [c.to_dict() for c in calls.calls]},
                "finish_reason": tool_finish_reason(seq.finish_reason, bool(calls.calls))}

    def chat_logprobs(self, pairs: list[list[Any]], tops: list[list[list[Any]]] | None,
                      k: int) -> dict[str, Any]:
        def entry(lp: float, tid: int) -> dict[str, Any]:
            text = self.token_text(tid)
            return {"token": text, "logprob": finite(lp), "bytes": list(text.encode())}

        content = []
        for i, (lp, tid) in enumerate(pairs):
            top = (tops[i] if tops else [])[:k]
            content.append({**entry(lp, tid), "top_logprobs": [entry(v, t) for v, t in top]})
        return {"content": content}


class _Stream:
    """What both stream renderers share: the chunk envelope and the usage tail."""

    OBJECT = ""

    def __init__(self, api: OpenAIServing, call: Call, group: RequestGroup) -> None:
        self.api, self.call, self.group = api, call, group

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        c = self.call
        chunk = {"id": c.id, "object": self.OBJECT, "created": c.created,
                 "model": c.model, "system_fingerprint": None, "choices": choices, **extra}
        if c.include_usage and "usage" not in chunk:
            chunk["usage"] = None
        return chunk

    def tail(self) -> list[dict[str, Any]]:
        if not self.call.include_usage:
            return []
        return [self._chunk([], usage=self.call.usage(self.group.seqs))]


class CompletionStream(_Stream):
    """Renders one /v1/completions stream: text deltas per choice."""

    OBJECT = "text_completion"

    def __init__(self, api: OpenAIServing, req: CompletionRequest, call: Call,
                 group: RequestGroup) -> None:
        super().__init__(api, call, group)
        self.req = req
        self.offsets: dict[int, int] = {}  # text_offset of each choice's next token

    def chunks(self, idx: int, out: StrOut) -> list[dict[str, Any]]:
        t = out.token
        first = idx not in self.offsets
        text = out.new_text
        pairs, tops = list(t.output_logprobs or []), list(t.output_top_logprobs or [])
        if first and self.req.echo:
            text = self.call.prompt_texts[self.call.prompt_of[idx]] + text
            if t.input_logprobs is not None:
                pairs = t.input_logprobs + pairs
                tops = (t.input_top_logprobs or [[]] * len(t.input_logprobs)) + tops
        if not text and not pairs and t.finish_reason is None and not first:
            return []
        logprobs = None
        offset = self.offsets.get(idx, 0)
        if self.req.logprobs is not None:
            logprobs, offset = self.api.completion_logprobs(pairs, tops or None,
                                                            self.req.logprobs, offset)
        self.offsets[idx] = offset
        return [self._chunk([{"index": idx, "text": text, "logprobs": logprobs,
                              "finish_reason": finish_reason(t.finish_reason),
                              "stop_reason": stop_reason(t.finish_reason)}])]


class ChatStream(_Stream):
    """Renders one /v1/chat/completions stream: the role delta first for each
    choice, then content deltas, then its finish_reason. A forced tool call
    streams as `delta.tool_calls` instead (see `_tool_deltas`)."""

    OBJECT = "chat.completion.chunk"

    def __init__(self, api: OpenAIServing, req: ChatCompletionRequest, call: Call,
                 group: RequestGroup, plan: ToolPlan | None = None) -> None:
        super().__init__(api, call, group)
        self.req = req
        self.plan = plan or ToolPlan()
        self.started: set[int] = set()
        self.readers: dict[int, ToolCallReader] = {}  # per choice, forced calls only
        self.output = api.parsers.for_plan(self.plan)
        self.outputs: dict[int, OutputStream] = {}  # per choice, with self.output

    def chunks(self, idx: int, out: StrOut) -> list[dict[str, Any]]:
        t = out.token
        chunks = []
        if idx not in self.started:
            self.started.add(idx)
            content = None if self.plan.forcing else ""
            chunks.append(self._chunk([{"index": idx,
                                        "delta": {"role": "assistant", "content": content},
                                        "logprobs": None, "finish_reason": None}]))
        if not out.new_text and not t.new_token_ids and t.finish_reason is None \
                and not self.plan.forcing:
            return chunks
        logprobs = None
        if self.req.logprobs:
            logprobs = self.api.chat_logprobs(t.output_logprobs or [], t.output_top_logprobs,
                                              self.req.top_logprobs or 0)
        if self.plan.forcing:
            deltas, fr = self._tool_deltas(idx, out, bool(logprobs and t.new_token_ids))
        elif self.output is not None:
            deltas, fr = self._parsed_deltas(idx, out, bool(logprobs and t.new_token_ids))
        else:
            deltas = [{"content": out.new_text} if out.new_text or t.finish_reason is None
                      else {}]
            fr = finish_reason(t.finish_reason)
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunks.append(self._chunk([{"index": idx, "delta": delta,
                                        "logprobs": logprobs if last else None,
                                        "finish_reason": fr if last else None,
                                        "stop_reason": stop_reason(t.finish_reason)
                                        if last else None}]))
        return chunks

    def _parsed_deltas(self, idx: int, out: StrOut, has_logprobs: bool
                       ) -> tuple[list[dict[str, Any]], str | None]:
        """Deltas from the server's parsers: reasoning, content and tool-call
        pieces as they become certain (text that may still turn into markup
        is held back until it does or does not)."""
        assert self.output is not None
        stream = self.outputs.setdefault(idx, OutputStream(self.output))
        fr = out.token.finish_reason
        deltas = stream.feed(out.new_text)
        if fr is not None:
            deltas += stream.finish()
        if not deltas and (fr is not None or has_logprobs):
            deltas = [{}]
        return deltas, tool_finish_reason(fr, stream.made_calls) if fr is not None else None

    def _tool_deltas(self, idx: int, out: StrOut, has_logprobs: bool
                     ) -> tuple[list[dict[str, Any]], str | None]:
        """One delta per tool-call entry: a call's header (id, name, empty
        arguments) as soon as its name is known, then argument pieces. In the
        "required" mode the name comes first in the output, so only the text up
        to the end of the name is held back; nothing is sent while it is."""
        reader = self.readers.setdefault(idx, ToolCallReader(self.plan))
        fr = out.token.finish_reason
        deltas: list[dict[str, Any]] = [{"tool_calls": [entry]}
                                        for entry in reader.feed(out.new_text)]
        if fr is not None:
            reader.finish()
            if reader.content:  # cut short before any call could be read
                deltas.append({"content": reader.content})
        if not deltas and (fr is not None or has_logprobs):
            deltas = [{}]  # the finish_reason, or logprobs of held-back tokens
        return deltas, tool_finish_reason(fr, bool(reader.calls)) if fr is not None else None


async def first_event(group: RequestGroup) -> tuple[EventIter, tuple[int, StrOut]]:
    """A streamed group's events and its first message, awaited before the HTTP
    response starts so a request the scheduler refuses still gets its status:
    APIError for a refused one (the stream closed)."""
    events = group.events()
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    seq = group.seqs[first[0]]
    if seq.error_status is not None:
        await events.aclose()
        raise APIError(seq.error_status, seq.error_message)
    return events, first


async def _sse_body(events: EventIter, first: tuple[int, StrOut],
                    render: Callable[[int, StrOut], list[dict[str, Any]]],
                    tail: Callable[[], list[dict[str, Any]]],
                    caught_up: Callable[[], bool],
                    wrote_first: Callable[[], None] = lambda: None) -> AsyncIterator[bytes]:
    """SSE frames: `data: {chunk}` per rendered chunk, then `data: [DONE]`.
    Closing `events` (also on a client disconnect) aborts unfinished choices.
    `wrote_first` runs as the first frames go to the server (timing stamps).

    Frames are written once `caught_up()` says nothing more is queued for this
    call: a stream that fell behind (a busy server, many streams per step)
    sends its backlog in one write. Each write is one ASGI send and one socket
    write, and at saturation that per-write cost, not the JSON, is what limits
    the API process; the client still sees one event per chunk."""
    try:
        frames = [sse(chunk) for chunk in render(*first)]
        first_write = True
        if caught_up() and frames:
            wrote_first()
            first_write = False
            yield b"".join(frames)
            frames.clear()
        async for idx, out in events:
            frames += [sse(chunk) for chunk in render(idx, out)]
            if caught_up() and frames:
                if first_write:
                    wrote_first()
                    first_write = False
                yield b"".join(frames)
                frames.clear()
        frames += [sse(chunk) for chunk in tail()]
        yield b"".join(frames) + SSE_DONE
    finally:
        await events.aclose()
