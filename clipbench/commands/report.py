"""`clipbench report [SWEEP] --baseline METHOD --format rich|markdown|latex|csv|html [--out DIR] [--replicate B] [--tune-on BENCH]`.

Reads the results store only (works offline; clipbench.report builds the report). Writes to ``--out``
(default ``<results>/reports/<sweep>/``) the files of the format (report/build.py); `rich` prints the
tables to the terminal. Paths written are printed, the HTML page last. ``--replicate B`` checks
every claim of SWEEP against sweep B (a name in the results dir or a path to a sweep directory)
instead of the two halves of SWEEP's seeds. ``--tune-on BENCH`` reads a learning-rate axis on that
benchmark alone (a validation split): each rule's best rate and lr* (docs/reports.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from clipbench.errors import UserError, unknown_choice
from clipbench.report import render
from clipbench.report.build import build_report, warning_lines, write_report
from clipbench.tracking.files import check_store_dir, check_writable_dir
from clipbench.tracking.store import list_sweeps


def report_command(
    sweep: str | None,
    *,
    baseline: str | None,
    fmt: str,
    results_dir: Path,
    out: Path | None,
    replicate: str | None = None,
    tune_on: str | None = None,
    replay: bool = True,
) -> list[Path]:
    if fmt not in render.FORMATS:
        raise UserError("--format: " + unknown_choice("format", fmt, render.FORMATS))
    if replicate and not sweep:
        raise UserError("--replicate: name the sweep it replicates (`clipbench report A --replicate B`)")
    results_dir = check_store_dir(results_dir)
    names = [sweep] if sweep else list_sweeps(results_dir)
    if not names:
        raise UserError(
            f"no sweeps with runs in {results_dir}; run `clipbench sweep FILE --results-dir {results_dir}` first"
        )
    written: list[Path] = []
    for name in names:
        s, result, tables, header = build_report(results_dir, name, baseline, replicate, tune_on, replay)
        if out is None:
            out_dir = check_writable_dir(results_dir / "reports" / name, "report directory")
        else:
            out_dir = check_writable_dir(Path(out) if len(names) == 1 else Path(out) / name, "--out")
        paths = write_report(s, result, tables, header, fmt, out_dir)
        if fmt != "rich":  # the files say it first; so does the terminal
            for line in warning_lines(s, result):
                print(f"warning: {line}", file=sys.stderr)
        if fmt == "rich":
            console = render.report_console()
            for line in header:
                console.print(line, highlight=False)
            console.print()
            render.print_rich(tables, console)
        written += paths
        for p in paths:
            # report.json and the tidy CSVs: always written, not printed (docs/reports.md)
            if p.suffix != ".png" and p.name != "report.json" and not p.name.endswith("_tidy.csv"):
                print(p)
    return written
