"""The run config's reference table, written from the schema's declarations (docs/config.md holds it
between its ``<!-- fields -->`` markers; tests/test_config_schema.py checks they agree).

    python -m clipbench.config.reference     # prints the table
"""

from __future__ import annotations

import dataclasses
import json
import typing

from clipbench.config.schema import SLOTS, RunConfig, Slot, declarations, is_section, value_at
from clipbench.config.values import Each, Range, Text

_SLOT_KEYS = {d.key: d for d in SLOTS.values()}


def _type_name(hint) -> str:
    text = str(hint).replace("typing.", "")
    return text if not isinstance(hint, type) else hint.__name__


def _types() -> dict[str, str]:
    out: dict[str, str] = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if is_section(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                out[prefix + f.name] = _type_name(hints[f.name])

    walk(RunConfig, "")
    return out


def _defaults() -> dict[str, typing.Any]:
    """{key: its default as YAML writes it}: a component in the one form ({name: ...})."""
    cfg = RunConfig()
    values = {key: value_at(cfg, key) for key in declarations()}
    return {k: v.one_form() if isinstance(v, Slot) else v for k, v in values.items()}


def _values(key: str, decl: dict) -> str:
    if key in _SLOT_KEYS:
        return f"a component (slot): one of its registry's {_SLOT_KEYS[key].noun} names, with its parameters"
    if decl.get("check") is not None:
        return _describe(decl["check"])
    if decl.get("choices"):
        return " \\| ".join(decl["choices"])
    if decl.get("owner"):
        return f"the names of `{decl['owner']}`"
    return ""


def _describe(check) -> str:
    """A check (Range, Each, Text, Source) in words."""
    if isinstance(check, Range):
        return check.describe()
    if isinstance(check, Each):
        text = f"a list of {check.length} " if check.length else "a list of "
        text += "; ".join(check.choices) if check.choices else _describe(check.item)
        return text + (", each once" if check.unique else "")
    null = " or null" if getattr(check, "none", False) else ""
    if isinstance(check, Text):
        if check.alphabet:
            return f"characters of `{check.alphabet}`, each at most once"
        return f"one line (at most {check.max_len} characters){null}"
    kinds = ["a local directory" if check.dir_only else "a local path"]
    kinds += ["a Hugging Face hub id"] * check.hub + ["`builtin:<name>`"] * check.builtin
    return ", ".join(kinds) + null


def table() -> str:
    """The markdown table: one row per leaf key (key, type, default, values, help)."""
    types, defaults = _types(), _defaults()
    rows = ["| key | type | default | values | help |", "|---|---|---|---|---|"]
    for key, decl in declarations().items():
        default = json.dumps(defaults[key])
        cells = [f"`{key}`", types[key], f"`{default}`", _values(key, decl), decl.get("help", "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") if i != 3 else c for i, c in enumerate(cells)) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
