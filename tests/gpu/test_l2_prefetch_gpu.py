"""The L2 prefetch after each qkv product (`radixlm/layers/l2_prefetch.py`) on the
device: the kernel takes any span and writes nothing; an engine gives the same
bits with it as without, in CUDA graphs (bf16 and FP8 weights); eagerly its
kernels run on a stream of their own. Whether it pays is
`benchmarks/l2_prefetch.py`'s and the end-to-end benchmarks' question."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gpu_models import save_random_llama  # noqa: E402

import radixlm  # noqa: E402
from radixlm.layers import l2_prefetch as L  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
if not L.supported(DEV):
    pytest.skip("bulk L2 prefetches need compute capability >= 9", allow_module_level=True)

NEW = 16


@pytest.mark.parametrize("evict_last", [False, True])
def test_any_span_is_taken_and_nothing_written(evict_last):
    base = torch.randint(0, 255, (3 * L.CHUNK + 4100,), dtype=torch.uint8, device=DEV)
    before = base.clone()
    for view in (base, base[3:], base[:17], base[5:9], base[:0],
                 base[: 64 * 1000].view(64, 1000)[:, :999]):
        L.prefetch(view, evict_last)
    torch.cuda.synchronize()
    assert torch.equal(base, before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("l2-llama"), num_hidden_layers=3)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, 32000, (n,), generator=g).tolist() for n in (9, 40, 3, 120)]


def _generate(model_dir, prompts, **kw):
    with radixlm.Engine(model_dir, dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=8192, **kw) as e:
        return e.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0)


def _bits(outs):
    return [(o["output_ids"], o["meta_info"]["input_token_logprobs"],
             o["meta_info"]["output_token_logprobs"]) for o in outs]


@pytest.mark.parametrize("quantization,mode", [(None, "o"), (None, "o+qkv"), ("fp8", "all")])
def test_the_same_bits_with_the_prefetch_in_graphs(model_dir, prompts, quantization, mode):
    off = _generate(model_dir, prompts, quantization=quantization)
    on = _generate(model_dir, prompts, quantization=quantization, l2_prefetch=mode)
    assert _bits(on) == _bits(off)


def test_eager_decode_prefetches_on_a_stream_of_its_own(model_dir, prompts, tmp_path):
    with radixlm.Engine(model_dir, dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=8192, disable_cuda_graph=True,
                        l2_prefetch="o+qkv") as e:
        sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        e.generate(input_ids=prompts[:1], sampling_params=sp)  # compile outside the trace
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            e.generate(input_ids=prompts[:1], sampling_params=sp)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    kernels = [ev for ev in json.loads(trace.read_text())["traceEvents"]
               if ev.get("cat") == "kernel"]
    ours = [ev for ev in kernels if "_prefetch_kernel" in ev["name"]]
    # Each forward of up to MAX_ROWS rows (the 9-token prefill, the decode steps):
    # each of the 3 layers' o_proj and its next layer's qkv (the last: the first's).
    assert len(ours) >= 4 * 6 and len(ours) % 6 == 0
    streams = {ev["args"]["stream"] for ev in ours}
    others = {ev["args"]["stream"] for ev in kernels if ev not in ours}
    assert len(streams) == 1 and streams.isdisjoint(others)
