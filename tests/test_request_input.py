"""The one front end's input rules (radixlm/request_input.py), without a model:
shapes, per-input values, n-expansion, the warm-up plan, and errors that name
their parameter."""

from __future__ import annotations

from typing import Any

import pytest

from radixlm.constrained.spec import precheck
from radixlm.request_input import (
    GenerateInput,
    InputError,
    Limits,
    PromptJob,
    native_jobs,
    prompt_ids,
)
from radixlm.sampling_params import SamplingParams

LIMITS = Limits(vocab_size=100, context_len=256, max_total_tokens=1000, max_running_requests=4)


def _encode(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def _grammar(params: SamplingParams) -> None:
    precheck(params, "xgrammar")


def _call(jobs: list[PromptJob], **kw: Any) -> GenerateInput:
    return GenerateInput("g", jobs, **kw)


def _job(rid: str, n: int, seed: int | None = None, **kw: Any) -> PromptJob:
    return PromptJob(rid, [1, 2, 3], SamplingParams.from_dict({"n": n, "seed": seed}), **kw)


def _error(fn: Any, *args: Any, **kw: Any) -> InputError:
    with pytest.raises(InputError) as e:
        fn(*args, **kw)
    return e.value


# ---- shapes -------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "input_ids", "ids", "single"), [
    ("ab", None, [[97 % 100, 98 % 100]], True),
    (["a", "bc"], None, [[97], [98, 99]], False),
    (None, [5, 6], [[5, 6]], True),
    (None, [[5], [6, 7]], [[5], [6, 7]], False),
    (None, [], [[]], True),  # an empty prompt: check_input refuses it, naming the rule
])
def test_prompt_shapes(text: Any, input_ids: Any, ids: list[list[int]], single: bool) -> None:
    assert prompt_ids(text, input_ids, _encode) == (ids, single)


@pytest.mark.parametrize(("text", "input_ids", "param", "needle"), [
    ("a", [1], "prompt", "exactly one of prompt, input_ids or input_embeds"),
    (None, None, "prompt", "exactly one"),
    ([], None, "prompt", "empty list"),
    (["a", 3], None, "prompt", "a string or a list of strings"),
    (None, [1, True], "input_ids", "token ids"),
    (None, [1.0], "input_ids", "token ids"),
    (None, [[1], 2], "input_ids", "token ids"),
])
def test_prompt_errors_name_the_parameter(text: Any, input_ids: Any, param: str,
                                          needle: str) -> None:
    err = _error(prompt_ids, text, input_ids, _encode, text_name="prompt")
    assert err.param == param and needle in str(err)


def test_text_needs_a_tokenizer() -> None:
    err = _error(prompt_ids, "hi", None, None)
    assert err.param == "text" and "input_ids" in str(err)


def test_native_jobs_shares_or_spreads_per_input_values() -> None:
    gid, jobs = native_jobs([[1], [2], [3]], sampling_params={"max_new_tokens": 3},
                            rid=["a", "b", "c"], priority=[3, 0, -1],
                            session_params={"id": "s"})
    assert gid not in ("a", "b", "c") and [j.rid for j in jobs] == ["a", "b", "c"]
    assert [j.params.max_new_tokens for j in jobs] == [3, 3, 3]
    assert [j.priority for j in jobs] == [3, 0, -1]
    assert [j.session_params for j in jobs] == [{"id": "s"}] * 3
    _, jobs = native_jobs([[1], [2]], sampling_params=[{"temperature": 0}, {"top_k": 5}],
                          priority=7)
    assert (jobs[0].params.temperature, jobs[1].params.top_k) == (0, 5)
    assert [j.priority for j in jobs] == [7, 7]


def test_rids() -> None:
    gid, jobs = native_jobs([[1]], rid="mine")
    assert gid == "mine" and jobs[0].rid == "mine"
    gid, jobs = native_jobs([[1], [2]])
    assert [j.rid for j in jobs] == [f"{gid}-0", f"{gid}-1"]


@pytest.mark.parametrize(("kw", "param"), [
    ({"sampling_params": [{}]}, "sampling_params"),
    ({"sampling_params": "greedy"}, "sampling_params"),
    ({"rid": ["a"]}, "rid"),
    ({"rid": 5}, "rid"),
    ({"session_params": [None]}, "session_params"),
    ({"session_params": "s"}, "session_params"),
    ({"priority": [1, 2, 3]}, "priority"),
])
def test_per_input_counts_and_types(kw: dict[str, Any], param: str) -> None:
    err = _error(native_jobs, [[1], [2]], **kw)
    assert err.param == param, err


