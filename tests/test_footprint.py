"""What a CPU scheduler process holds: the libraries it runs, not the ones it
might. Triton (CUDA kernels), sympy (pulled in by transformers 5's family
config classes) and xgrammar (until a grammar arrives) cost the embedded
model's process more resident memory than its weights; these tests pin that
they stay out, in a fresh interpreter, and that what was deferred still works
when it is needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from transformers import AutoConfig, AutoTokenizer

from radixlm.models.loader import converted_from_gguf, load_config
from radixlm.tokenizer import get_tokenizer

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
