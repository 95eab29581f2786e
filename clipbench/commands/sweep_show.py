"""What `clipbench sweep` prints about a plan and its runs: the plan table (--dry-run), the start
line, the warnings and the table of the runs a sweep trained."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from clipbench.commands import sweep_start
from clipbench.config.labels import format_value
from clipbench.objectives import METHODS
from clipbench.sweep.execute import Next, RunTask, checkpoint_step
from clipbench.sweep.expand import Expansion, iter_summary
from clipbench.sweep.manifest import manifest_runs, merge
from clipbench.sweep.spec import SweepSpec
from clipbench.tracking.store import RunDir, RunState

AVG_KEY = re.compile(r"/avg@(\d+|n)$")  # eval/<benchmark>/avg@<n> (avg@n: a store from before n was named)


def warn(err: Console, warnings: list[str]) -> None:
    for w in warnings:
        err.print(f"[yellow]warning:[/] {w}")


def show_plan(
    spec: SweepSpec, exp: Expansion, existing: dict | None, *, results_dir: Path, json_out: bool, err: Console
) -> dict[str, Any]:
    """--dry-run / --json: the plan, nothing written."""
    mg = merge(existing, spec, exp)
    warn(err, list(exp.warnings) + mg.warnings)
    if json_out:
        for rid, cfg, _ in manifest_runs(mg.manifest):
            sys.stdout.write(json.dumps({"run_id": rid, "config": cfg}) + "\n")
        sys.stdout.flush()
    else:
        out = Console(highlight=False, soft_wrap=False)
        out.print(plan_table(spec, exp, mg.manifest, results_dir, existing is not None, set(mg.new)))
        out.print(_plan_line(spec, exp, mg.manifest, results_dir))
    return {"sweep": spec.name, "runs": list(mg.manifest["runs"]), "written": False}


def start_line(sweep: str, n_runs: int, results_dir: Path, states: dict[str, Next]) -> str:
    counts = {s: sum(1 for v in states.values() if v is s) for s in Next}
    return sweep_start.start_line(
        sweep,
        n_runs,
        results_dir,
        finished=counts[Next.FINISHED],
        resume=counts[Next.RESUME],
        start=counts[Next.START],
        failed=counts[Next.FAILED],
    )


def _state(rd: RunDir) -> str:
    st = rd.status() if rd.status_path.exists() else None
    if st is None:
        return RunState.PENDING.value
    state = st.get("state", RunState.PENDING.value)
    if state in (RunState.RUNNING, RunState.PENDING, RunState.PREEMPTED):
        ck = checkpoint_step(rd)
        what = "preempted" if state == RunState.PREEMPTED else "interrupted"
        return f"{what} (ckpt {ck})" if ck is not None else what
    return state


def plan_table(
    spec: SweepSpec, exp: Expansion, manifest: dict, results_dir: Path, show_state: bool, new: set[str]
) -> Table:
    t = Table(title=f"sweep {spec.name} ({spec.file})", title_justify="left")
    for col in ("run_id", "method", "parameters", "seed", "steps"):
        t.add_column(col, justify="right" if col in ("seed", "steps") else "left")
    rows = list(iter_summary(manifest["runs"], manifest.get("points", {})))
    other = any(r["other"] for r in rows)
    if other:
        t.add_column("other axes")
    if show_state:
        t.add_column("state")
    for r in rows:
        defaults = METHODS[r["method"]].defaults if r["method"] in METHODS else {}
        on_axis = {k[len("objective.") :] for k in manifest.get("points", {}).get(r["run_id"], {})}
        params = (
            " ".join(f"{k}={format_value(v)}" for k, v in r["params"].items() if k in on_axis or defaults.get(k) != v)
            or "(defaults)"
        )
        cells = [r["run_id"], r["method"], params, str(r["seed"]), str(r["steps"])]
        if other:
            cells.append(" ".join(f"{k}={format_value(v)}" for k, v in r["other"].items()))
        if show_state:
            cells.append("new" if r["run_id"] in new else _state(RunDir(results_dir / spec.name / r["run_id"])))
        t.add_row(*cells)
    return t


def _plan_line(spec: SweepSpec, exp: Expansion, manifest: dict, results_dir: Path) -> str:
    n = len(manifest["runs"])
    dropped = exp.combos - exp.excluded - len(exp.runs)
    why = []
    if exp.excluded:
        why.append(f"{exp.excluded} excluded")
    if dropped:
        why.append(f"{dropped} dropped as duplicates (objective parameters a method does not have)")
    return (
        f"{n} runs from {exp.combos} grid points"
        + (f" ({'; '.join(why)})" if why else "")
        + f" -> {results_dir / spec.name} (dry run: nothing written)"
    )


def summary_table(tasks: list[RunTask], by_id: dict[str, dict]) -> Table:
    t = Table(title="runs", title_justify="left")
    for col in ("run_id", "run", "outcome", "time", "eval"):
        t.add_column(col)
    for task in tasks:
        r = by_id.get(task.run_id)
        if r is None:
            continue
        ev = " ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in (r.get("evals") or {}).items() if AVG_KEY.search(k))
        t.add_row(task.run_id, task.label, r["outcome"], f"{r['seconds']:.0f}s" if r.get("seconds") else "", ev)
    return t
