"""The model class for an HF config, imported on first use
(`architectures.py` lists the names)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from radixlm.models.architectures import ARCHITECTURES, resolve_architecture
from radixlm.models.architectures import supported_architectures as supported_architectures

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class for the first of `config.architectures` we implement; a
    ValueError naming them otherwise."""
    module, name = ARCHITECTURES[resolve_architecture(getattr(config, "architectures", None))]
    return getattr(importlib.import_module(module), name)
