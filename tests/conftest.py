"""Shared fixtures: the embedded SmolLM2 model, converted once, and HF's copy of it."""

from __future__ import annotations

import os

# Before torch loads OpenMP: see radixlm/__init__.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded GGUF model as an HF directory (converted on the first run, then cached)."""
    from radixlm.models.loader import prepare_model_dir

    return prepare_model_dir(None)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """HF transformers' Llama on the same converted weights: the reference."""
    from hf_reference import load_hf

    return load_hf(model_dir)
