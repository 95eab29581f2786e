"""One line per entry: the compact lists of `clipbench recipes`, `methods` and `engines`, and their
word filters.

    listing("clip rules: 32", ["name", "level", "summary"], rows, width=80)   # the last column is cut
    matches(["seq", "clip"], "gspo", "sequence", "sequence ratio, hard clip")  # every word, any text
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.markup import escape
from rich.table import Table


def fit(text: str, width: int) -> str:
    """`text` on one line of at most `width` characters (cut with an ellipsis)."""
    return text if len(text) <= width else text[: max(width - 1, 0)].rstrip() + "…"


def matches(words: Sequence[str], *texts: str) -> bool:
    """Whether every word occurs (case-insensitively) in one of `texts`."""
    hay = " ".join(texts).lower()
    return all(w.lower() in hay for w in words)


def listing(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    *,
    caps: dict[int, int] | None = None,
    wrap: bool = False,
) -> Table:
    """One line per row in `width` columns: each column as wide as its longest entry (column i at most
    `caps[i]` characters, cut), the last one cut with an ellipsis where it would wrap (`wrap`: folded
    over lines instead, nothing cut)."""
    caps = caps or {}
    widths = [
        min(max(len(h), *(len(r[i]) for r in rows)) if rows else len(h), caps.get(i, 10**6))
        for i, h in enumerate(headers[:-1])
    ]
    room = max(width - sum(widths) - 2 * len(widths), 10)  # a gap of two spaces after each column
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, padding=(0, 2, 0, 0))
    for i, h in enumerate(headers[:-1]):
        table.add_column(
            h,
            no_wrap=True,
            min_width=widths[i],
            max_width=widths[i],
            header_style="bold",
            style="bold" if i == 0 else None,
        )
    table.add_column(headers[-1], no_wrap=not wrap, header_style="bold", overflow="fold")
    for row in rows:
        cells = [escape(fit(c, widths[i])) for i, c in enumerate(row[:-1])]
        table.add_row(*cells, escape(row[-1] if wrap else fit(row[-1], room)))
    return table
