"""The options several verbs share, each declared once (its flag, type, default and help): a verb's
handler in clipbench.commands annotates its parameter with one of these and gives the default there."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ResultsDir = Annotated[Path, typer.Option("--results-dir", help="Results store (source of truth).")]
TrackingUri = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///<results-dir>/mlflow.db).",
    ),
]
Plugins = Annotated[
    list[str] | None, typer.Option("--plugin", help="A file (.py) or module with your own @rule; repeatable.")
]
Overrides = Annotated[list[str] | None, typer.Argument(help="key=value overrides (dotted run-config keys).")]
ReportFormat = Annotated[str, typer.Option("--format", help="rich | markdown | latex | csv | html")]
Recipe = Annotated[Path, typer.Argument(help="Recipe YAML, or a shipped recipe by name (clipbench recipes).")]
GpuMemory = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory",
        help="Memory of one of the recipe's GPUs, GiB, for its memory plan (default: the recipe's "
        "launch.gpu_memory, else 80).",
    ),
]
