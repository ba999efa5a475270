"""Constrained decoding: grammars (JSON schema, regex, EBNF) that mask the logits.

`spec` holds what a request's grammar is and the checks that need no compiler
(front ends use it), `base` the backend seam, `xgrammar_backend` its
implementation, and `manager` the scheduler's side (compile queue, masking,
matcher updates).

Importing the package loads `spec` only: the seam and the manager need torch
(and the manager the scheduler's request type), which the HTTP server's API
process never loads; they are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixlm.constrained.spec import GRAMMAR_KINDS, grammar_spec, precheck

_LAZY = {"GrammarBackend": "base", "GrammarMatcher": "base", "GrammarManager": "manager",
         "create_grammar_manager": "manager"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["GRAMMAR_KINDS", "GrammarBackend", "GrammarManager", "GrammarMatcher",
           "create_grammar_manager", "grammar_spec", "precheck"]
