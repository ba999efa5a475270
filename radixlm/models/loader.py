"""Building a model and loading its weights.

Where the files are, and the conversion's cache, is `model_source.py`
(torch-free, for the API process); a GGUF file's conversion into an HF
directory is `gguf_convert.py`. This module is the config as transformers
reads it, and the model built on its device with its weights (`dummy`:
seeded noise).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Container, Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from radixlm.layers.quantization import (
    QuantizationConfig,
    get_quantization_config,
    process_weights_after_loading,
)

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
