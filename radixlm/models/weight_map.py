"""Checkpoint names -> our parameters, in one place: the initial load, weight
updates and `get_weights_by_name` all resolve names here.

A model class declares how its checkpoint's names differ from its own in a
`weight_mapping` class attribute (`WeightMapping`): the projections it fuses
(HF's q_proj/k_proj/v_proj -> our qkv_proj, shards "q"/"k"/"v"), the
per-expert tensors it stacks (`experts.7.gate_proj` -> our stacked
`experts.gate_up_proj` at shard (7, 0)), the modules the checkpoint names
otherwise (Mixtral's `block_sparse_moe` is our `mlp`) and the buffers a
checkpoint may carry that it recomputes (rotary tables). Every other
checkpoint name must be one of our parameter names. A checkpoint tensor with
no place in the model is an error naming it, never skipped.

What a name resolves to (`WeightSlot`) answers everything about the tensor
through the owning layer's partition and the parameter's spec
(`layers/sharding.py`): the whole tensor's shape, its accepted dtypes, the
shards a complete checkpoint provides, loading it, and gathering it back.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.linear import default_weight_loader
from radixlm.layers.sharding import ShardId, check_checkpoint_dtype, weight_spec

# A layer's KV-cache scales as checkpoints name them (on the attention module:
# ModelOpt, newer compressed-tensors, HF FP8; on k_proj / v_proj: older
# compressed-tensors) -> the parameter of our attention layer that holds them.
KV_SCALE_NAMES = (("k_scale", "k_scale"), ("v_scale", "v_scale"),
                  ("k_proj.output_scale", "k_scale"), ("v_proj.output_scale", "v_scale"))


@dataclass(frozen=True)
class WeightMapping:
    """How a model's checkpoint names map onto its parameters.

    `fused`: checkpoint module name -> (our module name, shard id), matched on
    the last module component ('q_proj' in 'model.layers.0.self_attn.q_proj.weight').
    `skipped`: name suffixes of buffers we recompute. A parameter that another
    module shares (a tied LM head) is resolved for reading, and not loaded
    under the sharing module's name: the owner's name loads it.
    `experts`: the projection name inside one expert -> (our stacked parameter,
    part), for names '<prefix>.experts.<e>.<projection>.<param>': they resolve
    to our '<prefix>.experts.<stacked>' at shard (e, part) (a `param` other
    than 'weight', a quantized format's scale say, to '<stacked>_<param>').
    `renamed`: module names the checkpoint spells differently from ours,
    matched on whole components."""

    fused: Mapping[str, tuple[str, ShardId]] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    experts: Mapping[str, tuple[str, ShardId]] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)

    def our_parts(self, name: str) -> tuple[list[str], ShardId]:
        """Checkpoint name -> (our parameter's dotted components, shard id)."""
        parts = [self.renamed.get(p, p) for p in name.split(".")] if self.renamed else \
            name.split(".")
        if (len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit()
                and parts[-2] in self.experts):
            stacked, part = self.experts[parts[-2]]
            param = stacked if parts[-1] == "weight" else f"{stacked}_{parts[-1]}"
            return [*parts[:-3], param], (int(parts[-3]), part)
        if len(parts) >= 2 and parts[-2] in self.fused:
            module, shard_id = self.fused[parts[-2]]
            return [*parts[:-2], module, parts[-1]], shard_id
        return parts, None


@dataclass(frozen=True)
class WeightSlot:
    """Where checkpoint tensor `name` lives: our parameter `param_name`
    (the name `named_parameters` gives it), this shard of it, and the
    module whose partition it follows."""

    name: str
    param_name: str
    param: nn.Parameter
    shard_id: ShardId
    module: nn.Module
    alias: bool = False  # reached through a module that shares another's parameter

    def hf_shape(self) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor (all tensor-parallel ranks together)."""
        return weight_spec(self.param).hf_shape(self.module, self.param, self.shard_id)

    def check_dtype(self, dtype: torch.dtype | str) -> None:
        """ValueError unless the checkpoint may hold this tensor in `dtype`."""
        check_checkpoint_dtype(self.name, self.param, dtype)

    def load(self, tensor: torch.Tensor) -> None:
        """Write this rank's piece of the whole checkpoint tensor into place."""
        self.check_dtype(tensor.dtype)
        loader = getattr(self.param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            loader(self.param, tensor, self.shard_id)

    def gather(self) -> torch.Tensor:
        """The whole checkpoint tensor. With tensor parallelism a collective:
        every rank must call it, in the same order."""
        with torch.no_grad():
            return weight_spec(self.param).gather(self.module, self.param, self.shard_id)


class WeightMap:
    """Resolves checkpoint names for one model (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.mapping: WeightMapping = getattr(model, "weight_mapping", WeightMapping())
        self.param_names = {id(p): n for n, p in model.named_parameters()}

    def is_skipped(self, name: str) -> bool:
        return bool(self.mapping.skipped) and name.endswith(self.mapping.skipped)

    def resolve(self, name: str) -> WeightSlot | None:
        """The slot of checkpoint tensor `name`; None when the model has no
        parameter for it (skipped buffers included)."""
        parts, shard_id = self.mapping.our_parts(self._kv_scale(name) or name)
        try:
            module = self.model.get_submodule(".".join(parts[:-1]))
        except AttributeError:
            return None
        param = getattr(module, parts[-1], None)
        if not isinstance(param, nn.Parameter):
            return None
        knows = getattr(weight_spec(param), "knows", None)
        if knows is not None and not knows(shard_id):
            return None  # an expert index past the model's experts
        ours = ".".join(parts)
        canonical = self.param_names[id(param)]
        return WeightSlot(name, canonical, param, shard_id, module, alias=canonical != ours)

    def _kv_scale(self, name: str) -> str | None:
        """Our name for a checkpoint's k/v cache scale: the `RadixAttention` inside
        the module that carries it (or inside k_proj's / v_proj's parent)."""
        for suffix, ours in KV_SCALE_NAMES:
            if not name.endswith("." + suffix):
                continue
            owner = name[:-len(suffix) - 1]
            try:
                module = self.model.get_submodule(owner)
            except AttributeError:
                return None
            for child, sub in module.named_children():
                if isinstance(sub, RadixAttention):
                    return f"{owner}.{child}.{ours}"
        return None

    def held_elsewhere(self) -> Container[str]:
        """Checkpoint names this rank holds none of (another expert-parallel
        group's experts): a loader need not read them."""
        return _HeldElsewhere(self)

    def slots(self) -> Iterator[WeightSlot]:
        """One slot per parameter, under its own name (shard None: all of it)."""
        for name, param in self.model.named_parameters():
            module = self.model.get_submodule(name.rpartition(".")[0])
            yield WeightSlot(name, name, param, None, module)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, set[ShardId]]:
        """Load checkpoint-named tensors in place; returns, per parameter written
        (our name), the shard ids written, for `missing`. ValueError for a name
        with no place in the model or a dtype its parameter does not take."""
        written: dict[str, set[ShardId]] = {}
        for name, tensor in weights:
            if self.is_skipped(name):
                continue
            slot = self.resolve(name)
            if slot is None:
                raise ValueError(self.no_place(name))
            if slot.alias:
                continue
            slot.load(tensor)
            written.setdefault(slot.param_name, set()).add(slot.shard_id)
        return written

    def missing(self, written: Mapping[str, set[ShardId]]) -> list[str]:
        """Our parameters that `written` (param name -> shard ids) leaves incomplete."""
        out = []
        for slot in self.slots():
            got = written.get(slot.param_name, set())
            required = weight_spec(slot.param).required_shards(slot.module, slot.param)
            if None not in got and not required <= got:
                out.append(slot.param_name)
        return out

    def no_place(self, name: str) -> str:
        return (f"checkpoint tensor {name} has no place in {type(self.model).__name__}: it is "
                "neither one of its parameters nor a buffer it recomputes (a checkpoint of "
                "another architecture, or a format it does not read)")


class _HeldElsewhere(Container[str]):
    def __init__(self, weight_map: WeightMap) -> None:
        self.weight_map = weight_map

    def __contains__(self, name: object) -> bool:
        slot = self.weight_map.resolve(name) if isinstance(name, str) else None
        holds = getattr(weight_spec(slot.param), "holds", None) if slot is not None else None
        return holds is not None and not holds(slot.shard_id)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> dict[str, set[ShardId]]:
    """`WeightMap(model).load(weights)`."""
    return WeightMap(model).load(weights)


def missing_message(missing: list[str]) -> str:
    shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
    return f"lacks {len(missing)} parameter(s): {shown}"
