"""Owns the model, the KV pools and the attention backend; runs one forward."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from radixlm import distributed as tp
from radixlm.cache.memory_pool import KVPool, MHATokenToKVPool, ReqToTokenPool
from radixlm.cache.swa_memory_pool import SWAKVPool
from radixlm.config import ServerArgs
from radixlm.forward_batch import ForwardBatch
from radixlm.layers.attention.base import AttentionBackend
from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.quantization import QuantizationConfig, get_quantization_config

logger = logging.getLogger(__name__)

# On the CPU the KV pool comes out of host RAM, which other processes share:
# take a modest slice by default, and never more than this many tokens.
CPU_KV_FRACTION = 0.1
CPU_MAX_DEFAULT_TOKENS = 65536


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_len: int

    @classmethod
    def from_config(cls, config, context_length: int | None, tp_size: int = 1,
                    tp_rank: int = 0) -> ModelShape:
        """Sizes as one tensor-parallel rank sees them (its share of the heads)."""
        from radixlm.layers.sharding import head_partition

        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        ctx = context_length or getattr(config, "max_position_embeddings", 4096)
        _, local_heads, _, local_kv = head_partition(heads, kv_heads, tp_size, tp_rank)
        return cls(num_layers=config.num_hidden_layers, num_heads=local_heads,
                   num_kv_heads=local_kv, head_dim=head_dim,
                   vocab_size=config.vocab_size, context_len=ctx)


def resolve_device(name: str, gpu_id: int | None = None) -> torch.device:
    """`gpu_id` picks the GPU of a tensor/data-parallel rank (None: the current one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and gpu_id is not None:
        device = torch.device("cuda", gpu_id)
    return device


def gguf_file(args: ServerArgs) -> Path | None:
    """The .gguf file the weights come from, or None."""
    from radixlm.models.loader import gguf_source

    if args.load_format == "dummy":
        return None
    return gguf_source(args.model_path, args.load_format)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir: str, config,
                 gpu_id: int | None = None) -> None:
        from radixlm.models.loader import load_model, resolve_dtype

        self.args = args
        self.device = resolve_device(args.device, gpu_id)
        if self.device.type == "cpu":
            self._set_cpu_threads()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
            from radixlm.layers.pdl import set_pdl  # Triton: not imported on CPU

            if set_pdl(not args.disable_pdl, self.device):
                logger.info("programmatic dependent launch on for the decode kernels")
        if (gguf := gguf_file(args)) is not None:
            from radixlm.models.gguf_packed import record_stored_dtype
            record_stored_dtype(config, gguf)  # for dtype auto
        self.dtype = resolve_dtype(args.dtype, config, self.device)
        self.config = config
        self.shape = ModelShape.from_config(config, args.context_length, args.tp_size,
                                            tp.get_tp_rank())
        self.model = load_model(model_dir, config, args.load_format, self.dtype, self.device,
                                seed=args.random_seed, quant_config=self._quant_config())
        self.layer_windows = self._pooled_windows()
        self.max_total_tokens = self._kv_capacity()
        self.max_running_requests = min(
            args.max_running_requests or (256 if self.device.type == "cuda" else 128),
            self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests,
                                                self.shape.context_len + 8, self.device)
        self.kv_pool = self._make_kv_pool()
        self.attn_backend = self._make_attn_backend()
        if args.enable_deterministic_inference:
            self._check_deterministic()
        for module in self.model.modules():
            if isinstance(module, RadixAttention):
                self.attn_backend.check_layer(module)  # refuse what it cannot compute
        self.graph_runner = None
        if self.device.type == "cuda" and self.attn_backend.supports_cuda_graph:
            from radixlm.runtime.cuda_graph_runner import CudaGraphRunner
            self.graph_runner = CudaGraphRunner(
                self, min(args.cuda_graph_max_bs, self.max_running_requests),
                use_graphs=not args.disable_cuda_graph)

    def _check_deterministic(self) -> None:
        """Refuse, by name, what --enable-deterministic-inference cannot make batch-invariant."""
        if not getattr(self.attn_backend, "batch_invariant", False):
            raise ValueError(f"enable_deterministic_inference: the {self._backend_name()} "
                             "attention backend's results depend on the batch; use the cpu "
                             "backend on the CPU (needs a C++ compiler), triton on CUDA")
        for name, module in self.model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and not getattr(method, "batch_invariant", True):
                raise ValueError(f"enable_deterministic_inference: layer {name} multiplies "
                                 f"through {type(method).__name__}, whose rows depend on the "
                                 "batch")
        experts = (getattr(self.config, "num_experts", None)
                   or getattr(self.config, "num_local_experts", None))
        if experts:
            raise ValueError("enable_deterministic_inference: mixture-of-experts layers "
                             f"({experts} experts) have no batch-invariant kernels yet")

    def _set_cpu_threads(self) -> None:
        if self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)
            return
        ranks = self.args.tp_size * self.args.dp_size // self.args.nnodes
        if ranks > 1:  # ranks share the cores: oversubscription costs several times over
            torch.set_num_threads(max(1, (psutil.cpu_count(logical=False) or 1) // ranks))

    def _quant_config(self) -> QuantizationConfig:
        """Each linear layer's weight method: the checkpoint's format (or
        --quantization; a .gguf file's blocks, `models/gguf_packed.py`), and for
        float weights the fast paths the flags allow."""
        from radixlm.models.gguf_packed import quant_config

        args = self.args
        fast = {"prepack": not args.disable_weight_prepack, "gemv": not args.disable_gemv,
                "deterministic": args.enable_deterministic_inference}
        if (gguf := gguf_file(args)) is not None:
            return quant_config(self.config, gguf, args.quantization, self.device, self.dtype,
                                **fast)
        return get_quantization_config(self.config, args.quantization, **fast)


    # ---- sizing ------------------------------------------------------------
    def _kv_capacity(self) -> int:
        tokens = self._local_kv_capacity()
        sync = tp.get_tp_sync()
        # Every rank must admit the same requests: all take the smallest capacity.
        return sync.min_int(tokens) if sync is not None else tokens

    def _pooled_windows(self) -> dict[int, int]:
        """{layer: window} of the sliding-window layers whose KV gets a window pool
        (SWAKVPool): empty without such layers, with --disable-hybrid-swa-memory, or
        for a backend that cannot read one."""
        windows = {m.layer_id: m.sliding_window for m in self.model.modules()
                   if isinstance(m, RadixAttention) and m.sliding_window is not None}
        if not windows or self.args.disable_hybrid_swa_memory:
            return {}
        if not self._backend_class().supports_window_pool:
            logger.info("attention backend %s keeps window layers' KV for every token",
                        self._backend_name())
            return {}
        return windows

    def _make_kv_pool(self) -> KVPool:
        s = self.shape
        if not self.layer_windows:
            return MHATokenToKVPool(self.max_total_tokens, self.dtype, s.num_kv_heads,
                                    s.head_dim, s.num_layers, self.device)
        window_size = max(1, int(self.max_total_tokens * self.args.swa_full_tokens_ratio))
        window = max(self.layer_windows.values())
        if window_size < 2 * window:
            # A running request holds up to two windows of window slots (the last
            # W - 1 of its cached prefix, and its own last W tokens).
            raise ValueError(
                f"swa_full_tokens_ratio={self.args.swa_full_tokens_ratio} gives {window_size} "
                f"window-layer KV slots for {self.max_total_tokens} tokens, fewer than the "
                f"{2 * window} one request needs with window {window}: raise it (or the "
                f"KV memory), or pass --disable-hybrid-swa-memory")
        logger.info("window pool: %d full-layer slots, %d window-layer slots (%d of %d layers "
                    "windowed, largest window %d)", self.max_total_tokens, window_size,
                    len(self.layer_windows), s.num_layers, window)
        return SWAKVPool(self.max_total_tokens, window_size, self.dtype, s.num_kv_heads,
                         s.head_dim, s.num_layers, self.layer_windows, self.device)

    def kv_bytes_per_token(self) -> float:
        """KV bytes per pool slot (a window pool's: with its share of window slots)."""
        s = self.shape
        if self.layer_windows:
            n_win = len(self.layer_windows)
            return SWAKVPool.bytes_per_full_token(s.num_kv_heads, s.head_dim,
                                                  s.num_layers - n_win, n_win,
                                                  self.args.swa_full_tokens_ratio, self.dtype)
        return MHATokenToKVPool.bytes_per_token(s.num_kv_heads, s.head_dim, s.num_layers,
                                                self.dtype)

    def _local_kv_capacity(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        per_token = self.kv_bytes_per_token()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.args.mem_fraction_static)
        else:
            budget = psutil.virtual_memory().available * CPU_KV_FRACTION
        tokens = int(budget // per_token)
        if self.device.type == "cpu":
            tokens = min(tokens, CPU_MAX_DEFAULT_TOKENS)
        if tokens < 16:
            raise RuntimeError(f"not enough memory for the KV cache ({budget / 2**20:.0f} MiB "
                               f"left); lower --mem-fraction-static or set --max-total-tokens")
        return tokens

    def _backend_name(self) -> str:
        from radixlm.layers.attention.cpu_backend import CpuAttentionBackend

        name = self.args.attention_backend
        if name != "auto":
            return name
        if self.device.type == "cpu":
            return "cpu" if CpuAttentionBackend.supports(self.shape.head_dim) else "torch_native"
        return "triton"

    def _backend_class(self) -> type[AttentionBackend]:
        name = self._backend_name()
        if name == "triton":
            from radixlm.layers.attention.triton_backend import TritonAttentionBackend
            return TritonAttentionBackend
        if name == "cpu":
            from radixlm.layers.attention.cpu_backend import CpuAttentionBackend
            return CpuAttentionBackend
        from radixlm.layers.attention.torch_native import TorchNativeBackend
        return TorchNativeBackend

    def _make_attn_backend(self) -> AttentionBackend:
        from radixlm.layers.attention.cpu_backend import CpuAttentionBackend

        name = self._backend_name()
        on_cpu = self.device.type == "cpu"
        if name == "cpu":
            if not on_cpu or not CpuAttentionBackend.supports(self.shape.head_dim):
                raise ValueError("attention_backend='cpu' needs the CPU device, a C++ compiler "
                                 "(see the log) and a head dim that is a multiple of 16")
            return CpuAttentionBackend()
        if name == "triton":
            from radixlm.layers.attention.triton_backend import TritonAttentionBackend
            s = self.shape
            return TritonAttentionBackend(s.num_heads, s.num_kv_heads, s.head_dim, self.device,
                                          self.req_to_token_pool.max_context_len,
                                          deterministic=self.args.enable_deterministic_inference)
        from radixlm.layers.attention.torch_native import TorchNativeBackend
        return TorchNativeBackend()

    # ---- execution -----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logit_rows), vocab] in float32. From a CUDA graph they live
        in the graph's output buffer: consume them before the next forward."""
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        fb.attn_backend.begin_forward(fb)
        return self.model(fb.input_ids, fb.positions, fb).float()

