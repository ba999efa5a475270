"""Where programs run: the in-process Engine or a server's native API.

Both backends offer the same four operations; `select` is built on the last
two. Every method may be called from many threads at once (forks and
`run_batch` run programs in parallel, and their requests batch together).
"""

from __future__ import annotations

import json
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from radixlm.lang.chat_template import PLAIN, ChatTemplate, from_tokenizer
from radixlm.protocol import GenerateReq, StrOut
from radixlm.request_input import GenerateInput, PromptJob, new_id
from radixlm.sampling_params import SamplingParams

# A chunk of generated text, plus the request's meta_info with the last chunk.
Chunk = tuple[str, dict[str, Any] | None]


class Backend(ABC):
    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        ...

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids as `generate` would see `text` (special tokens included)."""

    @abstractmethod
    def generate(self, prompt: str, params: dict[str, Any], stream: bool) -> Iterator[Chunk]:
        """Text chunks (one chunk unless `stream`); the last carries meta_info.
        Raises ValueError for a refused request, RuntimeError for a failed one."""

    @abstractmethod
    def prompt_logprobs(self, inputs: list[list[int]], start: int) -> list[list[list[Any]]]:
        """Per input, [logprob, token id] of its tokens from position `start` on
        (prefill only; one batch, so shared prefixes are computed once)."""

    def score_choices(self, prefix: str, choices: list[str]) -> list[float]:
        """Mean logprob of each choice's tokens after `prefix` (SGLang's
        token-length-normalized score). A token that straddles the boundary
        (BPE merged the prefix's end with the choice) counts for the choice."""
        prefix_ids = self.tokenize(prefix)
        ids = [self.tokenize(prefix + c) for c in choices]
        starts = [max(1, min(_common_len(prefix_ids, x), len(x) - 1)) for x in ids]
        start = min(starts)
        logprobs = self.prompt_logprobs(ids, start)
        scores = []
        for lp, s in zip(logprobs, starts, strict=True):
            values = [v for v, _ in lp[s - start:] if v is not None]
            scores.append(sum(values) / len(values) if values else float("-inf"))
        return scores


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def raise_for_finish(meta: dict[str, Any]) -> None:
    reason = meta.get("finish_reason") or {}
    if reason.get("type") != "abort":
        return
    message = reason.get("message", "the request was aborted")
    raise ValueError(message) if reason.get("status_code") == 400 else RuntimeError(message)


# ---- in-process Engine --------------------------------------------------------------
class EngineBackend(Backend):
    """Runs programs on a `radixlm.Engine` in this process.

    One driver thread owns the engine's scheduler while programs run: callers on
    any thread hand it requests, it steps the scheduler and routes each output
    to its caller, so parallel programs share batches. While a program runs,
    do not also call `engine.generate` from another thread."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._template: ChatTemplate | None = None
        self._lock = threading.Condition()
        self._inbox: list[tuple[GenerateReq, queue.Queue[Any]]] = []
        self._routes: dict[str, queue.Queue[Any]] = {}
        self._thread: threading.Thread | None = None

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = from_tokenizer(self.engine.tokenizer)
        return self._template

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def generate(self, prompt: str, params: dict[str, Any], stream: bool) -> Iterator[Chunk]:
        msg = self._request(self.tokenize(prompt), params, stream=stream)
        q = self._submit([msg])[0]
        text: list[str] = []
        while True:
            out = _get(q)
            if out.token.finish_reason is not None:
                meta = _meta(out)
                raise_for_finish(meta)
                yield ("".join(text) + out.new_text if not stream else out.new_text), meta
                return
            if stream and out.new_text:
                yield out.new_text, None
            elif not stream:
                text.append(out.new_text)

    def prompt_logprobs(self, inputs: list[list[int]], start: int) -> list[list[list[Any]]]:
        msgs = [self._request(ids, {"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=start) for ids in inputs]
        results = []
        for q in self._submit(msgs):
            out = _get(q)
            raise_for_finish(_meta(out))
            results.append(out.token.input_logprobs or [])
        return results

    # ---- requests --------------------------------------------------------------------
    def _request(self, ids: list[int], params: dict[str, Any], stream: bool = False,
                 return_logprob: bool = False, logprob_start_len: int = -1) -> GenerateReq:
        """Validated here (as Engine.generate validates), on the caller's thread, so
        mistakes raise ValueError there. Programs sample one sequence per call."""
        job = PromptJob(new_id("lang-"), ids, SamplingParams.from_dict(params))
        call = GenerateInput(job.rid, [job], stream=stream, return_logprob=return_logprob,
                             logprob_start_len=logprob_start_len)
        self.engine.validate(call)
        (msg,) = call.requests()
        return msg

    def _submit(self, msgs: list[GenerateReq]) -> list[queue.Queue[Any]]:
        queues: list[queue.Queue[Any]] = [queue.Queue() for _ in msgs]
        with self._lock:
            self._inbox += zip(msgs, queues)
            if self._thread is None:
                self._thread = threading.Thread(target=self._drive, name="radixlm-lang-driver",
                                                daemon=True)
                self._thread.start()
            self._lock.notify()
        return queues

    def _drive(self) -> None:
        sched, detok = self.engine.scheduler, self.engine.detokenizer
        while True:
            with self._lock:
                while not self._inbox and not sched.has_work:
                    self._lock.wait()
                inbox, self._inbox = self._inbox, []
            for msg, q in inbox:
                self._add(msg, q)
            try:
                outs = detok.process(sched.step())
            except BaseException as e:  # wake every caller rather than leave them hanging
                for q in self._routes.values():
                    q.put(e)
                self._routes.clear()
                raise
            for out in outs:
                self._route(out)

    def _add(self, msg: GenerateReq, q: queue.Queue[Any]) -> None:
        try:
            self.engine.scheduler.add_request(msg)
            self._routes[msg.rid] = q
        except Exception as e:
            q.put(e)

    def _route(self, out: StrOut) -> None:
        q = self._routes.get(out.token.rid)
        if q is None:
            return
        if out.token.finish_reason is not None:
            del self._routes[out.token.rid]
        q.put(out)


def _get(q: queue.Queue[Any]) -> StrOut:
    item = q.get()
    if isinstance(item, BaseException):
        raise item
    return item


def _meta(out: StrOut) -> dict[str, Any]:
    t = out.token
    return {"finish_reason": t.finish_reason, "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens, "cached_tokens": t.cached_tokens}


# ---- a server's native API ------------------------------------------------------------
class RuntimeEndpoint(Backend):
    """Runs programs against a radixlm (or SGLang) server's native API:
    /generate, /tokenize and /get_model_info."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 chat_template: ChatTemplate | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._template = chat_template
        self._local = threading.local()  # one HTTP client per thread

    @property
    def client(self) -> Any:
        import httpx

        if getattr(self._local, "client", None) is None:
            self._local.client = httpx.Client(base_url=self.base_url, headers=self.headers,
                                              timeout=self.timeout)
        return self._local.client

    def get_model_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_model_info")

    def chat_template(self) -> ChatTemplate:
        """The server's tokenizer's template, when its files are on this machine."""
        if self._template is None:
            path = self.get_model_info().get("tokenizer_path")
            tokenizer = None
            if path and Path(path).exists():
                from radixlm.tokenizer import get_tokenizer
                tokenizer = get_tokenizer(path)
            self._template = from_tokenizer(tokenizer) if tokenizer is not None else PLAIN
        return self._template

    def tokenize(self, text: str) -> list[int]:
        return self._call("POST", "/tokenize", {"text": text})["tokens"]

    def generate(self, prompt: str, params: dict[str, Any], stream: bool) -> Iterator[Chunk]:
        body = {"text": prompt, "sampling_params": params, "stream": stream}
        if not stream:
            out = self._call("POST", "/generate", body)
            raise_for_finish(out["meta_info"])
            yield out["text"], out["meta_info"]
            return
        yield from self._stream(body)

    def _stream(self, body: dict[str, Any]) -> Iterator[Chunk]:
        sent = 0
        with self.client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                _raise_http(r)
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "stream failed"))
                text, meta = chunk["text"], chunk["meta_info"]
                done = meta.get("finish_reason") is not None
                if done:
                    raise_for_finish(meta)
                if text[sent:] or done:  # native chunks carry the whole text so far
                    yield text[sent:], meta if done else None
                    sent = len(text)

    def prompt_logprobs(self, inputs: list[list[int]], start: int) -> list[list[list[Any]]]:
        outs = self._call("POST", "/generate", {
            "input_ids": inputs, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": start})
        for out in outs:
            raise_for_finish(out["meta_info"])
        return [out["meta_info"].get("input_token_logprobs") or [] for out in outs]

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = self.client.request(method, path, json=body)
        if r.status_code != 200:
            _raise_http(r)
        return r.json()


def _raise_http(r: Any) -> None:
    try:
        message = r.json()["error"]["message"]
    except Exception:
        message = r.text
    if r.status_code == 400:
        raise ValueError(message)
    raise RuntimeError(f"HTTP {r.status_code}: {message}")
