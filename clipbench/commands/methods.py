"""`clipbench methods`: every registered rule as a rich table (read from METHODS)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from clipbench.objectives.aggregation import AGGREGATIONS
from clipbench.objectives.registry import METHODS, MethodSpec


def _params(spec: MethodSpec) -> str:
    return "\n".join(f"{p.name}={p.default}" + (f" ({'/'.join(p.choices)})" if p.choices else "")
                     for p in spec.params) or "-"


def methods_table() -> Table:
    table = Table(title="clip objectives (loss is minimised; l = per-token loss)", show_lines=True)
    for col in ("method", "parameters (defaults)", "rule", "source"):
        table.add_column(col, overflow="fold")
    for name, spec in METHODS.items():
        head = f"[bold]{name}[/bold]\n{spec.description}"
        if spec.origin is not None:
            head += f"\nplugin: {spec.origin.path}"
        table.add_row(head, _params(spec), spec.formula or "-", spec.source)
    table.caption = "aggregations: " + ", ".join(AGGREGATIONS) + " (agg=...); KL: beta * k3 to ref_logp"
    return table


def print_methods(console: Console | None = None) -> None:
    (console or Console()).print(methods_table())
