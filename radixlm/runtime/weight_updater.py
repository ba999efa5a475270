"""Changing the weights of a live model, and reading them back by HF name.

Three sources (SGLang's API): a checkpoint on disk, tensors handed over
in-process or as safetensors bytes, and a trainer that broadcasts tensors over
a torch.distributed group of its own. One object per model runner, so under
tensor parallelism every rank runs the same call on its own shard; tensors
always arrive whole (HF layout) and each parameter's `weight_loader` takes
this rank's piece, exactly as the initial load does.

Every update is all or nothing:
1. validate first, touching nothing: load format, architecture and the
   config fields the modules were built from, every tensor's name, dtype
   and HF shape, and (for a full checkpoint) that every parameter is there;
2. load, taking a CPU copy of each parameter just before its first write;
3. on any failure while loading (an unreadable shard, a device error), copy
   the saved parameters back.
The trade-off: step 2 holds a host-memory copy of what the update touches
(for a full checkpoint, the model's size) for the duration of the update,
instead of a second copy in scarce device memory (a staging model). Step 1
catches the usual mistakes before anything is written, so the copy is the
guarantee for the unusual ones.

Nothing here pickles: tensors travel as safetensors bytes, or by broadcast.
"""

from __future__ import annotations

import copy
import datetime
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from radixlm import distributed as tp
from radixlm.config import WEIGHT_UPDATE_GROUP
from radixlm.layers.quantization import derived_addresses, process_weights_after_loading
from radixlm.models.weight_map import WeightMap, WeightSlot, missing_message

logger = logging.getLogger(__name__)

DISK_LOAD_FORMATS = ("auto", "safetensors", "gguf")
GROUP_TIMEOUT_S = 120.0
# Config fields the modules were built from: a checkpoint that differs in any of
# them cannot be loaded into this model in place.
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "attention_bias",
                "mlp_bias", "hidden_act", "rms_norm_eps", "quantization_config")


class WeightUpdateError(ValueError):
    """A refused or failed update; the message says why (the weights are unchanged)."""


# ---- tensors as bytes ------------------------------------------------------------------
def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """safetensors bytes of (name, tensor) pairs: the wire form of a tensor update."""
    from safetensors.torch import save

    out: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError("named_tensors must be (str, torch.Tensor) pairs")
        if name in out:
            raise ValueError(f"tensor {name!r} appears twice")
        # clone: safetensors refuses views that share storage (e.g. slices of one tensor).
        out[name] = tensor.detach().to("cpu").contiguous().clone()
    return save(out)


def deserialize_named_tensors(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `serialize_named_tensors`; raises WeightUpdateError on bad bytes."""
    from safetensors.torch import load

    try:
        return list(load(bytes(data)).items())
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise WeightUpdateError(f"serialized_named_tensors is not valid safetensors data: "
                                f"{e}") from None


def parse_dtype(name: Any) -> torch.dtype:
    """'bfloat16', 'torch.float16', ... -> a floating torch dtype; WeightUpdateError else."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise WeightUpdateError(f"dtype {name!r} is not a floating-point torch dtype "
                                "(e.g. 'bfloat16', 'float32')")
    return dtype


