"""Token ids -> text for many requests at once (the DetokenizerManager's core).

Keeps one incremental detokenizer per live request. With stop strings, text
that could be the beginning of one is held back until it is known not to be,
so a stream never shows text that the final answer trims; a matched stop
string is cut from the end (unless `no_stop_trim`). State is dropped when a
request's last message goes through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.detokenizer import IncrementalDetokenizer
from radixlm.protocol import StrOut, TokenOut

MAX_LIVE_STATES = 1 << 16  # bound on per-request state; a leak would hit this and raise


@dataclass
class _State:
    detok: IncrementalDetokenizer
    held: str = ""  # decoded but not yet sent (may start a stop string)


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def process(self, outs: list[TokenOut]) -> list[StrOut]:
        return [self.process_one(o) for o in outs]

    def process_one(self, out: TokenOut) -> StrOut:
        if self.tokenizer is None or out.embedding is not None:  # ids only, or no text at all
            return StrOut(token=out, new_text="")
        state = self.states.get(out.rid) or self._new_state(out)
        text = state.held + state.detok.add(out.new_token_ids)
        if out.finish_reason is None:
            keep = _stop_prefix_len(text, out.stop)
            state.held = text[len(text) - keep:] if keep else ""
            return StrOut(token=out, new_text=text[:len(text) - keep])
        text += state.detok.flush()
        del self.states[out.rid]
        matched = out.finish_reason.get("matched")
        if isinstance(matched, str) and not out.no_stop_trim:
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        return StrOut(token=out, new_text=text)

    def _new_state(self, out: TokenOut) -> _State:
        if len(self.states) >= MAX_LIVE_STATES:
            raise RuntimeError("too many live detokenizer states: requests are leaking")
        state = _State(IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=out.skip_special_tokens,
            spaces_between_special_tokens=out.spaces_between_special_tokens))
        self.states[out.rid] = state
        return state

    def abort(self, rid: str) -> None:
        self.states.pop(rid, None)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a prefix of a stop string
    (or contains one whole: the finish message is then about to arrive)."""
    best = 0
    for stop in stops:
        pos = text.find(stop)
        if pos >= 0:
            best = max(best, len(text) - pos)
            continue
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
