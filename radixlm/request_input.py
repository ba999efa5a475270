"""An API call's generation input, from the caller's shapes to validated wire requests.

SGLang's `GenerateReqInput.normalize`, in one place for every front end: the
offline Engine (`Engine.generate`, `Engine.encode`), the HTTP server's
TokenizerManager (under the native and both OpenAI routes) and the language
frontend's EngineBackend. Each keeps only its own I/O: the Engine steps an
in-process scheduler or a `RemoteScheduler`, the TokenizerManager sends over
ZMQ and awaits.

    jobs = native_jobs(prompt_ids(text, input_ids, tokenizer.encode), ...)
    call = GenerateInput(gid, jobs, stream=..., return_logprob=...)
    call.validate(limits, check_grammar)      # once: every ValueError names its parameter
    *warmups, reqs = call.stages(radix_cache=...)  # n > 1: prefill shared prompts first,
                                                   # then the GenerateReqs, input-major

Validated here, before anything reaches a scheduler: the shapes (text or
token ids, one or a batch; per-input sampling params, rids, session params and
priorities), the sampling parameters (`SamplingParams`, including token ids
against the vocabulary), the prompt against the scheduler's limits
(`check_input`), the logprob arguments, `priority`, ids unique within the call,
and the grammar (`check_grammar`).

The grammar check is the caller's: the in-process Engine compiles the grammar
(the scheduler then finds it compiled); the HTTP server's API process and the
Engine's `RemoteScheduler` (tp/dp > 1) only run `constrained.spec.precheck`,
the checks that need no compiler, and a grammar that fails to compile comes
back from the scheduler as a 400 abort.

Left to the scheduler, which alone knows them: the session's context (its
prompt plus these ids is checked against the limits there), the grammar
compile (remotely), whether memory is released, whether an id is live there,
and its queue limit.
"""

from __future__ import annotations

import array
import math
import sys
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from radixlm.protocol import GenerateReq
from radixlm.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # vLLM's default cap on top-k logprobs per token (server side)
INT64 = (-(1 << 63), 1 << 63)  # msgpack's integers; priority must fit the wire


class InputError(ValueError):
    """Bad input, naming the request parameter it is about (`param`), so the HTTP
    layer can report it in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- limits ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """The scheduler's sizes that input is checked against (a Scheduler and a
    RemoteScheduler have them as attributes; the server learns them from the
    scheduler's ready message)."""

    vocab_size: int
    context_len: int
    max_total_tokens: int
    max_running_requests: int
    hidden_size: int = 0  # the length of an `input_embeds` row (0: unknown)

    @property
    def max_seq_len(self) -> int:
        return min(self.context_len, self.max_total_tokens)

    @classmethod
    def of(cls, sizes: Any) -> Limits:
        return cls(sizes.vocab_size, sizes.context_len, sizes.max_total_tokens,
                   sizes.max_running_requests, sizes.hidden_size)

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> Limits:
        return cls(info["vocab_size"], info["context_len"], info["max_total_tokens"],
                   info["max_running_requests"], info["hidden_size"])


def check_input(sizes: Any, input_ids: list[int], max_new_tokens: int) -> None:
    """ValueError (naming the limit) unless the prompt fits. `sizes` has `vocab_size`,
    `context_len` and `max_total_tokens`: a Scheduler, or the `Limits` a front end
    learned from one."""
    n = len(input_ids)
    if n == 0:
        raise ValueError("the prompt is empty: at least one input token is required")
    bad = next((t for t in input_ids if not 0 <= t < sizes.vocab_size), None)
    if bad is not None:
        raise ValueError(f"input token id {bad} is outside the vocabulary "
                         f"[0, {sizes.vocab_size})")
    limit = min(sizes.context_len, sizes.max_total_tokens)
    if n >= limit:
        raise ValueError(f"the prompt has {n} tokens, but this model accepts at most "
                         f"{limit - 1} input tokens")
    if n + max_new_tokens > limit:
        raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"is {n + max_new_tokens} tokens, more than the limit of {limit} "
                         f"(context length {sizes.context_len}, KV pool "
                         f"{sizes.max_total_tokens} tokens)")


# ---- single fields ----------------------------------------------------------------------
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_priority(value: Any, scheduling: bool = True) -> int:
    """`priority` (higher runs first): an integer; a bool or a float is refused,
    not rounded, and so is any non-zero value unless the server schedules by
    priority (`scheduling`: --enable-priority-scheduling), as vLLM refuses it."""
    if value is None:
        return 0
    if not _is_int(value):
        raise InputError(f"priority must be an integer, got {value!r}", "priority")
    if not INT64[0] <= value < INT64[1]:
        raise InputError(f"priority must be a 64-bit integer, got {value}", "priority")
    if value and not scheduling:
        raise InputError(f"priority={value}: this server does not schedule by priority "
                         "(start it with --enable-priority-scheduling)", "priority")
    return value


