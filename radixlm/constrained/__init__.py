"""Constrained decoding: grammars (JSON schema, regex, EBNF) that mask the logits.

`base` holds the backend seam, `xgrammar_backend` its implementation, and
`manager` the scheduler's side (compile queue, masking, matcher updates).
"""

from __future__ import annotations

from radixlm.constrained.base import (
    GRAMMAR_KINDS,
    GrammarBackend,
    GrammarMatcher,
    grammar_spec,
    precheck,
)
from radixlm.constrained.manager import GrammarManager, create_grammar_manager

__all__ = ["GRAMMAR_KINDS", "GrammarBackend", "GrammarManager", "GrammarMatcher",
           "create_grammar_manager", "grammar_spec", "precheck"]
