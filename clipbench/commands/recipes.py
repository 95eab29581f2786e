"""`clipbench recipes [WORD ...] [--long] [--show NAME]`: every recipe and sweep shipped with the package,
runnable by name from any directory (`clipbench train quickstart`, `clipbench sweep nsr_vs_decay`); a
local file of the same name wins. One line each (the scale and what it runs cut to fit); words keep
the entries that hold every one (`clipbench recipes gpu`); --long is the full table with the expected
times. The list and its columns come from clipbench.config.shipped (its shipped.yaml)."""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clipbench.commands.listing import listing, matches
from clipbench.config.shipped import PACKAGE, catalog, shipped_recipe, shipped_sweep
from clipbench.errors import ConfigError, UserError

VERB = {"recipe": "train", "sweep": "sweep"}


def _rows(words: list[str]) -> list:
    return [s for s in catalog() if matches(words, f"{VERB[s.kind]} {s.name}", s.summary, s.scale, s.time)]


def recipes_table(words: list[str] = ()) -> Table:
    """Every shipped recipe and sweep (those that hold every word), with what it runs, its scale and its
    expected time in full."""
    table = Table(title="shipped recipes and sweeps (a local file of the same name wins)", title_justify="left")
    for col in ("command", "runs", "scale", "expected time"):
        table.add_column(col, overflow="fold")
    for item in _rows(list(words)):
        table.add_row(
            escape(f"clipbench {VERB[item.kind]} {item.name}"),
            escape(item.summary),
            escape(item.scale),
            escape(item.time),
        )
    table.caption = CAPTION
    return table


def recipes_list(width: int, words: list[str] = ()) -> Table:
    """One line per shipped recipe and sweep (those that hold every word): `train NAME` or `sweep
    NAME`, where it runs (its scale's first words) and what it runs (cut at the console's width)."""
    rows = [(f"{VERB[s.kind]} {s.name}", _short(s.scale), s.summary) for s in _rows(list(words))]
    shown = f"{len(rows)} of {len(catalog())}" if words else str(len(rows))
    title = f"shipped recipes and sweeps: {shown} (clipbench train|sweep NAME; a local file of the same name wins)"
    return listing(title, ("clipbench", "on", "runs"), rows, width, caps={1: 12})


def _short(scale: str) -> str:
    """'8 GPUs of 80 GB (FSDP2) + vLLM' -> '8 GPUs'; 'CPU, 1 process' -> 'CPU' (--long has it in full)."""
    return re.split(r" of |,| \(| \+", scale, maxsplit=1)[0]


CAPTION = "rehearse a recipe before booking GPUs: clipbench rehearse NAME; print one: clipbench recipes --show NAME"
HINT = (
    "`clipbench recipes WORD ...`: those that hold every word (gpu, cpu, table3, sweep); --long: the full table "
    "with the expected times; --show NAME: print one (to copy); clipbench rehearse NAME before booking GPUs"
)


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


def recipes_command(show: str | None = None, words: list[str] = (), long: bool = False) -> None:
    """One line per entry (those that hold every word), the full table (`long`), or with `show` the
    text of one shipped file (to copy and edit)."""
    if show is not None:
        path, other = show_files(show)
        key = other.relative_to(PACKAGE).with_suffix("").as_posix() if other else ""
        also = f"# the sweep of this name: clipbench recipes --show {key}\n" if other else ""
        print(f"# {path}\n{also}" + path.read_text(encoding="utf-8"), end="")
        return
    words = list(words)
    if words and not _rows(words):
        raise UserError(f"no shipped recipe or sweep holds {' '.join(words)!r} (`clipbench recipes` lists them all)")
    console = Console()
    if long:
        console.print(recipes_table(words))
        return
    console.print(recipes_list(console.width, words))
    console.print(HINT)
