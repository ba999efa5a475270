"""Tree verification on the Triton attention backend: every row of a verify batch
over trees of drafts (`fb.tree`) computes what a decode step after that row's
path computes (the request's prefix, the row's ancestors, itself; never a
sibling), through each decode variant the backend has: the split-KV decode in
fp32 / bf16, window and softcap layers, a window pool's slot map, an FP8 pool,
and the deterministic (batch-invariant) decode, there bit for bit.

Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1;
`tests/test_tree_verify.py::test_triton_tree_rows_under_interpreter` runs this
file so in CI). The bf16 and FP8 cases need CUDA (the interpreter has no such
math).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch
from devices import DEV, HAS_CUDA, needs_cuda, needs_kernels

from radixlm.cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixlm.forward_batch import ForwardBatch, ForwardMode
from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.speculative import tree

pytestmark = pytest.mark.gpu

KVH, GROUP, D = 2, 2, 32
CONTEXT = 128  # the backend's max context: two 64-key splits at most
# Per request: (prefix tokens, draft parents). Branching trees, a chain, a lone root.
REQUESTS = [(37, [0, 0, 0, 1, 4, 4, 2]), (20, [0, 1, 2]), (51, []), (9, [0, 0, 1, 1])]
# ||out - ref|| / ||ref||: a decode of one row splits its keys differently.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float32
    deterministic: bool = False
    window: int | None = None
    softcap: float | None = None
    pool: str = "plain"  # "plain", "window" (SWAKVPool), "fp8"


CASES = {
    "fp32": Case(),
    "bf16": Case(torch.bfloat16),
    "window-softcap": Case(window=24, softcap=30.0),
    "window-pool": Case(window=16, pool="window"),
    "deterministic": Case(deterministic=True),
    "deterministic-bf16": Case(torch.bfloat16, deterministic=True),
    "deterministic-window": Case(deterministic=True, window=16),
    "fp8": Case(torch.bfloat16, pool="fp8"),
}


def _kv_pool(case: Case, size: int) -> MHATokenToKVPool:
    if case.pool == "window":
        from radixlm.cache.swa_memory_pool import SWAKVPool

        pool = SWAKVPool(size, size, case.dtype, KVH, D, 1, {0: case.window}, DEV)
    elif case.pool == "fp8":
        from radixlm.cache.fp8_pool import FP8TokenToKVPool

        pool = FP8TokenToKVPool(size, torch.float8_e4m3fn, KVH, D, 1, DEV)
        pool.set_scales([0.5], [0.25])
    else:
        pool = MHATokenToKVPool(size, case.dtype, KVH, D, 1, DEV)
    for buf in pool.k_buffer + pool.v_buffer:  # random everywhere: zeros hide bad reads
        buf.copy_(torch.randn(buf.shape, device=DEV).to(buf.dtype))
    return pool


def _backend(case: Case):
    from radixlm.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(KVH * GROUP, KVH, D, DEV, max_context_len=CONTEXT,
                                  deterministic=case.deterministic)


def _decode_after_path(case, r2t, kv, slot, pre, path_slots, q, k, v, layer):
    """One decode step of a request whose KV is `slot`'s prefix, then `path_slots`."""
    ref_row = r2t.size - 1  # kept free for this
    depth = len(path_slots)
    r2t.req_to_token[ref_row, :pre] = r2t.req_to_token[slot, :pre]
    if depth:
        r2t.req_to_token[ref_row, pre:pre + depth] = torch.tensor(path_slots,
                                                                  dtype=torch.int32)
    own = kv.alloc(1)
    r2t.req_to_token[ref_row, pre + depth] = own.to(DEV, torch.int32)
    backend = _backend(case)
    fb = ForwardBatch.build(ForwardMode.DECODE, [0], [ref_row], [pre + depth], [1], own,
                            r2t, kv, backend, DEV)
    backend.begin_forward(fb)
    return backend.forward(q, k, v, layer, fb)


