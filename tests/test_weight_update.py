"""Runtime control on the offline Engine (issue 8): weight updates from disk, tensors
and a trainer process, with rollback; weights by name; memory release/resume;
profiling; log level. One Engine for the module (embedded SmolLM2, CPU, fp32);
every test that changes the weights restores the original ones."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest
import torch
from hf_reference import EXACT, hf_greedy, load_hf
from safetensors.torch import save
from server_utils import free_port
from weight_update_utils import (
    GROUP,
    PERTURBED,
    Trainer,
    checkpoint_with,
    other_config_checkpoint,
    perturb,
    renamed_architecture,
    same_prefix,
)

import radixlm
from radixlm.models import loader

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
NEW_TOKENS = 10
SP = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine(model_dir):
    with radixlm.Engine(**EXACT, max_total_tokens=4096, context_length=256, num_threads=1) as e:
        yield e


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in PROMPTS]


def greedy(engine, prompt_ids) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompt_ids, sampling_params=SP)]


@pytest.fixture(scope="module")
def baseline(engine, prompt_ids) -> list[list[int]]:
    return greedy(engine, prompt_ids)


@pytest.fixture(scope="module")
def second(model_dir, prompt_ids, tmp_path_factory, baseline):
    """A second checkpoint (the embedded model with PERTURBED changed), its changed
    tensors, and HF's greedy tokens on it."""
    hf = load_hf(model_dir)
    tensors = perturb(hf)
    path = tmp_path_factory.mktemp("second") / "ckpt"
    hf.save_pretrained(path)
    ref = hf_greedy(hf, prompt_ids, NEW_TOKENS)
    assert ref != baseline, "the perturbation must change the greedy outputs"
    return {"path": str(path), "tensors": tensors, "greedy": ref}


def restore(engine, model_dir) -> None:
    ok, message = engine.update_weights_from_disk(model_dir)
    assert ok, message


# ---- from disk ------------------------------------------------------------------------------
def test_update_from_disk_serves_the_new_checkpoint(engine, prompt_ids, baseline, second,
                                                    model_dir):
    greedy(engine, prompt_ids)  # the prefix cache holds KV of the old weights
    assert engine.get_server_info()["kv_tokens_cached"] > 0
    ok, message = engine.update_weights_from_disk(second["path"])
    assert ok, message
    try:
        assert engine.get_server_info()["kv_tokens_cached"] == 0  # flushed: it was stale
        assert same_prefix(greedy(engine, prompt_ids), second["greedy"])
        assert engine.get_server_info()["server_args"]["model_path"] == second["path"]
    finally:
        restore(engine, model_dir)
    assert greedy(engine, prompt_ids) == baseline
    engine.scheduler.check_invariants()


