"""Constrained decoding (xgrammar) end to end on the embedded SmolLM2 model:
100 generated JSON schemas and 50 regexes, greedy and sampled, every output
valid; bad grammars refused with a ValueError naming the problem; compile
errors inside the scheduler; retraction, n > 1, streaming, mixed batches."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch
from grammar_cases import json_schemas, regexes
from hf_reference import EXACT

import radixlm
from radixlm.constrained import create_grammar_manager
from radixlm.constrained.xgrammar_backend import XGrammarBackend, clean_error
from radixlm.protocol import GenerateReq
from radixlm.sampling_params import SamplingParams

NUM_SCHEMAS, NUM_REGEXES = 100, 50
SCHEMAS = json_schemas(NUM_SCHEMAS, seed=0)
REGEXES = regexes(NUM_REGEXES, seed=0)
# The generators bound outputs to ~220 characters; 160 tokens leave room for
# tokens shorter than 1.4 characters on average (measured: 24 on average).
JSON_TOKENS, REGEX_TOKENS = 160, 64
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"]}


@pytest.fixture(scope="module")
def engine():
    with radixlm.Engine(**EXACT, max_total_tokens=32768) as e:
        yield e


def chat(engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                tokenize=False, add_generation_prompt=True)


def sampling(temperature: float, i: int, **grammar) -> dict:
    return {"temperature": temperature, "seed": i, **grammar}


def assert_valid_json(out: dict, schema: dict) -> None:
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)


# ---- many grammars, greedy and sampled ----------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_generated_json_schemas_validate(engine, temperature):
    prompt = chat(engine, "Give an example record as JSON.")
    params = [{**sampling(temperature, i, json_schema=json.dumps(s)),
               "max_new_tokens": JSON_TOKENS} for i, s in enumerate(SCHEMAS)]
    outs = engine.generate([prompt] * NUM_SCHEMAS, params)
    for out, schema in zip(outs, SCHEMAS, strict=True):
        assert_valid_json(out, schema)
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_generated_regexes_fullmatch(engine, temperature):
    prompt = chat(engine, "Give an example value.")
    params = [{**sampling(temperature, i, regex=r), "max_new_tokens": REGEX_TOKENS}
              for i, r in enumerate(REGEXES)]
    outs = engine.generate([prompt] * NUM_REGEXES, params)
    for out, regex in zip(outs, REGEXES, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])


def test_ebnf_grammar(engine):
    ebnf = ('root ::= greeting ", " name "!"\n'
            'greeting ::= "Hello" | "Hi" | "Hey"\n'
            'name ::= [A-Z] [a-z]{1,8}')
    outs = engine.generate([chat(engine, "Greet someone.")] * 2,
                           [{"max_new_tokens": 24, "temperature": t, "ebnf": ebnf}
                            for t in (0.0, 1.0)])
    for out in outs:
        assert re.fullmatch(r"(Hello|Hi|Hey), [A-Z][a-z]{1,8}!", out["text"]), out["text"]


def test_grammar_and_free_requests_share_a_batch(engine):
    """The mask touches only grammar rows: free requests decode exactly as alone."""
    free = [chat(engine, "Name three colors."), "The capital of France is"]
    greedy = {"max_new_tokens": 24, "temperature": 0.0}
    alone = [engine.generate(p, greedy)["output_ids"] for p in free]
    prompt = chat(engine, "Describe a person as JSON.")
    outs = engine.generate([free[0], prompt, free[1], prompt],
                           [greedy, {**greedy, "max_new_tokens": 64,
                                     "json_schema": json.dumps(PERSON)},
                            greedy, {**greedy, "max_new_tokens": 32, "regex": r"\d{3}-[a-z]{4}"}])
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == alone
    assert_valid_json(outs[1], PERSON)
    assert re.fullmatch(r"\d{3}-[a-z]{4}", outs[3]["text"])


def test_n_samples_each_have_a_matcher(engine):
    outs = engine.generate(chat(engine, "Describe a person as JSON."),
                           {"max_new_tokens": 64, "temperature": 1.0, "n": 4, "seed": 3,
                            "json_schema": json.dumps(PERSON)})
    assert [o["index"] for o in outs] == [0, 1, 2, 3]
    for out in outs:
        assert_valid_json(out, PERSON)
    assert len({o["text"] for o in outs}) > 1


def test_streaming_with_grammar(engine):
    regex = r"[A-Z][a-z]{2,6} (is|was) \d{1,3} years old"
    chunks = list(engine.generate(chat(engine, "How old is someone?"),
                                  {"max_new_tokens": 32, "regex": regex, "temperature": 0.7},
                                  stream=True))
    assert len(chunks) > 2
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(regex, "".join(c["text"] for c in chunks))


def _long_schema(i: int) -> dict:
    """Outputs of ~40 tokens: enough to overflow a small KV pool."""
    names = {"type": "array", "items": {"type": "string", "minLength": 6, "maxLength": 10},
             "minItems": 3 + i % 2, "maxItems": 4}
    score = {"type": "integer", "minimum": 0, "maximum": 1000}
    return {"type": "object", "properties": {"names": names, "score": score},
            "required": ["names", "score"]}


def test_chunked_prefill_and_retraction_keep_matchers_valid(engine):
    """6 grammar requests in a 220-token pool with 32-token prefill chunks, all
    admitted at once (a tiny decode reservation): decode runs out of memory,
    retracts and re-prefills requests (output ids kept, so the matcher state
    stays valid); the greedy outputs must equal those of the roomy engine."""
    schemas = [_long_schema(i) for i in range(6)]
    prompts = [chat(engine, f"List some names for team number {i + 1} as JSON, with a score.")
               for i in range(6)]
    params = [{"max_new_tokens": 96, "temperature": 0.0, "json_schema": json.dumps(s)}
              for s in schemas]
    roomy = engine.generate(prompts, params)
    with radixlm.Engine(**EXACT, max_total_tokens=220, chunked_prefill_size=32,
                        schedule_conservativeness=0.05) as small:
        assert len(small.tokenizer.encode(prompts[0])) > 32  # prompts are chunked
        tight = small.generate(prompts, params)
        assert small.scheduler.stats.num_retractions > 0
        small.scheduler.check_invariants()
    for a, b, s in zip(roomy, tight, schemas, strict=True):
        assert_valid_json(b, s)
        assert a["output_ids"] == b["output_ids"]


# ---- refusals ---------------------------------------------------------------------
BAD_GRAMMARS = [
    ({"json_schema": '{"type": "object", "properties": {'}, "json_schema is not valid JSON"),
    ({"json_schema": '["not", "a", "schema"]'}, "json_schema must be a JSON object"),
    ({"json_schema": '{"type": "strin"}'}, 'json_schema is invalid: Unsupported type "strin"'),
    ({"json_schema": '{"type": "integer", "minimum": 5, "maximum": 1}'},
     "json_schema is invalid: Invalid range"),
    ({"json_schema": '{"$ref": "#/definitions/missing"}'}, "json_schema is invalid"),
    ({"regex": "(abc"}, "regex is invalid: Regex parsing error at position 5: The parenthesis"),
    ({"regex": r"(a)\1"}, "regex is invalid: Regex parsing error at position 4: Backreference "
                          "is not supported"),
    ({"regex": r"(?<=a)b"}, "regex is invalid: Regex parsing error at position 3: Lookbehind "
                            "is not supported"),
    ({"regex": r"\p{L}+"}, "regex is invalid"),
    ({"ebnf": "root ::= foo"}, 'ebnf is invalid: EBNF parser error at line 1, column 10: '
                               'Rule "foo" is not defined'),
    ({"regex": "a+", "json_schema": "{}"}, "only one of json_schema, regex, ebnf may be set"),
    ({"regex": ""}, "regex must be a non-empty string"),
]


@pytest.mark.parametrize("grammar,message", BAD_GRAMMARS,
                         ids=[f"bad{i}" for i in range(len(BAD_GRAMMARS))])
def test_bad_grammar_is_a_value_error(engine, grammar, message):
    with pytest.raises(ValueError) as err:
        engine.generate("Hello", {"max_new_tokens": 4, **grammar})
    assert message in str(err.value)
    assert "/project/" not in str(err.value)  # no C++ source locations leak
    assert not engine.scheduler.reqs
    ok = engine.generate("Hello", {"max_new_tokens": 8, "regex": "(yes|no)"})
    assert ok["text"] in ("yes", "no")


def _run_scheduler(sched, rids: set[str], timeout: float = 120.0) -> dict[str, list]:
    """Step the scheduler until every rid finished; the TokenOuts per rid."""
    outs: dict[str, list] = {r: [] for r in rids}
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while done != rids:
        assert time.monotonic() < deadline, "requests did not finish"
        for out in sched.step():
            if out.rid in outs:
                outs[out.rid].append(out)
                if out.finish_reason is not None:
                    done.add(out.rid)
    return outs


def _req(engine, rid: str, **sp) -> GenerateReq:
    params = SamplingParams.from_dict({"max_new_tokens": 8, **sp})
    return GenerateReq(rid=rid, input_ids=engine.tokenizer.encode(chat(engine, "Hi")),
                       sampling_params=params.to_dict())


def test_compile_error_in_scheduler_aborts_with_400(engine):
    """A grammar that reaches the scheduler unvalidated (e.g. from another front
    end) fails only its own request, with the error and status 400."""
    sched = engine.scheduler
    sched.add_request(_req(engine, "bad", regex=r"(a)\1"))
    sched.add_request(_req(engine, "good", regex=r"[a-z]{3}"))
    sched.add_request(_req(engine, "free"))
    outs = _run_scheduler(sched, {"bad", "good", "free"})
    bad = outs["bad"][-1].finish_reason
    assert bad["type"] == "abort" and bad["status_code"] == 400
    assert "Backreference is not supported" in bad["message"]
    assert outs["bad"][-1].new_token_ids == []
    assert outs["good"][-1].finish_reason["type"] == "stop"
    assert len(outs["free"][-1].new_token_ids) > 0
    sched.check_invariants()


def test_grammar_backend_none_refuses(engine):
    sched = engine.scheduler
    saved = sched.grammars
    sched.grammars = create_grammar_manager("none", engine.tokenizer, sched.vocab_size,
                                            sched.eos_token_ids, 4)
    try:
        with pytest.raises(ValueError, match="json_schema needs constrained decoding.*"
                                             "--grammar-backend none"):
            engine.generate("Hi", {"max_new_tokens": 4, "json_schema": "{}"})
        with pytest.raises(ValueError, match="--grammar-backend none"):
            sched.add_request(_req(engine, "x", regex="a"))
        assert engine.generate("Hi", {"max_new_tokens": 4})["meta_info"]["completion_tokens"]
    finally:
        sched.grammars = saved


class _GatedBackend:
    """The real backend, except that compiles wait until `gate` is set."""

    def __init__(self, real: XGrammarBackend) -> None:
        self.real = real
        self.gate = threading.Event()
        self.pool = ThreadPoolExecutor(1)

    def compile_async(self, kind: str, spec: str):
        return self.pool.submit(self._compile, kind, spec)

    def _compile(self, kind: str, spec: str):
        assert self.gate.wait(60)
        return self.real.compile(kind, spec)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@pytest.fixture
def gated(engine):
    grammars = engine.scheduler.grammars
    real = grammars.backend  # built on first use
    gate = grammars._backend = _GatedBackend(real)
    yield gate
    gate.gate.set()
    gate.pool.shutdown()
    grammars._backend = real
    engine.scheduler.check_invariants()


def test_slow_compile_does_not_stall_the_loop(engine, gated):
    sched = engine.scheduler
    sched.add_request(_req(engine, "slow", regex=r"[a-k]{2}"))  # never compiled before
    sched.add_request(_req(engine, "fast", max_new_tokens=6))
    assert [r.rid for r, _ in sched.grammars.pending] == ["slow"]
    assert "slow" not in [r.rid for r in sched.waiting]
    outs = _run_scheduler(sched, {"fast"})  # finishes while "slow" still compiles
    assert outs["fast"][-1].finish_reason is not None
    assert sched.grammars.has_pending and sched.has_work
    gated.gate.set()
    outs = _run_scheduler(sched, {"slow"})
    assert outs["slow"][-1].finish_reason["type"] == "stop"
    assert re.fullmatch(r"[a-k]{2}", engine.tokenizer.decode(
        [t for o in outs["slow"] for t in o.new_token_ids], skip_special_tokens=True))


def test_abort_while_compiling(engine, gated):
    sched = engine.scheduler
    sched.add_request(_req(engine, "doomed", regex=r"[l-z]{2}"))
    sched.abort("doomed")
    assert not sched.grammars.has_pending and "doomed" not in sched.reqs
    outs = sched.step()
    assert [o.finish_reason["type"] for o in outs if o.rid == "doomed"] == ["abort"]
    gated.gate.set()  # the orphaned compile finishes; nothing refers to it
    assert not sched.has_work


def test_recent_grammar_skips_the_compile_pool(engine):
    """A grammar compiled moments ago (here by the Engine's validation) is
    attached at add_request: the request is schedulable in the same step."""
    sched = engine.scheduler
    params = SamplingParams.from_dict({"max_new_tokens": 4, "regex": "[0-9]{3}"})
    sched.grammars.validate(params)
    sched.add_request(_req(engine, "warm", regex="[0-9]{3}", max_new_tokens=4))
    assert not sched.grammars.has_pending
    assert [r.rid for r in sched.waiting] == ["warm"] and sched.waiting[0].grammar is not None
    outs = _run_scheduler(sched, {"warm"})
    assert outs["warm"][-1].finish_reason["type"] == "stop"


# ---- backend units ---------------------------------------------------------------
def test_mask_covers_padded_vocab_columns(engine):
    backend = engine.scheduler.grammars.backend
    grammar = backend.compile("regex", "(yes|no)")
    m = backend.matcher(grammar)
    bitmask = backend.allocate_bitmask(2)
    backend.fill_bitmasks([m], bitmask, [1])
    logits = torch.zeros(2, backend.vocab_size + 64)  # an LM head padded past the vocab
    backend.apply_bitmask(logits, bitmask, [1])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(t < backend.vocab_size for t in allowed)
    assert all(engine.tokenizer.decode([t]) and
               ("yes".startswith(engine.tokenizer.decode([t])) or
                "no".startswith(engine.tokenizer.decode([t]))) for t in allowed)
    assert torch.isfinite(logits[0]).all()  # rows without a grammar are untouched


def test_matcher_accept_terminate_rollback(engine):
    backend = engine.scheduler.grammars.backend
    m = backend.matcher(backend.compile("regex", "ab[0-9]"))
    ids = engine.tokenizer.encode("ab7")
    assert all(m.accept_token(t) for t in ids)
    assert not m.accept_token(engine.tokenizer.encode("x")[0])
    eos = engine.tokenizer.eos_token_id
    assert m.accept_token(eos) and m.is_terminated()
    assert m.supports_rollback
    m.rollback(1)
    assert not m.is_terminated()


def test_clean_error_strips_cpp_location():
    e = RuntimeError("[09:53:50] /project/cpp/regex_converter.cc:94: Regex parsing error at "
                     "position 5: The parenthesis is not closed.\n")
    assert clean_error(e) == "Regex parsing error at position 5: The parenthesis is not closed."


def test_backend_that_fails_to_start_refuses_grammars_and_serves_the_rest(engine):
    """The backend is built when the first grammar arrives; if that fails, that
    request and later grammars get the reason, and plain requests still run."""
    from radixlm.constrained.manager import GrammarManager

    def broken():
        raise RuntimeError("tokenizer has no vocabulary")

    sched = engine.scheduler
    saved = sched.grammars
    sched.grammars = sched.output.grammars = GrammarManager(broken, "xgrammar", 4)
    try:
        params = SamplingParams(regex="[ab]+")
        with pytest.raises(ValueError, match="failed to start: tokenizer has no vocabulary"):
            sched.grammars.validate(params)
        with pytest.raises(ValueError, match="failed to start"):
            sched.grammars.check(params)
        out = engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 3
    finally:
        sched.grammars = sched.output.grammars = saved
    sched.check_invariants()
