"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`) in the Triton
attention backend: the store's codes, the kernels over FP8 pools against float64
references of the dequantized pool (codes.double() * scale), and the whole engine
against a bf16 cache, with twice the tokens in the same memory.

The kernel tests run on CUDA, or small and in fp32 on the CPU under the Triton
interpreter (`TRITON_INTERPRET=1`); the store-codes and engine tests need CUDA
(the Triton 3.9 interpreter rounds fp32 -> fp8 without carrying a mantissa
overflow into the exponent, so its codes are not the hardware's).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (HAS_CUDA or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from attention_reference import TOL, ref_attention, rel_err  # noqa: E402
from gpu_models import agreement  # noqa: E402

from radixlm.cache.fp8_pool import FP8TokenToKVPool  # noqa: E402
from radixlm.cache.memory_pool import ReqToTokenPool  # noqa: E402
from radixlm.forward_batch import ForwardBatch, ForwardMode, find_prefix_groups  # noqa: E402
from radixlm.layers.attention.radix_attention import RadixAttention  # noqa: E402
from radixlm.layers.attention.torch_native import TorchNativeBackend  # noqa: E402
from radixlm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixlm.layers.attention.triton_ops import cascade_decode as cd  # noqa: E402
from radixlm.layers.attention.triton_ops import invariant_attention as inv  # noqa: E402
from radixlm.layers.attention.triton_ops.decode_attention import (  # noqa: E402
    alloc_decode_scratch,
    decode_attention_fwd,
)
from radixlm.layers.attention.triton_ops.extend_attention import (  # noqa: E402
    build_extend_block_table,
    extend_attention_fwd,
    extend_config,
)
from radixlm.layers.attention.triton_ops.kv_store import store_kv  # noqa: E402
from radixlm.utils import to_device  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")
LOW = torch.bfloat16 if HAS_CUDA else torch.float32
SMALL = INTERPRET and not HAS_CUDA
# Against the dequantized pool the codes widen exactly to bf16 / fp16, so the
# 16-bit pools' bounds (attention_reference.TOL) hold.
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Scales != 1: true K ~ N(0, 1) is stored as codes ~ N(0, 1 / K_SCALE).
K_SCALE, V_SCALE = 0.02, 0.05


def scales() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([K_SCALE], device=DEV), torch.tensor([V_SCALE], device=DEV))


def fp8_pool(seq_lens: list[int], kvh: int, d: int, fp8: torch.dtype, seed: int):
    """(k codes, v codes, k dequantized, v dequantized (float64), req_to_token, rows):
    requests on shuffled rows and shuffled slots, every slot random."""
    gen = torch.Generator().manual_seed(seed)
    size = sum(seq_lens) + 64
    m = torch.finfo(fp8).max
    k = (torch.randn((size + 1, kvh, d), generator=gen) / K_SCALE).clamp(-m, m).to(fp8)
    v = (torch.randn((size + 1, kvh, d), generator=gen) / V_SCALE).clamp(-m, m).to(fp8)
    slots = torch.randperm(size, generator=gen)[:sum(seq_lens)] + 1
    rows = torch.randperm(len(seq_lens) + 3, generator=gen)[:len(seq_lens)]
    r2t = torch.zeros((len(seq_lens) + 3, max(seq_lens) + 70), dtype=torch.int32)
    off = 0
    for i, n in enumerate(seq_lens):
        r2t[rows[i], :n] = slots[off:off + n].int()
        off += n
    k, v = k.to(DEV), v.to(DEV)
    return (k, v, k.double() * K_SCALE, v.double() * V_SCALE, r2t.to(DEV), rows.to(DEV))


