"""`clipbench doctor`: one table of what this machine can run (clipbench.engines.machine), with the one
command that fixes each missing piece. `clipbench rehearse` prints it first. Exit code 0: it reports,
it does not judge (a CPU machine without vLLM runs every CPU recipe)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clipbench.engines.machine import Check, machine_checks


def doctor_table(checks: list[Check]) -> Table:
    table = Table(title="what this machine can run (clipbench doctor)", title_justify="left")
    for col in ("part", "here", "usable", "fix"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(escape(c.part), escape(c.found), "[green]yes[/]" if c.ok else "[yellow]no[/]", escape(c.fix))
    return table


def doctor_command(
    *, results_dir: Path, tracking_uri: str | None, json_out: bool = False, console: Console | None = None
) -> list[Check]:
    checks = machine_checks(results_dir, tracking_uri)
    if json_out:
        for c in checks:
            print(json.dumps({"part": c.part, "found": c.found, "ok": c.ok, "fix": c.fix}))
    else:
        console = console or Console()
        console.width = max(console.width, 120)  # a pipe reports 80 columns: the fixes need more
        console.print(doctor_table(checks))
    return checks