# ---- the updater -------------------------------------------------------------------------
class WeightUpdater:
    """Updates one model runner's weights in place; see the module docstring."""

    def __init__(self, model: nn.Module, config: Any, device: torch.device,
                 model_path: str | None,
                 on_derived_moved: Callable[[], None] | None = None) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.model_path = model_path
        # Called when deriving from the new weights put a derived tensor (a scale
        # table, a kernel's reordered copy) at a new address: captured CUDA graphs
        # would read the old one (MemoryOccupation.refresh_graphs captures anew).
        self.on_derived_moved = on_derived_moved
        self.groups: dict[str, WeightSyncGroup] = {}
        self.weight_map = WeightMap(model)

    # ---- lookup ---------------------------------------------------------------------
    def slot(self, name: str) -> WeightSlot:
        """The place of HF tensor `name`; WeightUpdateError if the model has none."""
        found = self.weight_map.resolve(name) if isinstance(name, str) else None
        if found is None:
            raise WeightUpdateError(f"the model has no parameter named {name!r} (use HF "
                                    "checkpoint names, e.g. 'model.layers.0.mlp.up_proj.weight')")
        return found

    def _target(self, name: str) -> WeightSlot:
        """The slot an update of `name` writes; an alias of a shared parameter is refused."""
        slot = self.slot(name)
        if slot.alias:
            raise WeightUpdateError(f"{name} is the parameter {slot.param_name} (tied): update "
                                    "it under that name")
        return slot

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of the flattened HF tensor `name`."""
        if not isinstance(truncate_size, int) or truncate_size < 0:
            raise WeightUpdateError(f"truncate_size must be an integer >= 0, got "
                                    f"{truncate_size!r}")
        with torch.no_grad():
            full = self.slot(name).gather()
            return full.flatten()[:truncate_size].float().cpu().tolist()

    # ---- from disk ------------------------------------------------------------------
    def update_from_disk(self, model_path: str, load_format: str | None = "auto") -> None:
        """Load the checkpoint at `model_path` (HF directory or GGUF file) in place.
        Raises WeightUpdateError (weights unchanged) on any failure."""
        from radixlm.models.loader import iter_safetensors, load_config, prepare_model_dir

        load_format = load_format or "auto"
        if load_format not in DISK_LOAD_FORMATS:
            raise WeightUpdateError(f"load_format={load_format!r}: expected one of "
                                    f"{', '.join(DISK_LOAD_FORMATS)}")
        if not isinstance(model_path, str) or not model_path:
            raise WeightUpdateError("model_path must be a non-empty string")
        error = None
        try:
            model_dir = prepare_model_dir(model_path, load_format)
            self._check_config(load_config(model_dir))
            self._check_checkpoint(_checkpoint_header(model_dir))
        except WeightUpdateError as e:
            error = str(e)
        except Exception as e:  # missing file, unreadable config or header, ...
            error = f"{type(e).__name__}: {e}"
        # Ranks may see different files (multi-node): all go ahead, or none does.
        if not _all_ranks_agree(error is None):
            raise WeightUpdateError(error or "the checkpoint failed its checks on another "
                                             "tensor-parallel rank")
        self._load(iter_safetensors(model_dir))
        self.model_path = model_path

    def _check_config(self, new: Any) -> None:
        from radixlm.layers.rotary import rope_parameters
        from radixlm.models.decoder import head_dim_of

        old_arch, new_arch = getattr(self.config, "architectures", None), \
            getattr(new, "architectures", None)
        if old_arch and new_arch and list(old_arch) != list(new_arch):
            raise WeightUpdateError(f"the checkpoint's architecture {new_arch} differs from the "
                                    f"served model's {old_arch}")
        diffs = [f"{f}: {getattr(self.config, f, None)!r} -> {getattr(new, f, None)!r}"
                 for f in SHAPE_FIELDS if getattr(self.config, f, None) != getattr(new, f, None)]
        if head_dim_of(self.config) != head_dim_of(new):
            diffs.append(f"head_dim: {head_dim_of(self.config)} -> {head_dim_of(new)}")
        types = set(getattr(self.config, "layer_types", None) or ["full_attention"])
        if any(rope_parameters(self.config, t) != rope_parameters(new, t) for t in types):
            diffs.append("rope parameters differ")
        if self._decoder_differs(new):
            diffs.append("the decoder differs (windows, softcaps, norms, activation or biases)")
        if diffs:
            raise WeightUpdateError("the checkpoint's config does not match the served model ("
                                    + "; ".join(diffs) + "): restart the server to change "
                                    "the architecture")

    def _decoder_differs(self, new: Any) -> bool:
        """Whether `new` describes another computation than the served model's spec
        (for models built from one, `models/decoder.py`), at the served context."""
        spec_of = getattr(type(self.model), "decoder_spec", None)
        served = getattr(self.model, "spec", None)
        if spec_of is None or served is None:
            return False
        new = copy.copy(new)
        new.max_position_embeddings = self.config.max_position_embeddings
        try:
            return spec_of(new) != served
        except ValueError:
            return True

    def _check_checkpoint(self, header: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Names, dtypes and shapes from the safetensors headers, and completeness."""
        covered: dict[str, set[str | int | None]] = {}
        for name, (dtype, shape) in header.items():
            if self.weight_map.is_skipped(name):
                continue
            slot = self.weight_map.resolve(name)
            if slot is None:
                raise WeightUpdateError(self.weight_map.no_place(name))
            self._check_dtype(slot, dtype)
            self._check_shape(slot, shape)
            if not slot.alias:
                covered.setdefault(slot.param_name, set()).add(slot.shard_id)
        missing = self.weight_map.missing(covered)
        if missing:
            raise WeightUpdateError(f"the checkpoint {missing_message(missing)}")

    @staticmethod
    def _check_dtype(slot: WeightSlot, dtype: torch.dtype | str) -> None:
        try:
            slot.check_dtype(dtype)
        except ValueError as e:
            raise WeightUpdateError(str(e)) from None

    @staticmethod
    def _check_shape(slot: WeightSlot, shape: tuple[int, ...]) -> None:
        expected = slot.hf_shape()
        if tuple(shape) != expected:
            raise WeightUpdateError(f"tensor {slot.name} has shape {list(shape)}, the model "
                                    f"expects {list(expected)}")

    # ---- from tensors ---------------------------------------------------------------
    def update_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load whole HF-named tensors (a partial update is fine). Raises
        WeightUpdateError (weights unchanged) for a bad name, dtype or shape."""
        if not named_tensors:
            raise WeightUpdateError("no tensors to load")
        for name, tensor in named_tensors:
            slot = self._target(name)
            self._check_dtype(slot, tensor.dtype)
            self._check_shape(slot, tuple(tensor.shape))
        self._load(named_tensors)

    # ---- from a trainer over torch.distributed ------------------------------------------
    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str = WEIGHT_UPDATE_GROUP,
                   backend: str | None = None, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        """Join the trainer's weight-sync group as rank `rank_offset + tp_rank` (the
        trainer is rank 0). A group of its own, never the default process group
        (tensor parallelism uses that one). Blocks until every rank has joined."""
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if group_name in self.groups:
            raise WeightUpdateError(f"weight update group {group_name!r} already exists")
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"backend={backend!r}: expected 'gloo' or 'nccl'")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError("backend 'nccl' needs the model on a CUDA device; use gloo")
        rank = rank_offset + tp.get_tp_rank()
        if not 0 < rank < world_size:
            raise WeightUpdateError(f"rank {rank} (rank_offset {rank_offset}) is outside "
                                    f"[1, world_size={world_size}): rank 0 is the trainer")
        try:
            self.groups[group_name] = new_weight_sync_group(
                master_address, master_port, rank, world_size, group_name, backend, timeout_s)
        except Exception as e:  # unreachable trainer, timeout, ...
            raise WeightUpdateError(f"could not join weight update group {group_name!r} at "
                                    f"{master_address}:{master_port}: {e}") from None

    def destroy_group(self, group_name: str = WEIGHT_UPDATE_GROUP) -> None:
        if self.groups.pop(group_name, None) is None:
            raise WeightUpdateError(f"no weight update group named {group_name!r}")

    def update_from_distributed(self, names: list[str], dtypes: list[Any],
                                shapes: list[list[int]],
                                group_name: str = WEIGHT_UPDATE_GROUP) -> None:
        """Receive each tensor by broadcast from the trainer (rank 0), in order, then
        load them all. Bad names, dtypes or shapes are refused before receiving
        anything, so the trainer must not broadcast when the call fails."""
        group = self.groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"no weight update group named {group_name!r}: call "
                                    "init_weights_update_group first")
        specs = self._distributed_specs(names, dtypes, shapes)
        device = self.device if group.backend == "nccl" else torch.device("cpu")
        received = []
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            group.broadcast(tensor)
            received.append((name, tensor))
        self._load(received)

    def _distributed_specs(self, names: Any, dtypes: Any,
                           shapes: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        if not isinstance(names, list) or not names:
            raise WeightUpdateError("names must be a non-empty list of parameter names")
        if not (isinstance(dtypes, list) and isinstance(shapes, list)
                and len(dtypes) == len(names) == len(shapes)):
            raise WeightUpdateError(f"names, dtypes and shapes must be lists of equal length "
                                    f"(got {len(names)} names)")
        specs = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            slot = self._target(name)
            if not (isinstance(shape, (list, tuple))
                    and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise WeightUpdateError(f"shape of {name} must be a list of non-negative "
                                        f"integers, got {shape!r}")
            self._check_shape(slot, tuple(shape))
            torch_dtype = parse_dtype(dtype)
            self._check_dtype(slot, torch_dtype)
            specs.append((name, torch_dtype, tuple(shape)))
        return specs

    # ---- loading with rollback ----------------------------------------------------------
    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load in place; on a failure here or on any other tensor-parallel rank,
        restore every parameter touched, so the ranks never hold different models.
        Either way the layers' methods then derive from the weights as they are."""
        backup = _Backup()
        error = None
        derived = derived_addresses(self.model)
        try:
            self.weight_map.load(self._saving(weights, backup))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # copies done before anyone reads them
        ok = _all_ranks_agree(error is None)
        if not ok:
            backup.restore()
        process_weights_after_loading(self.model)
        if self.on_derived_moved is not None and derived_addresses(self.model) != derived:
            self.on_derived_moved()
        if ok:
            return
        logger.error("weight update failed while loading (%s); restored %d parameter(s)",
                     error or "on another rank", len(backup))
        raise WeightUpdateError(f"loading failed ({error or 'on another tensor-parallel rank'}); "
                                "the previous weights were restored")

    def _saving(self, weights: Iterable[tuple[str, torch.Tensor]],
                backup: _Backup) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            slot = self.weight_map.resolve(name)
            if slot is not None:
                backup.save(slot.param)
            yield name, tensor


