"""Reading an HF config the way transformers' model of that family reads it,
and refusing what we cannot compute the same way.

Each family's `decoder_spec` reads its fields through these helpers, so a
value the engine cannot honour is a ValueError at load naming the field and
the value, never a silently different model. Fields transformers' own model
does not read (e.g. `sliding_window` in a Llama config) are ignored as it
ignores them: HF is the reference.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from radixlm.layers.rotary import rope_parameters

LAYER_TYPES = ("full_attention", "sliding_attention")


def refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config {field}={value!r}: {why}")


def flag(config: Any, name: str) -> bool:
    return bool(getattr(config, name, False))


def activation(config: Any, allowed: Iterable[str], *names: str) -> str:
    """The gated MLP's activation, from the first of `names` the config has
    (default: hidden_act); ValueError unless it is one of `allowed`."""
    names = names or ("hidden_act",)
    field = next((n for n in names if getattr(config, n, None) is not None), names[0])
    act = getattr(config, field, None) or "silu"
    if act not in allowed:
        raise refuse(field, act, f"this family runs {', '.join(map(repr, allowed))} only")
    return act


def require(config: Any, field: str, allowed: Iterable[Any], why: str) -> None:
    """ValueError unless the config's `field` (absent: None) is one of `allowed`."""
    value = getattr(config, field, None)
    if value not in tuple(allowed):
        raise refuse(field, value, why)


def effective_window(config: Any, window: int | None) -> int | None:
    """`window`, or None where it cannot matter: no position of the served
    context (max_position_embeddings) is more than `window` tokens back."""
    if window is None:
        return None
    if not isinstance(window, int) or window < 1:
        raise refuse("sliding_window", window, "expected a positive integer or null")
    return None if window >= config.max_position_embeddings else window


def windows_on_every_layer(config: Any) -> tuple[int | None, ...]:
    """Mistral's and Phi-3's rule: `sliding_window`, when set, on every layer."""
    window = effective_window(config, getattr(config, "sliding_window", None))
    return (window,) * config.num_hidden_layers


def layer_types(config: Any) -> tuple[str, ...]:
    """`layer_types` (transformers derives it from use_sliding_window /
    max_window_layers / sliding_window_pattern when config.json lacks it)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if len(types) != config.num_hidden_layers:
        raise refuse("layer_types", types, f"{len(types)} entries for "
                     f"num_hidden_layers={config.num_hidden_layers}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise refuse("layer_types", unknown, f"attention kinds this engine does not have "
                     f"(supported: {', '.join(LAYER_TYPES)})")
    return tuple(types)


def windows_by_layer_type(config: Any) -> tuple[int | None, ...]:
    """Qwen2's, Qwen3's and Gemma's rule: `sliding_window` on the layers whose
    `layer_types` entry is sliding_attention."""
    window = effective_window(config, getattr(config, "sliding_window", None))
    return tuple(window if t == "sliding_attention" else None for t in layer_types(config))


def full_rotary(config: Any, layer_type: str | None = None) -> None:
    """Refuse a partial rotary factor where HF's model of the family rotates
    whole heads (only Phi-3's model rotates a leading part)."""
    factor = rope_parameters(config, layer_type)["partial_rotary_factor"]
    if factor != 1.0:
        raise refuse("partial_rotary_factor", factor,
                     "this family's HF model rotates whole heads (1.0)")


def softcap(config: Any, field: str) -> float | None:
    value = getattr(config, field, None)
    if value is None:
        return None
    if not isinstance(value, int | float) or value <= 0:
        raise refuse(field, value, "expected a positive number or null")
    return float(value)
