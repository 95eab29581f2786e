"""Rich progress bars for a sweep: one bar for the sweep (runs done / total, ETA) and one per active
run (rollout step / steps, reward, entropy, clip events).

The trainer calls `progress(event)` once per rollout step with keys step, steps, reward, entropy,
clip_events (and accuracy); `SweepProgress.callback(run_id)` returns such a callable. The sweep bar
advances by fractions of a run, so its ETA is meaningful after the first steps of the first run.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

OUTCOME_STYLE = {
    "finished": "green",
    "resumed": "green",
    "skipped": "dim",
    "locked": "yellow",
    "failed": "red",
    "failed-skipped": "red",
    "crashed": "red",
    "disk-full": "red",
    "killed": "red",
    "preempted": "yellow",
    "not-started": "yellow",
}


class SweepProgress(AbstractContextManager):
    def __init__(self, total: int, *, console: Console | None = None, title: str = "sweep"):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}", style="bold"),
            BarColumn(bar_width=28),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            transient=False,
            refresh_per_second=4,
        )
        self.total = total
        self.done = 0
        self._frac: dict[str, float] = {}
        self._tasks: dict[str, TaskID] = {}
        self._ended: set[str] = set()  # late messages from a worker's queue are dropped
        self._lock = threading.RLock()  # --jobs: a queue-pump thread and the main thread both update
        self.sweep_task = self.progress.add_task(title, total=max(total, 1), count=f"0/{total} runs", info="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        return False

    # sweep-level
    def _update_sweep(self) -> None:
        self.progress.update(
            self.sweep_task, completed=self.done + sum(self._frac.values()), count=f"{self.done}/{self.total} runs"
        )

    def start_run(self, run_id: str, label: str, steps: int | None) -> None:
        with self._lock:
            if run_id in self._ended or run_id in self._tasks:
                return
            self._start_run(run_id, label, steps)

    def _start_run(self, run_id: str, label: str, steps: int | None) -> None:
        self._frac[run_id] = 0.0
        self._tasks[run_id] = self.progress.add_task(
            f"  {run_id} {label}"[:60], total=steps or 1, count=f"0/{steps} steps", info=""
        )

    def event(self, run_id: str, ev: dict) -> None:
        with self._lock:
            self._event(run_id, ev)

    def _event(self, run_id: str, ev: dict) -> None:
        tid = self._tasks.get(run_id)
        if tid is None:
            return
        step, steps = int(ev.get("step", 0)), int(ev.get("steps", 1) or 1)
        info = "  ".join(f"{k} {ev[k]:.3f}" for k in ("reward", "entropy") if isinstance(ev.get(k), (int, float)))
        if isinstance(ev.get("clip_events"), (int, float)):
            info += f"  clip events {int(ev['clip_events'])}"
        self.progress.update(tid, completed=step, total=steps, count=f"{step}/{steps} steps", info=info)
        self._frac[run_id] = min(step / steps, 1.0)
        self._update_sweep()

    def end_run(self, run_id: str, outcome: str, label: str = "", detail: str = "") -> None:
        with self._lock:
            self._ended.add(run_id)
            self._end_run(run_id, outcome, label, detail)

    def _end_run(self, run_id: str, outcome: str, label: str, detail: str) -> None:
        tid = self._tasks.pop(run_id, None)
        if tid is not None:
            self.progress.remove_task(tid)
        self._frac.pop(run_id, None)
        if outcome in ("finished", "resumed", "failed", "crashed", "disk-full", "killed"):
            self.done += 1
        style = OUTCOME_STYLE.get(outcome, "default")
        self.progress.console.print(f"[{style}]{outcome:>9}[/] {run_id} {label}" + (f"  {detail}" if detail else ""))
        self._update_sweep()

    def callback(self, run_id: str):
        return lambda ev: self.event(run_id, ev)
