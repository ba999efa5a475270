"""Giving device memory back while idle, and taking it again (SGLang's
release_memory_occupation / resume_memory_occupation, e.g. for an RL trainer
that shares the GPU between rollouts).

Tags name what to release: `kv_cache` (the K/V buffers of every layer) and
`weights` (every parameter; a host copy is kept). No tags means both.

CUDA graphs hold the device addresses of the buffers they captured, and a
released buffer comes back at another address. Rather than pin addresses
(which needs a virtual-memory allocator like SGLang's torch_memory_saver),
the graphs are dropped on release (their memory pool goes too) and captured
again once everything is resumed. On the CPU there are no graphs; releasing
the KV pool frees its memory, releasing the weights keeps the same host
memory (the copy *is* the tensor), so it only guards against use. What the
layers' weight methods derived from the weights (oneDNN-prepacked copies) is
dropped on release and derived again on resume.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from radixlm.layers.quantization import drop_derived_weights, process_weights_after_loading

logger = logging.getLogger(__name__)

TAGS = ("kv_cache", "weights")


def normalize_tags(tags: Any) -> list[str]:
    """None -> every tag; ValueError for an unknown tag or a non-list."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str) or not isinstance(tags, list):
        raise ValueError(f"tags must be a list drawn from {list(TAGS)}, got {tags!r}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}: expected some of {list(TAGS)}")
    return list(dict.fromkeys(tags))


class MemoryOccupation:
    """Release / resume of one model runner's KV pool and weights."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.released: set[str] = set()
        self._weights: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._had_graphs = False

    @property
    def is_released(self) -> bool:
        return bool(self.released)

    def release(self, tags: list[str]) -> list[str]:
        """Release what `tags` name (already released ones are skipped); returns
        what was released now. The caller made sure nothing runs and the prefix
        cache is empty (it indexes the KV buffers)."""
        todo = [t for t in tags if t not in self.released]
        if not todo:
            return []
        self._drop_graphs()
        if "kv_cache" in todo:
            self.runner.kv_pool.release_buffers()
        if "weights" in todo:
            self._release_weights()
        self.released.update(todo)
        self._empty_device_cache()
        return todo

    def resume(self, tags: list[str]) -> list[str]:
        """Bring back what `tags` name; returns what was resumed now. Graphs are
        captured again once nothing is released any more."""
        todo = [t for t in tags if t in self.released]
        if "weights" in todo:
            self._resume_weights()
        if "kv_cache" in todo:
            self.runner.kv_pool.restore_buffers()  # fresh zeros at new addresses
        self.released.difference_update(todo)
        if todo and not self.released:
            self._recapture_graphs()
        return todo

    # ---- weights -------------------------------------------------------------------
    def _release_weights(self) -> None:
        device = self.runner.device
        seen: set[int] = set()
        drop_derived_weights(self.runner.model)
        with torch.no_grad():
            for param in self.runner.model.parameters():  # tied weights: once
                if id(param) in seen:
                    continue
                seen.add(id(param))
                host = param.data.to("cpu", copy=device.type != "cpu")
                # An empty tensor, not a meta one: any use fails loudly but nothing
                # that inspects dtype/device breaks.
                param.data = torch.empty(0, dtype=param.dtype, device=device)
                self._weights.append((param, host))

    def _resume_weights(self) -> None:
        device = self.runner.device
        with torch.no_grad():
            for param, host in self._weights:
                param.data = host.to(device, copy=device.type != "cpu")
        self._weights = []
        process_weights_after_loading(self.runner.model)

    # ---- CUDA graphs and the allocator ------------------------------------------------
    def _drop_graphs(self) -> None:
        if self.runner.graph_runner is not None:
            self._had_graphs = True
            self.runner.graph_runner = None  # frees the graphs and their memory pool

    def _recapture_graphs(self, why: str = "resume") -> None:
        if not self._had_graphs:
            return
        from radixlm.runtime.cuda_graph_runner import CudaGraphRunner

        args, runner = self.runner.args, self.runner
        start = time.perf_counter()
        runner.graph_runner = CudaGraphRunner(
            runner, min(args.cuda_graph_max_bs, runner.max_running_requests),
            use_graphs=not args.disable_cuda_graph)
        self._had_graphs = False
        logger.info("recaptured CUDA graphs after %s in %.1f s", why, time.perf_counter() - start)

    def refresh_graphs(self) -> None:
        """Capture the CUDA graphs again (a weight update moved a tensor they read);
        nothing while released (resume captures them) or where there are none."""
        if self.released or self.runner.graph_runner is None:
            return
        self._drop_graphs()
        self._recapture_graphs("a weight update moved derived weights")

    def _empty_device_cache(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()
