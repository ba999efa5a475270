"""Sliding-window and softcapped layers in the Triton kernels and backend, and the
window pool's slot translation, against float64 references (HF's convention: the
query at position p sees keys p - W + 1 .. p; a softcap c scores c * tanh(s / c)).

Runs on CUDA, or on the CPU under the Triton interpreter (`TRITON_INTERPRET=1`:
small cases, fp32, since the interpreter computes bf16 wrongly on the CPU).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (HAS_CUDA or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from attention_reference import TOL, ref_attention, rel_err  # noqa: E402

from radixlm.cache.memory_pool import ReqToTokenPool  # noqa: E402
from radixlm.cache.swa_memory_pool import SWAKVPool  # noqa: E402
from radixlm.forward_batch import ForwardBatch, ForwardMode, find_prefix_groups  # noqa: E402
from radixlm.layers.attention.radix_attention import RadixAttention  # noqa: E402
from radixlm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixlm.layers.attention.triton_ops import cascade_decode as cd  # noqa: E402
from radixlm.layers.attention.triton_ops.decode_attention import (  # noqa: E402
    alloc_decode_scratch,
    decode_attention_fwd,
)
from radixlm.layers.attention.triton_ops.extend_attention import (  # noqa: E402
    build_extend_block_table,
    extend_attention_fwd,
    extend_config,
)
from radixlm.utils import to_device  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")
LOW = torch.bfloat16 if HAS_CUDA else torch.float32
SMALL = INTERPRET and not HAS_CUDA


def test_reference_window_is_transformers_mask():
    """The reference's window is transformers' sliding-window causal mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    n, window = 12, 4
    hf = sliding_window_causal_mask_function(window)
    z = torch.tensor(0)
    want = torch.tensor([[bool(hf(z, z, torch.tensor(q), torch.tensor(k))) for k in range(n)]
                         for q in range(n)])
    # Scores of 0 give uniform weights over the visible keys: nonzero = visible.
    q = torch.zeros((n, 1, 16), device=DEV)
    v = torch.eye(n, 16, device=DEV)[:, None, :]
    out = ref_attention(q, torch.zeros_like(v), v, torch.arange(n, device=DEV), 1.0, window)
    assert torch.equal(out[:, 0, :n].cpu() > 0, want)


def make_pool(seq_lens, kvh, d, dtype, seed, window_rows=None):
    """Random pool + table (shuffled rows and slots). With `window_rows`, also a
    window buffer and a slot map that sends every used full slot to a shuffled
    window row (as SWAKVPool's), and the full buffer holds garbage there."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    size = total + 64
    k_buf = torch.randn((size + 1, kvh, d), generator=gen).to(dtype).to(DEV)
    v_buf = torch.randn((size + 1, kvh, d), generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(size, generator=gen)[:total] + 1
    rows = torch.randperm(len(seq_lens) + 3, generator=gen)[:len(seq_lens)]
    r2t = torch.zeros((len(seq_lens) + 3, max(seq_lens) + 70), dtype=torch.int32)
    off = 0
    for i, n in enumerate(seq_lens):
        r2t[rows[i], :n] = slots[off:off + n].int()
        off += n
    out = dict(k=k_buf, v=v_buf, r2t=r2t.to(DEV), rows=rows.to(DEV), slot_map=None)
    if window_rows:
        smap = torch.zeros(size + 1, dtype=torch.int64)
        smap[slots] = torch.randperm(window_rows, generator=gen)[:total] + 1
        out["slot_map"] = smap.to(DEV)
        out["wk"] = torch.randn((window_rows + 1, kvh, d), generator=gen).to(dtype).to(DEV)
        out["wv"] = torch.randn((window_rows + 1, kvh, d), generator=gen).to(dtype).to(DEV)
    return out


def keys_of(p, i, n):
    """Request i's first n keys and values as the kernel must see them."""
    sl = p["r2t"][p["rows"][i], :n].long()
    if p["slot_map"] is not None:
        sl = p["slot_map"][sl]
        return p["wk"][sl], p["wv"][sl]
    return p["k"][sl], p["v"][sl]


# (group, head_dim, dtype, seq_lens, window, softcap, translate)
DECODE_CASES = [
    (4, 64, LOW, [1, 5, 40, 300, 33], 32, None, False),
    (2, 32, torch.float32, [1, 17, 200, 64], 16, 5.0, False),
    (1, 64, torch.float32, [100, 3, 250], None, 2.0, False),
    (4, 32, torch.float32, [1, 90, 260, 31], 64, None, True),
    (2, 64, torch.float32, [130, 7], 1, 30.0, True),
]
if not SMALL:
    DECODE_CASES += [
        (4, 128, torch.bfloat16, [1, 8192, 17, 1000, 4096, 65], 1024, None, False),
        (2, 256, torch.bfloat16, [5000, 4096, 4097, 3], 4096, 50.0, False),
        (8, 128, torch.float16, [3000, 1, 2048], 512, 30.0, True),
        (2, 256, torch.bfloat16, [700, 9000], None, 50.0, False),
    ]


