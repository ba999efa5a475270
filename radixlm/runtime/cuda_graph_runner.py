"""Decode forwards replayed from CUDA graphs (seed 001: ModelRunner's cuda graphs).

One graph per captured batch size; a batch is padded up to the next captured
size. A verify batch (k + 1 rows per request) replays the graph of its row
count: each of its rows is a decode step of its own
(`ForwardBatch.verify_decode_view`), so the decode graphs serve it as they
are. Padded rows have sequence length 0 (the decode kernel writes zeros for
them) and write their K/V to slot 0, which the pool never hands out.

With `--disable-cuda-graph` the same padded static batches run eagerly: the
kernels then see exactly the shapes the graphs would, so outputs are
identical with and without graphs (GEMM and split-KV reductions can otherwise
round differently for a batch of 5 and one padded to 8).

A verify batch over trees of drafts (`fb.tree`) replays the same decode graphs:
its view gives each row a slot table of its own (the request's prefix, the
row's ancestors, itself), and the graphs read the request table, whose address
they captured. So the table keeps `path_rows` spare rows (`ReqToTokenPool`,
reserved by the memory plan when tree drafts are on: graph max batch x
context, int32); each tree replay copies the view's table into them (the rows
and columns in use) and points the rows there. Chains and plain decode replay
as before, nothing copied. Without path rows (trees not configured, e.g. a
drafter swapped in by hand) trees run eagerly.

With cascade attention (`cascade_attention_wanted`, a backend with
`supports_cascade_decode`) the graphs capture the cascade decode path and each
replay hands the batch's `prefix_groups` to the backend, which writes their
plan into its static tables (none: plain decode through the same kernels).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from radixlm.forward_batch import ForwardBatch, ForwardMode, cascade_attention_wanted

if TYPE_CHECKING:
    from radixlm.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int, use_graphs: bool = True) -> None:
        self.runner = runner
        self.use_graphs = use_graphs
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        n = self.max_bs
        # The graphs' inputs, rows of one buffer so a replay fills them in one copy
        # (an even row length keeps every row 16-byte aligned).
        self.static = torch.zeros(5, n + n % 2, dtype=torch.int64, device=dev)
        (self.input_ids, self.positions, self.req_pool_indices, self.seq_lens,
         self.out_cache_loc) = (row[:n] for row in self.static)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        table = runner.req_to_token_pool
        # Tree verifies of up to this many rows replay: as many as there are spare
        # table rows, where the backend's decode reads any rows it is pointed at.
        self.max_tree_rows = (min(n, table.num_path_rows)
                              if runner.attn_backend.supports_tree_mask else 0)
        self.path_indices = table.path_row_indices(self.max_tree_rows, dev)
        self.tree_replays = 0  # verify forwards of trees served here (tests, stats)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        backend = runner.attn_backend
        self.cascade = backend.supports_cascade_decode and cascade_attention_wanted(runner.args)
        backend.init_cuda_graph_state(n, cascade=self.cascade)
        if use_graphs:
            self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        ones = self.rows[:bs] * 0 + 1
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[:bs],
            extend_seq_lens=ones, extend_prefix_lens=self.seq_lens[:bs] - 1,
            extend_start_loc=self.rows[:bs], seq_lens_cpu=[1] * bs, extend_seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs, req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.kv_pool, attn_backend=r.attn_backend, logit_rows=self.rows[:bs],
            capture=r.capture)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # Largest first: smaller graphs then fit in the memory the largest reserved.
        for bs in reversed(self.sizes):
            fb = self._batch(bs)
            self.runner.attn_backend.init_forward_metadata_cuda_graph(
                bs, fb.req_pool_indices, fb.seq_lens)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile / autotune outside the graph
                    self.runner.model(fb.input_ids, fb.positions, fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            fb.captured.clear()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.runner.model(fb.input_ids, fb.positions, fb)
            self.graphs[bs], self.outputs[bs] = graph, (out, list(fb.captured))
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - t0)

    def can_run(self, fb: ForwardBatch) -> bool:
        rows = self.max_bs if fb.tree is None else self.max_tree_rows
        return fb.mode.is_decode_like() and fb.num_tokens <= rows and fb.input_embeds is None

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of `fb`'s rows; captured hidden states (a `HiddenCapture`) land in
        `fb.captured`, like the logits views into the graph's buffers."""
        caller = fb
        # Prefix groups are a decode batch's requests'; a verify view's rows have none.
        groups = None if fb.mode.is_verify() else fb.prefix_groups
        if fb.mode.is_verify():
            fb = fb.verify_decode_view()
        bs = fb.batch_size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        if padded > bs:  # padded rows: length 0, K/V to slot 0, request slot 0
            self.static[:, bs:padded].zero_()
        pools = self._path_rows(fb) if caller.tree is not None else fb.req_pool_indices
        self.static[:, :bs].copy_(torch.stack(
            [fb.input_ids, fb.positions, pools, fb.seq_lens, fb.out_cache_loc]))
        self.runner.attn_backend.init_forward_metadata_cuda_graph(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded],
            prefix_groups=groups if self.cascade else None)
        if caller.tree is not None:
            self.tree_replays += 1
        if not self.use_graphs:
            static = self._batch(padded)
            logits = self.runner.model(self.input_ids[:padded], self.positions[:padded], static)
            caller.captured = [t[:bs] for t in static.captured]
            return logits[:bs]
        self.graphs[padded].replay()
        logits, captured = self.outputs[padded]
        caller.captured = [t[:bs] for t in captured]
        return logits[:bs]

    def _path_rows(self, view: ForwardBatch) -> torch.Tensor:
        """A tree view's per-row tables copied into the request table's path rows
        (only the rows and columns in use: a row never reads past its length);
        the row indices that read them."""
        table = view.req_to_token_pool.req_to_token
        n, width = table.shape
        self.runner.req_to_token_pool.path_table(n, width).copy_(table, non_blocking=True)
        return self.path_indices[:n]