@needs_kernels
@pytest.mark.parametrize("name", list(CASES))
def test_tree_rows_are_decode_steps_of_their_paths(name: str) -> None:
    case = CASES[name]
    if case.dtype != torch.float32 and not HAS_CUDA:
        pytest.skip("bf16 / FP8 need CUDA: the interpreter computes them through numpy, "
                    "which has neither (its outputs are garbage)")
    torch.manual_seed(0)
    h = KVH * GROUP
    r2t = ReqToTokenPool(len(REQUESTS) + 1, CONTEXT, DEV)
    kv = _kv_pool(case, 512)
    layer = RadixAttention(0, h, KVH, D, D ** -0.5, sliding_window=case.window,
                           logit_softcap=case.softcap)
    slots, prefix, trees = list(range(len(REQUESTS))), [], []
    for slot, (pre, parents) in zip(slots, REQUESTS):
        r2t.req_to_token[slot, :pre] = kv.alloc(pre).to(DEV, torch.int32)
        prefix.append(pre)
        trees.append(parents)
    ext = [len(p) + 1 for p in trees]
    loc = kv.alloc(sum(ext))
    for slot, pre, e, first in zip(slots, prefix, ext, accumulate(ext, initial=0)):
        # As the scheduler does: the rows' slots in node order after the prefix.
        r2t.req_to_token[slot, pre:pre + e] = loc[first:first + e].to(DEV, torch.int32)
    n = sum(ext)
    act = case.dtype if case.pool != "fp8" else torch.bfloat16
    q = torch.randn((n, h * D), device=DEV).to(act)
    k = torch.randn((n, KVH * D), device=DEV).to(act)
    v = torch.randn((n, KVH * D), device=DEV).to(act)
    backend = _backend(case)
    fb = ForwardBatch.build(ForwardMode.VERIFY, [0] * n, slots, prefix, ext, loc, r2t, kv,
                            backend, DEV, tree=trees)
    backend.begin_forward(fb)
    out = backend.forward(q, k, v, layer, fb)

    row = 0
    for slot, pre, parents in zip(slots, prefix, trees):
        for r in range(len(parents) + 1):
            path = tree.path_rows(parents, r)[:-1]
            at = row + r
            ref = _decode_after_path(case, r2t, kv, slot, pre,
                                     [int(loc[row + a]) for a in path],
                                     q[at:at + 1], k[at:at + 1], v[at:at + 1], layer)
            got = out[at:at + 1]
            if case.deterministic:
                assert torch.equal(got, ref), (name, at)
            else:
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err <= TOL[act], (name, at, err)
        row += len(parents) + 1
    # The mask is a tree's: row 2 (under the root) would see row 1 in a chain.
    chain_backend = _backend(case)
    chain = ForwardBatch.build(ForwardMode.VERIFY, [0] * n, slots, prefix, ext, loc, r2t, kv,
                               chain_backend, DEV)
    chain_backend.begin_forward(chain)
    chained = chain_backend.forward(q, k, v, layer, chain)
    assert not torch.allclose(chained[2].float(), out[2].float(), atol=1e-3)


@needs_cuda
def test_tree_verify_through_static_path_rows_in_a_graph() -> None:
    """The CUDA-graph path: a decode graph captured over the request table, its
    rows pointed at the table's path rows (`ReqToTokenPool(path_rows=...)`, what
    the graph runner fills per replay), replays a tree verify exactly as the
    eager verify computes it."""
    from gpu_models import capture_graph

    case = Case()
    torch.manual_seed(1)
    h = KVH * GROUP
    n_rows = 24  # the graph's batch: 18 tree rows, padded
    r2t = ReqToTokenPool(len(REQUESTS) + 1, CONTEXT, DEV, path_rows=n_rows)
    kv = _kv_pool(case, 512)
    layer = RadixAttention(0, h, KVH, D, D ** -0.5)
    slots, prefix, trees = list(range(len(REQUESTS))), [p for p, _ in REQUESTS], \
        [t for _, t in REQUESTS]
    for slot, pre in zip(slots, prefix):
        r2t.req_to_token[slot, :pre] = kv.alloc(pre).to(DEV, torch.int32)
    ext = [len(p) + 1 for p in trees]
    n = sum(ext)
    loc = kv.alloc(n)
    q = torch.randn((n, h * D), device=DEV)
    k = torch.randn((n, KVH * D), device=DEV)
    v = torch.randn((n, KVH * D), device=DEV)
    eager_backend = _backend(case)
    fb = ForwardBatch.build(ForwardMode.VERIFY, [0] * n, slots, prefix, ext, loc, r2t, kv,
                            eager_backend, DEV, tree=trees)
    eager_backend.begin_forward(fb)
    want = eager_backend.forward(q, k, v, layer, fb)

    view = fb.verify_decode_view()
    backend = _backend(case)
    backend.init_cuda_graph_state(n_rows)
    rpi = torch.zeros(n_rows, dtype=torch.int64, device=DEV)
    seq = torch.zeros(n_rows, dtype=torch.int64, device=DEV)
    static_q = torch.zeros((n_rows, h * D), device=DEV)
    static_k = torch.zeros((n_rows, KVH * D), device=DEV)
    static_v = torch.zeros((n_rows, KVH * D), device=DEV)
    static_loc = torch.zeros(n_rows, dtype=torch.int64, device=DEV)
    static = ForwardBatch.build(ForwardMode.DECODE, [0] * n_rows, [0] * n_rows, [0] * n_rows,
                                [1] * n_rows, static_loc, r2t, kv, backend, DEV)
    static.req_pool_indices, static.seq_lens, static.out_cache_loc = rpi, seq, static_loc
    backend.init_forward_metadata_cuda_graph(n_rows, rpi, seq)
    graph, out = capture_graph(lambda: backend.forward(static_q, static_k, static_v, layer,
                                                       static))
    # Per replay: the view's table into the path rows, the rows pointed at them.
    table = view.req_to_token_pool.req_to_token
    r2t.path_table(n, table.shape[1]).copy_(table)
    rpi.zero_()
    seq.zero_()
    static_loc.zero_()
    rpi[:n] = r2t.path_row_indices(n, DEV)
    seq[:n] = view.seq_lens
    static_loc[:n] = loc
    static_q[:n], static_k[:n], static_v[:n] = q, k, v
    backend.init_forward_metadata_cuda_graph(n_rows, rpi, seq)
    graph.replay()
    torch.cuda.synchronize()
    err = ((out[:n] - want).norm() / want.norm()).item()
    assert err <= 1e-5, err  # fp32; the graph's 24 rows split keys unlike 18