def _all_ranks_agree(ok: bool) -> bool:
    """True when `ok` holds on every tensor-parallel rank (each rank must call this)."""
    sync = tp.get_tp_sync()
    return ok if sync is None else bool(sync.min_int(int(ok)))


class _Backup:
    """CPU copies of parameters, taken just before their first write."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.saved)

    def save(self, param: nn.Parameter) -> None:
        if id(param) not in self.saved:
            self.saved[id(param)] = (param, param.detach().to("cpu", copy=True))

    def restore(self) -> None:
        with torch.no_grad():
            for param, copy in self.saved.values():
                param.data.copy_(copy)


def _checkpoint_header(model_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) from the shards' headers, reading no data."""
    from safetensors import safe_open

    from radixlm.models.loader import safetensors_files

    files = safetensors_files(model_dir)
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {model_dir}")
    header = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open objects are not mappings)
                piece = handle.get_slice(name)
                header[name] = (piece.get_dtype(), tuple(piece.get_shape()))
    return header


# ---- the weight-sync process group ------------------------------------------------------
@dataclass
class WeightSyncGroup:
    """A process group of the trainer (rank 0) and the inference ranks."""

    pg: Any  # a ProcessGroupGloo / ProcessGroupNCCL, driven directly
    store: Any  # the TCP store: it must outlive the group
    backend: str
    rank: int

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From rank 0 into `tensor` on every other rank (rank 0: sends it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()


def new_weight_sync_group(master_address: str, master_port: int, rank: int, world_size: int,
                          group_name: str = WEIGHT_UPDATE_GROUP, backend: str = "gloo",
                          timeout_s: float = GROUP_TIMEOUT_S) -> WeightSyncGroup:
    """Join (rank > 0) or host (rank 0: the trainer, which runs the TCP store) a
    weight-sync group. It is built straight from a store, so it neither is nor
    needs the default process group. Trainers call this too, with rank 0, so
    both sides agree on the store layout, then `group.broadcast(tensor)` for
    each tensor named in an update_weights_from_distributed call."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout)
    prefixed = dist.PrefixStore(f"radixlm-weights/{group_name}", store)
    if backend == "nccl":
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return WeightSyncGroup(pg, store, backend, rank)
