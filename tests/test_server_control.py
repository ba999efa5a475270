"""Runtime-control endpoints over HTTP (issue 8): /update_weights_from_disk,
/update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group,
/get_weights_by_name, /release_memory_occupation, /resume_memory_occupation,
/start_profile, /stop_profile, /configure_logging, and --dump-requests-folder.

One server for the module (the embedded model, small KV pool); every test that
changes the weights restores them, and each ends with a /generate that works.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy, load_hf
from server_utils import DEFAULT_ARGS, ServerProcess, free_port
from weight_update_utils import (
    GROUP,
    PERTURBED,
    Trainer,
    other_config_checkpoint,
    perturb,
    same_prefix,
)

from radixlm.runtime.weight_updater import serialize_named_tensors

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
NEW_TOKENS = 10
SP = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: tmp_path_factory.mktemp(name) for name in ("dumps", "profiles", "work")}


@pytest.fixture(scope="module")
def server(dirs, model_dir):
    old = os.environ.get("RADIXLM_TORCH_PROFILER_DIR")
    os.environ["RADIXLM_TORCH_PROFILER_DIR"] = str(dirs["profiles"])
    try:
        s = ServerProcess(DEFAULT_ARGS + ["--dump-requests-folder", str(dirs["dumps"]),
                                          "--dump-requests-threshold", "2"])
    finally:
        if old is None:
            os.environ.pop("RADIXLM_TORCH_PROFILER_DIR")
        else:
            os.environ["RADIXLM_TORCH_PROFILER_DIR"] = old
    with s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[list[int]]:
    from radixlm.tokenizer import get_tokenizer

    tok = get_tokenizer(model_dir)
    return [tok.encode(p) for p in PROMPTS]


def generate(client, prompt_ids) -> list[list[int]]:
    r = client.post("/generate", json={"input_ids": prompt_ids, "sampling_params": SP})
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


@pytest.fixture(scope="module")
def baseline(client, prompt_ids) -> list[list[int]]:
    return generate(client, prompt_ids)


@pytest.fixture(scope="module")
def second(model_dir, prompt_ids, dirs, baseline):
    hf = load_hf(model_dir)
    tensors = perturb(hf)
    path = dirs["work"] / "second"
    hf.save_pretrained(path)
    ref = hf_greedy(hf, prompt_ids, NEW_TOKENS)
    assert ref != baseline
    return {"path": str(path), "tensors": tensors, "greedy": ref}


def refused(r, phrase: str, param: str | None = None, body_check: bool = False) -> None:
    """A 400 in both shapes: SGLang's success/message and OpenAI's error object
    (`body_check`: refused by the request-body schema, OpenAI's shape only)."""
    assert r.status_code == 400, r.text
    body = r.json()
    if not body_check:
        assert body["success"] is False and phrase in body["message"], body
    assert body["error"]["code"] == 400 and phrase in body["error"]["message"], body
    if param is not None:
        assert body["error"]["param"] == param


def restore(client, model_dir) -> None:
    r = client.post("/update_weights_from_disk", json={"model_path": model_dir})
    assert r.status_code == 200 and r.json()["success"], r.text


# ---- from disk ------------------------------------------------------------------------------
def test_update_from_disk(client, prompt_ids, baseline, second, model_dir):
    r = client.post("/update_weights_from_disk", json={"model_path": second["path"]})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    try:
        assert same_prefix(generate(client, prompt_ids), second["greedy"])
        assert client.get("/get_server_info").json()["server_args"]["model_path"] == \
            second["path"]
        assert client.get("/get_model_info").json()["model_path"] == second["path"]
    finally:
        restore(client, model_dir)
    assert generate(client, prompt_ids) == baseline


def test_failed_updates_from_disk(client, prompt_ids, baseline, dirs):
    refused(client.post("/update_weights_from_disk",
                        json={"model_path": str(dirs["work"] / "nope")}), "does not exist")
    small = other_config_checkpoint(dirs["work"] / "small")
    refused(client.post("/update_weights_from_disk", json={"model_path": str(small)}),
            "hidden_size: 576 -> 64")
    refused(client.post("/update_weights_from_disk", json={"model_path": str(small),
                                                           "load_format": "pt"}), "load_format")
    refused(client.post("/update_weights_from_disk", json={}), "model_path", "model_path",
            body_check=True)
    assert generate(client, prompt_ids) == baseline


def _stream(server, ids: list[int], n: int, first: threading.Event, out: dict) -> None:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out["last"] = json.loads(line[6:])
                first.set()
    out["ended"] = time.monotonic()


@pytest.mark.parametrize("abort", [False, True])
def test_update_waits_for_running_requests(server, client, prompt_ids, model_dir, abort):
    """SGLang's behaviour: admission pauses, running requests finish (or are aborted
    with abort_all_requests), then the weights change."""
    first, out = threading.Event(), {}
    n = 200 if abort else 40  # an aborted stream must still be running when the abort lands
    thread = threading.Thread(target=_stream, args=(server, prompt_ids[0], n, first, out))
    thread.start()
    assert first.wait(120)
    r = client.post("/update_weights_from_disk",
                    json={"model_path": model_dir, "abort_all_requests": abort})
    done = time.monotonic()
    thread.join(60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert out["ended"] <= done + 0.5  # the stream was over before the update answered
    finish = out["last"]["meta_info"]["finish_reason"]
    assert finish["type"] == ("abort" if abort else "length")
    if not abort:
        assert len(out["last"]["output_ids"]) == n


# ---- from tensors --------------------------------------------------------------------------
def _tensor_body(named: list[tuple[str, torch.Tensor]], **extra) -> dict:
    data = base64.b64encode(serialize_named_tensors(named)).decode()
    return {"serialized_named_tensors": data, **extra}


def test_update_from_tensor(client, prompt_ids, baseline, second, model_dir):
    try:
        for name in PERTURBED:  # one per request: the body limit is 8 MiB
            r = client.post("/update_weights_from_tensor",
                            json=_tensor_body([(name, second["tensors"][name])]))
            assert r.status_code == 200 and r.json()["success"], r.text
        for name in PERTURBED:
            r = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 9})
            assert r.json() == second["tensors"][name].flatten()[:9].tolist()
        assert same_prefix(generate(client, prompt_ids), second["greedy"])
    finally:
        restore(client, model_dir)
    assert generate(client, prompt_ids) == baseline