# ---- the store ------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_CUDA, reason="the interpreter's fp32 -> fp8 rounding is not "
                    "the hardware's (module docstring)")
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
def test_store_codes_equal_the_torch_pool(fp8, src):
    """`store_kv` into an FP8 pool writes the codes of `FP8TokenToKVPool.set_kv_buffer`
    (on the GPU and on the CPU), saturated values included."""
    gen = torch.Generator().manual_seed(5)
    kvh, d, n = 8, 128, 300
    pools = {dev: FP8TokenToKVPool(1000, fp8, kvh, d, 2, dev) for dev in ("cpu", "cuda")}
    for p in pools.values():
        p.set_scales([1.0, 0.37], [1.0, 2.5])
    loc = torch.randperm(999, generator=gen)[:n] + 1
    # Wide values: some saturate at the dtype's max, some land in its subnormals.
    kv = (torch.randn((n, 3 * kvh * d), generator=gen)
          * torch.logspace(-4, 4, 3 * kvh * d)).to(src)
    kv[0, :4] = torch.tensor([1e6, -1e6, 0.0, 1e-30])
    k, v = kv[:, :kvh * d], kv[:, 2 * kvh * d:]  # strided views, as out of a fused qkv
    pools["cpu"].set_kv_buffer(1, loc, k, v)
    torch_gpu = FP8TokenToKVPool(1000, fp8, kvh, d, 2, "cuda")
    torch_gpu.set_scales([1.0, 0.37], [1.0, 2.5])
    torch_gpu.set_kv_buffer(1, loc.cuda(), k.cuda(), v.cuda())
    gpu = pools["cuda"]
    store_kv(k.cuda(), v.cuda(), *gpu.get_kv_buffer(1), loc.cuda(),
             kv_scales=(gpu.k_scales[1:2], gpu.v_scales[1:2]))
    for i in range(2):
        ours = gpu.get_kv_buffer(1)[i].view(torch.uint8).cpu()
        assert torch.equal(ours, torch_gpu.get_kv_buffer(1)[i].view(torch.uint8).cpu()), i
        assert torch.equal(ours, pools["cpu"].get_kv_buffer(1)[i].view(torch.uint8)), i


# ---- the kernels against the dequantized pool ----------------------------------------

DECODE_CASES = [
    # (group, head_dim, seq_lens, num_splits or None for the backend's policy)
    (4, 64, [1, 70, 300], 3),
    (1, 32, [5, 129], None),
] if SMALL else [
    *[(g, d, [1, 8192, 17, 1000, 4096, 64, 65, 3000], None) for g in (1, 4, 8) for d in (64, 128)],
    (8, 128, [8192], 64),  # one request over many splits
    (4, 128, [5, 777, 8192], 1),  # one split over a long context
    (4, 128, [3 + 97 * i for i in range(64)], None),  # batch 64
    (1, 256, [1, 500, 4100], 7),
]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("group,d,seq_lens,splits", DECODE_CASES)
def test_decode_over_fp8_pool(fp8, group, d, seq_lens, splits):
    kvh = 2
    h, bs = kvh * group, len(seq_lens)
    k, v, kd, vd, r2t, rows = fp8_pool(seq_lens, kvh, d, fp8, 100 * group + d + bs)
    q = torch.randn((bs, h, d), generator=torch.Generator().manual_seed(bs)).to(DEV, LOW)
    seq = torch.tensor(seq_lens, device=DEV)
    if splits is None:
        splits = TritonAttentionBackend(h, kvh, d, DEV).num_kv_splits(bs)
    mid_o, mid_lse = alloc_decode_scratch(bs, h, splits, d, DEV)
    o = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    decode_attention_fwd(q, k, v, o, r2t, rows, seq, mid_o, mid_lse, splits, scale,
                         kv_scales=scales())
    assert torch.isfinite(o).all()
    for i, n in enumerate(seq_lens):
        sl = r2t[rows[i], :n].long()
        ref = ref_attention(q[i:i + 1], kd[sl], vd[sl], torch.tensor([n - 1], device=DEV),
                            scale)
        assert rel_err(o[i:i + 1], ref) < TOL[LOW], (i, n)


EXTEND_CASES = [
    (4, 64, [(0, 5), (40, 30), (100, 90)]),
] if SMALL else [
    *[(g, d, [(0, 1), (0, 300), (5, 1), (1000, 77), (129, 128), (0, 2048), (4000, 1)])
      for g in (1, 4, 8) for d in (64, 128)],
    (8, 128, [(7000, 1192), (1, 1), (4095, 129), (0, 64)]),
    (1, 256, [(0, 700), (300, 333)]),
]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("group,d,reqs", EXTEND_CASES)
def test_extend_with_prefix_over_fp8_pool(fp8, group, d, reqs):
    kvh = 2
    h = kvh * group
    prefix, ext = [p for p, _ in reqs], [e for _, e in reqs]
    k, v, kd, vd, r2t, rows = fp8_pool([p + e for p, e in reqs], kvh, d, fp8, group + d)
    n = sum(ext)
    q = torch.randn((n, h, d), generator=torch.Generator().manual_seed(n)).to(DEV, LOW)
    o = torch.full_like(q, float("nan"))
    starts = [sum(ext[:i]) for i in range(len(ext))]
    cfg = extend_config(d, LOW)
    table = build_extend_block_table(prefix, ext, cfg["block_m"], DEV)
    scale = d ** -0.5
    extend_attention_fwd(q, o, k, v, r2t, rows, torch.tensor(prefix, device=DEV),
                         torch.tensor(ext, device=DEV), torch.tensor(starts, device=DEV), table,
                         scale, **cfg, kv_scales=scales())
    assert torch.isfinite(o).all()
    for i, (p, e) in enumerate(reqs):
        sl = r2t[rows[i], :p + e].long()
        ref = ref_attention(q[starts[i]:starts[i] + e], kd[sl], vd[sl],
                            p + torch.arange(e, device=DEV), scale)
        assert rel_err(o[starts[i]:starts[i] + e], ref) < TOL[LOW], (i, p, e)


