"""Tokenizer loading."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of an HF directory; a .gguf file is first converted
    (once, cached) by the model loader, so its tokenizer also loads in a blink."""
    from radixlm.models.loader import converted_from_gguf, prepare_model_dir

    if Path(path).suffix == ".gguf":
        path = prepare_model_dir(path)
    if converted_from_gguf(path):
        # The converter saved transformers' generic fast tokenizer, the class
        # AutoTokenizer picks here too; asking AutoTokenizer would first load
        # the family's config class (see loader._read_config for its cost).
        return PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{path}: no fast (tokenizers-backed) tokenizer could be built")
    return tokenizer
