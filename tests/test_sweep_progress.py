"""The sweep's progress bars: fractional sweep progress for the ETA, per-run fields, late events."""

from __future__ import annotations

import io

from rich.console import Console

from clipbench.commands.progress import SweepProgress


def test_progress_bars_track_runs_steps_and_drop_late_events():
    buf = io.StringIO()
    with SweepProgress(4, console=Console(file=buf, width=140), title="sw") as ui:
        ui.start_run("r1", "grpo seed=0", 10)
        ui.event("r1", {"step": 5, "steps": 10, "reward": 0.25, "entropy": 0.5, "clip_events": 12.0})
        task = ui.progress.tasks[ui._tasks["r1"]]
        assert (task.completed, task.total) == (5, 10)
        assert task.fields["info"] == "reward 0.250  entropy 0.500  clip events 12"
        sweep = ui.progress.tasks[ui.sweep_task]
        assert sweep.completed == 0.5  # half of the first of 4 runs: the ETA moves within a run
        ui.end_run("r1", "finished", "grpo seed=0", "3s")
        assert sweep.completed == 1 and sweep.fields["count"] == "1/4 runs"
        ui.event("r1", {"step": 10, "steps": 10})  # a worker's late message: ignored
        ui.start_run("r1", "grpo seed=0", 10)
        assert "r1" not in ui._tasks and sweep.completed == 1
        ui.end_run("r2", "locked", "dapo seed=0")  # skipped runs do not count as done
        assert sweep.completed == 1
    out = buf.getvalue()
    assert "finished r1 grpo seed=0  3s" in out and "locked r2 dapo seed=0" in out
