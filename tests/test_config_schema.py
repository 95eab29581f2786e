"""Each run-config field is declared once (issue 26 part 3): its type, default, allowed values and
help side by side in clipbench/config/schema.py; RANGES and CHOICES are derived from there, and the
reference table of docs/config.md is written from the same declarations."""

from __future__ import annotations

import re
from pathlib import Path

from clipbench.config.reference import table
from clipbench.config.schema import CHOICES, RANGES, SLOTS, choices, declarations, leaf_keys
from clipbench.config.values import Range

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def test_every_leaf_has_one_declaration_with_help():
    decl = declarations()
    assert tuple(decl) == leaf_keys()
    assert [k for k, d in decl.items() if not d.get("help")] == []
    for key, d in decl.items():  # at most one kind of declaration per field
        assert sum(d.get(kind) is not None for kind in ("check", "choices", "owner")) <= 1, key


def test_ranges_and_choices_are_the_declarations():
    decl = declarations()
    assert RANGES == {k: d["check"] for k, d in decl.items() if d["check"] is not None}
    assert CHOICES == {k: d["choices"] for k, d in decl.items() if d["choices"]}
    assert RANGES["train.lr"] == Range(0.0, 1.0, lo_open=True)  # the field's own declaration
    assert CHOICES["sampler.backend"] == ("auto", "hf", "vllm")


def test_the_closed_lists_read_from_their_owners_are_the_fields_that_name_an_owner():
    owned = {k for k, d in declarations().items() if d["owner"]}
    # eval.benchmarks is checked item by item against clipbench.tasks.benchmarks.BENCHMARKS
    assert owned - {"eval.benchmarks"} == set(choices()) - set(CHOICES)
    assert {d.key for d in SLOTS.values() if d.bare} <= owned  # the aggregation and the advantage


def test_the_reference_table_in_docs_is_the_schemas():
    text = DOC.read_text()
    m = re.search(r"<!-- fields[^>]*-->\n(.*?)<!-- /fields -->", text, re.S)
    assert m, f"{DOC} has no <!-- fields --> block"
    assert m.group(1).strip() == table().strip(), "run: python -m clipbench.config.reference (into docs/config.md)"
    assert len(table().splitlines()) == 2 + len(leaf_keys())
