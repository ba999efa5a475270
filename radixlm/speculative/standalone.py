"""STANDALONE drafting: a smaller model with the target's tokenizer drafts k tokens
greedily (or, for sampling requests, by sampling) one decode step at a time.

The draft model runs in its own `ModelRunner` (its weights, attention backend,
CUDA graphs) over its own KV pool at the target's slots (`model_drafter.py`).
It takes the target's runtime settings (dtype, quantization, attention
backend) and context length; a draft whose vocabulary or tokenizer differs
from the target's is refused at start-up.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from radixlm.config import ServerArgs
from radixlm.runtime.model_runner import ModelRunner
from radixlm.speculative.model_drafter import ModelDrafter

logger = logging.getLogger(__name__)


class StandaloneDrafter(ModelDrafter):
    shift = 0

    @classmethod
    def create(cls, args: ServerArgs, target: ModelRunner, target_dir: str,
               gpu_id: int | None, max_verify_tokens: int) -> StandaloneDrafter:
        from radixlm.models.loader import load_config, prepare_model_dir

        draft_dir = prepare_model_dir(args.speculative_draft_model_path, args.load_format)
        config = load_config(draft_dir, target.context_len)
        check_same_vocabulary(target, target_dir, config, draft_dir)
        runner = ModelRunner(draft_args(args, draft_dir, target), draft_dir, config, gpu_id)
        return cls(args, target, runner, max_verify_tokens)


def draft_args(args: ServerArgs, draft_dir: str, target: ModelRunner) -> ServerArgs:
    """The draft runner's settings: the target's, with the draft's weights and the
    target's context length (the request table is shared)."""
    return args.replace(model_path=draft_dir, context_length=target.context_len)


def check_same_vocabulary(target: ModelRunner, target_dir: str, config: Any,
                          draft_dir: str) -> None:
    """ValueError unless the draft model speaks the target's token ids: the same
    vocabulary size and, where both directories have a tokenizer, the same one."""
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_draft_model_path: the draft's vocab_size is "
                         f"{config.vocab_size}, the target's {target.vocab_size}; a draft "
                         "model must share the target's tokenizer")
    if Path(draft_dir).resolve() == Path(target_dir).resolve():
        return
    from radixlm.tokenizer import get_tokenizer

    try:
        ours, theirs = get_tokenizer(target_dir), get_tokenizer(draft_dir)
    except (OSError, ValueError) as e:
        logger.warning("could not compare the draft's tokenizer with the target's (%s); "
                       "their vocabulary sizes agree", e)
        return
    if ours.get_vocab() != theirs.get_vocab():
        raise ValueError("speculative_draft_model_path: the draft model's tokenizer differs "
                         "from the target's (other token ids); a draft model must share it")
