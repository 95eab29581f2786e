"""What a value of the run config accepts: the checks a field declares beside its default
(`clipbench.config.schema.declared`), each with `problem(value) -> str | None` (why the value is
refused, None when it passes) and words for the reference table (docs/config.md).

    Range(0.0, 1.0, lo_open=True).problem(0)   -> "must be in (0, 1], got 0"
    Each(Range(0, 1), length=2).problem([0.9])  -> "must have 2 items, got 1"
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """A finite number in [lo, hi] (an end is open with lo_open / hi_open; None = unbounded);
    ``none``: null is allowed too; ``why``: a reason shown with the error."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    none: bool = False
    why: str = ""

    def describe(self) -> str:
        def num(x):
            return f"{x:g}" if isinstance(x, float) else str(x)

        if self.lo is not None and self.hi is not None:
            text = f"in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {num(self.hi)}"
        else:
            text = "a finite number"
        return text + (" or null" if self.none else "") + (f" ({self.why})" if self.why else "")

    def problem(self, v: Any) -> str | None:
        if v is None:
            return None if self.none else "must not be null"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"must be a number {self.describe()}, got {v!r}"
        if isinstance(v, float) and not math.isfinite(v):
            return f"must be a finite number {self.describe()}, got {v}"
        low = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
        high = self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi)
        return f"must be {self.describe()}, got {v:g}" if low or high else None


@dataclass(frozen=True)
class Each:
    """A list whose items each satisfy ``item``, with exactly ``length`` items when given."""

    item: Any  # a Range, Text, ... (anything with .problem(value))
    length: int | None = None
    choices: tuple[str, ...] | None = None  # each item one of these
    unique: bool = False

    def problem(self, v: Any) -> str | None:
        if not isinstance(v, (list, tuple)):
            return f"must be a list, got {v!r}"
        if self.length is not None and len(v) != self.length:
            return f"must have {self.length} items, got {len(v)}"
        for i, x in enumerate(v):
            p = self.item.problem(x)
            if p:
                return f"item {i}: {p}"
            if self.choices is not None and x not in self.choices:
                return f"item {i}: unknown {x!r}; valid: {', '.join(self.choices)}"
        if self.unique and len(set(v)) != len(v):
            return f"lists an item twice: {list(v)}"
        return None


@dataclass(frozen=True)
class Text:
    """A string of one line (``max_len`` characters at most); ``alphabet``: only these characters,
    each at most once; ``none``: null is allowed too."""

    none: bool = False
    max_len: int = 1000
    alphabet: str | None = None

    def problem(self, v: Any) -> str | None:
        if v is None:
            return None if self.none else "must not be null"
        if not isinstance(v, str) or not v.strip():
            return f"must be a non-empty string, got {v!r}"
        if "\n" in v or len(v) > self.max_len:
            return f"must be one line of at most {self.max_len} characters"
        if self.alphabet is not None:
            bad = [c for c in v if c not in self.alphabet]
            if bad or len(set(v)) != len(v):
                return f"must be characters of {self.alphabet!r}, each at most once, got {v!r}"
        return None


# A Hugging Face hub id: "name" or "namespace/name" (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class Source:
    """Where data or a model comes from: a local path (which must exist; ``dir_only``: a directory)
    or, when ``hub`` allows it, a Hugging Face hub id; ``builtin``: ``builtin:<name>`` names are
    allowed (the name is checked when the model loads: the trainer's preflight, before anything is
    written); ``none``: null is allowed too."""

    hub: bool = True
    builtin: bool = False
    dir_only: bool = False
    none: bool = False

    def problem(self, v: Any) -> str | None:
        if v is None:
            return None if self.none else "must not be null"
        if not isinstance(v, str) or not v.strip():
            return f"must be a non-empty string, got {v!r}"
        if self.builtin and v.startswith("builtin:"):
            return None if _HUB_ID.match(v.split(":", 1)[1]) else f"'{v}' is not a built-in model name (builtin:<name>)"
        path = os.path.expanduser(v)
        if os.path.exists(path):
            return None if not self.dir_only or os.path.isdir(path) else f"'{v}' is not a directory"
        if not self.hub or not _HUB_ID.match(v):  # '/x', './x', '~/x', 'a/b/c' are paths, not hub ids
            what = "directory" if self.dir_only else "path"
            hub = " and not a Hugging Face hub id (namespace/name)" if self.hub else ""
            return f"no such {what} '{v}'{hub}"
        return None