def test_sampling_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="^temperature must be >= 0"):
        native_jobs([[1]], sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        native_jobs([[1]], sampling_params=[{"bogus": 1}])


# ---- priority ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [True, 1.0, 2.5, "1", [1], 1 << 63])
def test_priority_must_be_an_integer(bad: Any) -> None:
    _, jobs = native_jobs([[1]], priority=bad if not isinstance(bad, list) else [bad])
    err = _error(_call(jobs).validate, LIMITS, _grammar)
    assert err.param == "priority" and str(err).startswith("priority must be")


def test_priority_travels_on_every_sample_and_warmup() -> None:
    _, jobs = native_jobs([[1, 2], [3]], sampling_params=[{"n": 2}, {}], priority=[5, None])
    call = _call(jobs)
    call.validate(LIMITS, _grammar)
    assert [r.priority for r in call.requests()] == [5, 5, 0]
    assert [w.priority for w in call.warmups()] == [5]


# ---- n-expansion and the warm-up plan -------------------------------------------------------
def test_seeded_samples_differ() -> None:
    samples = _job("r", 3, seed=5).samples()
    assert [rid for rid, _ in samples] == ["r-0", "r-1", "r-2"]
    assert [sp["seed"] for _, sp in samples] == [5, 6, 7]


def test_unseeded_samples_stay_unseeded() -> None:
    assert [sp["seed"] for _, sp in _job("r", 2).samples()] == [None, None]
    assert [rid for rid, _ in _job("r", 1, seed=4).samples()] == ["r"]


def test_requests_are_input_major() -> None:
    call = _call([_job("a", 2), _job("b", 1)], stream=True, return_logprob=True,
                 top_logprobs_num=2, logprob_start_len=0)
    reqs = call.requests()
    assert [r.rid for r in reqs] == ["a-0", "a-1", "b"]
    assert all(r.stream and r.return_logprob and r.top_logprobs_num == 2
               and r.logprob_start_len == 0 for r in reqs)
    assert call.num_seqs == 3


def test_prompt_logprobs_only_with_logprobs() -> None:
    (req,) = _call([_job("a", 1)], logprob_start_len=0).requests()
    assert req.logprob_start_len == -1


def test_warmups_prefill_shared_prompts_only() -> None:
    jobs = [_job("a", 3), _job("b", 1), _job("c", 2, session_params={"id": "s"})]
    call = _call(jobs)
    (warm,) = call.warmups()
    assert warm.input_ids == [1, 2, 3] and warm.rid.startswith("warm-")
    assert warm.sampling_params["max_new_tokens"] == 0 and warm.sampling_params["n"] == 1
    assert call.warmups(radix_cache=False) == []


def test_group_members_cover_call_prompt_and_sample_ids() -> None:
    members = _call([_job("g-0", 2), _job("g-1", 1)]).members()
    assert members["g"] == [0, 1, 2]
    assert members["g-0"] == [0, 1] and members["g-0-0"] == [0] and members["g-0-1"] == [1]
    assert members["g-1"] == [2]


def test_repeated_ids_are_refused() -> None:
    err = _error(_call([_job("a", 1), _job("a", 1)]).validate, LIMITS, _grammar)
    assert err.param == "rid" and "appears twice" in str(err)


# ---- validation against the scheduler's limits ------------------------------------------------
@pytest.mark.parametrize(("ids", "sp", "needle"), [
    ([], {}, "empty"),
    ([1, 100], {}, "outside the vocabulary"),
    ([1] * 256, {}, "at most 255 input tokens"),
    ([1] * 10, {"max_new_tokens": 250}, "more than the limit of 256"),
    ([1], {"stop_token_ids": [100]}, "stop_token_ids"),
    ([1], {"regex": ""}, "regex must be a non-empty string"),
    ([1], {"json_schema": "{"}, "json_schema is not valid JSON"),
])
def test_validate_checks_the_limits_and_grammar(ids: list[int], sp: dict[str, Any],
                                                needle: str) -> None:
    job = PromptJob("r", ids, SamplingParams.from_dict(sp))
    with pytest.raises(ValueError, match=needle):
        _call([job]).validate(LIMITS, _grammar)


def test_validate_calls_the_grammar_check_per_prompt() -> None:
    seen: list[str | None] = []
    jobs = [PromptJob("a", [1], SamplingParams.from_dict({"regex": "x+"})),
            PromptJob("b", [1], SamplingParams())]
    _call(jobs).validate(LIMITS, lambda p: seen.append(p.regex))
    assert seen == ["x+", None]


@pytest.mark.parametrize(("kw", "cap", "param"), [
    ({"top_logprobs_num": 21}, 20, "top_logprobs_num"),
    ({"top_logprobs_num": -1}, None, "top_logprobs_num"),
    ({"top_logprobs_num": 2.0}, 20, "top_logprobs_num"),
    ({"logprob_start_len": -2}, 20, "logprob_start_len"),
])
def test_logprob_args(kw: dict[str, Any], cap: int | None, param: str) -> None:
    err = _error(_call([_job("a", 1)], **kw).validate, LIMITS, _grammar, max_top_logprobs=cap)
    assert err.param == param


def test_the_engine_has_no_top_logprobs_cap() -> None:
    _call([_job("a", 1)], top_logprobs_num=50).validate(LIMITS, _grammar,
                                                        max_top_logprobs=None)