def check_logprob_args(top_logprobs_num: Any, logprob_start_len: Any,
                       max_top: int | None = MAX_TOP_LOGPROBS) -> None:
    """`max_top`: the cap on top_logprobs_num (None: no cap, the offline Engine)."""
    if not _is_int(top_logprobs_num) or top_logprobs_num < 0 or (
            max_top is not None and top_logprobs_num > max_top):
        allowed = f"in [0, {max_top}]" if max_top is not None else ">= 0"
        raise InputError(f"top_logprobs_num must be {allowed}, got {top_logprobs_num!r}",
                         "top_logprobs_num")
    if not _is_int(logprob_start_len) or logprob_start_len < -1:
        raise InputError(f"logprob_start_len must be >= 0 (or -1: no prompt logprobs), got "
                         f"{logprob_start_len!r}", "logprob_start_len")


# ---- the call's shapes -------------------------------------------------------------------
def prompt_ids(text: str | list[str] | None, input_ids: list[int] | list[list[int]] | None,
               encode: Callable[[str], list[int]] | None,
               text_name: str = "text") -> tuple[list[list[int]], bool]:
    """Token ids per input from `text` (one string or a list) or `input_ids` (one
    list of ids or a list of them), and whether the call named a single input.
    `encode` None: no tokenizer (text is refused). `text_name`: what the caller
    calls the text parameter (the Engine's is `prompt`)."""
    if (text is None) == (input_ids is None):
        raise InputError(f"pass exactly one of {text_name}, input_ids or input_embeds",
                         text_name)
    if text is not None:
        if encode is None:
            raise InputError(f"this engine has no tokenizer (skip_tokenizer_init): pass "
                             f"input_ids, not {text_name}", text_name)
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise InputError(f"{text_name} must be a string or a list of strings", text_name)
        if not texts:
            raise InputError(f"{text_name} must not be an empty list", text_name)
        return [encode(t) for t in texts], single
    single = not input_ids or not isinstance(input_ids[0], list)
    batch = [input_ids] if single else input_ids
    if not isinstance(batch, list) or not all(
            isinstance(ids, list) and all(_is_int(t) for t in ids) for ids in batch):
        raise InputError("input_ids must be a list of token ids or a list of such lists",
                         "input_ids")
    return [list(ids) for ids in batch], single


def prompt_inputs(text: Any, input_ids: Any, input_embeds: Any,
                  encode: Callable[[str], list[int]] | None, text_name: str = "text"
                  ) -> tuple[list[list[int]], list[list[list[float]]] | None, bool]:
    """`prompt_ids`, or a prompt given as embeddings: (placeholder token ids per
    input, one vector per position per input, single). `input_embeds` is one
    prompt (a list of vectors) or a batch of them; its shape is checked by
    `GenerateInput.validate` against the model's hidden size."""
    if input_embeds is None:
        ids, single = prompt_ids(text, input_ids, encode, text_name)
        return ids, None, single
    if text is not None or input_ids is not None:
        raise InputError(f"pass exactly one of {text_name}, input_ids or input_embeds",
                         "input_embeds")
    if not isinstance(input_embeds, list) or not input_embeds:
        raise InputError("input_embeds must be a non-empty list of vectors (or a list of "
                         "such lists, one per input)", "input_embeds")
    single = not (isinstance(input_embeds[0], list) and input_embeds[0]
                  and isinstance(input_embeds[0][0], list))
    batch = [input_embeds] if single else input_embeds
    return [[0] * len(e) if isinstance(e, list) else [] for e in batch], batch, single


def check_embeds(embeds: Any, hidden_size: int, max_positions: int) -> bytes:
    """One prompt's `input_embeds` (a list of `hidden_size` finite floats per
    position) as the wire's float32 bytes; InputError naming what is wrong."""
    if not hidden_size:
        raise InputError("this server does not take input_embeds", "input_embeds")
    if not isinstance(embeds, list) or not embeds:
        raise InputError("input_embeds of a prompt must be a non-empty list of vectors",
                         "input_embeds")
    if len(embeds) >= max_positions:
        raise InputError(f"input_embeds has {len(embeds)} positions, but this model accepts "
                         f"at most {max_positions - 1} input positions", "input_embeds")
    flat = array.array("f")
    for i, row in enumerate(embeds):
        if not isinstance(row, list) or len(row) != hidden_size:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise InputError(f"input_embeds[{i}] must be a list of {hidden_size} floats (the "
                             f"model's hidden size), got {got}", "input_embeds")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                   and math.isfinite(x) for x in row):
            raise InputError(f"input_embeds[{i}] holds a value that is not a finite number",
                             "input_embeds")
        flat.extend(row)
    if sys.byteorder != "little":
        flat.byteswap()
    return flat.tobytes()


