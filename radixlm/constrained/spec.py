"""What a request's grammar is, and the checks of it that need no compiler.

Torch-free on purpose: the HTTP server's API process and the offline Engine's
proxy for scheduler processes run these checks without loading a grammar
backend (or torch); the scheduler compiles.
"""

from __future__ import annotations

import json

from radixlm.sampling_params import SamplingParams

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


def grammar_spec(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, spec) of the request's grammar, or None; SamplingParams.validate
    already refused more than one."""
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind)
        if spec is not None:
            return kind, spec
    return None


def check_json_schema(spec: str) -> None:
    """The cheap part of validating a schema: JSON syntax and top-level type."""
    try:
        schema = json.loads(spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (or true/false), got "
                         f"{type(schema).__name__}")


def precheck(params: SamplingParams, backend_name: str) -> None:
    """Checks that need no compiler (for a front end without one): a grammar
    needs a backend, and a schema must at least be JSON."""
    spec = grammar_spec(params)
    if spec is None:
        return
    kind, text = spec
    if backend_name == "none":
        raise ValueError(f"{kind} needs constrained decoding, but the server runs with "
                         f"--grammar-backend none")
    if not isinstance(text, str) or not text:
        raise ValueError(f"{kind} must be a non-empty string")
    if kind == "json_schema":
        check_json_schema(text)
