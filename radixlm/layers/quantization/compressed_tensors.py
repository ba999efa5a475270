"""compressed-tensors checkpoints (llm-compressor's format), FP8 schemes.

The quantization_config lists `config_groups`, each a scheme (weights,
input activations) and the modules it `targets` ("Linear", or "re:"
regexes on module names), an `ignore` list, and a `kv_cache_scheme`. A
linear layer takes the first group that targets it; its tensors are
`weight` (FP8), `weight_scale` ([1] per tensor, [out, 1] per channel, or
[cdiv(out, bn), cdiv(in, bk)] per block) and, for static activations,
`input_scale` [1]. What radixlm runs of them:
- weights FP8 e4m3 (num_bits 8, type float, symmetric), strategy tensor,
  channel or block;
- input activations FP8 dynamic per token (or per group of bk with block
  weights), FP8 static per tensor, or none (W8A16: activations stay bf16);
- a kv_cache_scheme of FP8 per-tensor scales: the checkpoint's k/v scales
  load onto the attention layers (`k_scale` / `v_scale`), kept for an FP8 KV
  cache; the cache itself stays in the model's dtype.
A MoE layer's experts take the scheme of the group that targets the experts
module (`fp8_moe.py`). Anything else (int8 or int4 weights, asymmetric, group strategies on the
weights, activation ordering, sparsity, transforms) is refused by name.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from radixlm.layers.quantization.base import FusedMoEMethod, LinearMethod, QuantizationConfig
from radixlm.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from radixlm.layers.quantization.selection import LayerFilter, matches
from radixlm.layers.quantization.unquantized import UnquantizedConfig

TOP_FIELDS = ("quant_method", "format", "quantization_status", "config_groups", "ignore",
              "kv_cache_scheme", "global_compression_ratio", "sparsity_config",
              "transform_config", "version")
ARG_FIELDS = ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size",
              "block_structure", "observer", "observer_kwargs", "actorder", "scale_dtype",
              "zp_dtype")


def _fp8_args(args: dict[str, Any], what: str) -> dict[str, Any]:
    unknown = sorted(set(args) - set(ARG_FIELDS))
    if unknown:
        raise ValueError(f"compressed-tensors {what} has field(s) radixlm does not read: "
                         f"{', '.join(unknown)}")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(f"compressed-tensors {what}: num_bits={args.get('num_bits')!r} "
                         f"type={args.get('type')!r}; radixlm reads FP8 (8-bit float) schemes "
                         "only")
    if not args.get("symmetric", True):
        raise ValueError(f"compressed-tensors {what}: symmetric=false is not supported")
    if args.get("actorder"):
        raise ValueError(f"compressed-tensors {what}: actorder={args['actorder']!r} is not "
                         "supported")
    return args


def parse_scheme(group: dict[str, Any], name: str) -> Fp8Scheme:
    """The FP8 scheme of config group `name`, or ValueError naming what we lack."""
    if group.get("output_activations"):
        raise ValueError(f"compressed-tensors config group {name}: output_activations "
                         "quantization is not supported")
    weights = _fp8_args(group.get("weights") or {}, f"config group {name} weights")
    strategy = weights.get("strategy", "tensor")
    block = None
    if strategy == "block":
        bn, bk = (int(b) for b in weights.get("block_structure") or ())
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"compressed-tensors config group {name}: block_structure "
                             f"{[bn, bk]}: the block's input size must be a power of two >= 16")
        block = (bn, bk)
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"compressed-tensors config group {name}: weight strategy "
                         f"{strategy!r} (radixlm reads tensor, channel and block)")
    if weights.get("dynamic"):
        raise ValueError(f"compressed-tensors config group {name}: dynamic weight scales "
                         "are not supported")
    acts = group.get("input_activations")
    if acts is None:
        return Fp8Scheme(strategy, "weight_scale", block, scalar_ndim=1, weight_only=True)
    acts = _fp8_args(acts, f"config group {name} input_activations")
    kind = acts.get("strategy", "tensor")
    if acts.get("dynamic"):
        want = "group" if block else "token"
        if kind != want or (block and acts.get("group_size") != block[1]):
            raise ValueError(f"compressed-tensors config group {name}: dynamic input "
                             f"activations by {kind!r} (group_size {acts.get('group_size')}) "
                             f"with {strategy} weights; radixlm scales them per "
                             + ("group of the weight block's inputs" if block else "token"))
        return Fp8Scheme(strategy, "weight_scale", block, scalar_ndim=1)
    if kind != "tensor":
        raise ValueError(f"compressed-tensors config group {name}: static input activations "
                         f"by {kind!r} (radixlm reads one static scale per tensor)")
    return Fp8Scheme(strategy, "weight_scale", block, static_input=True,
                     input_scale="input_scale", scalar_ndim=1)


class CompressedTensorsConfig(QuantizationConfig):
    """Each linear layer in its config group's FP8 scheme (see the module
    docstring), floats where no group targets it or `ignore` names it."""

    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], Fp8Scheme]], skip: LayerFilter,
                 kv_scales: bool = False, fallback: QuantizationConfig | None = None) -> None:
        self.groups = groups
        self.skip = skip
        self.kv_scales = kv_scales
        self.fallback = fallback or UnquantizedConfig()
        self.counts: Counter[str] = Counter()

    @classmethod
    def from_hf_config(cls, hf_quant_config: dict[str, Any], **options: Any
                       ) -> CompressedTensorsConfig:
        c = hf_quant_config
        unknown = sorted(set(c) - set(TOP_FIELDS))
        if unknown:
            raise ValueError(f"compressed-tensors quantization_config has field(s) radixlm "
                             f"does not read: {', '.join(unknown)}")
        if c.get("sparsity_config") or c.get("transform_config"):
            raise ValueError("compressed-tensors sparsity_config / transform_config: sparse or "
                             "transformed weights are not supported")
        status = c.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status={status!r}: radixlm reads "
                             "compressed checkpoints only")
        groups = []
        for name, group in (c.get("config_groups") or {}).items():
            fmt = group.get("format") or c.get("format")
            if fmt != "float-quantized":
                raise ValueError(f"compressed-tensors config group {name}: format={fmt!r} "
                                 "(radixlm reads float-quantized FP8)")
            targets = list(group.get("targets") or ())
            if not targets or any(t != "Linear" and not t.startswith("re:") for t in targets):
                raise ValueError(f"compressed-tensors config group {name}: targets {targets} "
                                 "(radixlm reads 'Linear' and 're:' module-name patterns)")
            groups.append((targets, parse_scheme(group, name)))
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        kv = c.get("kv_cache_scheme")
        if kv:
            args = _fp8_args(kv, "kv_cache_scheme")
            if args.get("strategy", "tensor") != "tensor" or args.get("dynamic"):
                raise ValueError("compressed-tensors kv_cache_scheme: radixlm reads static "
                                 "per-tensor k/v scales only")
        skip = LayerFilter(c.get("ignore") or (), options.get("fused"))
        return cls(groups, skip, bool(kv), options.get("fallback"))

    def scheme_of(self, prefix: str, shard_ids: tuple) -> Fp8Scheme | None:
        if prefix == "lm_head" or self.skip.skipped(prefix, shard_ids):
            return None
        names = [prefix, *self.skip.hf_names(prefix, shard_ids)]
        for targets, scheme in self.groups:
            if any(t == "Linear" or any(matches(t, n) for n in names) for t in targets):
                return scheme
        return None

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethod:
        scheme = self.scheme_of(prefix, layer.shard_ids)
        if scheme is None:
            self.counts["float"] += 1
            return self.fallback.get_linear_method(layer, prefix)
        self.counts[scheme.describe()] += 1
        return Fp8LinearMethod(scheme)

    def get_moe_method(self, layer: Any, prefix: str) -> FusedMoEMethod:
        """FP8 experts (`fp8_moe.py`) in the scheme of the group that targets the
        experts' module (a "Linear" target does); floats where none does."""
        scheme = self.scheme_of(prefix, (None,))
        if scheme is None:
            self.counts["float experts"] += 1
            return self.fallback.get_moe_method(layer, prefix)
        from radixlm.layers.quantization.fp8_moe import Fp8FusedMoEMethod

        self.counts["experts"] += 1
        return Fp8FusedMoEMethod(scheme, getattr(self.fallback, "moe_backend", "auto"))

    def describe(self) -> str:
        kinds = "; ".join(f"{n} with {kind}" for kind, n in self.counts.items()
                          if kind not in ("float", "experts", "float experts"))
        line = (f"quantization compressed-tensors: FP8 e4m3 linear layers ({kinds}), "
                f"{self.counts['float']} in floats; CUDA: our FP8 GEMV at 1-8 rows, FP8 GEMM "
                "above; elsewhere the weights are dequantized at matmul time")
        if self.counts["experts"] or self.counts["float experts"]:
            line += (f"; {self.counts['experts']} MoE layers' experts in FP8 (weight-only "
                     f"products), {self.counts['float experts']} in floats")
        if self.kv_scales:
            line += ("; the checkpoint's k/v cache scales are kept on the attention layers "
                     "(the KV cache stays in the model's dtype)")
        return line