def _broken(model_dir, tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (checkpoint path, a phrase the refusal must contain)."""
    up = "model.layers.3.mlp.up_proj.weight"

    def truncate(t):
        t[up] = t[up][:-1].clone()

    def drop(t):
        del t["model.layers.5.self_attn.v_proj.weight"]

    def integer(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)

    return {
        "missing dir": (str(tmp_path / "nope"), "does not exist"),
        "other config": (str(other_config_checkpoint(tmp_path / "small")), "hidden_size"),
        "other architecture": (str(renamed_architecture(model_dir, tmp_path / "arch",
                                                        "MistralForCausalLM")), "architecture"),
        "wrong shape": (str(checkpoint_with(model_dir, tmp_path / "shape", truncate)),
                        "has shape [1535, 576], the model expects [1536, 576]"),
        "missing tensor": (str(checkpoint_with(model_dir, tmp_path / "missing", drop)),
                           "lacks 1 parameter(s): model.layers.5.self_attn.qkv_proj.weight"),
        "int dtype": (str(checkpoint_with(model_dir, tmp_path / "int", integer)),
                      "not a floating-point type"),
        "empty dir": (str(tmp_path), "no config.json and no .gguf file"),
    }


def test_failed_updates_keep_the_old_weights(engine, prompt_ids, baseline, model_dir, tmp_path):
    before = engine.get_weights_by_name("model.layers.3.mlp.up_proj.weight", 20)
    for case, (path, phrase) in _broken(model_dir, tmp_path).items():
        ok, message = engine.update_weights_from_disk(path)
        assert not ok, case
        assert phrase in message, (case, message)
        assert "previous weights are kept" in message
    ok, message = engine.update_weights_from_disk(model_dir, load_format="dummy")
    assert not ok and "load_format" in message
    assert engine.get_weights_by_name("model.layers.3.mlp.up_proj.weight", 20) == before
    assert engine.get_server_info()["server_args"]["model_path"] != str(tmp_path / "nope")
    assert greedy(engine, prompt_ids) == baseline


def test_failure_while_loading_rolls_back(engine, prompt_ids, baseline, second, monkeypatch):
    """Past validation, an error halfway through the shards (a truncated file, a
    device error) restores the tensors already written."""
    def half_then_fail(model_dir):
        yield from second["tensors"].items()  # real, valid changes: they are written
        raise OSError("disk went away")

    monkeypatch.setattr(loader, "iter_safetensors", half_then_fail)
    ok, message = engine.update_weights_from_disk(second["path"])
    assert not ok
    assert "disk went away" in message and "restored" in message
    monkeypatch.undo()
    name = "model.layers.0.mlp.down_proj.weight"
    assert engine.get_weights_by_name(name, 8) != second["tensors"][name].flatten()[:8].tolist()
    assert greedy(engine, prompt_ids) == baseline


def test_update_is_refused_while_requests_run_unless_aborted(engine, prompt_ids, model_dir):
    stream = engine.generate(input_ids=prompt_ids[0], sampling_params=SP, stream=True)
    next(stream)  # the request is now running
    ok, message = engine.update_weights_from_disk(model_dir)
    assert not ok and "abort_all_requests" in message
    ok, message = engine.update_weights_from_disk(model_dir, abort_all_requests=True)
    assert ok, message
    chunks = list(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    engine.scheduler.check_invariants()


# ---- from tensors ------------------------------------------------------------------------------
def test_update_from_tensor(engine, prompt_ids, baseline, second, model_dir):
    ok, message = engine.update_weights_from_tensor(list(second["tensors"].items()))
    assert ok, message
    try:
        for name, t in second["tensors"].items():
            assert engine.get_weights_by_name(name, 12) == t.flatten()[:12].tolist(), name
        assert same_prefix(greedy(engine, prompt_ids), second["greedy"])
    finally:
        restore(engine, model_dir)
    assert greedy(engine, prompt_ids) == baseline


def test_bf16_updates_replace_the_prepacked_weights(model_dir, prompt_ids, second,
                                                    monkeypatch):
    """On the CPU in bf16 the linear layers run from copies prepacked for oneDNN: an
    update must reach them (a stale copy would go on serving the old model). Those
    copies come back at new addresses, which on a GPU would leave captured CUDA
    graphs reading the old ones: the updater says so (`refresh_graphs`, a no-op
    without graphs) after each update that moved them."""
    from radixlm.runtime.memory_occupation import MemoryOccupation

    refreshed = []
    real = MemoryOccupation.refresh_graphs
    monkeypatch.setattr(MemoryOccupation, "refresh_graphs",
                        lambda self: (refreshed.append(1), real(self)))
    kw = {"dtype": "bfloat16", "quantization": "none", "max_total_tokens": 4096,
          "context_length": 256, "num_threads": 1}
    with radixlm.Engine(model_path=second["path"], skip_tokenizer_init=True, **kw) as fresh:
        want = greedy(fresh, prompt_ids)
    with radixlm.Engine(**kw) as e:
        base = greedy(e, prompt_ids)  # packs the embedded model's weights
        ok, message = e.update_weights_from_tensor(list(second["tensors"].items()))
        assert ok, message
        assert refreshed == [1]
        assert greedy(e, prompt_ids) == want != base
        restore(e, model_dir)
        assert refreshed == [1, 1]
        assert greedy(e, prompt_ids) == base


@pytest.mark.parametrize(("tensors", "phrase"), [
    ([("model.layers.99.mlp.up_proj.weight", torch.zeros(1536, 576))], "no parameter named"),
    ([("model.norm.weight", torch.zeros(575))], "has shape [575], the model expects [576]"),
    ([("model.layers.0.self_attn.k_proj.weight", torch.zeros(192, 575))], "expects [192, 576]"),
    ([("model.norm.weight", torch.zeros(576, dtype=torch.int64))], "not a floating-point"),
    ([], "no tensors"),
    ([("model.norm.weight", torch.ones(576)), ("model.norm.weight", torch.ones(576))],
     "appears twice"),
])
def test_bad_tensor_updates_are_refused(engine, tensors, phrase):
    before = engine.get_weights_by_name("model.norm.weight", 5)
    # A valid tensor first: nothing of a refused update may be written.
    ok, message = engine.update_weights_from_tensor(
        [("model.layers.2.mlp.down_proj.weight", torch.zeros(576, 1536))] + tensors
        if tensors else [])
    assert not ok and phrase in message, message
    assert engine.get_weights_by_name("model.norm.weight", 5) == before
    assert engine.get_weights_by_name("model.layers.2.mlp.down_proj.weight", 3) != [0.0] * 3


# ---- from a trainer process ----------------------------------------------------------------------
def test_update_from_distributed(engine, prompt_ids, baseline, second, model_dir, tmp_path):
    port = free_port()
    trainer = Trainer(port, second["tensors"], tmp_path)
    try:
        ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
        assert ok, message
        trainer.wait("joined")
        ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
        assert not ok and "already exists" in message
        names = PERTURBED
        tensors = [second["tensors"][n] for n in names]
        # Refused before anything is received (the trainer does not send).
        for bad, phrase in [
            (dict(names=["model.nope.weight"], dtypes=["float32"], shapes=[[576]]),
             "no parameter named"),
            (dict(dtypes=["int32"] * len(names)), "not a floating-point torch dtype"),
            (dict(dtypes=["float99"] * len(names)), "not a floating-point torch dtype"),
            (dict(shapes=[[1, 2]] * len(names)), "has shape [1, 2]"),
            (dict(shapes=[[576]]), "equal length"),
            (dict(group_name="other"), "no weight update group named 'other'"),
        ]:
            kwargs = dict(names=names, dtypes=[t.dtype for t in tensors],
                          shapes=[list(t.shape) for t in tensors], group_name=GROUP) | bad
            ok, message = engine.update_weights_from_distributed(**kwargs)
            assert not ok and phrase in message, (bad, message)
        trainer.send(names)
        ok, message = engine.update_weights_from_distributed(
            names, [t.dtype for t in tensors], [t.shape for t in tensors], GROUP)
        assert ok, message
        trainer.wait("sent")
        for name, t in zip(names, tensors, strict=True):
            assert engine.get_weights_by_name(name, 12) == t.flatten()[:12].tolist(), name
        assert same_prefix(greedy(engine, prompt_ids), second["greedy"])
        assert engine.destroy_weights_update_group(GROUP)[0]
        assert not engine.destroy_weights_update_group(GROUP)[0]
    finally:
        trainer.close()
        restore(engine, model_dir)
    assert greedy(engine, prompt_ids) == baseline


# ---- weights by name ---------------------------------------------------------------------------
def test_get_weights_by_name_matches_the_checkpoint(engine, hf_model):
    params = dict(hf_model.named_parameters())
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.4.self_attn.v_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.2.mlp.gate_proj.weight",
                 "model.layers.2.mlp.up_proj.weight", "model.layers.7.input_layernorm.weight",
                 "model.norm.weight"]:
        assert engine.get_weights_by_name(name, 50) == params[name].flatten()[:50].tolist(), name
    # Tied: the head is the embedding.
    assert engine.get_weights_by_name("lm_head.weight", 7) == \
        params["model.embed_tokens.weight"].flatten()[:7].tolist()
    assert len(engine.get_weights_by_name("model.norm.weight", 10_000)) == 576
    assert engine.get_weights_by_name("model.norm.weight", 0) == []
    with pytest.raises(ValueError, match="no parameter named"):
        engine.get_weights_by_name("model.layers.0.nope.weight")
    with pytest.raises(ValueError, match="truncate_size"):
        engine.get_weights_by_name("model.norm.weight", -1)


# ---- memory ------------------------------------------------------------------------------------
def test_release_and_resume(engine, prompt_ids, baseline):
    runner = engine.scheduler.worker.runner
    ok, message = engine.release_memory_occupation()
    assert ok, message
    try:
        assert runner.kv_pool.k_buffer == [] and runner.kv_pool.v_buffer == []
        assert all(p.numel() == 0 for p in runner.model.parameters())
        with pytest.raises(ValueError, match="resume_memory_occupation"):
            engine.generate(input_ids=prompt_ids[0], sampling_params=SP)
        with pytest.raises(ValueError, match="released"):
            engine.get_weights_by_name("model.norm.weight")
        ok, message = engine.update_weights_from_tensor([("model.norm.weight", torch.ones(576))])
        assert not ok and "released" in message
        assert engine.release_memory_occupation()[1] == "already released"
        ok, message = engine.resume_memory_occupation(["weights"])  # the KV stays released
        assert ok and message == "resumed weights"
        with pytest.raises(ValueError, match="kv_cache"):
            engine.generate(input_ids=prompt_ids[0], sampling_params=SP)
    finally:
        assert engine.resume_memory_occupation()[0]
    assert greedy(engine, prompt_ids) == baseline
    engine.scheduler.check_invariants()


def test_release_by_tag_and_refusals(engine, prompt_ids, baseline):
    ok, message = engine.release_memory_occupation(["nope"])
    assert not ok and "unknown memory tag" in message
    ok, message = engine.release_memory_occupation(["kv_cache"])
    assert ok and message == "released kv_cache"
    assert engine.scheduler.worker.runner.model.model.norm.weight.numel() == 576  # weights stay
    assert engine.resume_memory_occupation(["kv_cache"])[0]
    assert engine.resume_memory_occupation()[1] == "nothing was released"
    stream = engine.generate(input_ids=prompt_ids[0], sampling_params=SP, stream=True)
    next(stream)
    ok, message = engine.release_memory_occupation()
    assert not ok and "running or queued" in message
    list(stream)
    assert greedy(engine, prompt_ids) == baseline


# ---- profiling and logging ---------------------------------------------------------------------
def _trace_events(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_writes_a_trace(engine, prompt_ids, tmp_path):
    ok, message = engine.start_profile(output_dir=str(tmp_path))
    assert ok, message
    ok, message = engine.start_profile(output_dir=str(tmp_path))
    assert not ok and "already running" in message
    engine.generate(input_ids=prompt_ids[0], sampling_params={**SP, "max_new_tokens": 3})
    ok, message = engine.stop_profile()
    assert ok, message
    traces = list(tmp_path.glob("*-TP-0.trace.json"))
    assert len(traces) == 1 and str(traces[0]) in message
    assert _trace_events(str(traces[0]))
    ok, message = engine.stop_profile()
    assert not ok and "not running" in message


def test_profile_num_steps_stops_by_itself(engine, prompt_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    assert engine.start_profile(num_steps=2)[0]
    engine.generate(input_ids=prompt_ids[0], sampling_params={**SP, "max_new_tokens": 5})
    assert not engine.scheduler.controls.profiler.active
    ok, message = engine.stop_profile()  # reports the trace the profile wrote itself
    assert ok and str(tmp_path / "env") in message
    assert len(list(Path(tmp_path / "env").glob("*.trace.json"))) == 1
    for bad, phrase in [({"num_steps": 0}, "num_steps"), ({"activities": ["TPU"]}, "activity"),
                        ({"activities": ["GPU"]}, "CUDA")]:
        ok, message = engine.start_profile(output_dir=str(tmp_path), **bad)
        assert not ok and phrase in message


def test_configure_logging(engine):
    radix_logger = logging.getLogger("radixlm")
    previous = radix_logger.level
    try:
        assert engine.configure_logging("debug") == (True, "log level set to debug")
        assert radix_logger.level == logging.DEBUG
        ok, message = engine.configure_logging("loud")
        assert not ok and "log_level" in message
        assert radix_logger.level == logging.DEBUG
    finally:
        radix_logger.setLevel(previous)


def test_serialized_tensors_are_safetensors_not_pickle():
    from radixlm.runtime.weight_updater import (
        WeightUpdateError,
        deserialize_named_tensors,
        serialize_named_tensors,
    )

    t = torch.arange(6.0).reshape(2, 3)
    data = serialize_named_tensors([("a", t), ("b", t[0])])  # views of one storage are fine
    assert data == save({"a": t, "b": t[0].clone()})
    # safetensors does not keep the order of the names (it sorts by offset or name).
    assert sorted((n, x.tolist()) for n, x in deserialize_named_tensors(data)) == \
        [("a", t.tolist()), ("b", t[0].tolist())]
    import pickle
    with pytest.raises(WeightUpdateError, match="not valid safetensors"):
        deserialize_named_tensors(pickle.dumps({"a": t}))


# ---- tensor parallelism ------------------------------------------------------------------------
def test_tensor_parallel_weights_by_name_and_updates(hf_model, model_dir):
    """tp=2 splits SmolLM2's 9 query / 3 KV heads unevenly (6+3 / 2+1 per rank):
    get_weights_by_name still answers the whole HF tensor, and updates reach
    every rank's shard."""
    params = dict(hf_model.named_parameters())
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    with radixlm.Engine(**EXACT, tp_size=2, max_total_tokens=2048, context_length=256) as e:
        for name in names:
            whole = params[name].flatten()
            assert e.get_weights_by_name(name, whole.numel()) == whole.tolist(), name
        # The embedding's second half lives on rank 1: its first row of that half.
        emb = e.get_weights_by_name("model.embed_tokens.weight", 24577 * 576)
        assert emb[-576:] == params["model.embed_tokens.weight"][24576].tolist()
        q = params[names[0]].detach() * 0.5
        assert e.update_weights_from_tensor([(names[0], q)])[0]
        assert e.get_weights_by_name(names[0], q.numel()) == q.flatten().tolist()
        ok, message = e.update_weights_from_disk(model_dir)
        assert ok, message
        assert e.get_weights_by_name(names[0], 10) == params[names[0]].flatten()[:10].tolist()
