"""`clipbench methods`: every registered rule and sampler correction as rich tables (read from
METHODS and CORRECTIONS)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clipbench.objectives.aggregation import AGGREGATIONS
from clipbench.objectives.corrections import CORRECTIONS, NONE
from clipbench.objectives.registry import METHODS, MethodSpec


def _params(spec) -> str:
    return escape(
        "\n".join(f"{p.name}={p.default}" + (f" ({'/'.join(p.choices)})" if p.choices else "") for p in spec.params)
        or "-"
    )


def _scope(spec: MethodSpec) -> str:
    """What a rule's statistics range over, when they span more than its token."""
    if spec.per_call:
        return "\nper call: exact unsplit only (its statistics range over one micro-batch)"
    if spec.batch_stat is not None:
        return "\nmini-batch statistic: exact under micro-batching (a no-grad pass over the mini-batch when split)"
    return ""


def methods_table() -> Table:
    table = Table(title="clip objectives (loss is minimised; l = per-token loss)", show_lines=True)
    for col in ("method", "parameters (defaults)", "rule", "source"):
        table.add_column(col, overflow="fold")
    for name, spec in METHODS.items():
        head = f"[bold]{escape(name)}[/bold]\n{escape(spec.description)}" + _scope(spec)
        if spec.origin is not None:
            head += f"\nplugin: {escape(spec.origin.path)}"
        table.add_row(head, _params(spec), escape(spec.formula or "-"), escape(spec.source))
    table.caption = "aggregations: " + ", ".join(AGGREGATIONS) + " (agg=...); KL: beta * k3 to ref_logp"
    return table


def corrections_table() -> Table:
    table = Table(
        title="sampler corrections (sampler.correction; rho = pi_old / pi_sampler per token, d = log rho)",
        show_lines=True,
    )
    for col in ("correction", "parameters (defaults)", "weight", "masked tokens", "source"):
        table.add_column(col, overflow="fold")
    table.add_row(f"[bold]{NONE}[/bold]\nno correction (the mismatch is still measured)", "-", "1", "-", "-")
    for name, spec in CORRECTIONS.items():
        head = f"[bold]{escape(name)}[/bold]\n{escape(spec.description)}"
        if spec.origin is not None:
            head += f"\nplugin: {escape(spec.origin.path)}"
        where = "leave the denominators" if spec.denominator == "drop" else "stay in the denominators"
        table.add_row(head, _params(spec), escape(spec.formula or "-"), where, escape(spec.source))
    table.caption = (
        "needs sampler.old_logp: recompute; every correction is per token or per sequence (exact under any split)"
    )
    return table


def print_methods(console: Console | None = None) -> None:
    console = console or Console()
    console.print(methods_table())
    console.print(corrections_table())
