"""Tokenizer loading."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of an HF directory; a .gguf file is first converted
    (once, cached) by the model loader, so its tokenizer also loads in a blink."""
    if Path(path).suffix == ".gguf":
        from radixlm.models.loader import prepare_model_dir

        path = prepare_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{path}: no fast (tokenizers-backed) tokenizer could be built")
    return tokenizer