def test_bad_tensor_updates(client, prompt_ids, baseline):
    url = "/update_weights_from_tensor"
    refused(client.post(url, json={"serialized_named_tensors": "%%% not base64"}),
            "not valid base64", "serialized_named_tensors")
    refused(client.post(url, json={"serialized_named_tensors": base64.b64encode(
        pickle.dumps({"model.norm.weight": torch.ones(576)})).decode()}),
        "not valid safetensors")
    refused(client.post(url, json=_tensor_body([("model.nope.weight", torch.ones(3))])),
            "no parameter named 'model.nope.weight'")
    refused(client.post(url, json=_tensor_body([("model.norm.weight", torch.ones(5))])),
            "has shape [5], the model expects [576]")
    refused(client.post(url, json=_tensor_body(
        [("model.norm.weight", torch.ones(576, dtype=torch.int32))])), "not a floating-point")
    refused(client.post(url, json=_tensor_body([("model.norm.weight", torch.ones(576))],
                                               load_format="direct")), "load_format")
    refused(client.post(url, json={"flush_cache": True}), "serialized_named_tensors",
            body_check=True)
    assert generate(client, prompt_ids) == baseline


# ---- weights by name ---------------------------------------------------------------------------
def test_get_weights_by_name(client, hf_model, prompt_ids, baseline):
    params = dict(hf_model.named_parameters())
    for name in ["model.layers.0.self_attn.v_proj.weight", "model.layers.3.mlp.gate_proj.weight",
                 "model.embed_tokens.weight", "model.norm.weight"]:
        r = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 6})
        assert r.status_code == 200 and r.json() == params[name].flatten()[:6].tolist(), name
    r = client.request("GET", "/get_weights_by_name", json={"name": "model.norm.weight"})
    assert len(r.json()) == 100
    refused(client.post("/get_weights_by_name", json={"name": "model.nope"}),
            "no parameter named 'model.nope'", "name")
    refused(client.post("/get_weights_by_name", json={"name": "model.norm.weight",
                                                      "truncate_size": -1}), "truncate_size")
    refused(client.post("/get_weights_by_name", json={"truncate_size": 3}), "name", "name",
            body_check=True)
    assert generate(client, prompt_ids) == baseline


