"""Building a model and loading its weights; writing a GGUF file's conversion.

Where the files are, and the conversion's cache, is `model_source.py`
(torch-free, for the API process); this module is the part that needs torch
and transformers' config classes: the GGUF -> HF converter (dequantized
tensors renamed to HF names, llama.cpp's q/k row permutation undone, config
and tokenizer rebuilt from the metadata), the config as transformers reads
it, and the model built on its device with its weights (`dummy`: seeded noise).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from radixlm.layers.quantization import (
    QuantizationConfig,
    get_quantization_config,
    process_weights_after_loading,
)
from radixlm.layers.rotary import compute_inv_freq
from radixlm.models.gguf_arch import GgufArch, arch_spec

# Re-exported: the loader's callers (the runner, the weight updater, the GGUF
# blocks, benchmarks) find what locates a model here too.
from radixlm.models.model_source import (  # noqa: F401
    CONVERTED_FROM_GGUF,
    CONVERTED_LAYOUT,
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    LOAD_FORMATS,
    cached_dir,
    convert_gguf,
    converted_from_gguf,
    default_model_path,
    gguf_source,
    gguf_tensor_summary,
    prepare_model_dir,
    safetensors_files,
)
from radixlm.models.registry import get_model_class
from radixlm.models.weight_map import WeightMap, missing_message

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Converted checkpoints are written in shards of at most this many bytes, so a
# large GGUF never needs all its dequantized tensors in memory at once.
_SHARD_BYTES = 4 << 30


# ---- GGUF -> HF directory ----------------------------------------------------
def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    """Write `gguf_path` converted into the empty directory `out`
    (`model_source.convert_gguf` runs it once per file, into its cache)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = gguf_field(reader, "general.architecture")
    spec = arch_spec(arch, (t.name for t in reader.tensors))
    config = _gguf_config(reader, arch)
    config.save_pretrained(out)
    record = {"source": gguf_path.name, "architecture": arch,
              "tensors": {t.name: [t.tensor_type.name, len(t.shape)] for t in reader.tensors}}
    (out / CONVERTED_FROM_GGUF).write_text(json.dumps(record) + "\n")
    _write_generation_config(config, out)
    _write_tokenizer(reader, gguf_path, out)
    _write_tensors(reader, config, spec, out)


_MISSING = object()


def gguf_field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file lacks the metadata key {key!r}")
        return default
    return field.contents()


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first


def _gguf_config(reader: Any, arch: str) -> PretrainedConfig:
    import transformers

    def meta(key: str, default: Any = _MISSING) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    spec = arch_spec(arch, tensors)
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    theta = _tidy_float(meta("rope.freq_base", 10000.0))
    fields = dict(
        architectures=[spec.architecture],
        vocab_size=_hf_shape(tensors["token_embd.weight"])[0],
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=_tidy_float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_gguf_rope_scaling(reader, arch, tensors, theta, head_dim),
        # llama.cpp drops output.weight when the head is the embedding.
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=gguf_field(reader, "tokenizer.ggml.padding_token_id", None),
    )
    fields.update(spec.config_fields(meta, tensors))
    return getattr(transformers, spec.config_class)(**fields)


def _tidy_float(value: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.999999747378752e-06. The shortest
    # float32 repr recovers the value the original config.json had.
    return float(str(np.float32(value)))


def _gguf_rope_scaling(reader: Any, arch: str, tensors: dict[str, Any], theta: float,
                       head_dim: int) -> dict[str, Any] | None:
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor"))
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": _tidy_float(gguf_field(
                    reader, f"{arch}.rope.scaling.factor")),
                "original_max_position_embeddings": gguf_field(
                    reader, f"{arch}.rope.scaling.original_context_length")}
    if kind not in ("none", ""):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, "
                         "yarn, and Llama 3's rope_freqs)")
    if "rope_freqs.weight" in tensors:
        return _llama3_rope_from_factors(np.asarray(tensors["rope_freqs.weight"].data), theta,
                                         head_dim)
    return None


