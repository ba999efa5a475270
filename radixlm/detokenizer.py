"""Token ids to text, incrementally, and stop strings over the growing text.

Incremental decoding keeps two offsets into the ids: `prefix_offset` starts a
small window of already-emitted context tokens and `read_offset` marks where
unemitted tokens begin. Each step decodes only the window, twice (context
alone, context + new), and emits the difference, so a token costs O(window)
whatever the length so far. The context matters for tokenizers whose decoding
of a token depends on its neighbour (SentencePiece drops the leading space of
a sequence's first piece).

A multi-byte character may span tokens: while the decoded window ends in
U+FFFD (the replacement for an incomplete UTF-8 sequence), nothing is emitted
and the offsets stay put, so a stream never shows half a character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """One per request. After `flush()`, the concatenation of everything `add`
    and `flush` returned equals `tokenizer.decode(output_ids, ...)` for
    byte-level tokenizers (and for others, up to their context effects).

    `prompt_ids_tail`: the last few prompt tokens, decoding context only (their
    text is not emitted); it must end on a character boundary, as any tokenized
    text does.
    """

    def __init__(self, tokenizer: Any, prompt_ids_tail: list[int] | None = None,
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs = {"skip_special_tokens": skip_special_tokens,
                               "spaces_between_special_tokens": spaces_between_special_tokens}
        self._ids: list[int] = list(prompt_ids_tail or [])
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset]
        self._chunks: list[str] = []

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens added whose text is held back (an incomplete character)."""
        return len(self._ids) - self._read_offset

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (maybe "")."""
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end: emit what is held back, incomplete character included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if window_text.endswith(_INCOMPLETE) and not final:
            return ""
        # The window starts at a character boundary, so its text extends the
        # context's text; slicing by length also tolerates decoders that don't.
        new_text = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        self._chunks.append(new_text)
        return new_text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], **self._decode_kwargs)


# ---- stop strings ----------------------------------------------------------
def find_stop(text: str, stops: Sequence[str], search_from: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text` as (position, stop), or None.

    `search_from`: how much of `text` was already searched without a match;
    matches that begin before it but end after it are still found. At equal
    positions the longest stop wins.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, max(0, search_from - len(stop) + 1))
        if pos != -1 and (best is None or (pos, -len(stop)) < (best[0], -len(best[1]))):
            best = (pos, stop)
    return best


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop
    string: it could still grow into a stop, so a stream must hold it back."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def trim_at_stop(text: str, match: tuple[int, str], no_stop_trim: bool = False) -> str:
    """The output text when `match` (from find_stop) ends generation: up to the
    stop string, or through it with no_stop_trim."""
    pos, stop = match
    return text[:pos + len(stop)] if no_stop_trim else text[:pos]


class StopStringStream:
    """Streams text while watching for stop strings; never emits text that a
    later stop match would trim away.

    Feed it each newly decoded piece; it returns what may be shown now. Once a
    stop matches, `stopped` is set and `text` is the final (trimmed) output.
    """

    def __init__(self, stops: Sequence[str], no_stop_trim: bool = False) -> None:
        self.stops = list(stops)
        self.no_stop_trim = no_stop_trim
        self.text = ""  # everything fed (trimmed once stopped)
        self.stopped = False
        self._emitted = 0  # chars of self.text already returned
        self._searched = 0  # chars of self.text already searched for stops

    def feed(self, new_text: str) -> str:
        assert not self.stopped, "feed after a stop string matched"
        self.text += new_text
        match = find_stop(self.text, self.stops, self._searched)
        self._searched = len(self.text)
        if match is not None:
            self.text = trim_at_stop(self.text, match, self.no_stop_trim)
            self.stopped = True
            return self._emit_to(len(self.text))
        return self._emit_to(len(self.text) - stop_prefix_len(self.text, self.stops))

    def flush(self) -> str:
        """At the end (no stop matched): the held-back tail."""
        return self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> str:
        out = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out
