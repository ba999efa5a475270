"""Tokenizer loading, without torch.

transformers' AutoTokenizer picks a tokenizer class from the checkpoint's
config and tokenizer_config.json, and to read the config it imports its
config classes, which import torch (transformers 5). The API process must
not load torch, so the class AutoTokenizer picks is asked once per
checkpoint (in a child process where torch is not loaded:
`model_source.call_with_torch`), remembered in the cache root, and built
here directly; the tokenizer classes themselves import no torch.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from radixlm.models.model_source import (
    call_with_torch,
    converted_from_gguf,
    prepare_model_dir,
    remembered,
)
from radixlm.utils import cache_root


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of an HF directory, the one AutoTokenizer builds; a
    .gguf file is first converted (once, cached), so its tokenizer also loads
    in a blink."""
    if Path(path).suffix == ".gguf":
        path = prepare_model_dir(path)
    if converted_from_gguf(path):
        # The converter saved transformers' generic fast tokenizer, the class
        # AutoTokenizer picks here too (tests/test_footprint.py checks it).
        return PreTrainedTokenizerFast.from_pretrained(path)
    module, _, name = tokenizer_class_name(path).partition(":")
    tokenizer = getattr(importlib.import_module(module), name).from_pretrained(path)
    if not tokenizer.is_fast:
        raise ValueError(f"{path}: no fast (tokenizers-backed) tokenizer could be built")
    return tokenizer


def tokenizer_class_name(path: str) -> str:
    """"module:class" of the tokenizer AutoTokenizer builds for `path`,
    remembered per directory state: the name, size and mtime of every file in
    it, so an edited tokenizer_config.json or config.json is asked again."""
    directory = Path(path).resolve()
    state = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                   for f in directory.iterdir() if f.is_file())
    key = hashlib.blake2b(repr((str(directory), state)).encode(), digest_size=12).hexdigest()
    return remembered(cache_root() / "tokenizer_classes.json", key,
                      lambda: call_with_torch(_auto_tokenizer_class, str(directory)))


def _auto_tokenizer_class(path: str) -> str:
    from transformers import AutoTokenizer

    cls = type(AutoTokenizer.from_pretrained(path, use_fast=True))
    return f"{cls.__module__}:{cls.__qualname__}"
