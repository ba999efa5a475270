"""Every dense family against HF transformers on a tiny random checkpoint (CPU, fp32).

Per family (`family_models.FAMILIES`: Qwen3, Gemma 2, Gemma 3, Phi-3, and
Mistral / Qwen2 with their windows honoured), on both CPU attention backends:
- logits within 1e-4 of HF's: a ragged prefill of prompts longer than the
  8-token window, a prompt extending its cached prefix, decode steps;
- greedy outputs equal to HF `generate`'s through the engine: batched and
  one at a time (the second pass hits the radix cache past the window),
  chunked prefill in chunks smaller than the window, the radix cache off,
  and a KV pool so small that requests are retracted and resumed;
- the windows and softcaps change HF's output, so these tests see them.
Plus Llama's rope scalings, and tensor parallelism (2 gloo ranks) for Qwen3
and Gemma 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import hf_reference
import pytest
import torch
from family_models import (
    FAMILIES,
    OTHER_VARIANTS,
    PHI3_ORIGINAL_CONTEXT,
    ROPE_VARIANTS,
    WINDOW,
    random_prompts,
    save_random_model,
)
from kv_runner import (
    KVRunner,
    check_close,
    check_through_kv,
    hf_logits,
    load_fp32,
    logits_through_kv,
)

import radixlm
from radixlm import distributed
from radixlm.forward_batch import ForwardMode
from radixlm.layers.attention.cpu_backend import CpuAttentionBackend
from radixlm.layers.attention.torch_native import TorchNativeBackend
from radixlm.models.loader import load_config, load_model

NEW_TOKENS = 16
BACKENDS = {"torch_native": TorchNativeBackend, "cpu": CpuAttentionBackend}


@dataclass
class Family:
    name: str
    path: str
    hf: torch.nn.Module
    prompts: list[list[int]]
    greedy: list[list[int]]  # HF generate's, per prompt


def prompt_lengths(name: str) -> list[int]:
    # All longer than the window but one. Phi-3's are longer than the LongRoPE
    # original context, past which HF's generate rotates everything with the
    # long factors, as we do for a context longer than that (see the test below
    # for the short factors).
    return [40, 45, 36, 33, 50] if name == "phi3" else [24, 45, 30, 5, 60]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    name = request.param
    config = FAMILIES[name]()
    path = tmp_path_factory.mktemp(name)
    hf = save_random_model(config, path)
    lengths = prompt_lengths(name)
    prompts = random_prompts(config, lengths[:3], shared=20) + \
        random_prompts(config, lengths[3:], seed=2)
    return Family(name, str(path), hf, prompts, hf_reference.hf_greedy(hf, prompts, NEW_TOKENS))


def _logits_through_kv(model: torch.nn.Module, seqs: list[list[int]],
                       backend: str) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`kv_runner.logits_through_kv` on the attention backend `backend`."""
    if backend == "cpu" and not CpuAttentionBackend.supports(model.kv_spec().k_head_dim):
        pytest.skip("the CPU kernels need a C++ compiler")
    return logits_through_kv(KVRunner(model, backend=BACKENDS[backend]()), seqs)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_logits_match_hf(family: Family, backend: str) -> None:
    seqs = [p for p in family.prompts if len(p) > WINDOW + 3]
    refs = [hf_logits(family.hf, ids) for ids in seqs]
    check_through_kv(refs, _logits_through_kv(load_fp32(family.path), seqs, backend))


def test_input_embeds_match_hf(family: Family) -> None:
    """`forward(..., input_embeds=...)` is HF's `inputs_embeds`: our `embed` of
    token ids is HF's embedding (Gemma's scale included), and arbitrary
    vectors (an image's, say) go through the layers as HF's do."""
    model = load_fp32(family.path)
    ids = family.prompts[1]
    with torch.inference_mode():
        hf_embeds = family.hf.get_input_embeddings()(torch.tensor([ids]))[0]
        torch.testing.assert_close(model.model.embed(torch.tensor(ids)), hf_embeds)
        vectors = hf_embeds.flip(0) * 0.5 + torch.randn(hf_embeds.shape,
                                                        generator=torch.Generator().manual_seed(5))
        ref = family.hf(inputs_embeds=vectors[None]).logits[0]
    runner = KVRunner(model)
    # The ids only decide how many tokens there are: the embeddings replace them.
    logits = runner.extend([(runner.new_request(), [0] * len(ids))], all_rows=True,
                           input_embeds=vectors)
    check_close(logits, ref)