@pytest.mark.parametrize("fp8", FP8)
def test_cascade_decode_over_fp8_pool(fp8):
    """Shared-prefix decode: both passes apply the scales."""
    group, d, kvh = 4, 64 if SMALL else 128, 2
    h = kvh * group
    plen = 150 if SMALL else 3000
    prefix = list(range(1, plen + 1))
    lists = [prefix + list(range(plen + 10 + 50 * j, plen + 10 + 50 * j + n))
             for j, n in enumerate([1, 40, 7, 3])] + [list(range(plen + 900, plen + 960))]
    size = plen + 1200
    m = torch.finfo(fp8).max
    gen = torch.Generator().manual_seed(9)
    k = (torch.randn((size, kvh, d), generator=gen) / K_SCALE).clamp(-m, m).to(fp8).to(DEV)
    v = (torch.randn((size, kvh, d), generator=gen) / V_SCALE).clamp(-m, m).to(fp8).to(DEV)
    bs = len(lists)
    r2t = torch.zeros((bs, plen + 256), dtype=torch.int32)
    for i, s in enumerate(lists):
        r2t[i, :len(s)] = torch.tensor(s, dtype=torch.int32)
    r2t, rows = r2t.to(DEV), torch.arange(bs, device=DEV)
    q = torch.randn((bs, h, d), generator=gen).to(DEV, LOW)
    be = TritonAttentionBackend(h, kvh, d, DEV)
    groups = find_prefix_groups(lists, min_prefix_len=1)
    plan = cd.build_cascade_plan(groups.groups, bs, be.cascade_members, kvh,
                                 be.programs_per_sm * be.num_sms, be.max_cascade_items,
                                 cd.SPLIT_ALIGN)
    assert plan is not None
    tables = cd.table_views(to_device(plan.pack(bs, be.max_cascade_items), DEV), bs,
                            be.max_cascade_items, be.cascade_members)
    splits = be.num_kv_splits(bs)
    mid_o, mid_lse = alloc_decode_scratch(bs, h, splits, d, DEV)
    mid_po = torch.zeros((bs, h, cd.MAX_PREFIX_SPLITS, d), device=DEV)
    mid_plse = torch.zeros((bs, h, cd.MAX_PREFIX_SPLITS), device=DEV)
    o = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    cd.cascade_decode_fwd(q, k, v, o, r2t, rows, torch.tensor([len(s) for s in lists],
                          device=DEV), mid_o, mid_lse, splits, scale, tables, mid_po, mid_plse,
                          kv_scales=scales())
    kd, vd = k.double() * K_SCALE, v.double() * V_SCALE
    for i, s in enumerate(lists):
        sl = torch.tensor(s, device=DEV)
        ref = ref_attention(q[i:i + 1], kd[sl], vd[sl], torch.tensor([len(s) - 1], device=DEV),
                            scale)
        assert rel_err(o[i:i + 1], ref) < TOL[LOW], i


@pytest.mark.parametrize("fp8", FP8)
def test_invariant_kernels_over_fp8_pool(fp8):
    """Deterministic mode's kernels: close to the reference, and a decode step is
    the same bits as the extend row at that position."""
    group, d, kvh = 4, 64 if SMALL else 128, 2
    h = kvh * group
    ctx = 1024 if SMALL else 8192
    lens = [1, 300] if SMALL else [1, 300, 2000, 5000]
    k, v, kd, vd, r2t, rows = fp8_pool(lens, kvh, d, fp8, 11)
    bs, n = len(lens), sum(lens)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn((n, h, d), generator=gen).to(DEV, LOW)
    starts = [sum(lens[:i]) for i in range(bs)]
    split = inv.split_size(ctx)
    scale = d ** -0.5
    o = torch.full_like(q, float("nan"))
    zeros = torch.zeros(bs, dtype=torch.int64, device=DEV)
    inv.invariant_extend_fwd(q, o, k, v, r2t, rows, zeros, torch.tensor(lens, device=DEV),
                             torch.tensor(starts, device=DEV),
                             inv.build_tiles([0] * bs, lens, group, kvh, DEV), scale, split,
                             kv_scales=scales())
    last = torch.tensor([s + e - 1 for s, e in zip(starts, lens, strict=True)], device=DEV)
    qd = q[last].contiguous()
    od = torch.full_like(qd, float("nan"))
    scratch = inv.alloc_invariant_scratch(bs, h, inv.num_splits(ctx), d, DEV)
    inv.invariant_decode_fwd(qd, k, v, od, r2t, rows, torch.tensor(lens, device=DEV), *scratch,
                             scale, split, inv.decode_programs(bs, kvh, group, 132),
                             kv_scales=scales())
    assert torch.equal(od, o[last])
    for i, e in enumerate(lens):
        sl = r2t[rows[i], :e].long()
        ref = ref_attention(q[starts[i]:starts[i] + e], kd[sl], vd[sl],
                            torch.arange(e, device=DEV), scale)
        assert rel_err(o[starts[i]:starts[i] + e], ref) < TOL[LOW], i


