"""JSON schemas for the structured-output tests, drawn from a seeded generator: nested
objects, arrays, enums, required and optional fields, integers, numbers, booleans, strings.

Every string has a maxLength or an enum, every number a multipleOf and every array a
maxItems, so a model with random weights, whose only reason to produce valid JSON is the
grammar, still reaches the end.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ["red", "green", "blue", "cat", "dog", "fox", "alpha", "beta", "north", "south"]


def schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng, depth=0) for _ in range(count)]


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "kind", "size", "tags", "spec", "ok", "score", "items", "meta"],
                       rng.randint(1, 3))
    properties = {name: _value(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "boolean", "string", "enum", "array"]
    if depth < 2:
        kinds += ["object", "object"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth)
    if kind == "array":
        item = _value(rng, depth + 1) if depth < 2 else {"type": "integer", "minimum": 0, "maximum": 9}
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 2)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        # multipleOf bounds the digits after the point (a bare number may have any number).
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000]),
                "multipleOf": rng.choice([0.5, 0.25])}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    return {"type": "boolean"}
