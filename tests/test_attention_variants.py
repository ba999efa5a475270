"""Attention layer variants (sliding window, logit softcap) a backend cannot
compute are refused at start-up, never ignored."""

from __future__ import annotations

import pytest

from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.attention.torch_native import TorchNativeBackend


def test_backend_refuses_variants_it_does_not_compute() -> None:
    backend = TorchNativeBackend()
    backend.check_layer(RadixAttention(0, 4, 2, 16, 0.25))
    for kw, phrase in (({"sliding_window": 8}, "sliding-window"),
                       ({"logit_softcap": 50.0}, "softcapping")):
        if getattr(backend, "supports_" + ("sliding_window" if "sliding_window" in kw
                                             else "logit_softcap")):
            continue  # this backend computes it: nothing to refuse
        with pytest.raises(ValueError, match=phrase):
            backend.check_layer(RadixAttention(3, 4, 2, 16, 0.25, **kw))


def test_variant_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        RadixAttention(0, 4, 2, 16, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        RadixAttention(0, 4, 2, 16, 0.25, logit_softcap=-1.0)