# ---- from a trainer process ----------------------------------------------------------------------
def test_update_from_distributed(client, prompt_ids, baseline, second, model_dir, dirs):
    port = free_port()
    group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
             "world_size": 2, "group_name": GROUP, "backend": "gloo"}
    refused(client.post("/init_weights_update_group", json={**group, "world_size": 1}),
            "outside [1, world_size=1)")
    refused(client.post("/init_weights_update_group", json={**group, "backend": "mpi"}),
            "backend")
    trainer = Trainer(port, second["tensors"], dirs["work"])
    try:
        r = client.post("/init_weights_update_group", json=group)
        assert r.status_code == 200 and r.json()["success"], r.text
        trainer.wait("joined")
        tensors = [second["tensors"][n] for n in PERTURBED]
        spec = {"names": PERTURBED, "dtypes": ["float32"] * len(PERTURBED),
                "shapes": [list(t.shape) for t in tensors], "group_name": GROUP}
        url = "/update_weights_from_distributed"
        refused(client.post(url, json={**spec, "dtypes": ["int8"] * len(PERTURBED)}),
                "'int8' is not a floating-point torch dtype")
        refused(client.post(url, json={**spec, "shapes": [[3, 3]] * len(PERTURBED)}),
                "has shape [3, 3]")
        refused(client.post(url, json={**spec, "names": ["x.weight"] + PERTURBED[1:]}),
                "no parameter named 'x.weight'")
        refused(client.post(url, json={**spec, "shapes": "576"}), "shapes", "shapes",
                body_check=True)
        trainer.send(PERTURBED)
        r = client.post(url, json=spec)
        assert r.status_code == 200 and r.json()["success"], r.text
        trainer.wait("sent")
        r = client.post("/get_weights_by_name", json={"name": PERTURBED[3], "truncate_size": 5})
        assert r.json() == tensors[3].flatten()[:5].tolist()
        assert same_prefix(generate(client, prompt_ids), second["greedy"])
        r = client.post("/destroy_weights_update_group", json={"group_name": GROUP})
        assert r.status_code == 200, r.text
        refused(client.post("/destroy_weights_update_group", json={"group_name": GROUP}),
                "no weight update group")
    finally:
        trainer.close()
        restore(client, model_dir)
    assert generate(client, prompt_ids) == baseline


