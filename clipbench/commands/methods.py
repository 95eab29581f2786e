"""`clipbench methods [NAME]`: every registered rule and sampler correction, one line each; NAME's
full card (read from METHODS and CORRECTIONS).

    clipbench methods                              # one line per rule and correction, by name: name, level, summary
    clipbench methods sequence                     # those whose name, level or summary holds every word
    clipbench methods --long                       # the summaries in full, over lines
    clipbench methods nsr                          # nsr's card: formula, parameters, inputs, source
    clipbench methods lower_only --plugin mine.py  # a plugin's rule, with its file

The list fits one terminal line per entry (the summary is cut with an ellipsis at the console's
width, unless --long); the card is where the formula, the parameters with their defaults and choices,
and the source are printed in full.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clipbench.commands.listing import listing, matches
from clipbench.errors import UserError, unknown_choice
from clipbench.objectives.aggregation import AGGREGATIONS
from clipbench.objectives.corrections import CORRECTIONS, NONE
from clipbench.objectives.corrections.registry import MASKED_TOKENS, NONE_SUMMARY, CorrectionSpec
from clipbench.objectives.registry import METHODS, MethodSpec


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


def _summary(spec) -> str:
    """The one-line description; a description that is only a name (BAPO, Clip-Cov) is followed by
    the formula; a plugin's is marked."""
    text = spec.description or spec.formula or "-"
    if " " not in text.strip() and spec.formula:
        text = f"{text}: {spec.formula}"
    return ("(plugin) " if spec.origin is not None else "") + text


def _rows(registry, words: list[str]) -> list[tuple[str, str, str]]:
    """(name, level, summary) of each entry whose name, level, summary or source holds every word, by name."""
    rows = [
        (name, levels(spec.level, spec.params), _summary(spec))
        for name, spec in registry.items()
        if matches(words, name, levels(spec.level, spec.params), _summary(spec), spec.source or "")
    ]
    return sorted(rows, key=lambda r: r[0])


def methods_table(width: int = 80, words: list[str] = (), wrap: bool = False) -> Table:
    """One line per rule in `width` columns (by name): its name, the ratio its cells use, its
    description (`wrap`: in full, over lines); `words`: those that hold every word."""
    rows = _rows(METHODS, list(words))
    shown = f"{len(rows)} of {len(METHODS)}" if words else f"{len(rows)}"
    return listing(f"clip rules (objective.name): {shown}", ("name", "level", "summary"), rows, width, wrap=wrap)


def corrections_table(width: int = 80, words: list[str] = (), wrap: bool = False) -> Table:
    """One line per sampler correction (and `none`) in `width` columns: name, unit, description."""
    rows = [r for r in [(NONE, "-", NONE_SUMMARY)] if matches(words, *r)] + _rows(CORRECTIONS, list(words))
    return listing(
        "sampler corrections (sampler.correction.name; rho = pi_old / pi_sampler)",
        ("name", "level", "summary"),
        rows,
        width,
        wrap=wrap,
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
            ("parameters", escape(spec.parameters)),
            ("inputs", ", ".join(spec.inputs)),
            ("scope", _scope(spec)),
            ("source", escape(spec.source)),
            ("plugin", escape(spec.origin.path) if spec.origin is not None else None),
            ("aggregation", "train.agg: " + ", ".join(AGGREGATIONS) + "; KL: beta * k3 to ref_logp"),
        ]
    )


def correction_card(spec: CorrectionSpec) -> Table:
    """A sampler correction's full card: summary, unit, weight, parameters, denominators, source."""
    return _card(
        [
            ("correction", f"[bold]{escape(spec.name)}[/bold]: {escape(spec.description or '-')}"),
            ("level", levels(spec.level, spec.params)),
            ("weight", escape(spec.formula or "-")),
            ("parameters", escape(spec.parameters)),
            ("inputs", ", ".join(spec.inputs)),
            ("masked tokens", MASKED_TOKENS[spec.denominator]),
            ("source", escape(spec.source)),
            ("plugin", escape(spec.origin.path) if spec.origin is not None else None),
            ("needs", "sampler.old_logp: recompute; per token or per sequence (exact under any split)"),
        ]
    )


def card(name: str) -> Table:
    """NAME's card: a rule's, a correction's (`none` too); UserError with a did-you-mean otherwise."""
    if name == NONE:
        return _card([("correction", f"[bold]{NONE}[/bold]: {NONE_SUMMARY}"), ("weight", "1")])
    for registry, make in ((METHODS, method_card), (CORRECTIONS, correction_card)):
        try:
            return make(registry.lookup(name))  # an installed package's entry points load on an unknown name
        except ValueError:
            continue
    raise UserError(unknown_choice("rule or correction", name, [*METHODS, *CORRECTIONS, NONE]))


def print_methods(console: Console | None = None, name: str | None = None, *, words=(), wrap: bool = False) -> None:
    """NAME's card; or the one-line-per-entry list (`words`: the entries whose name, level or summary
    holds every word; one word that names an entry is its card; `wrap`: the summaries in full)."""
    console = console or Console()
    words = [name] if name is not None else list(words)
    unknown = None
    if len(words) == 1:
        try:
            console.print(card(words[0]))  # an installed package's entry points load on an unknown name
            return
        except UserError as e:  # not a name: a word to look for
            unknown = e
    rules, corrections = methods_table(console.width, words, wrap), corrections_table(console.width, words, wrap)
    if words and not rules.row_count and not corrections.row_count:
        raise unknown or UserError(f"no rule or correction holds {' '.join(words)!r} (`clipbench methods` lists them)")
    for table in (rules, corrections):
        if table.row_count:
            console.print(table)
            console.print()
    if not words:
        console.print(escape("aggregations (train.agg.name): " + ", ".join(AGGREGATIONS)))
    console.print(
        "`clipbench methods NAME`: one entry's card (formula, parameters, source); `clipbench methods WORD ...`: "
        "the entries whose name, level, summary or source holds every word (sequence, verl); --long: the "
        "summaries in full"
    )
