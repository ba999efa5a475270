"""Mixture-of-experts models against HF transformers on tiny random checkpoints (CPU, fp32).

- The experts' compute: the reference (`layers/moe/torch_ref.py`) against a
  float64 loop over tokens and choices; the CPU backend against the reference
  (fp32 and bf16, one token and many, experts without tokens, another rank's
  experts skipped); the backend registry's choices and refusals.
- Checkpoint names: per-expert names (Qwen's, OLMoE's, Mixtral's w1/w2/w3 under
  `block_sparse_moe`) and transformers' fused stacks resolve to our stacked
  weights at (expert, part).
- Per family (`moe_models.MOE_FAMILIES`): logits within 1e-4 of HF's through a
  KV pool (ragged prefill, an extended prefix, decode steps), and greedy
  outputs equal to HF `generate`'s through the engine: batched and one at a
  time (the second pass hits the radix cache), chunked prefill, the radix
  cache off, and a pool so small that requests are retracted.
- Parallelism on gloo: every family's logits on two ranks at tp=2 (every
  expert's intermediate split) and ep=2 (each rank holds half the experts);
  the engine's tokens at tp=2 and at ep=2, where an expert weight of each
  rank is read back, updated in place and restored; (slow) tp=4 with ep=2,
  two ranks per expert group, against HF and reading experts back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import hf_reference
import pytest
import torch
from family_models import random_prompts, save_random_model
from kv_runner import KVRunner, check_through_kv, hf_logits, load_fp32, logits_through_kv
from moe_models import MOE_FAMILIES

import radixlm
from radixlm import distributed
from radixlm.layers.moe import cpu as moe_cpu
from radixlm.layers.moe import torch_ref
from radixlm.layers.moe.backends import MOE_BACKENDS, select_backend
from radixlm.models.loader import load_config, load_model
from radixlm.models.weight_map import WeightMap

NEW_TOKENS = 16
SP = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}


# ---- the experts' compute ---------------------------------------------------------
def _routing(tokens: int, k: int, experts: int, seed: int = 0, skip: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    if skip:
        ids[torch.rand(ids.shape, generator=gen) < skip] = -1
    weights = torch.rand(tokens, k, generator=gen)
    return weights / weights.sum(-1, keepdim=True), ids


def _experts(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5,
            torch.randn(e, h, i, generator=gen) / i ** 0.5)


def _per_token_loop(x, w13, w2, weights, ids) -> torch.Tensor:
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
                out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens,k,skip", [(1, 2, 0.0), (7, 3, 0.0), (33, 2, 0.3)])
def test_reference_is_the_per_token_sum(tokens, k, skip):
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(3))
    w13, w2 = _experts(8, 32, 16)
    weights, ids = _routing(tokens, k, 8, skip=skip)
    out = torch_ref.fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), _per_token_loop(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    into = torch.empty_like(x)
    assert torch_ref.fused_experts(x, w13, w2, weights, ids, out=into) is into
    torch.testing.assert_close(into, out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_cpu_backend_matches_the_reference(dtype, tol, tokens):
    # Only 3 of 16 experts get tokens (uneven routing, empty experts); some pairs
    # belong to another rank (-1).
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    w13, w2 = (w.to(dtype) for w in _experts(16, 64, 32))
    weights, ids = _routing(tokens, 2, 3, skip=0.2)
    ids = torch.where(ids >= 0, ids * 5, ids)  # experts 0, 5, 10
    ref = torch_ref.fused_experts(x, w13, w2, weights, ids)
    out = moe_cpu.fused_experts(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_a_lone_token_routed_only_to_other_ranks_gets_zeros():
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    w13, w2 = _experts(4, 64, 32)
    ids = torch.full((1, 2), -1, dtype=torch.int32)
    out = moe_cpu.fused_experts(x, w13, w2, torch.ones(1, 2), ids)
    assert torch.equal(out, torch.zeros_like(x))


def test_olmoe_projection_norm_takes_the_cpu_kernel_in_bf16(monkeypatch):
    """OLMoE's q/k norm over a whole projection, on one rank in bf16: the fused
    CPU kernel on the strided q slice of a qkv output, agreeing with HF's
    OlmoeRMSNorm arithmetic (bf16 rounding before the weight)."""
    from radixlm.layers import cpu_ops
    from radixlm.models.olmoe import ProjectionRMSNorm

    if not cpu_ops.load():
        pytest.skip("no C++ compiler: the CPU kernels are unavailable")
    g = torch.Generator().manual_seed(3)
    norm = ProjectionRMSNorm(256, 0, 256, 1e-5)
    norm.weight.data = torch.randn(256, generator=g).bfloat16()
    q = torch.randn(5, 256 + 128, generator=g).bfloat16()[:, :256]  # a split's view
    calls = []
    kernel = cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda *a: calls.append(1) or kernel(*a))
    out = norm(q)
    assert calls, "bf16 on one rank takes the kernel"
    qf = q.float()
    ref = norm.weight * (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    torch.testing.assert_close(out, ref)
    assert (out == ref).float().mean().item() > 0.99


def test_reference_refuses_mismatched_shapes():
    x = torch.randn(3, 32)
    w13, w2 = _experts(4, 32, 16)
    weights, ids = _routing(3, 2, 4)
    with pytest.raises(ValueError, match="do not fit hidden size 32"):
        torch_ref.fused_experts(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match=r"must both be \[3, k\]"):
        torch_ref.fused_experts(x, w13, w2, weights[:2], ids[:2])
    with pytest.raises(ValueError, match="activation='relu'"):
        torch_ref.fused_experts(x, w13, w2, weights, ids, activation="relu")


def test_backend_registry_chooses_by_device_and_refuses_by_name():
    assert select_backend("auto", torch.device("cpu")).name == "cpu"
    assert select_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="runs on cuda, not cpu"):
        select_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="moe_runner_backend='fast'"):
        select_backend("fast", torch.device("cpu"))
    assert MOE_BACKENDS["triton"].graph_capturable and not MOE_BACKENDS["torch"].graph_capturable


# ---- the families -------------------------------------------------------------------
@dataclass
class Family:
    name: str
    path: str
    hf: torch.nn.Module
    prompts: list[list[int]]
    greedy: list[list[int]]  # HF generate's, per prompt


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory) -> Family:
    name = request.param
    config = MOE_FAMILIES[name]()
    path = tmp_path_factory.mktemp(name)
    hf = save_random_model(config, path)
    prompts = random_prompts(config, [24, 45, 30], shared=20) + \
        random_prompts(config, [5, 60], seed=2)
    return Family(name, str(path), hf, prompts, hf_reference.hf_greedy(hf, prompts, NEW_TOKENS))


def test_logits_match_hf(family: Family) -> None:
    seqs = family.prompts[:4]
    check_through_kv([hf_logits(family.hf, ids) for ids in seqs],
                   logits_through_kv(KVRunner(load_fp32(family.path)), seqs))


def test_the_routing_fields_change_the_output(family: Family) -> None:
    """What the tests above would miss if the engine ignored it."""
    fields = {"mixtral": {"num_experts_per_tok": 1, "sliding_window": None},
              "qwen2_moe": {"norm_topk_prob": True},
              "qwen3_moe": {"norm_topk_prob": False},
              "olmoe": {"clip_qkv": None, "norm_topk_prob": True}}[family.name]
    ids = max(family.prompts, key=len)
    ref = hf_logits(family.hf, ids)
    for field, value in fields.items():
        runner = KVRunner(load_fp32(family.path, **{field: value}))
        logits = runner.extend([(runner.new_request(), ids)], all_rows=True)
        diff = (logits - ref).abs().max().item()
        assert diff > 100 * 1e-4 * ref.abs().max().item(), f"{field} makes no difference"


def test_qwen3_moe_sparse_step_matches_hf(tmp_path: Path) -> None:
    """decoder_sparse_step 2: only layer 1 of 3 is MoE; a checkpoint of another
    layout is refused by name."""
    config = MOE_FAMILIES["qwen3_moe"](decoder_sparse_step=2, mlp_only_layers=[])
    hf = save_random_model(config, tmp_path)
    seqs = random_prompts(config, [30, 12, 9])
    model = load_fp32(str(tmp_path))
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == \
        ["GatedMLP", "SparseMoeBlock", "GatedMLP"]
    check_through_kv([hf_logits(hf, ids) for ids in seqs], logits_through_kv(KVRunner(model), seqs))
    with pytest.raises(ValueError, match=r"layers\.[02]\.mlp\.(gate|up|down)_proj.* has no place"):
        load_fp32(str(tmp_path), decoder_sparse_step=1)


def test_expert_names_resolve_to_stacked_weights(family: Family) -> None:
    model = load_fp32(family.path)
    weight_map = WeightMap(model)
    layer = 2 if family.name == "qwen3_moe" or family.name == "qwen2_moe" else 1
    mlp = "block_sparse_moe" if family.name == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if family.name == "mixtral" else \
        ("gate_proj", "up_proj", "down_proj")
    experts = model.model.layers[layer].mlp.experts
    hf_experts = family.hf.model.layers[layer].mlp.experts
    inter = experts.intermediate_size
    for proj, part, want in ((gate, 0, hf_experts.gate_up_proj[5, :inter]),
                             (up, 1, hf_experts.gate_up_proj[5, inter:]),
                             (down, None, hf_experts.down_proj[5])):
        slot = weight_map.resolve(f"model.layers.{layer}.{mlp}.experts.5.{proj}.weight")
        assert slot.param is getattr(experts, "down_proj" if part is None else "gate_up_proj")
        assert slot.shard_id == (5, part) and slot.hf_shape() == tuple(want.shape)
        torch.testing.assert_close(slot.gather(), want.detach())
    # transformers' own names: the whole stacks.
    fused = weight_map.resolve(f"model.layers.{layer}.mlp.experts.gate_up_proj")
    assert fused.shard_id is None
    torch.testing.assert_close(fused.gather(), hf_experts.gate_up_proj.detach())
    past = f"model.layers.{layer}.{mlp}.experts.{len(hf_experts.down_proj)}.{down}.weight"
    assert weight_map.resolve(past) is None
    with pytest.raises(ValueError, match=f"{past} has no place"):
        weight_map.load([(past, torch.zeros(hf_experts.down_proj[0].shape))])


def test_an_expert_parallel_rank_reads_only_its_experts(family: Family, monkeypatch) -> None:
    """Rank 1 of ep=2 (no collectives needed to load): the other half of the
    experts is never read from the checkpoint, and its own half is HF's."""
    from radixlm.models import loader

    monkeypatch.setattr(distributed, "_MOE", distributed.MoeParallel(2, 1, 1, 0))
    read: list[str] = []
    iterate = loader.iter_safetensors

    def recording(model_dir, skip=()):
        for name, tensor in iterate(model_dir, skip):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "iter_safetensors", recording)
    model = load_fp32(family.path)
    experts = [name for name in read if ".experts." in name]
    assert experts and all(int(name.split(".experts.")[1].split(".")[0]) >= 4
                           for name in experts), experts
    layer = next(i for i, layer in enumerate(model.model.layers)
                 if hasattr(layer.mlp, "experts"))
    ours, theirs = model.model.layers[layer].mlp.experts, family.hf.model.layers[layer].mlp.experts
    assert ours.num_local_experts == 4 and ours.expert_start == 4
    torch.testing.assert_close(ours.down_proj.data, theirs.down_proj[4:].detach())


