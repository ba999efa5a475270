"""What a program appends to its state: plain text, `gen`, `select`, roles.

`s += expr` accepts a str, one of these expressions, or a list/tuple of them.
The expressions are inert descriptions; `interpreter.py` executes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# gen()'s keyword -> the sampling parameter it sets (SGLang's gen() names).
_GEN_PARAMS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
               "stop": "stop", "stop_token_ids": "stop_token_ids",
               "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
               "min_p": "min_p", "frequency_penalty": "frequency_penalty",
               "presence_penalty": "presence_penalty", "ignore_eos": "ignore_eos",
               "seed": "seed", "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf"}


@dataclass(frozen=True)
class Gen:
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)  # sampling params, set ones only


@dataclass(frozen=True)
class Select:
    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True)
class Role:
    role: str
    body: Expr | None  # None: only the role's begin or end marker
    marker: str = "both"  # "both", "begin" or "end"


Expr = str | Gen | Select | Role | list | tuple


def gen(name: str | None = None, max_tokens: int | None = None, *, stop: str | list[str] |
        None = None, temperature: float | None = None, choices: list[str] | None = None,
        json_schema: str | dict[str, Any] | None = None, **kwargs: Any) -> Gen | Select:
    """Generate text into variable `name`. Unset parameters take the run's defaults.
    `choices=[...]` makes it a `select`; `regex`, `json_schema` or `ebnf` constrain it."""
    if choices is not None:
        return select(name, choices)
    unknown = sorted(set(kwargs) - set(_GEN_PARAMS))
    if unknown:
        raise TypeError(f"gen() got unknown parameter(s): {', '.join(unknown)}")
    given = {"max_tokens": max_tokens, "stop": stop, "temperature": temperature,
             "json_schema": json.dumps(json_schema) if isinstance(json_schema, dict)
             else json_schema, **kwargs}
    return Gen(name, {_GEN_PARAMS[k]: v for k, v in given.items() if v is not None})


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Append the choice the model finds most likely (mean token logprob)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select() needs choices: a non-empty list of non-empty strings")
    return Select(name, tuple(choices))


def system(body: Expr | None = None) -> Role:
    return Role("system", body)


def user(body: Expr | None = None) -> Role:
    return Role("user", body)


def assistant(body: Expr | None = None) -> Role:
    return Role("assistant", body)


def role_begin(role: str) -> Role:
    return Role(role, None, "begin")


def role_end(role: str) -> Role:
    return Role(role, None, "end")
