"""Tensor parallelism on two GPUs: the custom all-reduce against NCCL (eager and
inside a CUDA graph), and a tp=2 engine against tp=1 on the same random model."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

pytestmark = pytest.mark.gpu

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from gpu_models import capture_graph, save_random_llama  # noqa: E402

import radixlm  # noqa: E402
from radixlm import distributed as tp  # noqa: E402
from radixlm.server.workers import free_port  # noqa: E402

# (numel, dtype): batch 1 and batch 37 of hidden 4096, an odd length, fp32
SHAPES = [((1, 4096), torch.bfloat16), ((37, 4096), torch.bfloat16), ((3, 1000), torch.bfloat16),
          ((5, 1024), torch.float32), ((256, 4096), torch.bfloat16)]


def _all_reduce_worker(rank: int, port: int) -> None:
    torch.cuda.set_device(rank)
    tp.init_distributed("nccl", f"tcp://127.0.0.1:{port}", 2, rank, 120)
    assert tp.custom_all_reduce_enabled(), "symmetric-memory all-reduce did not start"
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    for shape, dtype in SHAPES:
        x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        _check(x, tp.tensor_model_parallel_all_reduce(x.clone()))
    # Inside a CUDA graph: three reduces in a row, replayed on fresh inputs.
    static = torch.zeros(2, 4096, dtype=torch.bfloat16, device="cuda")

    def step() -> torch.Tensor:
        reduce = tp.tensor_model_parallel_all_reduce
        return reduce(reduce(reduce(static * 0.5) + 1) * 2)

    graph, out = capture_graph(step)
    for _ in range(3):
        static.copy_(torch.randn(static.shape, generator=gen, device="cuda"))
        graph.replay()
        ref = static * 0.5
        dist.all_reduce(ref)
        ref = ref + 1
        dist.all_reduce(ref)
        ref = ref * 2
        dist.all_reduce(ref)
        torch.testing.assert_close(out, ref, atol=0.1, rtol=0.02)
        _same_on_every_rank(out)
    dist.destroy_process_group()


def _allreduce_norm_worker(rank: int, port: int) -> None:
    """The fused all-reduce + add + RMSNorm against NCCL's all-reduce and the unfused
    Triton norm (the new residual bit for bit, the normed rows within one rounding
    step), eager and five calls in a row in a CUDA graph."""
    from radixlm.layers.fused_ops import rms_norm

    torch.cuda.set_device(rank)
    tp.init_distributed("nccl", f"tcp://127.0.0.1:{port}", 2, rank, 120)
    assert tp.partial_sum_buffer((1, 4096), torch.bfloat16, torch.device("cuda")) is not None
    gen = torch.Generator(device="cuda").manual_seed(200 + rank)
    same = torch.Generator(device="cuda").manual_seed(7)  # residual, weight: equal on both ranks

    def unfused(x, residual, weight):
        ref = x.clone()
        dist.all_reduce(ref)
        return rms_norm(ref, weight, 1e-5, residual)

    # Batch 8 of hidden 4096 (64 KB) is the largest message the fused kernel takes.
    assert tp.partial_sum_buffer((9, 4096), torch.bfloat16, torch.device("cuda")) is None
    fused_shapes = [((1, 4096), torch.bfloat16), ((8, 4096), torch.bfloat16),
                    ((3, 1000), torch.bfloat16), ((5, 1024), torch.float32),
                    ((7, 4096), torch.float16)]
    for shape, dtype in fused_shapes:
        weight = torch.randn(shape[-1], generator=same, device="cuda").to(dtype)
        residual = torch.randn(shape, generator=same, device="cuda").to(dtype)
        x = tp.partial_sum_buffer(shape, dtype, torch.device("cuda"))
        x.copy_(torch.randn(shape, generator=gen, device="cuda").to(dtype))
        y, new_res = tp.all_reduce_add_rms_norm(x, residual, weight, 1e-5)
        ref_y, ref_res = unfused(x, residual, weight)
        assert torch.equal(new_res, ref_res), (shape, dtype)
        _close(y, ref_y)
        _same_on_every_rank(y)
    hidden = 4096
    weight = torch.randn(hidden, generator=same, device="cuda").to(torch.bfloat16)
    static = torch.zeros(5, 2, hidden, dtype=torch.bfloat16, device="cuda")
    residual0 = torch.zeros(2, hidden, dtype=torch.bfloat16, device="cuda")

    def chain():
        residual, outs = residual0, []
        for i in range(5):
            x = tp.partial_sum_buffer((2, hidden), torch.bfloat16, torch.device("cuda"))
            x.copy_(static[i])
            y, residual = tp.all_reduce_add_rms_norm(x, residual, weight, 1e-5)
            outs.append(y)
        return torch.stack(outs), residual

    graph, (outs, last) = capture_graph(chain)
    for _ in range(3):
        static.copy_(torch.randn(static.shape, generator=gen, device="cuda"))
        residual0.copy_(torch.randn(residual0.shape, generator=same, device="cuda"))
        graph.replay()
        residual = residual0
        for i in range(5):
            ref_y, ref_res = unfused(static[i], residual, weight)
            _close(outs[i], ref_y)
            residual = ref_res
        assert torch.equal(last, residual)
        _same_on_every_rank(outs)
    dist.destroy_process_group()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[got.dtype]
    torch.testing.assert_close(got, ref, atol=tol * 4, rtol=tol)


def test_allreduce_norm_matches_unfused_eager_and_in_graph():
    mp.spawn(_allreduce_norm_worker, args=(free_port(),), nprocs=2)


def _check(x: torch.Tensor, got: torch.Tensor) -> None:
    ref = x.clone()
    dist.all_reduce(ref)  # torch.distributed itself: NCCL
    assert got.shape == x.shape and got.dtype == x.dtype
    tol = dict(atol=2e-2, rtol=1e-2) if x.dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, ref, **tol)
    _same_on_every_rank(got)


def _same_on_every_rank(t: torch.Tensor) -> None:
    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.contiguous())
    assert torch.equal(parts[0], parts[1]), "ranks disagree on the sum"


def test_custom_all_reduce_matches_nccl_eager_and_in_graph():
    mp.spawn(_all_reduce_worker, args=(free_port(),), nprocs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("tiny-llama-tp"))


def _greedy(model_dir, **kw) -> tuple[list[list[int]], list[float]]:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist() for n in (9, 40, 130)]
    with radixlm.Engine(model_dir, dtype="float32", skip_tokenizer_init=True,
                        max_total_tokens=20000, **kw) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"temperature": 0.0,
                                                              "max_new_tokens": 24})
        lp = e.generate(input_ids=prompts[1], sampling_params={"max_new_tokens": 1},
                        return_logprob=True, logprob_start_len=0)
    return [o["output_ids"] for o in outs], [v for v, _ in lp["meta_info"]
                                             ["input_token_logprobs"][1:]]


def test_tp2_greedy_matches_tp1_fp32(model_dir):
    ids1, lp1 = _greedy(model_dir)
    ids2, lp2 = _greedy(model_dir, tp_size=2)
    assert ids2 == ids1
    assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 2e-3


def test_tp2_allreduce_fusion_changes_nothing(model_dir):
    """The fused all-reduce + norm computes what the separate kernels do: the same
    greedy tokens, logprobs within fp32 rounding (CUDA graphs on in both)."""
    ids, lp = _greedy(model_dir, tp_size=2)
    ids_apart, lp_apart = _greedy(model_dir, tp_size=2, disable_allreduce_fusion=True)
    assert ids == ids_apart
    assert max(abs(a - b) for a, b in zip(lp, lp_apart)) < 1e-4
