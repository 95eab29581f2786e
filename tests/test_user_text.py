"""What a user reads says what a thing is, not how the project was developed: no ticket numbers ("issue
36", "Issue-16", "issues 37-39") and no working sessions in the package (code, comments, recipes, sweeps,
model records), the Makefile, the README, the docs and studies, the benchmarks, scripts and examples."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLACES = ("clipbench", "docs", "bench", "scripts", "examples", "Makefile", "README.md")
TEXT = {".py", ".md", ".yaml", ".yml", ".json", ".txt", ".sh", ".toml", ".html", ".css", ".cfg", ""}
DEVELOPMENT = re.compile(r"\bissues?[\s-]+#?\d|\bsession\b", re.IGNORECASE)


def _texts():
    for place in PLACES:
        root = REPO / place
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            if path.suffix in TEXT and "__pycache__" not in path.parts and path.stat().st_size < 2_000_000:
                try:
                    yield path, path.read_text(encoding="utf-8")
                except UnicodeDecodeError:  # a binary file without a suffix
                    continue


def test_no_words_about_how_the_project_is_developed():
    found = [
        f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for path, text in _texts()
        for m in DEVELOPMENT.finditer(text)
    ]
    assert found == [], "say what a thing is, not which ticket or session made it:\n" + "\n".join(found)


def test_the_readme_leads_with_the_findings_counts_the_rules_and_fits_150_lines():
    """The README: what the tool found comes before how to run it; the number of built-in rules it states
    is the registry's (it changes when a rule is added); at most 150 lines."""
    from clipbench.objectives import METHODS

    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert text.index("## What it found") < text.index("## Two commands") < text.index("## Compare your rule")
    (count,) = re.findall(r"(\d+) rules are built in", text)
    assert int(count) == sum(spec.origin is None for spec in METHODS.values())
    for link in re.findall(r"\]\(((?:docs|examples)/[^)#]+)\)", text):  # every local link resolves
        assert (REPO / link).exists() or link == "docs/studies/offpolicy.md", link