@pytest.mark.parametrize("group,d,dtype,seq_lens,window,softcap,translate", DECODE_CASES)
def test_decode_window_softcap(group, d, dtype, seq_lens, window, softcap, translate):
    kvh, bs = 2, len(seq_lens)
    h = kvh * group
    p = make_pool(seq_lens, kvh, d, dtype, seed=d + group,
                  window_rows=sum(seq_lens) + 9 if translate else None)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((bs, h, d), generator=gen).to(dtype).to(DEV)
    splits = TritonAttentionBackend(h, kvh, d, DEV).num_kv_splits(bs)
    mid_o, mid_lse = alloc_decode_scratch(bs, h, splits, d, DEV)
    o = torch.full_like(q, float("nan"))
    k_buf, v_buf = (p["wk"], p["wv"]) if translate else (p["k"], p["v"])
    scale = d ** -0.5
    decode_attention_fwd(q, k_buf, v_buf, o, p["r2t"], p["rows"],
                         torch.tensor(seq_lens, device=DEV), mid_o, mid_lse, splits, scale,
                         window=window, softcap=softcap, slot_map=p["slot_map"])
    assert torch.isfinite(o).all()
    for i, n in enumerate(seq_lens):
        k, v = keys_of(p, i, n)
        ref = ref_attention(q[i:i + 1], k, v, torch.tensor([n - 1], device=DEV), scale,
                            window, softcap)
        assert rel_err(o[i:i + 1], ref) < TOL[dtype], (i, n)


# (group, head_dim, dtype, [(prefix, extend)], window, softcap, translate)
EXTEND_CASES = [
    (2, 32, torch.float32, [(0, 100), (30, 70), (5, 1), (150, 9)], 16, None, False),
    (4, 64, torch.float32, [(0, 130), (64, 64)], 100, 20.0, False),
    (1, 32, torch.float32, [(10, 40), (0, 3)], 1, None, True),
    (2, 64, LOW, [(0, 200), (97, 31)], 64, 50.0, True),
    (2, 32, torch.float32, [(20, 60)], None, 3.0, False),
]
if not SMALL:
    EXTEND_CASES += [
        (4, 128, torch.bfloat16, [(0, 4096), (1000, 77), (129, 128), (5000, 1), (0, 1)],
         1024, None, False),
        (2, 256, torch.bfloat16, [(0, 3000), (4000, 600), (100, 4100)], 4096, 50.0, False),
        (8, 128, torch.float16, [(2000, 700), (0, 1500)], 512, None, True),
        (4, 64, torch.bfloat16, [(0, 2000), (300, 517)], 63, 30.0, True),
        (4, 128, torch.float32, [(0, 1000), (300, 517)], 200, 50.0, False),
    ]