# ---- memory ------------------------------------------------------------------------------------
def test_release_and_resume(client, prompt_ids, baseline):
    r = client.post("/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["success"], r.text
    try:
        r = client.post("/generate", json={"input_ids": prompt_ids[0], "sampling_params": SP})
        assert r.status_code == 400 and "resume_memory_occupation" in \
            r.json()["error"]["message"], r.text
        refused(client.post("/get_weights_by_name", json={"name": "model.norm.weight"}),
                "released")
    finally:
        r = client.post("/resume_memory_occupation")
        assert r.status_code == 200 and r.json()["success"], r.text
    assert generate(client, prompt_ids) == baseline
    refused(client.post("/release_memory_occupation", json={"tags": ["gpu"]}),
            "unknown memory tag")
    r = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.json()["message"] == "released kv_cache"
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
    assert generate(client, prompt_ids) == baseline


# ---- profiling ---------------------------------------------------------------------------------
def test_profile(client, prompt_ids, baseline, dirs, tmp_path):
    r = client.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert r.status_code == 200 and r.json()["success"], r.text
    refused(client.post("/start_profile"), "already running")
    generate(client, prompt_ids[:1])
    r = client.post("/stop_profile")
    assert r.status_code == 200, r.text
    traces = list(tmp_path.glob("*-TP-0.trace.json"))
    assert len(traces) == 1 and r.json()["trace_path"] == str(traces[0])
    assert json.loads(traces[0].read_text())["traceEvents"]
    refused(client.post("/stop_profile"), "not running")
    # GET, no body: the directory from RADIXLM_TORCH_PROFILER_DIR, and num_steps.
    assert client.get("/start_profile").json()["success"]
    assert client.post("/stop_profile").json()["success"]
    assert len(list(dirs["profiles"].glob("*.trace.json"))) == 1
    refused(client.post("/start_profile", json={"num_steps": 0}), "num_steps")
    refused(client.post("/start_profile", json={"activities": ["GPU"]}), "CUDA")
    assert generate(client, prompt_ids) == baseline


# ---- request dumps and logging -------------------------------------------------------------------
def _dumped(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def test_dump_requests_and_configure_logging(server, client, prompt_ids, baseline, dirs):
    generate(client, prompt_ids)  # 3 requests: at least one flush at threshold 2
    records = _dumped(dirs["dumps"])
    assert records, "the dump folder should hold JSON lines"
    rec = records[0]
    assert set(rec) >= {"rid", "input_ids", "sampling_params", "output_text", "output_ids",
                        "meta_info", "created_time", "finished_time"}
    assert rec["meta_info"]["finish_reason"] is not None
    assert rec["finished_time"] >= rec["created_time"]
    # Any of the three may still be buffered (records come in finishing order), and
    # earlier tests' requests are in the folder too.
    expected = {tuple(p): out for p, out in zip(prompt_ids, baseline)}
    assert any(expected.get(tuple(r["input_ids"])) == r["output_ids"] for r in records)

    refused(client.post("/configure_logging", json={"log_level": "loud"}), "log_level")
    refused(client.post("/configure_logging", json={"dump_requests_threshold": 0}),
            "dump_requests_threshold")
    refused(client.post("/configure_logging", json={"dump_requests_folder": "/proc/nope"}),
            "cannot be created")
    r = client.post("/configure_logging", json={"log_level": "DEBUG",
                                                "dump_requests_threshold": 1})
    assert r.status_code == 200 and r.json()["success"], r.text
    args = client.get("/get_server_info").json()["server_args"]
    assert args["log_level"] == "debug" and args["dump_requests_threshold"] == 1
    before = len(_dumped(dirs["dumps"]))
    generate(client, prompt_ids[:1])
    assert len(_dumped(dirs["dumps"])) == before + 1  # threshold 1: written at once
    r = client.post("/configure_logging", json={"log_level": "info",
                                                "dump_requests_folder": ""})
    assert r.status_code == 200
    assert client.get("/get_server_info").json()["server_args"]["dump_requests_folder"] is None
    generate(client, prompt_ids[:1])
    assert len(_dumped(dirs["dumps"])) == before + 1  # dumping is off
    assert generate(client, prompt_ids) == baseline


def test_dumps_are_flushed_at_shutdown(server, client, prompt_ids, dirs):
    """Last in the module: it stops the server."""
    folder = dirs["work"] / "late-dumps"
    r = client.post("/configure_logging", json={"dump_requests_folder": str(folder),
                                                "dump_requests_threshold": 1000})
    assert r.status_code == 200, r.text
    generate(client, prompt_ids[:2])
    assert _dumped(folder) == []  # below the threshold: still buffered
    assert server.stop() == 0
    # Written in finishing order, which a batch does not fix.
    assert sorted(r["input_ids"] for r in _dumped(folder)) == sorted(prompt_ids[:2])