def _llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1 scaling as per-frequency divisors (rope_freqs)
    instead of its parameters; recover them, assuming the values every Llama 3.x
    release uses (low 1, high 4, original context 8192) and checking that
    they reproduce the stored divisors."""
    params = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = compute_inv_freq(head_dim, {"rope_type": "default", "rope_theta": theta})
    scaled = compute_inv_freq(head_dim, {**params, "rope_theta": theta})
    if not np.allclose((base / scaled).numpy(), factors, rtol=1e-3):
        raise ValueError("GGUF rope_freqs does not match Llama 3 rope scaling with its usual "
                         "parameters; this scaling is not supported")
    return params


def _write_generation_config(config: PretrainedConfig, out: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)


def _write_tokenizer(reader: Any, gguf_path: Path, out: Path) -> None:
    if "tokenizer.ggml.model" not in reader.fields:
        logger.warning("%s has no tokenizer; the converted model has none either", gguf_path)
        return
    from transformers import AutoTokenizer

    # transformers rebuilds a fast tokenizer (and keeps the chat template) from
    # the GGUF vocabulary; that takes seconds, which is why we save the result.
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except ValueError as e:
        if "not supported" not in str(e):
            raise
        # AutoTokenizer reads the file's model config first, for architectures
        # transformers knows (not OLMoE's); the tokenizer itself is generic.
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent,
                                                            gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of q/k (weights or biases).
    It reorders each head's rows from the two-halves layout HF's rotate_half
    uses to interleaved pairs, for its own rope kernel; we rotate halves."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _to_torch(tensor: Any, config: PretrainedConfig, spec: GgufArch) -> torch.Tensor:
    import gguf

    qtype = tensor.tensor_type
    array = gguf.quants.dequantize(tensor.data, qtype).reshape(_hf_shape(tensor))
    part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if spec.permuted_qk and part == "attn_q":
        array = unpermute_qk(array, config.num_attention_heads)
    elif spec.permuted_qk and part == "attn_k":
        array = unpermute_qk(array, config.num_key_value_heads)
    out = torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: the source is mmapped
    if spec.norm_offset and tensor.name.endswith("norm.weight"):
        out -= spec.norm_offset
    # Half-precision tensors stay half (losslessly); quantized ones become float32.
    if qtype == gguf.GGMLQuantizationType.F16:
        return out.to(torch.float16)
    if qtype == gguf.GGMLQuantizationType.BF16:
        return out.to(torch.bfloat16)
    return out


def _plan_shards(tensors: list[Any]) -> list[list[Any]]:
    shards: list[list[Any]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = int(np.prod(_hf_shape(tensor))) * 4
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def _write_tensors(reader: Any, config: PretrainedConfig, spec: GgufArch, out: Path) -> None:
    from safetensors.torch import save_file

    tensors = []
    for tensor in reader.tensors:
        if spec.hf_name(tensor.name) is not None:
            tensors.append(tensor)
        elif tensor.name not in spec.config_tensors:  # those went into the config
            raise ValueError(f"GGUF tensor {tensor.name} has no place in an HF "
                             f"{spec.architecture} checkpoint (a variant of the "
                             "architecture this converter does not know)")
    shards = _plan_shards(tensors)
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = ("model.safetensors" if len(shards) == 1
                    else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        data = dict(pair for t in shard for pair in spec.hf_tensors(t.name,
                                                                     _to_torch(t, config, spec)))
        save_file(data, out / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, filename))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


# ---- config and weights ------------------------------------------------------
def load_config(model_dir: str, context_length: int | None = None) -> PretrainedConfig:
    """The model's HF config; `context_length` overrides max_position_embeddings
    (the length the rope tables and the scheduler are sized for). The
    checkpoint's own value stays as `native_max_position_embeddings`: rope
    scalings (dynamic, YaRN, LongRoPE) are defined against it."""
    config = _read_config(model_dir)
    if context_length is not None:
        if context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        native = config.max_position_embeddings
        if context_length > native:
            logger.warning("context_length=%d exceeds the model's %d; output quality past "
                           "%d tokens is not guaranteed", context_length, native, native)
        config.native_max_position_embeddings = native
        config.max_position_embeddings = context_length
    return config


def _read_config(model_dir: str) -> PretrainedConfig:
    """AutoConfig's config for `model_dir`; for a directory converted from a
    GGUF file, the same fields as a plain PretrainedConfig (every field is
    written out, so the family's class would add no value). transformers 5's
    family config classes import torch.distributed.tensor and with it sympy:
    ~60 MiB of resident memory and ~1 s of start-up in every process, which on
    the embedded model is more than its weights."""
    if converted_from_gguf(model_dir):
        return PretrainedConfig.from_json_file(str(Path(model_dir) / "config.json"))
    return AutoConfig.from_pretrained(model_dir)


def family_config(config: PretrainedConfig) -> PretrainedConfig:
    """`config` as its family's transformers class (what AutoConfig returns),
    for code that hands it to transformers' own models."""
    if type(config) is not PretrainedConfig:
        return config
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    return AutoConfig.for_model(config.model_type, **fields)


def iter_safetensors(model_dir: str, skip: Container[str] = ()
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint's *.safetensors shards
    but those named in `skip` (not read at all)."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None) as bar:
        for handle in handles:
            for name in handle.keys():  # noqa: SIM118 (safe_open objects are not mappings)
                if name not in skip:
                    yield name, handle.get_tensor(name)
                bar.update()


def resolve_dtype(name: str, config: PretrainedConfig, device: str | torch.device) -> torch.dtype:
    """`auto`: on a GPU the checkpoint's half type, else bfloat16; on the CPU
    bfloat16 where the checkpoint is in a half type and the CPU computes bf16
    natively (AVX512-BF16 or AMX), else float32 (emulated bf16 is slower
    than fp32). The choice and its reason go to the log."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype={name!r}: expected one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    saved = _checkpoint_dtype(config)
    if torch.device(device).type != "cpu":
        return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16
    native = native_bf16_isa()
    if saved in (torch.bfloat16, torch.float16) and native:
        logger.info("dtype auto -> bfloat16: the checkpoint is %s and this CPU computes bf16 "
                    "natively (%s)", _dtype_name(saved), native)
        return torch.bfloat16
    why = (f"the checkpoint is {_dtype_name(saved)}" if saved not in (torch.bfloat16, torch.float16)
           else "this CPU has neither AVX512-BF16 nor AMX") if saved else "no dtype in the config"
    logger.info("dtype auto -> float32 on the CPU: %s", why)
    return torch.float32


def _checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    saved = getattr(config, "dtype", None)
    if saved is None:
        saved = getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    return saved if isinstance(saved, torch.dtype) else None


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def native_bf16_isa() -> str | None:
    """The CPU's native bf16 instructions ('AMX-BF16', 'AVX512-BF16'), or None."""
    from radixlm.layers.cpu_ops import _cpu_flags

    flags = set(_cpu_flags().split())
    if "amx_bf16" in flags:
        return "AMX-BF16"
    return "AVX512-BF16" if "avx512_bf16" in flags else None


@contextlib.contextmanager
def _building_on(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    # Parameters are created directly on the device in the dtype: no float32
    # CPU copy of an 8B model on the way.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def dummy_weights(config: PretrainedConfig, seed: int, device: torch.device,
                  model: nn.Module | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded noise the size of the real checkpoint, tensor by tensor under the HF
    names: N(0, 0.02) as HF initializes, norms at their identity (one; zero for
    `model`'s norms that scale by 1 + weight). Generated whole and then
    sharded by the weight loaders, so every tensor-parallel size (and HF itself,
    given these tensors) sees the same model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(family_config(config))
    weight_map = WeightMap(model) if model is not None else None
    for i, (name, meta) in enumerate(reference.named_parameters()):
        if name.endswith("norm.weight"):
            slot = weight_map.resolve(name) if weight_map is not None else None
            identity = getattr(slot.module, "identity_weight", 1.0) if slot else 1.0
            yield name, torch.full(meta.shape, identity, device=device)
            continue
        generator = torch.Generator(device=device).manual_seed(seed + i)
        yield name, torch.empty(meta.shape, device=device).normal_(0.0, 0.02,
                                                                   generator=generator)


def _load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
                  source: str) -> None:
    weight_map = WeightMap(model)
    try:
        written = weight_map.load(weights)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    missing = weight_map.missing(written)
    if missing:
        raise ValueError(f"{source} {missing_message(missing)}")


def load_model(model_dir: str, config: PretrainedConfig, load_format: str = "auto",
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               seed: int = 0, quant_config: QuantizationConfig | None = None) -> nn.Module:
    """Build the model for `config` on `device` in `dtype` and fill its weights.
    `quant_config` picks each linear layer's weight method (default: from
    the config and its quantization_config, with every fast path on)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    start = time.perf_counter()
    model_cls = get_model_class(config)
    quant_config = quant_config or get_quantization_config(config)
    device = torch.device(device)
    with _building_on(dtype, device):
        model = model_cls(config, quant_config=quant_config)
    if load_format == "dummy":
        weights = quant_config.dummy_weights(dummy_weights(config, seed, device, model), model)
        _load_weights(model, weights, "dummy weights")
    else:
        # Another expert-parallel group's experts are not read.
        weights = quant_config.checkpoint_weights(model_dir) or iter_safetensors(
            model_dir, skip=WeightMap(model).held_elsewhere())
        _load_weights(model, weights, f"checkpoint {model_dir}")
    process_weights_after_loading(model)
    if (chosen := quant_config.describe()) is not None:
        logger.info("%s", chosen)
    model.eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("Loaded %s (%s weights): %.1f MB of weights, %s on %s in %.2f s",
                model_cls.__name__, load_format, nbytes / 1e6,
                str(dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return model
