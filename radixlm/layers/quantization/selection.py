"""Which layers a checkpoint's quantization_config leaves unquantized.

Formats name them by HF module (`modules_to_not_convert`, `ignored_layers`,
compressed-tensors' `ignore`), while our layers fuse HF's projections
(q/k/v_proj -> qkv_proj). `LayerFilter` matches a pattern against our
module's name and the HF names of its fused parts; a fused layer whose parts
disagree (q_proj skipped, k_proj not) is refused, since one weight method
holds all of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from radixlm.layers.sharding import ShardId


def matches(pattern: str, name: str) -> bool:
    """compressed-tensors' "re:" patterns are regexes (re.match); any other
    pattern is a run of whole dotted components of the name ('mlp.gate'
    matches 'model.layers.0.mlp.gate', not 'mlp.gate_proj')."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return f".{pattern}." in f".{name}."


class LayerFilter:
    """`skipped(prefix, shard_ids)`: whether the format leaves our layer
    `prefix` unquantized. `fused`: the model's HF projection -> (our module,
    shard id) table (`WeightMapping.fused`)."""

    def __init__(self, patterns: Iterable[str] = (),
                 fused: Mapping[str, tuple[str, ShardId]] | None = None) -> None:
        self.patterns = [p for p in patterns if p]
        self.parts: dict[str, dict[ShardId, str]] = {}
        for hf, (ours, shard) in (fused or {}).items():
            self.parts.setdefault(ours, {})[shard] = hf

    def hf_names(self, prefix: str, shard_ids: tuple[ShardId, ...]) -> list[str]:
        """The HF module names of our layer's parts (itself when unfused)."""
        parent, _, last = prefix.rpartition(".")
        parts = self.parts.get(last)
        if parts is None or set(parts) != set(shard_ids):
            return [prefix]
        return [f"{parent}.{parts[s]}" if parent else parts[s] for s in shard_ids]

    def skipped(self, prefix: str, shard_ids: tuple[ShardId, ...] = (None,)) -> bool:
        if not self.patterns:
            return False
        if any(matches(p, prefix) for p in self.patterns):
            return True
        names = self.hf_names(prefix, shard_ids)
        hits = [any(matches(p, n) for p in self.patterns) for n in names]
        if any(hits) and not all(hits):
            skipped = [n for n, h in zip(names, hits, strict=True) if h]
            raise ValueError(f"the quantization_config leaves {', '.join(skipped)} "
                             f"unquantized but not the other parts of {prefix}, which radixlm "
                             "holds as one weight")
        return all(hits)


def fused_projections(hf_config: Any) -> Mapping[str, tuple[str, ShardId]]:
    """The model's fused-projection table, for a `LayerFilter` (empty when the
    architecture is not one of ours: the loader refuses it anyway)."""
    from radixlm.models.registry import get_model_class

    try:
        model_cls = get_model_class(hf_config)
    except ValueError:
        return {}
    mapping = getattr(model_cls, "weight_mapping", None)
    return dict(mapping.fused) if mapping is not None else {}


def refuse_unknown(config: Mapping[str, Any], known: Iterable[str], what: str) -> None:
    """ValueError naming the quantization_config fields radixlm does not read."""
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(f"{what} quantization_config has field(s) radixlm does not read: "
                         f"{', '.join(unknown)}")
