"""The CUDA graph runner's tree verifies (`runtime/cuda_graph_runner.py`), on the CPU
with its static batches run eagerly (`use_graphs=False`: what --disable-cuda-graph
runs, the very buffers a graph reads): a tree's view table goes into the request
table's path rows, the rows read there, and the logits are the eager verify's;
chains and decode never touch the path rows; without path rows trees stay eager.
The backend is the torch-native one given the graph hooks (its decode reads the
static rows through the request table, as the captured Triton kernels do)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kv_runner import KVRunner

from radixlm.cache.memory_pool import ReqToTokenPool
from radixlm.forward_batch import ForwardBatch, ForwardMode, PrefixGroups
from radixlm.layers.attention.torch_native import TorchNativeBackend
from radixlm.models.loader import load_config, load_model
from radixlm.runtime.cuda_graph_runner import CudaGraphRunner

MAX_BS = 8
CONTEXT = 128


class StaticNative(TorchNativeBackend):
    """Torch-native decode whose metadata comes from the graph runner's static
    buffers: each row's slots are `req_to_token[req_pool_indices[row]]`, read at
    the table's full width and masked by the row's length."""

    supports_cuda_graph = True

    def __init__(self, table: ReqToTokenPool) -> None:
        self.table = table
        self.graph_calls: list[torch.Tensor] = []

    def init_cuda_graph_state(self, max_bs: int, cascade: bool = False) -> None:
        self.max_bs = max_bs

    def init_forward_metadata_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                         seq_lens: torch.Tensor,
                                         prefix_groups: PrefixGroups | None = None) -> None:
        self.graph_calls.append(req_pool_indices.clone())
        rows = self.table.req_to_token[req_pool_indices].long()
        valid = torch.arange(rows.shape[1])[None, :] < seq_lens[:, None]
        valid[:, 0] = True  # padded rows (length 0) read slot 0, as the kernels' zeros
        self.decode_kv_index = torch.where(valid, rows, 0)
        self.decode_mask = valid[:, None, None, :]
        self._window_views = {}
        self._decode_fb = None  # read only for window layers (the test model has none)


@pytest.fixture(scope="module")
def smol(model_dir: str) -> torch.nn.Module:
    return load_model(model_dir, load_config(model_dir), "auto", torch.float32, "cpu")


def _setup(smol: torch.nn.Module, path_rows: int) -> tuple[KVRunner, CudaGraphRunner]:
    table = ReqToTokenPool(4, CONTEXT, "cpu", path_rows=path_rows)
    kv = KVRunner(smol, max_requests=4, max_context=CONTEXT, backend=StaticNative(table))
    kv.req_pool = table
    runner = SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=table,
                             kv_pool=kv.kv_pool, attn_backend=kv.backend, model=smol,
                             capture=None, args=SimpleNamespace())
    return kv, CudaGraphRunner(runner, MAX_BS, use_graphs=False)


def _verify(kv: KVRunner, reqs: list[tuple[int, list[int]]],
            trees: list[list[int]] | None) -> ForwardBatch:
    """A verify batch of (slot, [root, *drafts]), its rows' slots after each prefix."""
    ids, prefix, ext, locs = [], [], [], []
    for slot, new in reqs:
        pre = kv.kv_len[slot]
        loc = kv.kv_pool.alloc(len(new))
        kv.req_pool.req_to_token[slot, pre:pre + len(new)] = loc.to(torch.int32)
        ids += new
        prefix.append(pre)
        ext.append(len(new))
        locs.append(loc)
    return ForwardBatch.build(ForwardMode.VERIFY, ids, [s for s, _ in reqs], prefix, ext,
                              torch.cat(locs), kv.req_pool, kv.kv_pool, kv.backend,
                              torch.device("cpu"), tree=trees)


def _eager(kv: KVRunner, fb: ForwardBatch) -> torch.Tensor:
    kv.backend.begin_forward(fb)
    with torch.inference_mode():
        return kv.model(fb.input_ids, fb.positions, fb)


def _prompted(kv: KVRunner, prompts: list[list[int]]) -> list[int]:
    slots = [kv.new_request() for _ in prompts]
    kv.extend(list(zip(slots, prompts)))
    return slots


