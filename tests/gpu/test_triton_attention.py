"""Triton attention kernels and backend vs float64 references (CUDA only)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from attention_reference import TOL, ref_attention, rel_err  # noqa: E402
from gpu_models import capture_graph  # noqa: E402

from radixlm.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.layers.attention.torch_native import TorchNativeBackend  # noqa: E402
from radixlm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
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

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _make_pool(seq_lens: list[int], kvh: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """Random K/V pool, requests on shuffled rows and shuffled (non-contiguous) slots."""
    total = sum(seq_lens)
    size = total + 64
    k_buf = torch.randn((size + 1, kvh, d), generator=gen, device=DEV).to(dtype)
    v_buf = torch.randn((size + 1, kvh, d), generator=gen, device=DEV).to(dtype)
    slots = torch.randperm(size, generator=gen, device=DEV)[:total] + 1
    rows = torch.randperm(len(seq_lens) + 3, generator=gen, device=DEV)[:len(seq_lens)]
    r2t = torch.zeros((len(seq_lens) + 3, max(seq_lens) + 70), dtype=torch.int32, device=DEV)
    off = 0
    for i, n in enumerate(seq_lens):
        r2t[rows[i], :n] = slots[off:off + n].int()
        off += n
    return k_buf, v_buf, r2t, rows


DECODE_CASES = [
    # (group, head_dim, dtype, seq_lens, num_splits)
    *[(g, d, torch.bfloat16, [1, 8192, 17, 1000, 4096, 64, 65, 3000], None)
      for g in (1, 4, 8) for d in (64, 128)],
    (4, 128, torch.float16, [1, 8192, 333, 2048], None),
    (4, 128, torch.float32, [1, 8192, 333, 2048], None),
    (8, 128, torch.bfloat16, [8192], 64),
    (8, 64, torch.bfloat16, [5, 777, 8192], 1),
    (1, 256, torch.bfloat16, [1, 500, 4100], 7),
    (2, 32, torch.float16, [1, 500, 4100], 3),
    (1, 256, torch.float32, [1, 300, 2000], None),
]


@pytest.mark.parametrize("group,d,dtype,seq_lens,splits", DECODE_CASES)
def test_decode_attention(group, d, dtype, seq_lens, splits):
    gen = torch.Generator(device=DEV).manual_seed(1000 * group + d + len(seq_lens))
    kvh = 2
    h = kvh * group
    bs = len(seq_lens)
    k_buf, v_buf, r2t, rows = _make_pool(seq_lens, kvh, d, dtype, gen)
    q = torch.randn((bs, h, d), generator=gen, device=DEV).to(dtype)
    seq = torch.tensor(seq_lens, device=DEV)
    if splits is None:
        splits = TritonAttentionBackend(h, kvh, d, DEV).num_kv_splits(bs)
    mid_o, mid_lse = alloc_decode_scratch(bs, h, splits, d, DEV)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))
    o = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    decode_attention_fwd(q, k_buf, v_buf, o, r2t, rows, seq, mid_o, mid_lse, splits, scale)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    for i, n in enumerate(seq_lens):
        sl = r2t[rows[i], :n].long()
        ref = ref_attention(q[i:i + 1], k_buf[sl], v_buf[sl], torch.tensor([n - 1], device=DEV),
                             scale)
        err = rel_err(o[i:i + 1], ref)
        assert err < TOL[dtype], (i, n, err)


def test_decode_zero_length_rows_give_zeros():
    gen = torch.Generator(device=DEV).manual_seed(1)
    k_buf, v_buf, r2t, rows = _make_pool([100, 1], 2, 128, torch.bfloat16, gen)
    q = torch.randn((3, 8, 128), generator=gen, device=DEV).to(torch.bfloat16)
    rows3 = torch.cat([rows, rows[:1]])
    seq = torch.tensor([100, 1, 0], device=DEV)
    mid_o, mid_lse = alloc_decode_scratch(3, 8, 8, 128, DEV)
    o = torch.full_like(q, float("nan"))
    decode_attention_fwd(q, k_buf, v_buf, o, r2t, rows3, seq, mid_o, mid_lse, 8, 0.1)
    assert torch.isfinite(o).all() and (o[2] == 0).all()


EXTEND_CASES = [
    # (group, head_dim, dtype, [(prefix, extend), ...])
    *[(g, d, torch.bfloat16, [(0, 1), (0, 300), (5, 1), (1000, 77), (129, 128), (0, 2048),
                              (4000, 1)]) for g in (1, 4, 8) for d in (64, 128)],
    (4, 128, torch.bfloat16, [(0, 8192)]),
    (8, 128, torch.bfloat16, [(7000, 1192), (1, 1), (4095, 129), (0, 64)]),
    (4, 128, torch.float16, [(0, 1000), (300, 517), (64, 1)]),
    (4, 128, torch.float32, [(0, 1000), (300, 517), (64, 1)]),
    (4, 64, torch.float32, [(0, 257), (300, 17)]),
    (1, 256, torch.bfloat16, [(0, 700), (300, 333)]),
    (2, 256, torch.float32, [(0, 100), (30, 33)]),
    (2, 32, torch.float16, [(0, 100), (999, 333)]),
]


@pytest.mark.parametrize("group,d,dtype,reqs", EXTEND_CASES)
def test_extend_attention(group, d, dtype, reqs):
    gen = torch.Generator(device=DEV).manual_seed(1000 * group + d + len(reqs))
    kvh = 2
    h = kvh * group
    prefix = [p for p, _ in reqs]
    ext = [e for _, e in reqs]
    k_buf, v_buf, r2t, rows = _make_pool([p + e for p, e in reqs], kvh, d, dtype, gen)
    n = sum(ext)
    q = torch.randn((n, h, d), generator=gen, device=DEV).to(dtype)
    o = torch.full_like(q, float("nan"))
    starts = [sum(ext[:i]) for i in range(len(ext))]
    cfg = extend_config(d, dtype)
    table = build_extend_block_table(prefix, ext, cfg["block_m"], DEV)
    scale = d ** -0.5
    extend_attention_fwd(q, o, k_buf, v_buf, r2t, rows, torch.tensor(prefix, device=DEV),
                         torch.tensor(ext, device=DEV), torch.tensor(starts, device=DEV), table,
                         scale, **cfg)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    for i, (p, e) in enumerate(reqs):
        sl = r2t[rows[i], :p + e].long()
        qi = q[starts[i]:starts[i] + e]
        ref = ref_attention(qi, k_buf[sl], v_buf[sl], p + torch.arange(e, device=DEV), scale)
        err = rel_err(o[starts[i]:starts[i] + e], ref)
        assert err < TOL[dtype], (i, p, e, err)


def test_store_kv_matches_index_put():
    gen = torch.Generator(device=DEV).manual_seed(2)
    k_buf = torch.randn((1000, 8, 128), generator=gen, device=DEV).to(torch.bfloat16)
    v_buf = torch.randn((1000, 8, 128), generator=gen, device=DEV).to(torch.bfloat16)
    loc = torch.randperm(999, generator=gen, device=DEV)[:300] + 1
    kv = torch.randn((300, 3 * 1024), generator=gen, device=DEV).to(torch.bfloat16)
    k, v = kv[:, :1024], kv[:, 2048:]  # strided views, as out of a fused qkv
    kr, vr = k_buf.clone(), v_buf.clone()
    kr[loc] = k.view(-1, 8, 128)
    vr[loc] = v.view(-1, 8, 128)
    store_kv(k, v, k_buf, v_buf, loc)
    assert torch.equal(k_buf, kr) and torch.equal(v_buf, vr)


# ---- the backend through ForwardBatch, against TorchNativeBackend on one pool

def _setup_backend_case(group: int, d: int, dtype: torch.dtype, seed: int):
    from gpu_models import random_attention_pools

    return random_attention_pools(group, d, dtype, seed, DEV, max_requests=16,
                                  pool_tokens=40000, num_layers=2, layer_id=1)


def _run_both(fb_args: dict, q, k, v, layer, backends):
    outs = []
    for be in backends:
        fb = ForwardBatch.build(attn_backend=be, **fb_args)
        be.init_forward_metadata(fb)
        outs.append(be.forward(q, k, v, layer, fb))
    return outs


@pytest.mark.parametrize("group,d,dtype", [(4, 128, torch.bfloat16), (1, 64, torch.float16),
                                           (8, 128, torch.float32)])
def test_backend_matches_torch_native(group, d, dtype):
    h, kvh, r2t_pool, kv_pool, layer = _setup_backend_case(group, d, dtype, 3)
    triton_be = TritonAttentionBackend(h, kvh, d, DEV, max_context_len=4096)
    native_be = TorchNativeBackend()
    rng = random.Random(0)
    prefix = [0, 37, 1500, 0, 2000]
    ext = [1, 200, 500, 1024, 3]
    rows = [r2t_pool.alloc() for _ in prefix]
    # Prefix tokens: slots already holding (random) K/V, shuffled.
    for r, p in zip(rows, prefix, strict=True):
        if p:
            r2t_pool.req_to_token[r, :p] = kv_pool.alloc(p)[torch.randperm(p)].to(DEV).int()
    n = sum(ext)
    out_loc = kv_pool.alloc(n)
    off = 0
    for r, p, e in zip(rows, prefix, ext, strict=True):
        r2t_pool.req_to_token[r, p:p + e] = out_loc[off:off + e].to(DEV).int()
        off += e
    ids = [rng.randrange(1000) for _ in range(n)]
    args = dict(mode=ForwardMode.EXTEND, input_ids=ids, req_pool_indices=rows, prefix_lens=prefix,
                extend_lens=ext, out_cache_loc=out_loc, req_to_token_pool=r2t_pool,
                token_to_kv_pool=kv_pool, device=DEV)
    q = torch.randn((n, h * d), device=DEV).to(dtype)
    kv = torch.randn((n, 2 * kvh * d), device=DEV).to(dtype)
    k, v = kv[:, :kvh * d], kv[:, kvh * d:]
    out_t, out_n = _run_both(args, q, k, v, layer, [triton_be, native_be])
    assert rel_err(out_t, out_n.double()) < TOL[dtype]

    # One decode step for every request.
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    dec_loc = kv_pool.alloc(len(rows))
    for i, r in enumerate(rows):
        r2t_pool.req_to_token[r, seq[i]] = int(dec_loc[i])
    dargs = dict(mode=ForwardMode.DECODE, input_ids=ids[:len(rows)], req_pool_indices=rows,
                 prefix_lens=seq, extend_lens=[1] * len(rows), out_cache_loc=dec_loc,
                 req_to_token_pool=r2t_pool, token_to_kv_pool=kv_pool, device=DEV)
    bs = len(rows)
    qd = torch.randn((bs, h * d), device=DEV).to(dtype)
    kd = torch.randn((bs, kvh * d), device=DEV).to(dtype)
    vd = torch.randn((bs, kvh * d), device=DEV).to(dtype)
    dec_t, dec_n = _run_both(dargs, qd, kd, vd, layer, [triton_be, native_be])
    assert rel_err(dec_t, dec_n.double()) < TOL[dtype]


def test_backend_decode_cuda_graph_replay():
    dtype, d = torch.bfloat16, 128
    h, kvh, r2t_pool, kv_pool, layer = _setup_backend_case(4, d, dtype, 4)
    be = TritonAttentionBackend(h, kvh, d, DEV, max_context_len=4096)
    max_bs, bs = 8, 5
    be.init_cuda_graph_state(max_bs)
    rows = [r2t_pool.alloc() for _ in range(bs)]
    # Disjoint shuffled slots per request, so the K/V stores never collide.
    perm = torch.randperm(40000, device=DEV) + 1
    for i, r in enumerate(rows):
        r2t_pool.req_to_token[r] = perm[i * 4096:(i + 1) * 4096].int()
    # Static inputs the captured graph reads.
    s_rows = torch.tensor(rows, device=DEV)
    s_seq = torch.full((bs,), 10, device=DEV)
    s_loc = torch.zeros(bs, dtype=torch.int64, device=DEV)
    s_q = torch.randn((bs, h * d), device=DEV).to(dtype)
    s_k = torch.randn((bs, kvh * d), device=DEV).to(dtype)
    s_v = torch.randn((bs, kvh * d), device=DEV).to(dtype)

    def fb_for(seq_lens: list[int]) -> ForwardBatch:
        return ForwardBatch.build(ForwardMode.DECODE, [0] * bs, rows, [s - 1 for s in seq_lens],
                                  [1] * bs, s_loc, r2t_pool, kv_pool, be, DEV)

    graph_fb = fb_for([10] * bs)
    graph_fb.out_cache_loc = s_loc
    be.init_forward_metadata_cuda_graph(bs, s_rows, s_seq)
    graph, s_out = capture_graph(lambda: be.forward(s_q, s_k, s_v, layer, graph_fb))

    for seq_lens in ([1, 4096, 77, 2048, 3000], [4000, 2, 3, 4095, 1]):
        loc = r2t_pool.req_to_token[s_rows, torch.tensor(seq_lens, device=DEV) - 1].long()
        s_loc.copy_(loc)
        s_q.copy_(torch.randn_like(s_q, dtype=torch.float32))
        s_k.copy_(torch.randn_like(s_k, dtype=torch.float32))
        s_v.copy_(torch.randn_like(s_v, dtype=torch.float32))
        s_out.fill_(float("nan"))
        be.init_forward_metadata_cuda_graph(bs, s_rows, torch.tensor(seq_lens, device=DEV))
        graph.replay()
        replayed = s_out.clone()
        eager_fb = fb_for(seq_lens)
        native = TorchNativeBackend()
        native.init_forward_metadata(eager_fb)
        ref = native.forward(s_q, s_k, s_v, layer, eager_fb)
        assert torch.isfinite(replayed).all()
        assert rel_err(replayed, ref.double()) < TOL[dtype]
