"""`clipbench methods [NAME]`: every registered rule and sampler correction, one line each; NAME's
full card (read from METHODS and CORRECTIONS).

    clipbench methods                              # one line per rule and correction: name, level, summary
    clipbench methods nsr                          # nsr's card: formula, parameters, inputs, source
    clipbench methods lower_only --plugin mine.py  # a plugin's rule, with its file

The list fits one terminal line per entry (the summary is cut with an ellipsis at the console's
width); the card is where the formula, the parameters with their defaults and choices, and the
source are printed in full.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clipbench.errors import UserError, unknown_choice
from clipbench.objectives.aggregation import AGGREGATIONS
from clipbench.objectives.corrections import CORRECTIONS, NONE
from clipbench.objectives.corrections.registry import CorrectionSpec
from clipbench.objectives.registry import METHODS, MethodSpec

NO_CORRECTION = "no correction (the mismatch is still measured)"


def levels(level: str | Callable, params) -> str:
    """The ratio level(s) an entry acts on: its fixed level, or the levels its function of the
    params gives over the defaults and each choice of each parameter (nsr's base: token|sequence)."""
    if not callable(level):
        return level
    defaults = {p.name: p.default for p in params}
    seen = [level(defaults)]
    for p in params:
        for choice in p.choices:
            seen.append(level({**defaults, p.name: choice}))
    return "|".join(dict.fromkeys(seen))


def _fit(text: str, width: int) -> str:
    """`text` on one line of at most `width` characters (cut with an ellipsis)."""
    return text if len(text) <= width else text[: max(width - 1, 0)].rstrip() + "…"


def _listing(title: str, rows: list[tuple[str, str, str]], width: int) -> Table:
    """One line per row (name, level, summary) in `width` columns: the first two columns as wide as
    their longest entry, the summary cut with an ellipsis where it would wrap."""
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(("name", "level"))]
    room = width - sum(widths) - 4  # two gaps of two spaces
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, padding=(0, 2, 0, 0))
    table.add_column("name", no_wrap=True, min_width=widths[0], style="bold", header_style="bold")
    table.add_column("level", no_wrap=True, min_width=widths[1], header_style="bold")
    table.add_column("summary", no_wrap=True, header_style="bold")
    for name, level, summary in rows:
        table.add_row(escape(name), level, escape(_fit(summary, room)))
    return table


def _summary(spec) -> str:
    """The one-line description; a description that is only a name (BAPO, Clip-Cov) is followed by
    the formula; a plugin's is marked."""
    text = spec.description or spec.formula or "-"
    if " " not in text.strip() and spec.formula:
        text = f"{text}: {spec.formula}"
    return ("(plugin) " if spec.origin is not None else "") + text


def methods_table(width: int = 80) -> Table:
    """One line per rule in `width` columns: its name, the ratio its cells use, its description."""
    rows = [(name, levels(spec.level, spec.params), _summary(spec)) for name, spec in METHODS.items()]
    return _listing(f"clip rules (objective.name): {len(rows)}", rows, width)


def corrections_table(width: int = 80) -> Table:
    """One line per sampler correction (and `none`) in `width` columns: name, unit, description."""
    rows = [(NONE, "-", NO_CORRECTION)]
    rows += [(name, levels(spec.level, spec.params), _summary(spec)) for name, spec in CORRECTIONS.items()]
    return _listing("sampler corrections (sampler.correction.name; rho = pi_old / pi_sampler)", rows, width)


def _params(spec) -> str:
    return escape(
        ", ".join(f"{p.name}={p.default}" + (f" ({'/'.join(p.choices)})" if p.choices else "") for p in spec.params)
        or "-"
    )


def _scope(spec: MethodSpec) -> str | None:
    """What a rule's statistics range over, when they span more than its token."""
    if spec.per_call:
        return "per call: exact unsplit only (its statistics range over one micro-batch)"
    if spec.batch_stat is not None:
        return "mini-batch statistic: exact under micro-batching (a no-grad pass over the mini-batch when split)"
    return None


def _card(rows: list[tuple[str, str | None]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for key, value in rows:
        if value:
            grid.add_row(key, value)
    return grid


def method_card(spec: MethodSpec) -> Table:
    """A rule's full card: summary, level, formula, parameters, inputs, scope, source, origin."""
    return _card(
        [
            ("rule", f"[bold]{escape(spec.name)}[/bold]: {escape(spec.description or '-')}"),
            ("level", levels(spec.level, spec.params)),
            ("loss", escape(spec.formula or "-")),
            ("parameters", _params(spec)),
            ("inputs", ", ".join(spec.inputs)),
            ("scope", _scope(spec)),
            ("source", escape(spec.source)),
            ("plugin", escape(spec.origin.path) if spec.origin is not None else None),
            ("aggregation", "train.agg: " + ", ".join(AGGREGATIONS) + "; KL: beta * k3 to ref_logp"),
        ]
    )


def correction_card(spec: CorrectionSpec) -> Table:
    """A sampler correction's full card: summary, unit, weight, parameters, denominators, source."""
    where = "leave the denominators" if spec.denominator == "drop" else "stay in the denominators"
    return _card(
        [
            ("correction", f"[bold]{escape(spec.name)}[/bold]: {escape(spec.description or '-')}"),
            ("level", levels(spec.level, spec.params)),
            ("weight", escape(spec.formula or "-")),
            ("parameters", _params(spec)),
            ("inputs", ", ".join(spec.inputs)),
            ("masked tokens", where),
            ("source", escape(spec.source)),
            ("plugin", escape(spec.origin.path) if spec.origin is not None else None),
            ("needs", "sampler.old_logp: recompute; per token or per sequence (exact under any split)"),
        ]
    )


def card(name: str) -> Table:
    """NAME's card: a rule's, a correction's (`none` too); UserError with a did-you-mean otherwise."""
    if name == NONE:
        return _card([("correction", f"[bold]{NONE}[/bold]: {NO_CORRECTION}"), ("weight", "1")])
    for registry, make in ((METHODS, method_card), (CORRECTIONS, correction_card)):
        try:
            return make(registry.lookup(name))  # an installed package's entry points load on an unknown name
        except ValueError:
            continue
    raise UserError(unknown_choice("rule or correction", name, [*METHODS, *CORRECTIONS, NONE]))


def print_methods(console: Console | None = None, name: str | None = None) -> None:
    """The one-line-per-entry list, or NAME's card."""
    console = console or Console()
    if name is not None:
        console.print(card(name))
        return
    console.print(methods_table(console.width))
    console.print()
    console.print(corrections_table(console.width))
    console.print()
    console.print(escape("aggregations (train.agg.name): " + ", ".join(AGGREGATIONS)))
    console.print("`clipbench methods NAME`: one entry's card (formula, parameters, source)")