# Engine configurations, as in test_families.py.
ENGINE_CASES = {
    "default": {},
    "chunked-no-radix-cache": {"disable_radix_cache": True, "chunked_prefill_size": 8},
    "mixed-chunk": {"enable_mixed_chunk": True, "chunked_prefill_size": 8},
    "retraction": {"max_total_tokens": 100, "chunked_prefill_size": 16,
                   "schedule_conservativeness": 0.3},
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_greedy_matches_hf(family: Family, case: str) -> None:
    kwargs = ENGINE_CASES[case]
    with radixlm.Engine(model_path=family.path, skip_tokenizer_init=True, dtype="float32",
                        **{"max_total_tokens": 4096, **kwargs}) as e:
        batched = [o["output_ids"] for o in e.generate(input_ids=family.prompts,
                                                       sampling_params=SP)]
        assert batched == family.greedy
        if case == "retraction":
            assert e.scheduler.stats.num_retractions > 0
        if case == "default":  # one at a time, now with the prefixes cached
            single = [e.generate(input_ids=ids, sampling_params=SP)["output_ids"]
                      for ids in family.prompts]
            assert single == family.greedy
            assert e.scheduler.stats.num_cached_tokens > 20
        e.scheduler.check_invariants()


# ---- parallelism on gloo ---------------------------------------------------------------
def _saved(name: str, path: Path) -> tuple[torch.nn.Module, list[list[int]]]:
    config = MOE_FAMILIES[name]()
    hf = save_random_model(config, path)
    return hf, random_prompts(config, [24, 45, 30], shared=20) + random_prompts(config, [5],
                                                                                seed=2)


def _two_rank_worker(rank: int, init_file: str, jobs: list[tuple[str, list[list[int]], int, str]]
                     ) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    distributed.set_tp_group(dist.group.WORLD)
    try:
        for path, seqs, ep_size, out in jobs:
            distributed.set_ep_size(ep_size)
            logits = logits_through_kv(KVRunner(load_fp32(path)), seqs)
            if rank == 0:
                torch.save(logits, out)
    finally:
        distributed.set_tp_group(None)
        dist.destroy_process_group()


def test_two_ranks_match_hf(tmp_path: Path) -> None:
    """Every family on two gloo ranks, tp=2 (each expert's intermediate split; the
    shared expert's and the experts' partial sums; OLMoE's norms over split
    heads) and ep=2 (each rank half the experts, the other half skipped at load)."""
    jobs, refs = [], []
    for name in sorted(MOE_FAMILIES):
        hf, prompts = _saved(name, tmp_path / name)
        seqs = prompts[:3]
        refs.append([hf_logits(hf, ids) for ids in seqs])
        for ep in (1, 2):
            jobs.append((str(tmp_path / name), seqs, ep, str(tmp_path / f"{name}-ep{ep}.pt")))
    torch.multiprocessing.spawn(_two_rank_worker, args=(str(tmp_path / "store"), jobs), nprocs=2)
    for (_, _, _, out), ref in zip(jobs, [r for r in refs for _ in (1, 2)], strict=True):
        check_through_kv(ref, torch.load(out))


def test_tp2_engine_gives_hf_tokens(tmp_path: Path) -> None:
    hf, prompts = _saved("qwen2_moe", tmp_path)
    ref = hf_reference.hf_greedy(hf, prompts, NEW_TOKENS)
    with radixlm.Engine(model_path=str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                        max_total_tokens=2048, chunked_prefill_size=16, tp_size=2) as e:
        out = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=SP)]
        again = [e.generate(input_ids=ids, sampling_params=SP)["output_ids"] for ids in prompts]
        e.scheduler.control("check_invariants")
    assert out == ref
    assert again == ref


