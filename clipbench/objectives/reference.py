"""docs/objectives.md's tables of the built-in rules, aggregations and sampler corrections, written
from the registries: each rule's and correction's formula, summary, gradient and notes (its
docstring), parameters with their defaults (its signature) and source (``source=``); each
aggregation's docstring and metadata. The doc holds each table between ``<!-- NAME -->`` and
``<!-- /NAME -->`` markers (tests/test_objectives_diag.py checks that it equals what this writes).

    python -m clipbench.objectives.reference docs/objectives.md   # rewrites the marked tables in place
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

from clipbench.objectives.aggregation import AGGREGATIONS
from clipbench.objectives.corrections import CORRECTIONS, NONE
from clipbench.objectives.corrections.registry import MASKED_TOKENS, NONE_SUMMARY
from clipbench.objectives.registry import METHODS
from clipbench.objectives.rules import FAMILIES
from clipbench.objectives.signature import top_level_colon

REGENERATE = "python -m clipbench.objectives.reference docs/objectives.md"


def _cell(text: str) -> str:
    """One table cell: one line, a literal `|` escaped, reST's ``code`` as markdown's `code`."""
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else "-"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: tuple[str, ...], rows: list[list[str]]) -> str:
    return "\n".join([_row(list(header)), _row(["---"] * len(header)), *(_row(r) for r in rows)])


def notes(fn: Callable) -> str:
    """A function's docstring after its first line (the formula and summary): its gradient and notes."""
    return "\n\n".join(inspect.cleandoc(fn.__doc__ or "").split("\n\n")[1:])


def _sentences(*parts: str) -> str:
    """The parts as one cell of sentences, each ended with a full stop."""
    out = []
    for part in (" ".join(p.split()) for p in parts):
        if part:
            out.append(part + ("" if part.endswith((".", ".)")) else "."))
    return _cell(" ".join(out))


def _summary_and_notes(spec) -> str:
    return _sentences(spec.description, notes(spec.fn))


def family(module) -> tuple[str, str]:
    """(title, text) of a rules module: its docstring's first paragraph up to ': ', and the rest."""
    doc = inspect.cleandoc(module.__doc__ or "")
    paragraphs = [" ".join(p.split()).replace("``", "`") for p in doc.split("\n\n")]
    i = top_level_colon(paragraphs[0])
    if i < 0:
        return paragraphs[0], "\n\n".join(paragraphs[1:])
    lead = paragraphs[0][i + 2 :]
    return paragraphs[0][:i], "\n\n".join([lead[:1].upper() + lead[1:], *paragraphs[1:]])


def rules() -> str:
    """One table per rule family (rules/ module), the built-in rules in registration order."""
    out = []
    for module in FAMILIES:
        specs = [s for s in METHODS.values() if s.origin is None and s.fn.__module__ == module.__name__]
        title, text = family(module)
        rows = [
            [f"`{s.name}`", _code(s.formula), _cell(s.parameters), _summary_and_notes(s), _cell(s.source)]
            for s in specs
        ]
        header = ("name", "loss", "parameters (defaults)", "what it does, gradient, notes", "source")
        out.append(f"### {title}\n\n{text}\n\n{_table(header, rows)}")
    return "\n\n".join(out)


def aggregations() -> str:
    """One row per built-in aggregation (`train.agg`)."""
    rows = []
    for name in AGGREGATIONS:
        entry = AGGREGATIONS.entry(name)
        if entry.origin is not None:
            continue
        doc = inspect.cleandoc(entry.value.__doc__ or "")
        groups = "yes" if entry.meta.get("needs_groups") else "no"
        rows.append([f"`{name}`", _sentences(doc.split("\n\n")[0]), groups, _sentences(notes(entry.value)) or "-"])
    return _table(("name", "loss", "reads prompt groups", "notes"), rows)


def corrections() -> str:
    """One row per built-in sampler correction, `none` first."""
    rows = [[f"`{NONE}`", "1", "-", "-", _sentences(NONE_SUMMARY), "-"]]
    for spec in CORRECTIONS.values():
        if spec.origin is not None:
            continue
        cells = [_code(spec.formula), _cell(spec.parameters), MASKED_TOKENS[spec.denominator]]
        rows.append([f"`{spec.name}`", *cells, _summary_and_notes(spec), _cell(spec.source)])
    return _table(("name", "weight", "parameters (defaults)", "masked tokens", "what it does, notes", "source"), rows)


TABLES: dict[str, Callable[[], str]] = {"rules": rules, "aggregations": aggregations, "corrections": corrections}


def filled(text: str) -> str:
    """`text` with every marked table written anew (a marker missing: ValueError naming it)."""
    for name, make in TABLES.items():
        pattern = re.compile(rf"(<!-- {name}[^>]*-->\n).*?(<!-- /{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no <!-- {name} --> ... <!-- /{name} --> block")
        text = pattern.sub(lambda m, make=make: f"{m.group(1)}\n{make()}\n\n{m.group(2)}", text, count=1)
    return text


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.write_text(filled(path.read_text(encoding="utf-8")), encoding="utf-8")
