"""Model implementations and the registry that picks one for an HF config."""

from radixlm.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