# What each family's test would miss if the engine ignored it: removing it
# must move the logits far outside the tolerance.
VARIANT_FIELDS = {
    "qwen3": {"sliding_window": None}, "mistral": {"sliding_window": None},
    "qwen2": {"sliding_window": None}, "phi3": {"sliding_window": None},
    "gemma3": {"sliding_window": None, "final_logit_softcapping": None},
    "gemma2": {"sliding_window": None, "attn_logit_softcapping": None,
               "final_logit_softcapping": None},
}


def test_windows_and_softcaps_change_the_output(family: Family) -> None:
    ids = max(family.prompts, key=len)
    ref = hf_logits(family.hf, ids)
    for field, value in VARIANT_FIELDS[family.name].items():
        runner = KVRunner(load_fp32(family.path, **{field: value}))
        logits = runner.extend([(runner.new_request(), ids)], all_rows=True)
        diff = (logits - ref).abs().max().item()
        assert diff > 100 * 1e-4 * ref.abs().max().item(), f"{field} makes no difference"


# Engine configurations: (keyword arguments, backends to run them on).
ENGINE_CASES = {
    "default": ({}, ("torch_native", "cpu")),
    "chunks-below-window": ({"chunked_prefill_size": WINDOW // 2}, ("torch_native", "cpu")),
    "no-radix-cache": ({"disable_radix_cache": True, "chunked_prefill_size": 16}, ("cpu",)),
    # Prefill chunks in the same forwards as the running decodes.
    "mixed-chunk": ({"enable_mixed_chunk": True, "chunked_prefill_size": WINDOW},
                    ("torch_native", "cpu")),
    # Admission reserves little for decoding, so decodes outgrow the pool.
    "retraction": ({"max_total_tokens": 100, "chunked_prefill_size": 16,
                    "schedule_conservativeness": 0.3}, ("cpu",)),
}
CASES = [(case, b) for case, (_, backends) in ENGINE_CASES.items() for b in backends]


@pytest.mark.parametrize("case,backend", CASES)
def test_greedy_matches_hf(family: Family, case: str, backend: str) -> None:
    kwargs = ENGINE_CASES[case][0]
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with radixlm.Engine(model_path=family.path, skip_tokenizer_init=True, dtype="float32",
                        attention_backend=backend, **{"max_total_tokens": 4096, **kwargs}) as e:
        modes: list[ForwardMode] = []
        forward = e.scheduler.worker.forward
        e.scheduler.worker.forward = lambda b: modes.append(b.mode) or forward(b)
        batched = [o["output_ids"] for o in e.generate(input_ids=family.prompts,
                                                       sampling_params=sp)]
        assert batched == family.greedy
        assert (ForwardMode.MIXED in modes) == (case == "mixed-chunk")
        if case == "retraction":
            assert e.scheduler.stats.num_retractions > 0
        if case == "default":  # one at a time, now with the prefixes cached
            single = [e.generate(input_ids=ids, sampling_params=sp)["output_ids"]
                      for ids in family.prompts]
            assert single == family.greedy
            assert e.scheduler.stats.num_cached_tokens > WINDOW * len(family.prompts)
        e.scheduler.check_invariants()


def test_phi3_within_its_original_context_uses_the_short_factors(tmp_path: Path) -> None:
    config = FAMILIES["phi3"]()
    hf = save_random_model(config, tmp_path)
    seqs = random_prompts(config, [PHI3_ORIGINAL_CONTEXT, 20, 12])
    refs = [hf_logits(hf, ids) for ids in seqs]
    ours = load_model(str(tmp_path), load_config(str(tmp_path), PHI3_ORIGINAL_CONTEXT),
                      "safetensors", torch.float32, "cpu")
    check_through_kv(refs, _logits_through_kv(ours, seqs, "cpu"))
    prompts = random_prompts(config, [14, 9, 16], seed=4)
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with radixlm.Engine(model_path=str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                        context_length=PHI3_ORIGINAL_CONTEXT, max_total_tokens=1024) as e:
        ours_greedy = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    assert ours_greedy == hf_reference.hf_greedy(hf, prompts, NEW_TOKENS)


# ---- rope scalings and other honoured fields ------------------------------------
@pytest.mark.parametrize("name", sorted(ROPE_VARIANTS | OTHER_VARIANTS))
def test_variant_matches_hf(name: str, tmp_path: Path) -> None:
    config = (ROPE_VARIANTS | OTHER_VARIANTS)[name]()
    hf = save_random_model(config, tmp_path)
    seqs = random_prompts(config, [100, 70, 12])
    refs = [hf_logits(hf, ids) for ids in seqs]
    check_through_kv(refs, _logits_through_kv(load_fp32(str(tmp_path)), seqs, "cpu"))


# ---- tensor parallelism: two gloo ranks --------------------------------------------
def _tp_worker(rank: int, init_file: str, jobs: list[tuple[str, list[list[int]], str]]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    distributed.set_tp_group(dist.group.WORLD)
    try:
        for path, seqs, out in jobs:
            logits = _logits_through_kv(load_fp32(path), seqs, "torch_native")
            if rank == 0:
                torch.save(logits, out)
    finally:
        distributed.set_tp_group(None)
        dist.destroy_process_group()


def test_two_tensor_parallel_ranks_match_hf(tmp_path: Path) -> None:
    jobs, refs = [], []
    for name in ("qwen3", "gemma3"):
        config = FAMILIES[name]()
        config.vocab_size = 157  # each rank's half of the tied vocabulary is padded
        hf = save_random_model(config, tmp_path / name)
        seqs = random_prompts(config, [40, 13, 20])
        refs.append([hf_logits(hf, ids) for ids in seqs])
        jobs.append((str(tmp_path / name), seqs, str(tmp_path / f"{name}.pt")))
    torch.multiprocessing.spawn(_tp_worker, args=(str(tmp_path / "store"), jobs), nprocs=2)
    for (_, _, out), ref in zip(jobs, refs, strict=True):
        check_through_kv(ref, torch.load(out))


def test_dummy_weights_of_every_family_are_sane(tmp_path: Path) -> None:
    """`--load-format dummy` (the benchmarks' weights): norms at their identity
    (Gemma's (1 + w) ones at zero), finite logits of a sane size."""
    for name, make in FAMILIES.items():
        make().save_pretrained(tmp_path / name)
        model = load_model(str(tmp_path / name), load_config(str(tmp_path / name)), "dummy",
                           torch.float32, "cpu", seed=1)
        norms = [m for m in model.modules() if hasattr(m, "identity_weight")]
        assert norms and all(torch.equal(m.weight, torch.full_like(m.weight,
                                                                   m.identity_weight))
                             for m in norms)
        runner = KVRunner(model)
        logits = runner.extend([(runner.new_request(), list(range(40)))])
        assert torch.isfinite(logits).all() and logits.abs().max() < 20, name


@pytest.mark.parametrize("name", sorted(FAMILIES | ROPE_VARIANTS | OTHER_VARIANTS))
def test_builds_under_a_default_device_context(name: str) -> None:
    # The loader builds models inside `with torch.device(...)` (cuda on a GPU);
    # tables computed at construction (ropes, scales) must not mix in CPU tensors.
    from radixlm.models import get_model_class

    config = (FAMILIES | ROPE_VARIANTS | OTHER_VARIANTS)[name]()
    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
