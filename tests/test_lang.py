"""The frontend language on the embedded model: every example of
docs/frontend.md, run on the in-process Engine and on a real server through
RuntimeEndpoint, plus the semantics the examples rely on."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from hf_reference import EXACT

import radixlm
import radixlm.lang as sgl
from radixlm.lang.program import as_backend

DOC = Path(__file__).resolve().parents[1] / "docs" / "frontend.md"


def doc_blocks() -> list[str]:
    """The page's Python examples, minus the blocks that pick a backend."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return [b for b in blocks if "set_default_backend(" not in b]


@pytest.fixture(scope="module")
def engine():
    with radixlm.Engine(**EXACT, max_total_tokens=8192) as e:
        yield e


@pytest.fixture(scope="module")
def server():
    server_utils = pytest.importorskip("server_utils")
    return server_utils.default_server()


@pytest.fixture(params=["engine", "server"])
def backend(request, engine):
    """The backend under test, installed as the default for the test's duration."""
    be = as_backend(engine) if request.param == "engine" else \
        sgl.RuntimeEndpoint(request.getfixturevalue("server").url)
    saved = sgl.get_default_backend()
    sgl.set_default_backend(be)
    yield be
    if saved is not None:
        sgl.set_default_backend(saved)


@pytest.mark.parametrize("index", range(len(doc_blocks())))
def test_doc_example_runs(backend, engine, index):
    code = doc_blocks()[index]
    if "engine." in code and not isinstance(backend, sgl.EngineBackend):
        pytest.skip("an Engine-only example")
    exec(compile(code, f"{DOC.name}[{index}]", "exec"), {"engine": engine})


# ---- semantics --------------------------------------------------------------------
def test_roles_render_the_chat_template(backend, engine):
    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hello!")
        s += sgl.assistant("Hi. How can I help?")
        s += sgl.user("Nothing.")

    state = chat.run()
    msgs = state.messages()
    assert msgs == [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello!"},
                    {"role": "assistant", "content": "Hi. How can I help?"},
                    {"role": "user", "content": "Nothing."}]
    assert state.text() == engine.tokenizer.apply_chat_template(msgs, tokenize=False)


def test_select_scores_are_mean_choice_logprobs(engine):
    """select's scores equal the mean logprob of each choice's tokens, computed
    here from one full prompt-logprob request per choice."""
    prefix = "The capital of France is"
    choices = [" Paris", " a banana", " Berlin"]
    scores = as_backend(engine).score_choices(prefix, choices)
    prefix_ids = engine.tokenizer.encode(prefix)
    for choice, score in zip(choices, scores, strict=True):
        ids = engine.tokenizer.encode(prefix + choice)
        assert ids[:len(prefix_ids)] == prefix_ids  # this prefix does not merge
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0)
        lps = [lp for lp, _ in out["meta_info"]["input_token_logprobs"][len(prefix_ids):]]
        assert score == pytest.approx(sum(lps) / len(lps), abs=1e-4)
    assert max(range(3), key=scores.__getitem__) == 0


def test_forks_generate_in_the_same_batches(engine):
    runner = engine.scheduler.worker.runner
    sizes: list[int] = []
    real = runner.forward

    def spy(fb):
        if fb.mode.is_decode():
            sizes.append(fb.batch_size)
        return real(fb)

    @sgl.function
    def four(s):
        s += sgl.user("Name an animal.")
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += sgl.assistant(sgl.gen("animal", max_tokens=12, temperature=1.0, seed=i,
                                       ignore_eos=True))
        forks.join()

    runner.forward = spy
    try:
        state = four.run(backend=engine)
    finally:
        del runner.forward
    assert len(state["animal"]) == 4
    assert max(sizes) == 4  # all four decoded together


def test_run_batch_keeps_errors_per_state(backend):
    @sgl.function
    def pattern(s, regex):
        s += sgl.user("Give an example value.")
        s += sgl.assistant(sgl.gen("v", max_tokens=16, temperature=0, regex=regex))

    states = pattern.run_batch([{"regex": r"\d{3}"}, {"regex": "(a"}, {"regex": "[a-z]{2}"}])
    assert re.fullmatch(r"\d{3}", states[0]["v"])
    assert re.fullmatch(r"[a-z]{2}", states[2]["v"])
    assert isinstance(states[1].error, ValueError)
    with pytest.raises(ValueError, match="regex is invalid"):
        states[1]["v"]


def test_stream_yields_all_text(backend):
    @sgl.function
    def count(s):
        s += sgl.user("Count from one to five.")
        s += sgl.assistant(sgl.gen("n", max_tokens=20, temperature=0))

    state = count.run(stream=True)
    assert "".join(state.text_iter()) == state.text()


def test_gen_stop_string_and_run_defaults(backend):
    @sgl.function
    def listing(s):
        s += "1, 2, 3,"
        s += sgl.gen("rest", stop=",")

    state = listing.run(max_new_tokens=8, temperature=0)
    assert state["rest"].strip() == "4"
    assert state.get_meta_info("rest")["finish_reason"]["matched"] == ","


def test_mistakes_raise_where_made(backend):
    with pytest.raises(TypeError, match="unknown parameter"):
        sgl.gen("x", max_tokenz=3)
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", choices=[])

    @sgl.function
    def nested(s):
        s += sgl.user(sgl.assistant("x"))

    with pytest.raises(ValueError, match="roles do not nest"):
        nested.run()

    @sgl.function
    def too_hot(s):
        s += sgl.gen("x", max_tokens=4, temperature=-1)

    with pytest.raises(ValueError, match="temperature"):
        too_hot.run()


def test_program_exception_reaches_the_caller(backend):
    @sgl.function
    def fails(s):
        s += "hello"
        raise KeyError("boom")

    with pytest.raises(KeyError):
        fails.run()
    state = fails.run(stream=True)
    with pytest.raises(KeyError):
        list(state.text_iter())


def test_engine_backend_threads_share_one_driver(engine):
    assert as_backend(engine) is as_backend(engine)
    results: list[str] = []

    @sgl.function
    def hi(s, i):
        s += sgl.user(f"Say the number {i}.")
        s += sgl.assistant(sgl.gen("x", max_tokens=6, temperature=0))

    threads = [threading.Thread(target=lambda i=i: results.append(hi.run(i=i, backend=engine)
                                                                  ["x"])) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all(results)
    # Idle again: the engine's own API works beside the (waiting) driver thread.
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