# ---- the backend through ForwardBatch, against the torch backend --------------------

@pytest.mark.parametrize("fp8", FP8)
def test_backend_on_fp8_pool_matches_torch_native(fp8):
    """Extend with cached prefixes, then decode, on two copies of one FP8 pool: the
    Triton backend's outputs match TorchNativeBackend's (which dequantizes what it
    gathers) and, on CUDA, its stores leave the same codes."""
    group, d, kvh = 4, 64 if SMALL else 128, 2
    h = kvh * group
    torch.manual_seed(3)
    r2t_pool = ReqToTokenPool(8, 4096, DEV)
    tokens = 3000 if SMALL else 20000
    pools = [FP8TokenToKVPool(tokens, fp8, kvh, d, 2, DEV) for _ in range(2)]
    m = torch.finfo(fp8).max
    for i, buf in enumerate(pools[0].k_buffer + pools[0].v_buffer):
        s = K_SCALE if i < 2 else V_SCALE
        buf.copy_((torch.randn_like(buf, dtype=torch.float32) / s).clamp(-m, m))
    for p in pools:
        p.set_scales([1.0, K_SCALE], [1.0, V_SCALE])
    for a, b in zip(pools[1].k_buffer + pools[1].v_buffer,
                    pools[0].k_buffer + pools[0].v_buffer, strict=True):
        a.copy_(b)
    layer = RadixAttention(1, h, kvh, d, d ** -0.5)
    triton_be = TritonAttentionBackend(h, kvh, d, DEV, max_context_len=4096)
    triton_be.check_kv_dtype(LOW, fp8)
    if not HAS_CUDA:  # the interpreter's FP8 codes are not torch's: the pool stores
        triton_be.kv_store_min_tokens = 1 << 30
    native_be = TorchNativeBackend()
    # Every request has a cached prefix: the torch backend attends a fresh prompt
    # over its new K/V as computed, not as the pool holds them.
    prefix = [3, 37, 150] if SMALL else [1, 37, 1500, 9, 2000]
    ext = [1, 20, 50] if SMALL else [1, 200, 500, 1024, 3]
    rows = [r2t_pool.alloc() for _ in prefix]
    for r, p in zip(rows, prefix, strict=True):
        if p:
            r2t_pool.req_to_token[r, :p] = pools[0].alloc(p)[torch.randperm(p)].to(DEV).int()
    n = sum(ext)
    out_loc = pools[0].alloc(n)
    off = 0
    for r, p, e in zip(rows, prefix, ext, strict=True):
        r2t_pool.req_to_token[r, p:p + e] = out_loc[off:off + e].to(DEV).int()
        off += e

    def run(mode, seq_prefix, seq_ext, loc, q, k, v):
        outs = []
        for be, pool in ((triton_be, pools[0]), (native_be, pools[1])):
            fb = ForwardBatch.build(mode, [0] * sum(seq_ext), rows, seq_prefix, seq_ext, loc,
                                    r2t_pool, pool, be, DEV)
            be.init_forward_metadata(fb)
            outs.append(be.forward(q, k, v, layer, fb))
        return outs

    def qkv(rows_: int):
        q = torch.randn((rows_, h * d), device=DEV).to(LOW)
        kv = torch.randn((rows_, 2 * kvh * d), device=DEV).to(LOW)
        return q, kv[:, :kvh * d], kv[:, kvh * d:]

    out_t, out_n = run(ForwardMode.EXTEND, prefix, ext, out_loc, *qkv(n))
    assert rel_err(out_t, out_n.double()) < TOL[LOW]
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    dec_loc = pools[0].alloc(len(rows))
    for i, r in enumerate(rows):
        r2t_pool.req_to_token[r, seq[i]] = int(dec_loc[i])
    dec_t, dec_n = run(ForwardMode.DECODE, seq, [1] * len(rows), dec_loc, *qkv(len(rows)))
    assert rel_err(dec_t, dec_n.double()) < TOL[LOW]
    if HAS_CUDA:
        for a, b in zip(pools[0].k_buffer + pools[0].v_buffer,
                        pools[1].k_buffer + pools[1].v_buffer, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_backend_accepts_fp8_and_refuses_other_kv_dtypes():
    be = TritonAttentionBackend(8, 2, 64, DEV)
    for fp8 in FP8:
        be.check_kv_dtype(torch.bfloat16, fp8)
    be.check_kv_dtype(torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="needs the KV cache in the model's dtype"):
        be.check_kv_dtype(torch.bfloat16, torch.float32)


# ---- the whole engine (CUDA) --------------------------------------------------------

SIZES = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             max_position_embeddings=4096)
NEW = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from quant_checkpoints import save_tame_model, tiny_llama

    root = tmp_path_factory.mktemp("fp8-kv-gpu")
    config = tiny_llama(**SIZES)
    # Linear weights scaled down so that a 4-layer residual stream stays tame in bf16.
    save_tame_model(config, root, 0.05)
    scales = root / "kv_scales.json"  # per-layer scales != 1, through the file path
    scales.write_text(json.dumps({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {str(i): 0.01 * (i + 1) for i in range(SIZES["num_hidden_layers"])}}}}))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, SIZES["vocab_size"], (n,), generator=g).tolist()
               for n in (7, 40, 200, 1000)]
    return str(root), str(scales), prompts


