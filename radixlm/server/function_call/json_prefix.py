"""The longest valid prefix of one JSON value, read incrementally.

Tool-call parsers stream a call's arguments as the model writes them; this
decides how much of the text is still JSON (so what a client receives is
always a prefix of a valid document) and where the value ends (so the
parser knows where the text after it begins).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
# What a number may look like before it ends ("1.", "2e-" are on their way).
_NUMBER_PREFIX = re.compile(r"-|-?(0|[1-9]\d*)(\.\d*)?([eE][+-]?\d*)?")
_NUMBER_CHARS = frozenset("-+0123456789.eE")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_WS = frozenset(" \t\r\n")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')  # string content up to a quote, escape or control


class JsonPrefix:
    """Feed text; `feed` returns how many of its characters belong to the value.
    It stops early when the value ends (`done`) or at a character that no JSON
    value could continue with (`failed`); both are final."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers: "{" or "["
        # What comes next: value, first_value ("[" just opened), key, first_key,
        # colon, after_value, string, escape, unicode, number, literal
        self.state = "value"
        self.key = False  # the open string is an object key
        self.pending = ""  # the open number's characters, or a literal's remaining ones
        self.hex_left = 0
        self.done = False
        self.failed = False

    def feed(self, text: str) -> int:
        if self.done or self.failed:
            return 0
        i, n = 0, len(text)
        while i < n:
            if self.state == "string":
                # Most of a call's arguments is string content: skip it in C.
                i = _PLAIN.match(text, i).end()  # type: ignore[union-attr]
                if i == n:
                    break
            c = text[i]
            if self.state == "number" and c not in _NUMBER_CHARS:
                if not _NUMBER.fullmatch(self.pending):
                    self.failed = True
                    return i
                self._value_ended()
                if self.done:  # a top-level number ends before the delimiter
                    return i
            if not self._step(c):
                self.failed = True
                return i
            i += 1
            if self.done:
                return i
        return n

    def finish(self) -> None:
        """The text ended: a top-level number ends with it."""
        if self.state == "number" and not self.stack and _NUMBER.fullmatch(self.pending):
            self.done = True

    # ---- one character --------------------------------------------------------------
    def _step(self, c: str) -> bool:
        s = self.state
        if s == "string":
            return self._in_string(c)
        if s == "escape":
            if c not in _ESCAPES:
                return False
            if c == "u":
                self.state, self.hex_left = "unicode", 4
            else:
                self.state = "string"
            return True
        if s == "unicode":
            if c not in _HEX:
                return False
            self.hex_left -= 1
            if self.hex_left == 0:
                self.state = "string"
            return True
        if s == "literal":
            if c != self.pending[0]:
                return False
            self.pending = self.pending[1:]
            if not self.pending:
                self._value_ended()
            return True
        if s == "number":
            self.pending += c
            return _NUMBER_PREFIX.fullmatch(self.pending) is not None
        if c in _WS:
            return True
        return self._token(c)

    def _in_string(self, c: str) -> bool:
        if c == "\\":
            self.state = "escape"
        elif c == '"':
            if self.key:
                self.key, self.state = False, "colon"
            else:
                self._value_ended()
        elif ord(c) < 0x20:
            return False
        return True

    def _token(self, c: str) -> bool:
        s = self.state
        if s in ("key", "first_key"):
            if c == '"':
                self.state, self.key = "string", True
                return True
            return s == "first_key" and c == "}" and self._close("{")
        if s == "colon":
            if c == ":":
                self.state = "value"
                return True
            return False
        if s == "after_value":
            if c == ",":
                self.state = "key" if self.stack[-1] == "{" else "value"
                return True
            return c in "}]" and self._close("{" if c == "}" else "[")
        if s == "first_value" and c == "]":
            return self._close("[")
        return self._value_start(c)

    def _value_start(self, c: str) -> bool:
        if c == "{":
            self.stack.append("{")
            self.state = "first_key"
        elif c == "[":
            self.stack.append("[")
            self.state = "first_value"
        elif c == '"':
            self.state = "string"
        elif c in _LITERALS:
            self.state, self.pending = "literal", _LITERALS[c][1:]
        elif c == "-" or c.isdigit():
            self.state, self.pending = "number", c
        else:
            return False
        return True

    def _close(self, opener: str) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack.pop()
        self._value_ended()
        return True

    def _value_ended(self) -> None:
        self.pending = ""
        if self.stack:
            self.state = "after_value"
        else:
            self.done = True


def json_value_end(text: str) -> int | None:
    """Where the JSON value at the start of `text` (after whitespace) ends, or
    None when it is not complete (yet) or not valid."""
    p = JsonPrefix()
    n = p.feed(text)
    return n if p.done else None
