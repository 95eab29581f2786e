"""`clipbench engines`: every engine, and how it treats every run-config key (clipbench.engines.keys).

A key an engine refuses fails the run's preflight when it is set to anything but its default (one
line naming the key, exit 2, nothing written); docs/engines.md is this table.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from clipbench.engines import ENGINES
from clipbench.engines.keys import rows


def engines_table() -> Table:
    table = Table(title="engines: how each treats each run-config key", show_lines=False)
    table.add_column("key", overflow="fold")
    for name in ENGINES:
        table.add_column(name, overflow="fold")
    for key, support in rows():
        table.add_row(key, *(support[name].describe() for name in ENGINES))
    table.caption = "; ".join(f"{e.name}: {e.description}" for e in ENGINES.values())
    return table


def engines_command(console: Console | None = None) -> None:
    (console or Console()).print(engines_table())