def _serve(model: str, prompts, **kw):
    """Served with a fixed pool (the default memory fraction would size it by the
    memory other processes leave: under pytest -n, none). Returns the outputs and
    (pool class, K/V bytes the pool holds per slot on the device, K's dtype)."""
    import radixlm

    with radixlm.Engine(model, dtype="bfloat16", skip_tokenizer_init=True,
                        attention_backend="triton", max_total_tokens=20000, **kw) as e:
        worker = e.scheduler.worker
        assert isinstance(worker.runner.attn_backend, TritonAttentionBackend)
        graphs = worker.runner.graph_runner
        assert graphs is not None and graphs.use_graphs  # CUDA graphs on
        out = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                                             "temperature": 0,
                                                             "ignore_eos": True},
                         return_logprob=True, logprob_start_len=0)
        pool = worker.kv_pool
        buffers = [*pool.k_buffer, *pool.v_buffer]
        info = (type(pool), sum(b.nbytes for b in buffers) / buffers[0].shape[0],
                pool.k_buffer[0].dtype)
        # nothing of this engine may outlive it: the next needs its memory
        del buffers, worker, graphs, pool
    gc.collect()
    torch.cuda.empty_cache()
    return out, info


@pytest.mark.parametrize("fp8,scaled", [("fp8_e4m3", False), ("fp8_e4m3", True),
                                        ("fp8_e5m2", False)])
def test_engine_fp8_kv_tracks_bf16_kv(fp8, scaled, tiny_model):
    model, scales, prompts = tiny_model
    ref, (_, ref_bytes, ref_dtype) = _serve(model, prompts, kv_cache_dtype="auto")
    kw = {"quantization_param_path": scales} if scaled else {}
    ours, (cls, slot_bytes, dtype) = _serve(model, prompts, kv_cache_dtype=fp8, **kw)
    assert ref_dtype == torch.bfloat16 and cls is FP8TokenToKVPool and dtype.itemsize == 1
    a = agreement(ours, ref)
    print(f"\n[{fp8} kv{', scales file' if scaled else ''}] prompt logprobs vs bf16 kv: mean "
          f"|diff| {a.mean:.4f}, max {a.max:.3f}; first tokens equal {a.first}/{len(ours)}, "
          f"greedy tokens equal {a.same}/{NEW * len(ours)}; K/V bytes a slot {slot_bytes:.0f} "
          f"vs {ref_bytes:.0f}")
    # A misread pool (wrong scale, wrong codes) gives errors of nats.
    assert a.mean < 0.1, a.mean
    assert a.first >= len(ours) - 1
    # Half the bytes a slot on the device: twice the tokens in a budget (the plan's
    # arithmetic: tests/test_fp8_kv.py).
    assert slot_bytes * 2 == ref_bytes