def test_expert_weights_round_trip_under_expert_parallelism(tmp_path: Path) -> None:
    """ep=2: an expert of each rank read back by HF name, updated in place (the
    tokens follow HF on the changed weights), and restored."""
    hf, prompts = _saved("qwen3_moe", tmp_path)
    ref = hf_reference.hf_greedy(hf, prompts, NEW_TOKENS)
    experts = hf.model.layers[1].mlp.experts
    inter = experts.down_proj.shape[-1]
    names = {e: f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in (1, 6)}
    with radixlm.Engine(model_path=str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                        max_total_tokens=2048, tp_size=2, ep_size=2) as e:
        for expert, name in names.items():  # expert 1 on rank 0, 6 on rank 1
            want = experts.gate_up_proj[expert, :inter].detach().flatten()[:50].tolist()
            assert e.get_weights_by_name(name, 50) == pytest.approx(want, abs=0)
        assert [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=SP)] == ref
        changed = {name: experts.gate_up_proj[expert, :inter].detach() * -3.0
                   for expert, name in names.items()}
        ok, message = e.update_weights_from_tensor(list(changed.items()))
        assert ok, message
        for name, tensor in changed.items():
            assert e.get_weights_by_name(name, 20) == pytest.approx(
                tensor.flatten()[:20].tolist(), abs=0)
        with torch.no_grad():
            original = experts.gate_up_proj.detach().clone()
            for expert in names:
                experts.gate_up_proj[expert, :inter] *= -3.0
            changed_ref = hf_reference.hf_greedy(hf, prompts, NEW_TOKENS)
            experts.gate_up_proj.copy_(original)
        assert changed_ref != ref, "the change must move HF's greedy tokens"
        assert [o["output_ids"] for o in e.generate(input_ids=prompts,
                                                   sampling_params=SP)] == changed_ref
        ok, message = e.update_weights_from_disk(str(tmp_path))
        assert ok, message
        assert [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=SP)] == ref


