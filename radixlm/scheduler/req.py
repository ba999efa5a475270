"""A request as the scheduler sees it: token ids, KV ownership, progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.sampling_params import SamplingParams


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: also return logprobs of prompt tokens from here on
    eos_token_ids: frozenset[int] = frozenset()
    stop_str_max_len: int = 0
    # Prefix-cache namespace (cache/base.py): equal tokens share KV only within one.
    namespace: int = 0
    priority: int = 0  # higher first, under --enable-priority-scheduling
    # The prompt as embeddings [prompt len, hidden] (CPU) instead of token ids; its
    # `origin_input_ids` are placeholders then, and it never shares KV.
    input_embeds: torch.Tensor | None = None

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None

    # KV ownership. Tokens fill_ids[:kv_len] have KV at req_to_token[req_pool_idx, :kv_len].
    # The first len(prefix_indices) of those slots belong to the prefix cache (locked via
    # last_node); the rest were allocated for this request and are freed or handed to the
    # cache when it finishes or is retracted.
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    slots: list[int] = field(default_factory=list)  # host mirror of the table row [:kv_len]

    # Progress of the current prefill round.
    extend_input_len: int = 0
    is_chunked: bool = False  # the prompt is only partly prefilled
    cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    num_retractions: int = 0
    # Speculative decoding: verify steps that checked drafts for it, drafts it kept.
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0

    # What was already reported to the caller.
    sent_output_len: int = 0
    output_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    sent_logprob_len: int = 0
    input_logprobs_sent: bool = False
    input_logprobs_done: bool = False  # recorded once; a retracted request skips them

    # Constrained decoding: the request's GrammarMatcher, which has accepted exactly
    # output_ids (so it survives retraction unchanged); None without a grammar.
    grammar: Any = None

    # Embedding requests (--is-embedding, prefill only): `hidden_sum` accumulates the
    # prompt's hidden rows across chunks for mean pooling; `embedding` is the result.
    hidden_sum: torch.Tensor | None = None
    embedding: list[float] | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV must exist before the next token can be produced."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def kv_behind(self) -> int:
        """Tokens before the newest whose KV is not computed yet: 0 in steady
        decoding; more when a step accepted several tokens without their KV."""
        return self.seq_len - 1 - self.kv_len

    @property
    def shares_kv(self) -> bool:
        """Whether its KV may go into the prefix cache: not for a prompt given as
        embeddings (its token ids are placeholders)."""
        return self.input_embeds is None

    @property
    def own_kv_len(self) -> int:
        """KV slots this request allocated itself (not shared with the prefix cache)."""
        return self.kv_len - len(self.prefix_indices)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def needs_host_tokens(self) -> bool:
        """Sampling its next token needs its previous one on the host first."""
        p = self.sampling_params
        return (self.grammar is not None or p.frequency_penalty != 0
                or p.presence_penalty != 0 or p.repetition_penalty != 1
                or len(self.output_ids) < p.min_new_tokens)

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and \
            not self.input_logprobs_done

    @property
    def first_logprob_row(self) -> int:
        """Position whose logits give the first requested prompt-token logprob."""
        return max(self.logprob_start_len - 1, 0)

    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids))

    def check_finished(self, tokenizer: Any) -> None:
        """Set finished_reason after a new token was appended: stop tokens, then stop
        strings, then the length limit. A stop that lands on the last allowed token
        is still a stop (the model finished: OpenAI and vLLM say "stop" there)."""
        if self.finished:
            return
        params = self.sampling_params
        last = self.output_ids[-1]
        if len(self.output_ids) > params.min_new_tokens:  # the sampler masked stops before
            if last in params.stop_token_ids or (
                    not params.ignore_eos and last in self.eos_token_ids):
                self.finished_reason = {"type": "stop", "matched": last}
                return
            if params.stop and tokenizer is not None:
                self._check_stop_strings(tokenizer)
                if self.finished:
                    return
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = {"type": "length", "length": params.max_new_tokens}

    def _check_stop_strings(self, tokenizer: Any) -> None:
        # A stop string of c characters spans at most c tokens; one more token covers
        # a match that straddles the newest token's boundary.
        tail_ids = self.output_ids[-(self.stop_str_max_len + 1):]
        tail = tokenizer.decode(tail_ids, skip_special_tokens=False)
        for stop in self.sampling_params.stop:
            if stop in tail:
                self.finished_reason = {"type": "stop", "matched": stop}
                return

    def abort(self, message: str = "aborted") -> None:
        if not self.finished:
            self.finished_reason = {"type": "abort", "message": message}