def per_input(value: Any, n: int, name: str) -> list[Any]:
    """One value per input: a list must have n entries, anything else is shared."""
    if isinstance(value, list):
        if len(value) != n:
            raise InputError(f"got {len(value)} {name} for {n} inputs", name)
        return list(value)
    return [value] * n


def sampling_params_per_input(sp: dict[str, Any] | list[dict[str, Any]] | None,
                              n: int) -> list[SamplingParams]:
    """SamplingParams per input (one dict is shared); a ValueError names the field."""
    if not isinstance(sp, list):
        return [SamplingParams.from_dict(_params_dict(sp))] * n
    return [SamplingParams.from_dict(_params_dict(p))
            for p in per_input(sp, n, "sampling_params")]


def _params_dict(sp: Any) -> dict[str, Any] | None:
    if sp is not None and not isinstance(sp, dict):
        raise InputError(f"sampling_params must be an object (or a list of them, one per "
                         f"input), got {type(sp).__name__}", "sampling_params")
    return sp


def rids_per_input(rid: str | list[str] | None, n: int) -> tuple[str, list[str]]:
    """The call's id and one id per input: `rid` names the inputs (one string for
    one input); without it a fresh call id, and `{id}-{i}` per input of a batch."""
    if rid is None:
        gid = new_id()
        return gid, [gid] if n == 1 else [f"{gid}-{i}" for i in range(n)]
    rids = [rid] if isinstance(rid, str) else rid
    if not isinstance(rids, list) or not all(isinstance(r, str) and r for r in rids):
        raise InputError("rid must be a non-empty string or a list of them", "rid")
    if len(rids) != n:
        raise InputError(f"got {len(rids)} rids for {n} inputs", "rid")
    return (rids[0] if n == 1 else new_id()), list(rids)


def new_id(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex}"


# ---- one prompt, one call --------------------------------------------------------------
@dataclass
class PromptJob:
    """One prompt of an API call, to be sampled `params.n` times."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    session_params: dict[str, Any] | None = None  # the scheduler prepends the session context
    priority: int = 0  # as the caller sent it until GenerateInput.validate checks it
    # The prompt as one vector per position (`input_ids` then are placeholders);
    # after GenerateInput.validate, the wire's float32 bytes.
    input_embeds: list[list[float]] | bytes | None = None

    def samples(self) -> list[tuple[str, dict[str, Any]]]:
        """(rid, wire sampling params) per sample: `{rid}-{j}` with n > 1, and seeded
        samples get seed + j so the n samples of one seeded request differ."""
        p = self.params
        if p.n == 1:
            return [(self.rid, p.to_dict())]
        out = []
        for j in range(p.n):
            sp = p.to_dict()
            if p.seed is not None:
                sp["seed"] = p.seed + j
            out.append((f"{self.rid}-{j}", sp))
        return out


def native_jobs(inputs: list[list[int]], *, sampling_params: Any = None, rid: Any = None,
                session_params: Any = None, priority: Any = None,
                input_embeds: list[list[list[float]]] | None = None
                ) -> tuple[str, list[PromptJob]]:
    """SGLang's native call shape (/generate, Engine.generate): each of `sampling_params`,
    `rid`, `session_params` and `priority` is one value for every input or a list
    of one per input; `input_embeds` (from `prompt_inputs`) one prompt's vectors per
    input. Returns the call's id and its prompts."""
    n = len(inputs)
    params = sampling_params_per_input(sampling_params, n)
    gid, rids = rids_per_input(rid, n)
    sessions = per_input(session_params, n, "session_params")
    for s in sessions:
        if s is not None and not isinstance(s, dict):
            raise InputError(f"session_params must be an object, got {type(s).__name__}",
                             "session_params")
    priorities = per_input(priority, n, "priority")  # checked by GenerateInput.validate
    embeds = input_embeds if input_embeds is not None else [None] * n
    return gid, [PromptJob(r, ids, p, s, pr, e) for r, ids, p, s, pr, e
                 in zip(rids, inputs, params, sessions, priorities, embeds, strict=True)]


