"""`clipbench recipes`: every recipe and sweep shipped with the package, runnable by name from any
directory (`clipbench train quickstart`, `clipbench sweep nsr_vs_decay`); a local file of the same
name wins. The list and its columns come from clipbench.config.shipped (its shipped.yaml)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clipbench.config.shipped import catalog, recipe_path, sweep_path
from clipbench.errors import ConfigError

VERB = {"recipe": "train", "sweep": "sweep"}


def recipes_table() -> Table:
    table = Table(title="shipped recipes and sweeps (a local file of the same name wins)", title_justify="left")
    for col in ("command", "runs", "scale", "expected time"):
        table.add_column(col, overflow="fold")
    for kind in ("recipe", "sweep"):
        for item in (s for s in catalog() if s.kind == kind):
            table.add_row(
                escape(f"clipbench {VERB[kind]} {item.name}"),
                escape(item.summary),
                escape(item.scale),
                escape(item.time),
            )
    table.caption = (
        "rehearse a recipe before booking GPUs: clipbench rehearse NAME; print one: clipbench recipes --show NAME"
    )
    return table


def recipes_command(show: str | None = None) -> None:
    """The table, or with `show` the text of one shipped file (to copy and edit)."""
    if show is not None:
        try:
            path = sweep_path(show)
        except ConfigError:
            path = recipe_path(show)
        print(f"# {path}\n" + path.read_text(encoding="utf-8"), end="")
        return
    Console().print(recipes_table())
