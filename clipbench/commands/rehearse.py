"""`clipbench rehearse RECIPE [key=value ...] [--nproc-per-node N] [--results-dir DIR]`: a dress rehearsal
of a recipe on this machine (clipbench.rehearse), then its real memory plan and one verdict line.

    clipbench rehearse recipes/abc_grpo_table3/qwen3_4b_grpo.yaml      # before booking 8 GPUs for a week

Prints one table (every part of the recipe: ran as in the recipe, ran scaled (from -> to), skipped
(why)), the real recipe's memory plan per GPU (`clipbench plan`), and the verdict. Exit code: 0 when
everything that can run here ran, 1 when a part failed, 2 for bad input (nothing written).
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from clipbench.errors import UserError
from clipbench.rehearse import check_local_model, rehearse

STYLE = {"as": "green", "ran": "green", "scaled": "cyan", "skipped": "yellow", "failed": "bold red"}


def rehearse_command(
    recipe: Path,
    overrides: list[str],
    *,
    nproc_per_node: int | None,
    results_dir: Path,
    tracking_uri: str | None,
    plugins: list[str] = (),
    gpu_memory: float | None = None,
) -> int:
    from clipbench.commands.doctor import doctor_command  # noqa: PLC0415 - commands.doctor pulls in omegaconf
    from clipbench.commands.plan import check_gpu_memory, render  # noqa: PLC0415 - commands.plan pulls in torch
    from clipbench.config import load_run_config  # noqa: PLC0415 - config pulls in omegaconf

    if nproc_per_node is not None and nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    check_gpu_memory(gpu_memory)
    cfg = load_run_config(recipe, overrides, plugins=plugins)  # bad input: one line, before anything is printed
    check_local_model(cfg.model.name)
    err = Console(stderr=True, highlight=False)
    doctor_command(results_dir=results_dir, tracking_uri=tracking_uri, console=err)  # what this machine can run
    t0 = time.time()
    result = rehearse(
        recipe,
        overrides,
        nproc_per_node=nproc_per_node,
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        plugins=list(plugins),
        gpu_memory=gpu_memory,
        say=lambda msg: err.print(f"[dim]{time.time() - t0:6.1f} s  {msg}[/]"),
    )
    out = Console(highlight=False)
    out.width = max(out.width, 120)  # a pipe reports 80 columns: the parts' details need more
    table = Table(title=f"rehearsal of {recipe} ({result.work})", title_justify="left")
    table.add_column("part of the recipe")
    table.add_column("in the rehearsal", overflow="fold")
    for p in result.parts:
        table.add_row(p.name, f"[{STYLE[p.how]}]{p.describe()}[/]")
    out.print(table)
    if result.plan is not None:
        out.print("memory plan of the real recipe (clipbench plan):")
        render(result.plan, [result.plan_note] if result.plan_note else [], result.hardware)
    elif result.plan_note:
        out.print(result.plan_note)
    out.print(("[green]" if result.ok else "[bold red]") + result.verdict() + "[/]")
    return 0 if result.ok else 1
