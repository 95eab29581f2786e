"""Dotted keys ("train.agg.name") in nested mappings (partial configs, stored configs): read, replace,
remove. Each returns a new mapping (copies along the path); the input is never changed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def value(d: Mapping, key: str, default: Any = None) -> Any:
    """The value at `key`, `default` where it is not set."""
    node: Any = d
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def replaced(d: Mapping, key: str, new: Any) -> dict:
    """`d` with the value at `key` replaced (not merged); every mapping on its path must exist."""
    head, _, rest = key.partition(".")
    return {**d, head: replaced(d[head], rest, new) if rest else new}


def without(d: Mapping, key: str) -> dict:
    """`d` without `key`; every mapping on its path must exist."""
    head, _, rest = key.partition(".")
    if rest:
        return {**d, head: without(d[head], rest)}
    return {k: v for k, v in d.items() if k != head}
