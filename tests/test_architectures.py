"""An architecture we do not implement is refused by name before any other field
of its config is read: in the offline Engine, and in `radixlm serve` before a
child process is spawned. A Qwen2-VL checkpoint is the case in point: its
decoder's fields are nested under `text_config`, where a reader of flat
fields crashes (AttributeError: no attribute 'num_attention_heads') instead
of refusing."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from server_utils import REPO

import radixlm
from radixlm.models import get_model_class, supported_architectures
from radixlm.models.architectures import ARCHITECTURES, DRAFT_HEADS
from radixlm.models.decoder import DecoderForCausalLM
from radixlm.server.workers import free_port

QWEN2VL = "Qwen2VLForConditionalGeneration"
REFUSAL = rf"unsupported model architecture {QWEN2VL}; supported: .*LlamaForCausalLM"
GGUF_REFUSAL = r"GGUF architecture 'qwen2vl' is not supported \(supported: llama"


@pytest.fixture(scope="module")
def qwen2vl_dir(tmp_path_factory) -> str:
    """A Qwen2-VL checkpoint's config.json, as transformers writes it; no weights."""
    from transformers import Qwen2VLConfig

    out = tmp_path_factory.mktemp("qwen2vl")
    Qwen2VLConfig(architectures=[QWEN2VL]).save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    assert "text_config" in written and "num_attention_heads" not in written
    return str(out)


@pytest.fixture(scope="module")
def qwen2vl_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2vl-gguf") / "tiny-qwen2vl.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2vl")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_every_listed_architecture_imports_its_class():
    for name, (module, cls) in ARCHITECTURES.items():
        model_cls = getattr(importlib.import_module(module), cls)
        if name in DRAFT_HEADS:  # loaded beside a target, never served
            assert getattr(model_cls, "draft_only", False), name
        else:
            assert issubclass(model_cls, DecoderForCausalLM), name
    assert supported_architectures() == sorted(set(ARCHITECTURES) - DRAFT_HEADS)


def test_registry_refuses_the_config_object_by_name(qwen2vl_dir):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=REFUSAL):
        get_model_class(AutoConfig.from_pretrained(qwen2vl_dir))


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_engine_refuses_by_name(qwen2vl_dir, load_format):
    with pytest.raises(ValueError, match=REFUSAL):
        radixlm.Engine(model_path=qwen2vl_dir, load_format=load_format, dtype="float32",
                       skip_tokenizer_init=True)


def test_engine_refuses_a_gguf_file_by_name(qwen2vl_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=GGUF_REFUSAL):
        radixlm.Engine(model_path=qwen2vl_gguf, dtype="float32", skip_tokenizer_init=True)


def _serve(model_path: str, *args: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "radixlm.cli", "serve", "--model-path", model_path,
           "--port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_serve_refuses_by_name_before_spawning(qwen2vl_dir, load_format):
    proc = _serve(qwen2vl_dir, "--load-format", load_format)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot serve {qwen2vl_dir}: unsupported model architecture "
                           f"{QWEN2VL}; supported: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "started the" not in proc.stderr


def test_serve_refuses_a_gguf_file_by_name(qwen2vl_gguf, tmp_path):
    # The API process converts in a child (it holds no torch): the child's
    # refusal comes back as the server's exit message.
    import os

    env = {**os.environ, "RADIXLM_CACHE_DIR": str(tmp_path / "cache")}
    proc = _serve(qwen2vl_gguf, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot serve {qwen2vl_gguf}: ") and \
        "GGUF architecture 'qwen2vl' is not supported" in last, proc.stderr[-3000:]
    assert "started the" not in proc.stderr
    assert not [p for p in Path(tmp_path / "cache").iterdir() if p.is_dir()]  # nothing cached


def test_a_draft_head_is_refused_as_the_model_to_serve(tmp_path):
    """An EAGLE head needs its target's hidden states: the API process refuses it
    before anything starts, naming the flag that takes it."""
    from radixlm.models.model_source import model_architecture

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    with pytest.raises(ValueError, match="is a draft head: .*--speculative-draft-model-path"):
        model_architecture(tmp_path)