@dataclass
class GenerateInput:
    """One API call: its prompts and the options they share. Sequences are
    numbered input-major (prompt i, sample j -> i * n + j), the `index` results
    report."""

    gid: str
    jobs: list[PromptJob]
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: no prompt logprobs
    return_timing: bool = False  # stamp each sequence's way to its first output

    def validate(self, limits: Any, check_grammar: Callable[[SamplingParams], None],
                 max_top_logprobs: int | None = MAX_TOP_LOGPROBS,
                 priority_scheduling: bool = True) -> None:
        """Every check a front end can make (the module docstring lists them);
        raises ValueError naming the parameter (InputError where the message does
        not start with it). `check_grammar` raises ValueError for a grammar that
        cannot be served; `priority_scheduling` False refuses non-zero priorities."""
        check_logprob_args(self.top_logprobs_num, self.logprob_start_len, max_top_logprobs)
        for job in self.jobs:
            if job.input_embeds is not None:
                self._check_embeds(job, limits)
            check_input(limits, job.input_ids, job.params.max_new_tokens)
            job.params.check_token_ids(limits.vocab_size)
            check_grammar(job.params)
            job.priority = check_priority(job.priority, priority_scheduling)
        self.members()

    def _check_embeds(self, job: PromptJob, limits: Any) -> None:
        if isinstance(job.input_embeds, bytes):
            return  # validated already
        if job.session_params is not None:
            raise InputError("input_embeds cannot continue a session (session_params): a "
                             "session continues token ids", "input_embeds")
        if self.return_logprob and self.logprob_start_len >= 0:
            raise InputError("input_embeds has no prompt tokens to report logprobs of: "
                             "logprob_start_len must be -1", "logprob_start_len")
        job.input_embeds = check_embeds(job.input_embeds, limits.hidden_size,
                                        limits.max_seq_len)

    @property
    def num_seqs(self) -> int:
        return sum(job.params.n for job in self.jobs)

    def samples(self) -> list[list[tuple[str, dict[str, Any]]]]:
        return [job.samples() for job in self.jobs]

    def requests(self) -> list[GenerateReq]:
        """The wire requests, input-major: `index` of requests()[k] is k."""
        return [GenerateReq(rid=rid, input_ids=job.input_ids, sampling_params=sp,
                            stream=self.stream, return_logprob=self.return_logprob,
                            top_logprobs_num=self.top_logprobs_num,
                            logprob_start_len=self.logprob_start_len
                            if self.return_logprob else -1,
                            session_params=job.session_params, priority=job.priority,
                            return_timing=self.return_timing, input_embeds=job.input_embeds)
                for job, samples in zip(self.jobs, self.samples(), strict=True)
                for rid, sp in samples]

    def stages(self, radix_cache: bool = True) -> list[list[GenerateReq]]:
        """What a front end sends, in order: every stage but the last runs to
        completion before the next is sent (the n > 1 warm-ups, `warmups`); the
        last is the call's requests (`requests`). The one sequencing of the
        offline Engine and the server's TokenizerManager."""
        warmups = self.warmups(radix_cache)
        return [warmups, self.requests()] if warmups else [self.requests()]

    def warmups(self, radix_cache: bool = True) -> list[GenerateReq]:
        """The n > 1 warm-up plan: a prefill-only request (max_new_tokens 0) per
        prompt sampled more than once, to run to completion before `requests()`, so
        the prompt's KV is in the radix tree and the n samples share it (seed note
        000). None without a radix cache, nor for a session's prompt (the scheduler
        builds it from the session's context later). A warm-up keeps its prompt's
        priority, so it is not starved behind the work it precedes."""
        if not radix_cache:
            return []
        prefill_only = SamplingParams(max_new_tokens=0).to_dict()
        return [GenerateReq(rid=new_id("warm-"), input_ids=job.input_ids,
                            sampling_params=prefill_only, priority=job.priority)
                for job in self.jobs if job.params.n > 1 and job.session_params is None
                and job.input_embeds is None]  # embeddings share no cached KV

    def members(self) -> dict[str, list[int]]:
        """Which sequence indices each id of the call covers (the call's id, each
        prompt's, each sample's): what an abort may name. InputError on an id that
        appears twice."""
        members: dict[str, list[int]] = {self.gid: []}
        seq_rids: set[str] = set()
        index = 0
        for job, samples in zip(self.jobs, self.samples(), strict=True):
            ids = list(range(index, index + len(samples)))
            members[self.gid] += ids
            if job.rid != self.gid:
                if job.rid in members:
                    raise InputError(f"request id {job.rid!r} appears twice", "rid")
                members[job.rid] = ids
            _add_samples(members, seq_rids, samples, ids)
            index += len(samples)
        return members


def _add_samples(members: dict[str, list[int]], seq_rids: set[str],
                 samples: Iterable[tuple[str, dict[str, Any]]], ids: list[int]) -> None:
    for (rid, _), i in zip(samples, ids, strict=True):
        if rid in seq_rids:
            raise InputError(f"request id {rid!r} appears twice", "rid")
        seq_rids.add(rid)
        members.setdefault(rid, [i])
