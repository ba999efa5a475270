"""Server and engine configuration.

`ServerArgs` is one frozen dataclass; the CLI flags are generated from its
fields (SGLang's names, `--model-path` for `model_path`), and the offline
`Engine(**kwargs)` takes the same names, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's own dtype; auto: the model's. fp8: scaled per layer (cache/fp8_pool.py).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "torch_native", "cpu", "triton")
MOE_RUNNER_BACKENDS = ("auto", "triton", "cpu", "torch")  # layers/moe/backends.py
EMBEDDING_POOLINGS = ("last", "mean")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral", "deepseekv3", "pythonic")
REASONING_PARSERS = ("deepseek-r1", "qwen3")
# --quantization choices: "auto" (what the checkpoint is; the default, None, means the
# same), "none" (float weights; a .gguf file dequantized at load). A weight method adds its
# name here and in layers/quantization/__init__.py.
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "fp8", "awq", "gptq", "compressed-tensors")
# --lm-head-quantization choices (layers/quantization/fp8_head.py).
LM_HEAD_QUANTIZATIONS = ("none", "fp8")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# --speculative-algorithm: who drafts the tokens a verify step checks (radixlm/speculative/).
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
# SGLang's default name of the group over which a trainer broadcasts new weights.
WEIGHT_UPDATE_GROUP = "weight_update_group"


def _opt(group: str, help: str, choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    meta = {"group": group, "help": help, "choices": choices}
    return field(metadata=meta, **kw)


@dataclass(frozen=True)
class ServerArgs:
    # Model
    model_path: str | None = _opt(
        "model", "HF checkpoint directory or .gguf file; default: embedded SmolLM2-135M-Instruct",
        default=None)
    tokenizer_path: str | None = _opt("model", "Tokenizer directory (default: the model's)",
                                      default=None)
    served_model_name: str | None = _opt("model", "Model name reported by the API", default=None)
    load_format: str = _opt("model", "Weight format", LOAD_FORMATS, default="auto")
    dtype: str = _opt("model", "Weight and activation dtype", DTYPES, default="auto")
    quantization: str | None = _opt(
        "model", "Weight quantization method. auto (default): what the checkpoint is (its "
        "config.json's quantization_config; a .gguf file keeps its blocks on the CPU where "
        "that is the faster path, see the start-up log); none: float weights (a .gguf file "
        "dequantized); gguf: a .gguf file's blocks in our CPU kernels; int8: per-channel "
        "int8 of a float checkpoint, CPU; fp8: an FP8 checkpoint (block or per-tensor "
        "scales), or a float checkpoint quantized to FP8 per channel at load; awq, gptq, "
        "compressed-tensors: checkpoints in those formats (awq/gptq on a float config: "
        "random int4 weights with --load-format dummy)", QUANTIZATIONS,
        default=None)
    lm_head_quantization: str = _opt(
        "model", "The LM head's weights: none (as the checkpoint has them; every format "
        "leaves the head in bf16/fp16) or fp8 (FP8 codes with a scale per vocabulary row, "
        "whatever --quantization is: a decode step reads half the head's bytes, the logits "
        "move by FP8 rounding)", LM_HEAD_QUANTIZATIONS, default="none")
    context_length: int | None = _opt("model", "Override the model's context length", default=None)
    skip_tokenizer_init: bool = _opt(
        "model", "No tokenizer: token ids in and out only (e.g. dummy benchmark models)",
        default=False)
    is_embedding: bool = _opt("model", "Serve pooled hidden states (embeddings)", default=False)
    embedding_pooling: str = _opt(
        "model", "With --is-embedding: the last token's final hidden state (SGLang's default "
        "for decoder models) or the mean over the prompt; L2-normalized either way",
        EMBEDDING_POOLINGS, default="last")
    random_seed: int = _opt("model", "Seed for weights of dummy models and unseeded sampling",
                            default=0)

    # Memory and scheduling
    device: str = _opt("runtime", "cpu or cuda (auto: cuda when available)", default="auto")
    mem_fraction_static: float = _opt(
        "memory", "Fraction of device memory for weights + KV cache", default=0.85)
    max_total_tokens: int | None = _opt("memory", "KV pool size in tokens (overrides the fraction)",
                                        default=None)
    kv_cache_dtype: str = _opt(
        "memory", "dtype of the KV cache (auto: the model's dtype); a smaller one holds more "
        "tokens", KV_CACHE_DTYPES, default="auto")
    quantization_param_path: str | None = _opt(
        "memory", "JSON of per-layer KV cache scales for an FP8 KV cache (vLLM's and SGLang's "
        "kv_cache.scaling_factor layout); a checkpoint's own k_scale/v_scale tensors come "
        "first", default=None)
    swa_full_tokens_ratio: float = _opt(
        "memory", "Models with sliding-window layers: window-layer KV slots per full slot "
        "(window layers drop the KV that left every window, so long contexts need few)",
        default=0.8)
    disable_hybrid_swa_memory: bool = _opt(
        "memory", "Keep every layer's KV for every token (no separate window-layer pool)",
        default=False)
    max_running_requests: int | None = _opt("scheduling", "Max requests decoded at once",
                                            default=None)
    max_queued_requests: int | None = _opt("scheduling", "Max waiting requests (503 beyond)",
                                           default=None)
    max_prefill_tokens: int = _opt("scheduling", "Token budget of one prefill batch", default=16384)
    chunked_prefill_size: int = _opt(
        "scheduling", "Prefill long prompts in chunks of this many tokens (-1: off)", default=8192)
    schedule_policy: str = _opt("scheduling", "Waiting-queue order", SCHEDULE_POLICIES,
                                default="lpm")
    schedule_conservativeness: float = _opt(
        "scheduling", "Scale of the reserved decode budget (higher: fewer retractions)",
        default=1.0)
    disable_radix_cache: bool = _opt("scheduling", "Disable prefix sharing", default=False)
    enable_mixed_chunk: bool = _opt(
        "scheduling", "Run a prefill chunk and the running decodes in one forward, so long "
        "prompts do not stall decoding (mixed chunked prefill)", default=False)
    enable_priority_scheduling: bool = _opt(
        "scheduling", "Admit waiting requests by their `priority` field (higher first), "
        "then by the policy; without it a non-zero priority is refused", default=False)
    priority_preemption: bool = _opt(
        "scheduling", "With priority scheduling: a waiting request may retract running "
        "requests of lower priority when it does not fit (they resume later)", default=False)

    # Execution
    attention_backend: str = _opt(
        "runtime", "Attention kernels (auto: triton on CUDA; on the CPU our C++ decode kernel "
        "when a compiler is present, else torch_native)", ATTENTION_BACKENDS, default="auto")
    disable_cuda_graph: bool = _opt("runtime", "Run decode without CUDA graphs", default=False)
    cuda_graph_max_bs: int = _opt("runtime", "Largest decode batch captured in a CUDA graph",
                                  default=256)
    disable_overlap_schedule: bool = _opt("runtime", "Do not overlap CPU scheduling with the GPU",
                                          default=False)
    disable_cascade_attention: bool = _opt(
        "runtime", "In decode attention, read a prefix that running requests share once per "
        "request instead of once per group (triton backend)", default=False)
    disable_weight_prepack: bool = _opt(
        "runtime", "On the CPU in bf16, run linear layers from the plain weights instead of "
        "a copy prepacked for oneDNN (the copy is faster and costs the weights' memory "
        "again)", default=False)
    disable_gemv: bool = _opt(
        "runtime", "On CUDA, run decode's small-batch linear layers with cuBLAS instead of "
        "our Triton GEMV", default=False)
    disable_pdl: bool = _opt(
        "runtime", "On Hopper and newer GPUs, launch the decode kernels one after another "
        "instead of with programmatic dependent launch (which lets each start during "
        "the previous one's tail)", default=False)
    enable_norm_fold: bool = _opt(
        "runtime", "On CUDA, in small-batch decode of a model whose weight kernels can fold "
        "it (AWQ, GPTQ, FP8 on the tensor-core GEMVs), fold the RMSNorm between two "
        "projections into their epilogues instead of launching it (experimental: measured "
        "no faster than the norm kernels)", default=False)
    num_threads: int | None = _opt("runtime", "torch CPU threads (default: all cores)",
                                   default=None)
    moe_runner_backend: str = _opt(
        "runtime", "Where float MoE experts are computed (auto: our Triton kernels on CUDA, "
        "grouped per-expert products on the CPU; torch: the float32 reference)",
        MOE_RUNNER_BACKENDS, default="auto")
    enable_deterministic_inference: bool = _opt(
        "runtime", "The same tokens and logprobs for a request whatever else is batched, "
        "however its prompt is chunked or cached, and after a retraction: batch-invariant "
        "products on every float weight (the CPU's attention and quantized products always "
        "are), and on CUDA batch-invariant attention kernels (cascade decode off). Slower; "
        "needs tp_size 1 (docs/determinism.md)", default=False)

    # Parallelism
    tp_size: int = _opt("parallelism", "Tensor-parallel ranks", default=1)
    ep_size: int = _opt(
        "parallelism", "Expert-parallel groups inside the tensor-parallel group: each holds "
        "1/ep_size of every MoE layer's experts (must divide tp_size)", default=1)
    dp_size: int = _opt("parallelism", "Data-parallel replicas", default=1)
    load_balance_method: str = _opt("parallelism", "Data-parallel routing", LOAD_BALANCE_METHODS,
                                    default="round_robin")
    nnodes: int = _opt("parallelism", "Number of nodes", default=1)
    node_rank: int = _opt("parallelism", "This node's rank", default=0)
    dist_init_addr: str | None = _opt(
        "parallelism", "host:port of the torch.distributed store (default: a free local port)",
        default=None)
    base_gpu_id: int = _opt("parallelism", "First GPU to use (ranks take consecutive GPUs)",
                            default=0)
    dist_timeout: float = _opt("parallelism", "Seconds a collective may wait for a peer rank",
                               default=600.0)
    disable_custom_all_reduce: bool = _opt(
        "parallelism", "Sum tensor-parallel partial results with NCCL alone, not the one-shot "
        "all-reduce over NVLink (symmetric memory) that small messages use", default=False)
    disable_allreduce_fusion: bool = _opt(
        "parallelism", "Run the custom all-reduce and the residual add + RMSNorm after it as "
        "separate kernels instead of one", default=False)

    # Speculative decoding (radixlm/speculative/)
    speculative_algorithm: str | None = _opt(
        "speculative", "Draft tokens that one verify forward of the model checks: NGRAM (the "
        "request's own text: the continuation of its longest earlier match), STANDALONE (a "
        "smaller model with the same tokenizer), EAGLE / EAGLE3 (a draft head over the "
        "model's hidden states); outputs are the model's own either way",
        SPECULATIVE_ALGORITHMS, default=None)
    speculative_draft_model_path: str | None = _opt(
        "speculative", "The draft model (STANDALONE) or draft head (EAGLE, EAGLE3) checkpoint "
        "directory", default=None)
    speculative_num_steps: int | None = _opt(
        "speculative", "Draft tokens per verify (the draft model's steps; default 3, NGRAM 4)",
        default=None)
    speculative_eagle_topk: int | None = _opt(
        "speculative", "Draft candidates per step: 1 a chain, > 1 a tree (the draft models "
        "also verify each step's next best tokens; NGRAM several continuations); trees need "
        "the cpu or torch_native attention backend", default=None)
    speculative_num_draft_tokens: int | None = _opt(
        "speculative", "Tokens one verify checks per request, its newest included: "
        "speculative_num_steps + 1 for a chain; with speculative_eagle_topk > 1 the tree's "
        "nodes + 1 (default num_steps x topk + 1)", default=None)
    speculative_ngram_min_match_window_size: int = _opt(
        "speculative", "NGRAM: shortest suffix of the text that must recur for a draft",
        default=1)
    speculative_ngram_max_match_window_size: int = _opt(
        "speculative", "NGRAM: longest suffix matched (longer matches win)", default=12)
    speculative_max_verify_tokens: int | None = _opt(
        "speculative", "Most rows one verify forward may have (running requests x (drafts + "
        "1)): drafts shorten to fit, and speculation pauses while not one draft per request "
        "fits. Default: the device's measured budget; 0: no limit (always speculate)",
        default=None)

    # Server
    host: str = _opt("server", "Bind address", default="127.0.0.1")
    port: int = _opt("server", "HTTP port", default=30000)
    api_key: str | None = _opt("server", "Require this bearer token", default=None)
    log_level: str = _opt("server", "Logging level", default="info")
    disable_uvicorn_access_log: bool = _opt(
        "server", "No access log line per HTTP request (method, path, status, latency, "
        "request id)", default=False)
    dump_requests_folder: str | None = _opt(
        "server", "Append finished requests to a JSON-lines file in this folder", default=None)
    dump_requests_threshold: int = _opt(
        "server", "Write the dumped requests out every this many requests (and at shutdown)",
        default=1000)
    enable_metrics: bool = _opt("server", "Expose Prometheus /metrics", default=False)
    stats_interval: float = _opt("server", "Seconds between stats log lines", default=10.0)
    stream_interval: int = _opt(
        "server", "Streamed requests report every this many new tokens (the first at once): "
        "larger values spend less of the front end per token", default=1)
    shutdown_timeout: float = _opt("server", "Seconds to drain on SIGTERM", default=30.0)
    skip_warmup: bool = _opt("server", "Skip the warm-up request", default=False)
    grammar_backend: str = _opt("server", "Constrained decoding backend", ("xgrammar", "none"),
                                default="xgrammar")
    tool_call_parser: str | None = _opt(
        "server", "How to read tool calls out of free-form output, for tool_choice auto "
        "(default: the one the chat template's markup names, if exactly one does)",
        TOOL_CALL_PARSERS, default=None)
    reasoning_parser: str | None = _opt(
        "server", "Split <think>...</think> off the answer into reasoning_content",
        REASONING_PARSERS, default=None)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"{f.name}={value!r}: expected one of {', '.join(choices)}")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("chunked_prefill_size must be > 0, or -1 to disable chunking")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError("swa_full_tokens_ratio must be in (0, 1]")
        if self.dump_requests_threshold < 1:
            raise ValueError("dump_requests_threshold must be >= 1")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if self.priority_preemption and not self.enable_priority_scheduling:
            raise ValueError("priority_preemption needs enable_priority_scheduling")
        self._check_parallelism()
        self._check_speculative()
        if self.enable_deterministic_inference and self.tp_size > 1:
            raise ValueError(
                f"enable_deterministic_inference with tp_size={self.tp_size}: the all-reduce of "
                "the tensor-parallel partial sums picks its path and summation order by the "
                "message size, so a row would depend on the batch; use tp_size=1 (dp_size "
                "replicas keep it)")

    @property
    def speculative_num_drafts(self) -> int:
        """Draft tokens per verify (a chain's length; a tree's depth), from whichever
        flag gave it."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None and self.speculative_topk == 1:
            return self.speculative_num_draft_tokens - 1
        return 4 if self.speculative_algorithm == "NGRAM" else 3

    @property
    def speculative_topk(self) -> int:
        """Branching of draft trees (1: chains)."""
        return self.speculative_eagle_topk or 1

    @property
    def speculative_tree_nodes(self) -> int:
        """Draft tokens per verify (a tree's nodes, the root not counted)."""
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        return self.speculative_num_drafts * self.speculative_topk

    def _check_trees(self) -> None:
        topk, depth = self.speculative_topk, self.speculative_num_drafts
        nodes = self.speculative_num_draft_tokens
        if nodes is not None and nodes - 1 > depth * topk:
            raise ValueError(f"speculative_num_draft_tokens={nodes} with speculative_num_steps="
                             f"{depth} and speculative_eagle_topk={topk}: a tree of that depth "
                             f"and branching verifies at most num_steps x topk + 1 = "
                             f"{depth * topk + 1} tokens")
        if self.tp_size > 1:
            raise ValueError(f"speculative_eagle_topk={topk} with tp_size={self.tp_size}: tree "
                             "drafts are not supported under tensor parallelism yet")

    def _check_speculative(self) -> None:
        algo, draft = self.speculative_algorithm, self.speculative_draft_model_path
        if algo is None:
            given = [f.name for f in dataclasses.fields(self)
                     if f.name.startswith("speculative_") and f.name != "speculative_algorithm"
                     and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{given[0]} is set but speculative_algorithm is not")
            return
        if self.is_embedding:
            raise ValueError(f"speculative_algorithm={algo}: an embedding server decodes nothing")
        if (algo == "NGRAM") != (draft is None):
            raise ValueError(f"speculative_algorithm={algo} needs speculative_draft_model_path"
                             if draft is None else "speculative_draft_model_path: NGRAM drafts "
                             "from the request's own text, it loads no draft model")
        topk = self.speculative_eagle_topk
        if topk is not None and topk < 1:
            raise ValueError(f"speculative_eagle_topk={topk}: must be >= 1 (1: chains)")
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if self.speculative_topk > 1:
            self._check_trees()
        elif steps is not None and tokens is not None and tokens != steps + 1:
            raise ValueError(f"speculative_num_draft_tokens={tokens} with speculative_num_steps="
                             f"{steps}: a chain verifies num_steps + 1 tokens")
        if self.speculative_num_drafts < 1 or self.speculative_tree_nodes < 1:
            raise ValueError("speculative_num_steps must be >= 1 (speculative_num_draft_tokens "
                             ">= 2)")
        lo, hi = (self.speculative_ngram_min_match_window_size,
                  self.speculative_ngram_max_match_window_size)
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_ngram_min_match_window_size={lo} and max={hi}: need "
                             "1 <= min <= max")
        if (self.speculative_max_verify_tokens or 0) < 0:
            raise ValueError("speculative_max_verify_tokens must be >= 0 (0: no limit)")

    def _check_parallelism(self) -> None:
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError("tp_size and dp_size must be >= 1")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}: "
                             "expert parallelism runs inside the tensor-parallel group")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got "
                             f"{self.node_rank}")
        if self.nnodes > 1:
            if self.tp_size % self.nnodes:
                raise ValueError(f"tp_size={self.tp_size} must be a multiple of "
                                 f"nnodes={self.nnodes} (each node runs tp_size/nnodes ranks)")
            if self.dp_size > 1:
                raise ValueError("dp_size > 1 with nnodes > 1 is not supported: run one "
                                 "multi-node server per replica behind a router")
            if not self.dist_init_addr:
                raise ValueError("nnodes > 1 needs --dist-init-addr host:port (node 0's "
                                 "address, reachable from every node)")

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # ---- CLI -----------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
            flag = "--" + f.name.replace("_", "-")
            base = _base_type(f.type)
            if base is bool:
                group.add_argument(flag, action="store_true", help=meta["help"])
                continue
            group.add_argument(flag, type=base, default=f.default, choices=meta["choices"],
                               help=f"{meta['help']} (default: {f.default})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _base_type(annotation: Any) -> type:
    """'int | None' -> int; works with postponed (string) annotations."""
    if isinstance(annotation, str):
        name = annotation.split("|")[0].strip()
        return {"int": int, "float": float, "bool": bool, "str": str}[name]
    if get_origin(annotation) is Literal:
        return str
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation
