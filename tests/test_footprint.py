"""What each process holds: the libraries it runs, not the ones it might.

A CPU scheduler process: Triton (CUDA kernels), sympy (pulled in by
transformers 5's family config classes) and xgrammar (until a grammar
arrives) cost the embedded model's process more resident memory than its
weights. The API process (`radixlm serve`'s main process): neither torch nor
transformers' model code, since it only tokenizes and talks to the others.
These tests pin what stays out, in a fresh interpreter or the real server,
and that what was deferred still works when it is needed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from server_utils import ServerProcess
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, Qwen2Config

from radixlm.models.loader import converted_from_gguf, default_model_path, load_config
from radixlm.tokenizer import get_tokenizer, tokenizer_class_name

_ENGINE_RUN = textwrap.dedent("""
    import json, sys
    from radixlm import Engine

    engine = Engine(max_total_tokens=4096, dtype="float32", device="cpu")
    out = engine.generate("The capital of France is", {"max_new_tokens": 4,
                                                       "temperature": 0})
    before = {m: m in sys.modules for m in ("triton", "sympy", "xgrammar")}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"]}
    constrained = engine.generate("Answer in JSON:", {"max_new_tokens": 16, "temperature": 0,
                                                      "json_schema": json.dumps(schema)})
    after = {m: m in sys.modules for m in ("triton", "sympy", "xgrammar")}
    print(json.dumps({"text": out["text"], "before": before, "after": after,
                      "constrained": constrained["text"]}))
""")


def test_cpu_engine_imports_what_it_runs(model_dir):
    # model_dir: the conversion (which does import the heavy parts) is done
    # before the fresh interpreter starts, as the server's front end does it.
    proc = subprocess.run([sys.executable, "-c", _ENGINE_RUN], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["text"]
    assert result["before"] == {"triton": False, "sympy": False, "xgrammar": False}
    # The first grammar builds the backend on demand; nothing else comes with it.
    assert result["after"] == {"triton": False, "sympy": False, "xgrammar": True}
    assert json.loads(result["constrained"])["ok"] in (True, False)


def test_converted_dir_reads_as_autoconfig_and_autotokenizer_would(model_dir):
    """The light readers of a converted directory give what AutoConfig and
    AutoTokenizer give: the same fields, the same tokenizer class and ids."""
    assert converted_from_gguf(model_dir)
    light, auto = load_config(model_dir).to_dict(), AutoConfig.from_pretrained(model_dir).to_dict()
    ignored = {"_name_or_path", "model_type", "use_cache", "transformers_version"}
    assert {k: v for k, v in light.items() if k not in ignored} == \
        {k: v for k, v in auto.items() if k not in ignored}
    ours, theirs = get_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(theirs)
    texts = ["Hello, world!", "  leading spaces\tand\ttabs\n", "naïve café 東京 🙂", "<|im_start|>"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


# ---- the API process -------------------------------------------------------------
# `radixlm serve`'s main, reporting at exit what its process imported meanwhile.
_API_LAUNCHER = textwrap.dedent("""
    import json, sys
    from radixlm.server.launch import main

    code = main()
    modeling = sorted(m for m in sys.modules
                      if m.startswith("transformers.models.") and ".modeling_" in m)
    print("API_PROCESS " + json.dumps({"torch": "torch" in sys.modules, "modeling": modeling}),
          flush=True)
    sys.exit(code)
""")


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _mib(proc: psutil.Process) -> float:
    return proc.memory_info().rss / 2**20


def test_api_process_holds_neither_torch_nor_model_code():
    """The real server on the embedded model: after generate, a streamed chat
    and a JSON-schema request, the API process has imported neither torch nor
    a transformers modeling module; the scheduler (which answered) has torch."""
    server = ServerProcess(["--model-path", default_model_path(), "--max-total-tokens", "2048",
                            "--context-length", "256", "--num-threads", "1"],
                           launcher=[sys.executable, "-c", _API_LAUNCHER])
    try:
        with server.client() as c:
            r = c.post("/generate", json={"text": "The capital of France is",
                                          "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200 and r.json()["text"], r.text
            chat = {"stream": True, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hi"}]}
            with c.stream("POST", "/v1/chat/completions", json=chat) as s:
                assert s.status_code == 200 and "[DONE]" in "".join(s.iter_text())
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"]}
            r = c.post("/generate", json={"text": "JSON:", "sampling_params": {
                "max_new_tokens": 12, "json_schema": json.dumps(schema)}})
            assert r.status_code == 200, r.text
        api = psutil.Process(server.proc.pid)
        children = api.children(recursive=True)
        assert not _maps_torch(api.pid)
        holding_torch = [p for p in children if _maps_torch(p.pid)]
        assert holding_torch, "no child process holds torch: who ran the model?"
        print(f"\nAPI process: {_mib(api):.0f} MiB resident; children: "
              + ", ".join(f"{p.name()} {_mib(p):.0f} MiB" for p in children))
        assert server.stop() == 0
        report = [line for line in server.log().splitlines() if line.startswith("API_PROCESS ")]
        assert report, server.log()[-3000:]
        assert json.loads(report[-1].removeprefix("API_PROCESS ")) == \
            {"torch": False, "modeling": []}
    finally:
        server.__exit__(None, None, None)


_TOKENIZE_WITHOUT_TORCH = textwrap.dedent("""
    import json, sys
    from radixlm.tokenizer import get_tokenizer

    tok = get_tokenizer(sys.argv[1])
    print(json.dumps({"class": f"{type(tok).__module__}:{type(tok).__qualname__}",
                      "ids": tok.encode(sys.argv[2]), "torch": "torch" in sys.modules}))
""")


def _hf_tokenizer_dir(model_dir: str, out: Path, tokenizer_class: str, config: object) -> str:
    """SmolLM2's tokenizer files under another tokenizer_config class, beside a
    family's config.json: what AutoTokenizer makes of them depends on both."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(model_dir) / name, out / name)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = tokenizer_class
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config.save_pretrained(out)
    return str(out)


def test_hf_tokenizer_is_autotokenizers_choice_without_torch(model_dir, tmp_path, monkeypatch):
    """An HF checkpoint's tokenizer, loaded where torch is not: the class
    AutoTokenizer picks (asked once, in a child process, then remembered) and
    the same ids. A Qwen2 config turns tokenizer_config's GPT2Tokenizer into
    Qwen2Tokenizer, a byte-level tokenizer.json turns LlamaTokenizerFast into
    the generic backend: the name in tokenizer_config.json alone is wrong."""
    import radixlm.tokenizer

    text = "Hello, world! naïve café 東京"
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "qwen2").mkdir()
    qwen2 = _hf_tokenizer_dir(model_dir, tmp_path / "qwen2", "GPT2Tokenizer",
                              Qwen2Config(architectures=["Qwen2ForCausalLM"]))
    proc = subprocess.run([sys.executable, "-c", _TOKENIZE_WITHOUT_TORCH, qwen2, text],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    light = json.loads(proc.stdout.strip().splitlines()[-1])
    auto = AutoTokenizer.from_pretrained(qwen2)
    assert light == {"class": "transformers.models.qwen2.tokenization_qwen2:Qwen2Tokenizer",
                     "ids": auto.encode(text), "torch": False}

    def ask_again(path: str) -> str:
        raise AssertionError(f"asked AutoTokenizer again for {path}")

    with monkeypatch.context() as m:
        m.setattr(radixlm.tokenizer, "_auto_tokenizer_class", ask_again)
        assert tokenizer_class_name(qwen2) == light["class"]
    (tmp_path / "llama").mkdir()
    llama = _hf_tokenizer_dir(model_dir, tmp_path / "llama", "LlamaTokenizerFast",
                              LlamaConfig(architectures=["LlamaForCausalLM"]))
    ours, theirs = get_tokenizer(llama), AutoTokenizer.from_pretrained(llama)
    assert type(ours) is type(theirs) and type(ours).__name__ == "TokenizersBackend"
    assert ours.encode(text) == theirs.encode(text)
