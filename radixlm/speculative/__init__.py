"""Speculative decoding: drafters behind the scheduler's `Drafter` seam.

    --speculative-algorithm   module          drafts from
    NGRAM                     ngram.py        the request's own text (no model)
    STANDALONE                standalone.py   a smaller model, same tokenizer
    EAGLE, EAGLE3             eagle.py        a draft head over the target's states

The target verifies a chain of k drafts per request in one forward
(`ForwardMode.VERIFY`); drafts only change how many forwards a request takes:
greedy outputs are the target's token for token, sampled ones (drafts drawn
from a draft model's distribution: `rejection.py`) have the target's
distribution.

Tree drafts (`--speculative-eagle-topk` > 1, `tree.py`): NGRAM merges several
continuations, the model drafters (STANDALONE, EAGLE, EAGLE3) add each draft
step's next best tokens beside their chain (up to
`--speculative-num-draft-tokens` - 1 nodes by cumulative draft probability).
The verify forward attends each node to the request's KV and its own
ancestors (every backend with `supports_tree_mask`: cpu, torch_native and
triton, whose CUDA graphs replay tree verifies through spare path rows of the
request table), the longest path whose drafts equal the target's tokens is kept
and its slots become the request's next positions; tree drafts are chosen
without sampling and kept by equality, so outputs are the plain run's, greedy
or seeded. Refused: trees under tensor parallelism or on a backend without
tree attention, and DeepSeek's NextN/MTP heads (no MLA model yet).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixlm.config import ServerArgs

if TYPE_CHECKING:
    from radixlm.runtime.model_runner import ModelRunner
    from radixlm.scheduler.drafter import Drafter

# Algorithm -> "module:class"; each class has `create(args, target, target_dir,
# gpu_id, max_verify_tokens)`.
DRAFTERS = {
    "NGRAM": "radixlm.speculative.ngram:NgramDrafter",
    "STANDALONE": "radixlm.speculative.standalone:StandaloneDrafter",
    "EAGLE": "radixlm.speculative.eagle:EagleDrafter",
    "EAGLE3": "radixlm.speculative.eagle:Eagle3Drafter",
}

# Verify rows per forward beyond which speculation shortens (see
# `scheduler.drafter.drafts_within`): about where a forward of the device stops
# costing the same for more rows (BENCHMARKS.md, "Speculative decoding").
DEFAULT_MAX_VERIFY_TOKENS = {"cpu": 16, "cuda": 256}


def check_target(config: Any) -> None:
    """ValueError for a draft head's checkpoint given as the model to serve."""
    from radixlm.models.registry import get_model_class

    if getattr(get_model_class(config), "draft_only", False):
        raise ValueError(f"{config.architectures[0]} is a draft head: serve its target model "
                         "with --speculative-draft-model-path pointing at the head")


def create_drafter(args: ServerArgs, target: ModelRunner, target_dir: str,
                   gpu_id: int | None = None) -> Drafter | None:
    """The drafter `args` asks for (None without --speculative-algorithm), built
    on the target's runner (model drafters load their model here)."""
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if args.tp_size > 1 and algo != "NGRAM":
        raise ValueError(f"speculative_algorithm={algo} with tp_size={args.tp_size}: a draft "
                         "model under tensor parallelism is not supported yet (NGRAM is)")
    budget = args.speculative_max_verify_tokens
    if budget is None:
        budget = DEFAULT_MAX_VERIFY_TOKENS.get(target.device.type, 0)
    module, name = DRAFTERS[algo].split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls.create(args, target, target_dir, gpu_id, budget)