def _tp4_ep2_worker(rank: int, init_file: str, path: str, seqs: list[list[int]],
                    out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    distributed.set_tp_group(dist.group.WORLD)
    distributed.set_ep_size(2)
    try:
        model = load_fp32(path)
        logits = logits_through_kv(KVRunner(model), seqs)
        slot = WeightMap(model).resolve("model.layers.2.mlp.experts.7.down_proj.weight")
        whole = WeightMap(model).resolve("model.layers.2.mlp.experts.gate_up_proj").gather()
        if rank == 0:
            torch.save((logits, slot.gather(), whole), out)
        else:
            slot.gather()
    finally:
        distributed.set_tp_group(None)
        dist.destroy_process_group()


@pytest.mark.slow
def test_four_ranks_in_two_expert_groups_match_hf(tmp_path: Path) -> None:
    """tp=4, ep=2: each expert group of two ranks splits its experts' intermediate
    dimension; reading an expert back gathers within its group."""
    hf, prompts = _saved("qwen2_moe", tmp_path / "model")
    seqs = prompts[:3]
    out = tmp_path / "out.pt"
    torch.multiprocessing.spawn(_tp4_ep2_worker, nprocs=4, args=(
        str(tmp_path / "store"), str(tmp_path / "model"), seqs, str(out)))
    logits, down, gate_up = torch.load(out)
    check_through_kv([hf_logits(hf, ids) for ids in seqs], logits)
    experts = hf.model.layers[2].mlp.experts
    torch.testing.assert_close(down, experts.down_proj[7].detach())
    torch.testing.assert_close(gate_up, experts.gate_up_proj.detach())


def test_expert_parallelism_refusals(tmp_path: Path, monkeypatch) -> None:
    from family_models import FAMILIES

    from radixlm.config import ServerArgs

    with pytest.raises(ValueError, match="ep_size=3 must divide tp_size=2"):
        ServerArgs(tp_size=2, ep_size=3)
    save_random_model(FAMILIES["qwen2"](), tmp_path)
    monkeypatch.setattr(distributed, "_MOE", distributed.MoeParallel(2, 0, 1, 0))
    with pytest.raises(ValueError, match="ep_size=2: Qwen2ForCausalLM has no expert layers"):
        load_fp32(str(tmp_path))
    from radixlm.layers.moe.fused_moe import FusedMoE

    with pytest.raises(ValueError, match="ep_size=2 exceeds the model's 1 experts"):
        FusedMoE(1, 64, 32)


def test_dummy_weights_of_every_moe_family(tmp_path: Path) -> None:
    """`--load-format dummy` (the GPU benchmarks' weights) fills the stacked experts
    from transformers' own stacked names: routers N(0, 0.02), finite logits."""
    for name, make in MOE_FAMILIES.items():
        make().save_pretrained(tmp_path / name)
        model = load_model(str(tmp_path / name), load_config(str(tmp_path / name)), "dummy",
                           torch.float32, "cpu", seed=1)
        experts = next(m for m in model.modules() if type(m).__name__ == "FusedMoE")
        assert 0.01 < experts.gate_up_proj.std().item() < 0.03, name
        runner = KVRunner(model)
        logits = runner.extend([(runner.new_request(), list(range(40)))])
        assert torch.isfinite(logits).all() and logits.abs().max() < 20, name


@pytest.mark.parametrize("quantization", ["int8"])
def test_quantized_experts_are_refused_by_name(tmp_path: Path, quantization: str) -> None:
    """A format without expert kernels (int8; GGUF and FP8 have them, FP8's in
    tests/test_fp8_moe.py): asking for it on an MoE model is an error naming the
    layer, never dense layers quantized beside float experts."""
    from radixlm.layers.quantization import get_quantization_config

    MOE_FAMILIES["qwen3_moe"]().save_pretrained(tmp_path)
    config = load_config(str(tmp_path))
    quant = get_quantization_config(config, quantization)
    with pytest.raises(ValueError, match=rf"quantization '{quantization}': the mixture-of-"
                                         r"experts layer model\.layers\.1\.mlp\.experts"):
        load_model(str(tmp_path), config, "dummy", torch.float32, "cpu", quant_config=quant)


def test_deterministic_inference_refuses_the_expert_layers_by_name(tmp_path: Path) -> None:
    """No expert kernel is batch-invariant: the mode names the first MoE layer."""
    import radixlm

    MOE_FAMILIES["qwen3_moe"]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layer model\.layers\.1\.mlp\.experts multiplies "
                                         r"through UnquantizedFusedMoEMethod"):
        radixlm.Engine(model_path=str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                       quantization="none", load_format="dummy",
                       enable_deterministic_inference=True)
