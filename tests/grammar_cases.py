"""Deterministic generators of JSON schemas and regexes for constrained-decoding
tests and the benchmark. Every grammar here is bounded (strings have maxLength,
arrays maxItems, quantifiers an upper bound), so a constrained output always
finishes within a known token budget."""

from __future__ import annotations

import random
from typing import Any

KEYS = ["name", "city", "age", "score", "tags", "id", "color", "size", "kind", "level",
        "price", "title", "owner", "rank", "code", "note", "year", "active", "items", "unit"]
WORDS = ["red", "green", "blue", "small", "large", "cat", "dog", "alpha", "beta", "north",
         "south", "yes", "no", "low", "high"]


# ---- JSON schemas ----------------------------------------------------------------
def _string(rng: random.Random) -> dict[str, Any]:
    hi = rng.randint(1, 12)
    s: dict[str, Any] = {"type": "string", "maxLength": hi}
    if rng.random() < 0.3:
        s["minLength"] = rng.randint(1, hi)
    return s


def _integer(rng: random.Random) -> dict[str, Any]:
    lo = rng.randint(-100, 100)
    s: dict[str, Any] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 900)}
    return s


def _number(rng: random.Random) -> dict[str, Any]:
    lo = round(rng.uniform(-50, 50), 1)
    return {"type": "number", "minimum": lo, "maximum": round(lo + rng.uniform(0.5, 100), 1)}


def _enum(rng: random.Random) -> dict[str, Any]:
    values: list[Any] = rng.sample(WORDS, rng.randint(2, 4))
    if rng.random() < 0.3:
        values.append(rng.randint(0, 9))
    return {"enum": values}


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "enum"])
    if kind == "boolean":
        return {"type": "boolean"}
    return {"string": _string, "integer": _integer, "number": _number, "enum": _enum}[kind](rng)


def _array(rng: random.Random, depth: int) -> dict[str, Any]:
    items = _object(rng, depth + 1, max_props=2) if depth < 2 and rng.random() < 0.3 \
        else _leaf(rng)
    hi = rng.randint(1, 3)
    return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": hi}


def _object(rng: random.Random, depth: int, max_props: int = 4) -> dict[str, Any]:
    keys = rng.sample(KEYS, rng.randint(1, max_props))
    props = {}
    for k in keys:
        r = rng.random()
        if depth < 2 and r < 0.15:
            props[k] = _object(rng, depth + 1, max_props=3)
        elif depth < 2 and r < 0.35:
            props[k] = _array(rng, depth)
        else:
            props[k] = _leaf(rng)
    required = [k for k in keys if rng.random() < 0.7] or [keys[0]]
    return {"type": "object", "properties": props, "required": required}


def max_chars(schema: dict[str, Any]) -> int:
    """A generous bound on the compact JSON text's length."""
    if schema.get("type") == "object":
        return 2 + sum(len(k) + 5 + max_chars(v) for k, v in schema["properties"].items())
    if schema.get("type") == "array":
        return 2 + schema["maxItems"] * (max_chars(schema["items"]) + 2)
    if schema.get("type") == "string":
        return 2 + schema["maxLength"]
    if schema.get("type") in ("integer", "number"):
        return 24  # sign, digits, fraction: bounded ranges keep them short
    if "enum" in schema:
        return 2 + max(len(str(v)) for v in schema["enum"])
    return 5


def json_schemas(count: int, seed: int = 0, max_len: int = 220) -> list[dict[str, Any]]:
    """`count` object schemas (nested objects, arrays, enums, bounded numbers,
    required fields) whose outputs stay under `max_len` characters."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < count:
        schema = _object(rng, 0)
        if max_chars(schema) <= max_len:
            out.append(schema)
    return out


# ---- regexes -------------------------------------------------------------------
def _regex_piece(rng: random.Random) -> str:
    choices = [
        lambda: f"[a-z]{{{rng.randint(1, 3)},{rng.randint(4, 8)}}}",
        lambda: f"[A-Z][a-z]{{1,{rng.randint(2, 7)}}}",
        lambda: rf"\d{{{rng.randint(1, 4)}}}",
        lambda: rf"\d{{1,{rng.randint(2, 4)}}}",
        lambda: "(" + "|".join(rng.sample(WORDS, rng.randint(2, 4))) + ")",
        lambda: f"[0-9a-f]{{{rng.randint(2, 6)}}}",
        lambda: rng.choice(["id", "user_", "v", "item", "x"]),
        lambda: f"(-[a-z]{{{rng.randint(1, 3)}}})?",
        lambda: rf"[A-Z]{{{rng.randint(1, 3)}}}\d{{{rng.randint(1, 3)}}}",
    ]
    return rng.choice(choices)()


_FIXED_REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r"([01]\d|2[0-3]):[0-5]\d",
    r"[a-z]{3,8}@[a-z]{3,6}\.(com|org|net)",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"#[0-9a-fA-F]{6}",
    r"-?\d{1,3}(\.\d{1,2})?",
    r"[A-Z][a-z]{2,8}, [A-Z][a-z]{2,8}",
    r"(true|false)",
]


def regexes(count: int, seed: int = 0) -> list[str]:
    """`count` bounded regexes: a few classic formats, then random compositions."""
    rng = random.Random(seed)
    out = list(_FIXED_REGEXES[:count])
    seps = ["-", ":", "/", "_", "@", r"\.", " ", ""]
    while len(out) < count:
        pieces = [_regex_piece(rng) for _ in range(rng.randint(2, 4))]
        sep = rng.choice(seps)
        out.append(sep.join(pieces))
    return out