@pytest.mark.parametrize("group,d,dtype,reqs,window,softcap,translate", EXTEND_CASES)
def test_extend_window_softcap(group, d, dtype, reqs, window, softcap, translate):
    kvh = 2
    h = kvh * group
    prefix = [a for a, _ in reqs]
    ext = [e for _, e in reqs]
    lens = [a + e for a, e in reqs]
    p = make_pool(lens, kvh, d, dtype, seed=7 * d + group,
                  window_rows=sum(lens) + 5 if translate else None)
    n = sum(ext)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn((n, h, d), generator=gen).to(dtype).to(DEV)
    o = torch.full_like(q, float("nan"))
    starts = [sum(ext[:i]) for i in range(len(ext))]
    cfg = extend_config(d, dtype)
    table = build_extend_block_table(prefix, ext, cfg["block_m"], DEV)
    k_buf, v_buf = (p["wk"], p["wv"]) if translate else (p["k"], p["v"])
    scale = d ** -0.5

    def t(x):
        return torch.tensor(x, device=DEV)

    extend_attention_fwd(q, o, k_buf, v_buf, p["r2t"], p["rows"], t(prefix), t(ext), t(starts),
                         table, scale, **cfg, window=window, softcap=softcap,
                         slot_map=p["slot_map"])
    assert torch.isfinite(o).all()
    for i, (a, e) in enumerate(reqs):
        k, v = keys_of(p, i, a + e)
        ref = ref_attention(q[starts[i]:starts[i] + e], k, v, a + torch.arange(e, device=DEV),
                            scale, window, softcap)
        assert rel_err(o[starts[i]:starts[i] + e], ref) < TOL[dtype], (i, a, e)


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_cascade_decode_softcap(softcap):
    """Shared-prefix decode of a softcapped layer equals the reference."""
    group, d, kvh = 4, 32, 2
    h = kvh * group
    prefix = list(range(1, 151))
    lists = [prefix + list(range(200 + 50 * j, 200 + 50 * j + n))
             for j, n in enumerate([1, 40, 7, 3])] + [list(range(900, 960))]
    size = 1200
    gen = torch.Generator().manual_seed(9)
    k_buf = torch.randn((size, kvh, d), generator=gen).to(DEV)
    v_buf = torch.randn((size, kvh, d), generator=gen).to(DEV)
    bs = len(lists)
    r2t = torch.zeros((bs, 256), dtype=torch.int32)
    for i, s in enumerate(lists):
        r2t[i, :len(s)] = torch.tensor(s, dtype=torch.int32)
    r2t, rows = r2t.to(DEV), torch.arange(bs, device=DEV)
    q = torch.randn((bs, h, d), generator=gen).to(DEV)
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
    cd.cascade_decode_fwd(q, k_buf, v_buf, o, r2t, rows, torch.tensor([len(s) for s in lists],
                          device=DEV), mid_o, mid_lse, splits, scale, tables, mid_po, mid_plse,
                          softcap=softcap)
    for i, s in enumerate(lists):
        sl = torch.tensor(s, device=DEV)
        ref = ref_attention(q[i:i + 1], k_buf[sl], v_buf[sl], torch.tensor([len(s) - 1],
                            device=DEV), scale, None, softcap)
        assert rel_err(o[i:i + 1], ref) < 1e-4, i


# ---- the backend on a window pool ---------------------------------------------------

def _swa_setup(window: int, softcap: float | None, dtype: torch.dtype, pool_tokens: int):
    """A 2-layer window pool (layer 1 windowed), every row random, and the layer."""
    group, d, kvh = 2, 32, 2
    h = kvh * group
    torch.manual_seed(0)
    r2t_pool = ReqToTokenPool(8, 1024, DEV)
    pool = SWAKVPool(pool_tokens, pool_tokens, dtype, kvh, d, 2, {1: window}, DEV)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn_like(buf, dtype=torch.float32))
    layer = RadixAttention(1, h, kvh, d, d ** -0.5, sliding_window=window,
                           logit_softcap=softcap)
    return h, kvh, d, r2t_pool, pool, layer


def _window_keys(pool, r2t_pool, row, n, layer_id=1):
    slots = r2t_pool.req_to_token[row, :n].long()
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    w = pool.slot_map[slots]
    return k_buf[w], v_buf[w]


