"""Helpers shared by the weight-update tests (Engine and HTTP): a perturbed copy
of the embedded model as a second checkpoint, HF greedy references, broken
checkpoints, and a trainer process for update_weights_from_distributed."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path
from typing import Any

import torch

# HF tensors the second checkpoint changes: a plain norm, row-parallel weights and
# parts of both fused parameters (q of qkv, up of gate_up).
PERTURBED = ["model.norm.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.up_proj.weight"]
GROUP = "test_weight_sync"


def perturb(model: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """Change the PERTURBED tensors of an HF model in place; returns their new values."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    out = {}
    with torch.no_grad():
        for name in PERTURBED:
            p = params[name]
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.mul_(1 + 0.3 * noise)
            else:
                p.add_(0.5 * p.std() * noise)
            out[name] = p.detach().clone()
    return out


def same_prefix(ours: list[list[int]], ref: list[list[int]]) -> bool:
    """Our greedy tokens equal HF's up to our length (we stop at EOS; HF pads)."""
    return all(o == r[:len(o)] and len(o) > 0 for o, r in zip(ours, ref, strict=True))


# ---- broken checkpoints --------------------------------------------------------------------
def checkpoint_with(model_dir: str, out: Path, change: Any) -> Path:
    """A copy of `model_dir` whose tensors pass through `change(dict)` first."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    change(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    return out


def other_config_checkpoint(out: Path) -> Path:
    """A (random) Llama of a different size: hidden 64, 2 layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def renamed_architecture(model_dir: str, out: Path, arch: str) -> Path:
    out.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.is_file():
            (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["architectures"] = [arch]
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---- a trainer for update_weights_from_distributed --------------------------------------------
def _trainer_main(port: int, tensors_file: str, commands: Any, replies: Any) -> None:
    """Rank 0 of the weight-sync group: hosts the store, then broadcasts the tensors
    of `tensors_file` (safetensors) in file order each time it is told to."""
    from safetensors.torch import load_file

    from radixlm.runtime.weight_updater import new_weight_sync_group

    tensors = load_file(tensors_file)
    group = new_weight_sync_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=120)
    replies.put("joined")
    while (cmd := commands.get()) != "exit":
        for name in cmd:
            group.broadcast(tensors[name])
        replies.put("sent")


class Trainer:
    """A spawned trainer process; `send(names)` broadcasts those tensors."""

    def __init__(self, port: int, tensors: dict[str, torch.Tensor], tmp: Path) -> None:
        from safetensors.torch import save_file

        self.file = tmp / "trainer_tensors.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, self.file)
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_trainer_main,
                                args=(port, str(self.file), self.commands, self.replies),
                                daemon=True)
        self.proc.start()

    def send(self, names: list[str]) -> None:
        self.commands.put(list(names))

    def wait(self, what: str, timeout: float = 120.0) -> None:
        assert self.replies.get(timeout=timeout) == what

    def close(self) -> None:
        self.commands.put("exit")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
