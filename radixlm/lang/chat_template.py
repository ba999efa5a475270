"""Role markers: the text a chat template puts before and after one message.

A program's text grows one piece at a time (`s += user("hi")`), so roles are
rendered as prefix + content + suffix. The markers are read off the model's
own (Jinja) chat template by rendering a conversation of sentinel contents
and cutting the output at the sentinels; a model without a usable template
gets plain "Role: content" lines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
_S1, _U1, _A1, _U2, _A2 = (f"\x00RADIXLM{i}\x00" for i in range(5))


@dataclass(frozen=True)
class ChatTemplate:
    prefixes: dict[str, str]
    suffixes: dict[str, str]
    name: str = "custom"

    def prefix(self, role: str) -> str:
        return self.prefixes[role]

    def suffix(self, role: str) -> str:
        return self.suffixes[role]


PLAIN = ChatTemplate(prefixes={r: f"{r.capitalize()}: " for r in ROLES},
                     suffixes={r: "\n" for r in ROLES}, name="plain")


def from_tokenizer(tokenizer: Any) -> ChatTemplate:
    """Markers of the tokenizer's chat template (PLAIN if it has none that works)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return PLAIN
    try:
        return _derive(lambda msgs, gen: tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen), tokenizer)
    except Exception as e:  # templates may refuse roles or orders; fall back, loudly
        logger.warning("could not read role markers off the chat template (%s); "
                       "using plain 'Role: ' lines", e)
        return PLAIN


def _derive(render: Any, tokenizer: Any) -> ChatTemplate:
    convo = [{"role": "system", "content": _S1}, {"role": "user", "content": _U1},
             {"role": "assistant", "content": _A1}, {"role": "user", "content": _U2},
             {"role": "assistant", "content": _A2}]
    full = render(convo, False)
    asked = render(convo[:2], True)
    assistant_prefix = _after(asked, render(convo[:2], False))
    cuts = [full.index(s) for s in (_S1, _U1, _A1, _U2, _A2)]
    between = [full[cuts[i] + len(_S1):cuts[i + 1]] for i in range(4)]
    assistant_suffix = full[cuts[4] + len(_A2):]
    user_prefix = _strip_start(between[2], assistant_suffix)
    system_prefix = full[:cuts[0]]
    bos = getattr(tokenizer, "bos_token", None)
    if bos and system_prefix.startswith(bos) and _adds_bos(tokenizer):
        system_prefix = system_prefix[len(bos):]  # encoding the text adds it again
    return ChatTemplate(
        prefixes={"system": system_prefix, "user": user_prefix,
                  "assistant": assistant_prefix},
        suffixes={"system": _strip_end(between[0], user_prefix),
                  "user": _strip_end(between[1], assistant_prefix),
                  "assistant": assistant_suffix},
        name=getattr(tokenizer, "name_or_path", "hf"))


def _adds_bos(tokenizer: Any) -> bool:
    with_special = tokenizer.encode("a")
    return len(with_special) > len(tokenizer.encode("a", add_special_tokens=False)) and \
        with_special[0] == tokenizer.bos_token_id


def _after(longer: str, shorter: str) -> str:
    if not longer.startswith(shorter):
        raise ValueError("the generation prompt does not extend the conversation")
    return longer[len(shorter):]


def _strip_start(text: str, head: str) -> str:
    if not text.startswith(head):
        raise ValueError(f"expected {head!r} at the start of {text!r}")
    return text[len(head):]


def _strip_end(text: str, tail: str) -> str:
    if not text.endswith(tail):
        raise ValueError(f"expected {tail!r} at the end of {text!r}")
    return text[:len(text) - len(tail)]
