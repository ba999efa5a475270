"""Runtime control on CUDA: memory release/resume really frees device memory and
recaptures the CUDA graphs; weight updates are seen by graph replays; the
profiler records CUDA kernels; a gloo trainer can feed a CUDA model."""

from __future__ import annotations

import gc
import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

from gpu_models import save_random_llama  # noqa: E402

import radixlm  # noqa: E402

NEW = 16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return save_random_llama(root / "a", 0), save_random_llama(root / "b", 1)


@pytest.fixture(scope="module")
def engine(ckpts):
    # Give earlier modules' cached blocks back to the driver first: the engine's
    # small tensors placed in such a segment would pin it, and the release test
    # would see too little memory returned.
    gc.collect()
    torch.cuda.empty_cache()
    with radixlm.Engine(ckpts[0], dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=20000, cuda_graph_max_bs=8) as e:
        yield e


PROMPTS = [[5, 17, 300, 42, 9], [1000, 2000, 3000], [7] * 40]
SP = {"max_new_tokens": NEW, "temperature": 0.0}


def greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=SP)]


def test_release_frees_memory_and_resume_recaptures_graphs(engine):
    before = greedy(engine)
    runner = engine.scheduler.worker.runner
    assert runner.graph_runner is not None and runner.graph_runner.graphs
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    ok, message = engine.release_memory_occupation()
    assert ok, message
    freed = held - torch.cuda.memory_allocated()
    assert freed > 300 << 20, f"only {freed >> 20} MiB freed"
    # Back to the driver: most of it (in a shared test process some freed blocks sit
    # in segments that other modules' live tensors keep reserved).
    assert torch.cuda.memory_reserved() <= reserved - freed // 2
    assert runner.graph_runner is None
    with pytest.raises(ValueError, match="resume_memory_occupation"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=SP)
    ok, message = engine.resume_memory_occupation()
    assert ok, message
    assert runner.graph_runner is not None and runner.graph_runner.graphs
    assert greedy(engine) == before


def test_weight_updates_reach_graph_replays(engine, ckpts):
    """Tensor updates copy in place, so captured graphs read the new weights: the
    outputs equal those of a fresh engine on the second checkpoint."""
    original = greedy(engine)
    with radixlm.Engine(ckpts[1], dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=20000, cuda_graph_max_bs=8) as other:
        expected = greedy(other)
    assert expected != original
    from safetensors.torch import load_file

    tensors = load_file(f"{ckpts[1]}/model.safetensors")
    ok, message = engine.update_weights_from_tensor(list(tensors.items()))
    assert ok, message
    name = "model.layers.3.self_attn.k_proj.weight"
    want = tensors[name].to(torch.bfloat16).float().flatten()[:10].tolist()
    assert engine.get_weights_by_name(name, 10) == want
    assert greedy(engine) == expected
    ok, message = engine.update_weights_from_disk(ckpts[0])
    assert ok, message
    assert greedy(engine) == original
    ok, message = engine.update_weights_from_disk(ckpts[1] + "-missing")
    assert not ok and greedy(engine) == original


@pytest.mark.parametrize("env", [None, "RADIXLM_FP8_GEMV"])
def test_quantized_updates_reach_graph_replays(ckpts, env, monkeypatch):
    """A quantized layer derives from its weights at new addresses (online FP8's
    row scales, the tensor-core GEMV's fragment-order copy): after an update the
    graphs are captured again, so replays read the new derived tensors. The
    outputs equal a fresh engine's on the second checkpoint, and back again."""
    if env:
        monkeypatch.setenv(env, "mma")
    kw = dict(dtype="bfloat16", skip_tokenizer_init=True, max_total_tokens=20000,
              cuda_graph_max_bs=8, quantization="fp8")
    with radixlm.Engine(ckpts[1], **kw) as other:
        expected = greedy(other)
    with radixlm.Engine(ckpts[0], **kw) as engine:
        original = greedy(engine)
        assert expected != original
        graphs = engine.scheduler.worker.runner.graph_runner
        ok, message = engine.update_weights_from_disk(ckpts[1])
        assert ok, message
        assert engine.scheduler.worker.runner.graph_runner is not graphs  # captured anew
        assert greedy(engine) == expected
        ok, message = engine.update_weights_from_disk(ckpts[0])
        assert ok, message
        assert greedy(engine) == original


def test_profile_records_cuda_kernels(engine, tmp_path):
    assert engine.start_profile(output_dir=str(tmp_path))[0]
    greedy(engine)
    ok, message = engine.stop_profile()
    assert ok, message
    (trace,) = tmp_path.glob("*.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)


def test_gloo_trainer_feeds_a_cuda_model(engine, ckpts, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from safetensors.torch import load_file
    from server_utils import free_port
    from weight_update_utils import GROUP, Trainer

    name = "model.layers.2.mlp.down_proj.weight"
    tensor = load_file(f"{ckpts[1]}/model.safetensors")[name]
    port = free_port()
    trainer = Trainer(port, {name: tensor}, tmp_path)
    try:
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")[0]
        trainer.wait("joined")
        trainer.send([name])
        ok, message = engine.update_weights_from_distributed([name], ["float32"],
                                                             [list(tensor.shape)], GROUP)
        assert ok, message
        trainer.wait("sent")
        assert engine.get_weights_by_name(name, 5) == \
            tensor.to(torch.bfloat16).float().flatten()[:5].tolist()
    finally:
        trainer.close()
        engine.update_weights_from_disk(ckpts[0])