def test_backend_on_window_pool_extend_then_decode():
    """Extend and decode through the backend on an SWAKVPool: the new K/V land at
    the window slots and are read back there, also after the out-of-window part
    of a request's KV was freed (its slots then map to the padding row)."""
    window, softcap = 24, 10.0
    h, kvh, d, r2t_pool, pool, layer = _swa_setup(window, softcap, torch.float32, 600)
    be = TritonAttentionBackend(h, kvh, d, DEV, max_context_len=1024)
    prefix, ext = [0, 50, 7], [70, 40, 1]
    rows = [r2t_pool.alloc() for _ in prefix]
    for r, a in zip(rows, prefix):
        if a:
            r2t_pool.req_to_token[r, :a] = to_device(pool.alloc(a), DEV, torch.int32)
    n = sum(ext)
    loc = pool.alloc(n)
    off = 0
    for r, a, e in zip(rows, prefix, ext):
        r2t_pool.req_to_token[r, a:a + e] = to_device(loc[off:off + e], DEV, torch.int32)
        off += e
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((n, h * d), generator=gen).to(DEV)
    k = torch.randn((n, kvh * d), generator=gen).to(DEV)
    v = torch.randn((n, kvh * d), generator=gen).to(DEV)
    fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * n, rows, prefix, ext, loc, r2t_pool, pool,
                            be, DEV)
    be.init_forward_metadata(fb)
    out = be.forward(q, k, v, layer, fb).view(n, h, d)
    off = 0
    for r, a, e in zip(rows, prefix, ext):
        kk, vv = _window_keys(pool, r2t_pool, r, a + e)
        ref = ref_attention(q.view(n, h, d)[off:off + e], kk, vv, a + torch.arange(e, device=DEV),
                            layer.scaling, window, softcap)
        assert rel_err(out[off:off + e], ref) < 1e-4
        # The new tokens' rows are where the map says, in the window buffer.
        kb = pool.get_kv_buffer(1)[0]
        assert torch.equal(kb[pool.slot_map[to_device(loc[off:off + e], DEV)]],
                           k.view(n, kvh, d)[off:off + e])
        off += e
    # Free what left the window of the next query, then decode one step.
    seq = [a + e for a, e in zip(prefix, ext)]
    for r, s in zip(rows, seq):
        pool.free_window(r2t_pool.req_to_token[r, :max(0, s - window + 1)].cpu().long())
    pool.check_invariants()
    dloc = pool.alloc(len(rows))
    for i, r in enumerate(rows):
        r2t_pool.req_to_token[r, seq[i]] = int(dloc[i])
    bs = len(rows)
    qd = torch.randn((bs, h * d), generator=gen).to(DEV)
    kd = torch.randn((bs, kvh * d), generator=gen).to(DEV)
    vd = torch.randn((bs, kvh * d), generator=gen).to(DEV)
    dfb = ForwardBatch.build(ForwardMode.DECODE, [0] * bs, rows, seq, [1] * bs, dloc, r2t_pool,
                             pool, be, DEV)
    be.init_forward_metadata(dfb)
    dout = be.forward(qd, kd, vd, layer, dfb).view(bs, h, d)
    for i, r in enumerate(rows):
        kk, vv = _window_keys(pool, r2t_pool, r, seq[i] + 1)
        ref = ref_attention(qd.view(bs, h, d)[i:i + 1], kk, vv,
                            torch.tensor([seq[i]], device=DEV), layer.scaling, window, softcap)
        assert rel_err(dout[i:i + 1], ref) < 1e-4


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need CUDA")
def test_backend_window_layer_cuda_graph_replay():
    """A captured decode of a window layer on a window pool replays new batches
    (the store's slot translation is inside the graph) and equals eager."""
    from gpu_models import capture_graph

    window = 300
    h, kvh, d, r2t_pool, pool, layer = _swa_setup(window, 30.0, torch.bfloat16, 20000)
    be = TritonAttentionBackend(h, kvh, d, DEV, max_context_len=1024)
    eager = TritonAttentionBackend(h, kvh, d, DEV, max_context_len=1024)
    max_bs = 8
    be.init_cuda_graph_state(max_bs, cascade=True)
    rng = random.Random(0)
    rows = [r2t_pool.alloc() for _ in range(max_bs)]
    s_rows = torch.tensor(rows, device=DEV)
    s_seq = torch.zeros(max_bs, dtype=torch.int64, device=DEV)
    s_loc = torch.zeros(max_bs, dtype=torch.int64, device=DEV)
    s_q = torch.zeros((max_bs, h * d), device=DEV, dtype=torch.bfloat16)
    s_k = torch.zeros((max_bs, kvh * d), device=DEV, dtype=torch.bfloat16)
    s_v = torch.zeros((max_bs, kvh * d), device=DEV, dtype=torch.bfloat16)
    fb = ForwardBatch.build(ForwardMode.DECODE, [0] * max_bs, rows, [0] * max_bs, [1] * max_bs,
                            s_loc, r2t_pool, pool, be, DEV)
    fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc = s_rows, s_seq, s_loc
    be.init_forward_metadata_cuda_graph(max_bs, s_rows, s_seq)
    graph, s_out = capture_graph(lambda: be.forward(s_q, s_k, s_v, layer, fb))
    for _ in range(3):
        seq = [rng.randrange(1, 900) for _ in rows]
        for r, n in zip(rows, seq):
            r2t_pool.req_to_token[r, :n] = to_device(pool.alloc(n), DEV, torch.int32)
        s_seq.copy_(torch.tensor(seq))
        s_loc.copy_(r2t_pool.req_to_token[s_rows, s_seq - 1].long())
        for t in (s_q, s_k, s_v):
            t.copy_(torch.randn(t.shape, device=DEV))
        be.init_forward_metadata_cuda_graph(max_bs, s_rows, s_seq)
        graph.replay()
        efb = ForwardBatch.build(ForwardMode.DECODE, [0] * max_bs, rows, [n - 1 for n in seq],
                                 [1] * max_bs, s_loc.clone(), r2t_pool, pool, eager, DEV)
        eager.init_forward_metadata(efb)
        ref = eager.forward(s_q, s_k, s_v, layer, efb)
        assert rel_err(s_out, ref.double()) < 1e-2
        for r, n in zip(rows, seq):
            pool.free(r2t_pool.req_to_token[r, :n].cpu().long())
