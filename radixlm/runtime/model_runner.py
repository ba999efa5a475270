"""Owns one model, its attention backend and CUDA graphs; runs one forward.

Built in two steps: the constructor loads the weights; `attach_pools` then
takes the KV pools the memory plan sized from the memory those weights left
(`runtime/memory_plan.py`) and builds the attention backend and the graphs
over them. The runner declares what its pool must hold (`kv_request`: the
model's `kv_spec()` in the KV dtype, windows dropped where the backend cannot
read a window pool); it never sizes or builds a pool itself.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import psutil
import torch

import radixlm
from radixlm import distributed as tp
from radixlm.cache.fp8_pool import FP8_DTYPES, FP8TokenToKVPool, kv_scales
from radixlm.cache.kv_spec import KVSpec
from radixlm.cache.memory_pool import KVPool, ReqToTokenPool
from radixlm.config import ServerArgs
from radixlm.forward_batch import ForwardBatch, HiddenCapture
from radixlm.layers.attention.base import AttentionBackend, AttentionShape
from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.attention.registry import attention_backend_class
from radixlm.layers.quantization import QuantizationConfig, get_quantization_config
from radixlm.layers.quantization.base import FusedMoEMethod, LinearMethod
from radixlm.layers.quantization.fp8_head import check_head_quantized
from radixlm.runtime.memory_plan import KVPools, KVRequest

logger = logging.getLogger(__name__)

_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# CPU steps of up to this many tokens run torch's own ops on one thread where the
# products run on our pool (`ModelRunner.cpu_threads`): their ops are then a few
# microseconds of work each, less than waking a sleeping OpenMP thread.
ONE_THREAD_TOKENS = 16


def resolve_device(name: str, gpu_id: int | None = None) -> torch.device:
    """`gpu_id` picks the GPU of a tensor/data-parallel rank (None: the current one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and gpu_id is not None:
        device = torch.device("cuda", gpu_id)
    return device


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r}: expected auto or one of "
                         f"{', '.join(_KV_DTYPES)}")
    return _KV_DTYPES[name]


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
        from radixlm.models.registry import get_model_class

        get_model_class(config)  # an unknown architecture is refused before its config is read
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
        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype)
        self.config = config
        self.context_len = args.context_length or getattr(config, "max_position_embeddings",
                                                          4096)
        self.vocab_size = config.vocab_size
        self.model = load_model(model_dir, config, args.load_format, self.dtype, self.device,
                                seed=args.random_seed, quant_config=self._quant_config())
        if args.lm_head_quantization != "none":
            check_head_quantized(self.model, args.lm_head_quantization)
        self._fold_norms()
        # Decode-sized CPU steps run torch's own ops on one thread where the
        # products run on our pool (`cpu_threads`).
        self.one_thread_tokens = (ONE_THREAD_TOKENS if self.device.type == "cpu"
                                  and products_on_pool(self.model) else 0)
        self.layers = sorted((m for m in self.model.modules() if isinstance(m, RadixAttention)),
                             key=lambda m: m.layer_id)
        spec = self.model.kv_spec()
        self.backend_class = attention_backend_class(args.attention_backend, self.device,
                                                     spec.k_head_dim)
        self.backend_class.check_tree_drafts(args.speculative_eagle_topk)
        self.kv_spec = self._pooled_spec(spec)
        self.req_to_token_pool: ReqToTokenPool | None = None
        self.kv_pool: KVPool | None = None
        self.attn_backend: AttentionBackend | None = None
        self.graph_runner = None
        self.max_running_requests = 0
        self.capture: HiddenCapture | None = None  # hidden states every forward keeps

    def _check_deterministic(self) -> None:
        """Refuse, by name, what --enable-deterministic-inference cannot make batch-invariant."""
        if not getattr(self.attn_backend, "batch_invariant", False):
            raise ValueError(f"enable_deterministic_inference: the attention backend "
                             f"(attention_backend={self.args.attention_backend!r}: "
                             f"{type(self.attn_backend).__name__}) gives rows that depend on "
                             "the batch; use the cpu backend on the CPU (needs a C++ compiler), "
                             "triton on CUDA, and a KV cache in the model's dtype")
        for name, module in self.model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and not getattr(method, "batch_invariant", False):
                raise ValueError(f"enable_deterministic_inference: layer {name} multiplies "
                                 f"through {type(method).__name__}, whose rows depend on the "
                                 "batch")

    def _fold_norms(self) -> None:
        """Under --enable-norm-fold on CUDA, fold each norm between two projections
        into them where every layer's kernels can (`layers/norm_fold.py`; a
        deterministic run keeps the norm kernels, whose rows are batch-invariant)."""
        enable = getattr(self.model, "enable_norm_fold", None)
        args = self.args
        if (enable is None or self.device.type != "cuda" or not args.enable_norm_fold
                or args.enable_deterministic_inference):
            return
        rows = enable()
        if rows:
            logger.info("RMSNorm folded into the projections around it in decode steps of up "
                        "to %d rows", rows)

    def _set_cpu_threads(self) -> None:
        if radixlm.OMP_BUSY_WAIT:
            # After each of torch's parallel ops its OpenMP threads spin on the
            # cores our product pool needs: a GGUF MoE decoded 67 tok/s this way
            # against 76 with the passive policy (2 cores, BENCHMARKS.md 2026-12-07).
            logger.warning("torch was imported before radixlm, so its OpenMP threads "
                           "busy-wait (OMP_WAIT_POLICY was unset when torch loaded it): CPU "
                           "decode can run ~10%% slower. Import radixlm first, or set "
                           "OMP_WAIT_POLICY=PASSIVE (or ACTIVE, to keep spinning) before "
                           "starting Python")
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
                "moe_backend": args.moe_runner_backend,
                "deterministic": args.enable_deterministic_inference,
                "lm_head": args.lm_head_quantization}
        if (gguf := gguf_file(args)) is not None:
            return quant_config(self.config, gguf, args.quantization, self.device, self.dtype,
                                **fast)
        return get_quantization_config(self.config, args.quantization, **fast)

    # ---- memory ------------------------------------------------------------
    def _pooled_spec(self, spec: KVSpec) -> KVSpec:
        """The model's layout as the pool will hold it: window layers keep only
        their window's KV (a window pool) unless --disable-hybrid-swa-memory or a
        backend that cannot read a window pool."""
        if not spec.window_layers or self.args.disable_hybrid_swa_memory:
            return spec.without_windows()
        if self.kv_dtype in FP8_DTYPES:
            logger.info("an FP8 KV pool keeps window layers' KV for every token")
            return spec.without_windows()
        if not self.backend_class.supports_window_pool:
            logger.info("attention backend %s keeps window layers' KV for every token",
                        self.backend_class.__name__)
            return spec.without_windows()
        return spec

    def kv_request(self, name: str = "target") -> KVRequest:
        """What this runner's KV pool must hold, for the memory plan."""
        return KVRequest(name, self.kv_spec, self.kv_dtype)

    def attach_pools(self, pools: KVPools, name: str = "target") -> None:
        """Take the memory plan's pools (this runner's is `pools.pools[name]`) and build
        the attention backend and CUDA graphs over them."""
        self.req_to_token_pool = pools.req_to_token_pool
        self.kv_pool = pools.pools[name]
        self.max_running_requests = pools.max_running_requests
        first = self.layers[0]
        self.attn_backend = self.backend_class.create(AttentionShape(
            first.num_heads, first.num_kv_heads, first.head_dim, self.device,
            self.req_to_token_pool.max_context_len,
            deterministic=self.args.enable_deterministic_inference))
        self.attn_backend.check_kv_dtype(self.dtype, self.kv_dtype)
        if self.args.enable_deterministic_inference:
            self._check_deterministic()
        if isinstance(self.kv_pool, FP8TokenToKVPool):
            self._set_kv_scales(self.kv_pool)
        for layer in self.layers:
            self.attn_backend.check_layer(layer)  # refuse what it cannot compute
        if self.device.type == "cuda" and self.attn_backend.supports_cuda_graph:
            from radixlm.runtime.cuda_graph_runner import CudaGraphRunner
            self.graph_runner = CudaGraphRunner(
                self, min(self.args.cuda_graph_max_bs, self.max_running_requests),
                use_graphs=not self.args.disable_cuda_graph)

    def _set_kv_scales(self, pool: FP8TokenToKVPool) -> None:
        ks, vs, source = kv_scales(self.layers, tp.get_tp_rank(),
                                   self.args.quantization_param_path)
        pool.set_scales(ks, vs)
        if source.startswith("none"):
            logger.warning("FP8 KV cache without scales (no k_scale/v_scale in the checkpoint, "
                           "no --quantization-param-path): using 1.0, which may cost accuracy")
        else:
            logger.info("FP8 KV cache scales from %s", source)

    # ---- execution -----------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's input embeddings of `input_ids` (what `input_embeds` holds
        for ordinary tokens)."""
        return self.model.model.embed(input_ids)

    def cpu_threads(self, num_tokens: int) -> contextlib.AbstractContextManager:
        """The threading a step of `num_tokens` runs under: where this CPU model's
        products run on our pool, a decode-sized step runs torch's own ops on one
        thread (`qgemm.torch_ops_on_one_thread`); otherwise as it is."""
        if 0 < num_tokens <= self.one_thread_tokens:
            from radixlm.layers.cpu_ops import qgemm

            return qgemm.torch_ops_on_one_thread()
        return contextlib.nullcontext()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logit_rows), vocab] in float32. From a CUDA graph they live
        in the graph's output buffer: consume them before the next forward."""
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        fb.attn_backend.begin_forward(fb)
        return self.model(fb.input_ids, fb.positions, fb, input_embeds=fb.input_embeds).float()

    @torch.inference_mode()
    def forward_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states of every token (embedding requests)."""
        fb.attn_backend.begin_forward(fb)
        return self.model.forward_hidden(fb.input_ids, fb.positions, fb,
                                         input_embeds=fb.input_embeds)


def products_on_pool(model: torch.nn.Module) -> bool:
    """Whether >= 90 % of the model's linear and expert weight bytes sit in layers
    whose products run on our CPU kernels' pool (`on_product_pool` methods)."""
    pooled = total = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, (LinearMethod, FusedMoEMethod)):
            continue
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        total += nbytes
        pooled += nbytes if method.on_product_pool else 0
    return total > 0 and pooled >= 0.9 * total
