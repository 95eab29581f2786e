"""`clipbench recipes`: every recipe and sweep shipped with the package, runnable by name from any
directory (`clipbench train quickstart`, `clipbench sweep nsr_vs_decay`); a local file of the same
name wins. The list and its columns come from clipbench.config.shipped (its shipped.yaml)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clipbench.config.shipped import PACKAGE, catalog, shipped_recipe, shipped_sweep
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


def show_files(ref: str) -> tuple[Path, Path | None]:
    """(the file `--show REF` prints, the other shipped file of that name or None). A local file wins;
    `recipes/NAME` is the recipe, `sweeps/NAME` the sweep; a bare NAME is the recipe (what `clipbench
    train NAME` runs) when there is one, else the sweep."""
    if Path(ref).is_file():
        return Path(ref), None
    recipe, sweep = shipped_recipe(ref), shipped_sweep(ref)
    first = recipe or sweep
    if first is None:
        raise ConfigError(ref, None, "no shipped recipe or sweep of that name (`clipbench recipes` lists them)")
    return first, (sweep if sweep not in (None, first) else None)


def recipes_command(show: str | None = None) -> None:
    """The table, or with `show` the text of one shipped file (to copy and edit)."""
    if show is not None:
        path, other = show_files(show)
        key = other.relative_to(PACKAGE).with_suffix("").as_posix() if other else ""
        also = f"# the sweep of this name: clipbench recipes --show {key}\n" if other else ""
        print(f"# {path}\n{also}" + path.read_text(encoding="utf-8"), end="")
        return
    Console().print(recipes_table())
