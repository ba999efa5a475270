"""A GGUF file converted into an HF checkpoint directory: tensors dequantized and
renamed to HF names (llama.cpp's q/k row permutation undone), the config and
tokenizer rebuilt from the metadata. `model_source.convert_gguf` runs it once per
file, into its cache (in a child process where the caller holds no torch);
the GGUF blocks (`gguf_packed.py`) read the same metadata through `gguf_field`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from radixlm.layers.rotary import compute_inv_freq
from radixlm.models.gguf_arch import GgufArch, arch_spec

logger = logging.getLogger(__name__)

# Converted checkpoints are written in shards of at most this many bytes, so a
# large GGUF never needs all its dequantized tensors in memory at once.
_SHARD_BYTES = 4 << 30


def write_hf_dir(gguf_path: Path, out: Path, record_name: str) -> None:
    """Write `gguf_path` converted into the empty directory `out`, with a record of
    its source and tensor types in file `record_name` (`model_source.convert_gguf`
    runs it once per file, into its cache, and names the record)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = gguf_field(reader, "general.architecture")
    spec = arch_spec(arch, (t.name for t in reader.tensors))
    config = _gguf_config(reader, arch)
    config.save_pretrained(out)
    record = {"source": gguf_path.name, "architecture": arch,
              "tensors": {t.name: [t.tensor_type.name, len(t.shape)] for t in reader.tensors}}
    (out / record_name).write_text(json.dumps(record) + "\n")
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