@pytest.mark.parametrize("sizes", [(5, 3), (4, 2)], ids=["8-rows", "6-rows-padded"])
def test_tree_verify_replays_through_the_path_rows(smol: torch.nn.Module,
                                                   sizes: tuple[int, int]) -> None:
    kv, graphs = _setup(smol, path_rows=MAX_BS)
    a, b = _prompted(kv, [[5, 17, 99, 4, 250, 31, 8], [77, 3, 12]])
    big, small = sizes
    trees = [[0, 0, 1, 1][:big - 1], [0, 0][:small - 1]]  # branching, then a chain
    sentinel = 123_456
    kv.req_pool.req_to_token[4:].fill_(sentinel)
    reqs = [(a, [40 + j for j in range(big)]), (b, [60 + j for j in range(small)])]
    fb = _verify(kv, reqs, trees)
    assert graphs.can_run(fb)
    got = graphs.replay(fb).clone()
    # The static rows read the path rows, which hold the view's table.
    n = big + small
    view = fb.verify_decode_view()
    table = view.req_to_token_pool.req_to_token
    assert torch.equal(kv.req_pool.req_to_token[4:4 + n, :table.shape[1]], table)
    assert kv.backend.graph_calls[-1][:n].tolist() == list(range(4, 4 + n))
    assert graphs.tree_replays == 1
    # The same rows verified eagerly (the view's own table) give the same logits.
    want = _eager(kv, _verify(kv, reqs, trees))
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_chains_and_decode_never_touch_the_path_rows(smol: torch.nn.Module) -> None:
    kv, graphs = _setup(smol, path_rows=MAX_BS)
    a, b = _prompted(kv, [[5, 17, 99, 4], [77, 3, 12]])
    kv.req_pool.req_to_token[4:].fill_(-7)
    chain = _verify(kv, [(a, [40, 41, 42]), (b, [60, 61])], None)
    graphs.replay(chain)
    assert kv.backend.graph_calls[-1][:2].tolist() == [a, a]  # the request's own row
    decode = kv.run(ForwardMode.DECODE, [(a, [9]), (b, [10])])  # eager, for the KV
    assert decode.shape[0] == 2
    step = ForwardBatch.build(ForwardMode.DECODE, [1, 2], [a, b], [kv.kv_len[a],
                              kv.kv_len[b]], [1, 1], kv.kv_pool.alloc(2), kv.req_pool,
                              kv.kv_pool, kv.backend, torch.device("cpu"))
    graphs.replay(step)
    assert kv.backend.graph_calls[-1][:2].tolist() == [a, b]
    assert (kv.req_pool.req_to_token[4:] == -7).all() and graphs.tree_replays == 0


def test_trees_stay_eager_without_path_rows(smol: torch.nn.Module) -> None:
    kv, graphs = _setup(smol, path_rows=0)
    (a,) = _prompted(kv, [[5, 17, 99]])
    tree = _verify(kv, [(a, [40, 41, 42])], [[0, 0]])
    assert graphs.max_tree_rows == 0 and not graphs.can_run(tree)
    chain = _verify(kv, [(a, [40, 41, 42])], None)
    assert graphs.can_run(chain)
    # More tree rows than path rows: eager too.
    kv, graphs = _setup(smol, path_rows=4)
    (a,) = _prompted(kv, [[5, 17, 99]])
    assert graphs.max_tree_rows == 4
    assert not graphs.can_run(_verify(kv, [(a, [1, 2, 3, 4, 5])], [[0, 0, 1, 1]]))
    assert graphs.can_run(_verify(kv, [(a, [1, 2, 3, 4])], [[0, 0, 1]]))



def test_memory_plan_reserves_path_rows_for_tree_drafts_on_cuda() -> None:
    from radixlm.config import ServerArgs
    from radixlm.runtime.memory_plan import MemoryPlan

    def rows(device: str, **kw: object) -> int:
        plan = SimpleNamespace(device=torch.device(device), args=ServerArgs(**kw))
        return MemoryPlan.tree_path_rows(plan, 48)  # 48 requests may run

    tree = dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2)
    assert rows("cuda", **tree) == 48  # the graph runner's largest batch: min(256, 48)
    assert rows("cuda", cuda_graph_max_bs=16, **tree) == 16
    assert rows("cuda", disable_cuda_graph=True, **tree) == 48  # static batches still
    assert rows("cuda", speculative_algorithm="NGRAM") == 0  # chains
    assert rows("cuda") == 0
    assert rows("cpu", **tree) == 0  # no graph runner
