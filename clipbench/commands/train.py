"""`clipbench train RECIPE [key=value ...] [--nproc-per-node N]`: one run into <results>/train/<run_id>/.

With launch.nproc_per_node = N > 1 (or --nproc-per-node N) this process validates the config, then
starts `torchrun --standalone --nproc-per-node N -m clipbench train ...` and waits: each rank runs
this same command under torchrun (`torchrun ... -m clipbench train ...` by hand works too, with
torchrun's rendezvous flags for several nodes). Rank 0 prints, writes the results store and MLflow.
A rank that dies fails the whole run: status.json says failed and `--resume` continues from the last
checkpoint (on any number of processes). SIGTERM (and launch.preempt_signal) preempts it: the current
optimizer step finishes, a checkpoint is written, status.json says preempted, and the last line is
the command that resumes it (exit code 75).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.console import Console

from clipbench.config import load_run_config, run_id
from clipbench.engines import preflight
from clipbench.engines.launch import launch_ranks, run_as_rank
from clipbench.errors import DiskFull, RunFailed, RunPreempted
from clipbench.tracking.files import check_writable_dir
from clipbench.tracking.mlflow_sink import run_sink
from clipbench.tracking.store import RunDir, RunState, check_run_path
from clipbench.train.checkpoint import find_checkpoint
from clipbench.train.distributed import under_torchrun
from clipbench.train.preempt import preempt_signals


def train_command(
    recipe: Path,
    overrides: list[str],
    *,
    resume: bool,
    results_dir: Path,
    tracking_uri: str | None,
    nproc_per_node: int | None = None,
    plugins: list[str] = (),
) -> dict:
    if nproc_per_node is not None:
        overrides = [*overrides, f"launch.nproc_per_node={nproc_per_node}"]
    # raises ConfigError before anything is written; imports the run's plugins (recipe + --plugin)
    cfg = load_run_config(recipe, overrides, plugins=plugins)
    rd = RunDir(Path(results_dir) / "train" / run_id(cfg))
    check_writable_dir(results_dir)  # a file, or not writable: one line, not a traceback
    check_run_path(rd.path)  # a dangling symbolic link in its place, a file: one line
    rd.status(), rd.read_config()  # a damaged store file of this run: one line (StoreError) before any write
    preflight(cfg, str(recipe))  # engine keys, model, task, benchmarks, sleep mode, GPU memory: nothing written
    n = cfg.launch.nproc_per_node
    args = ["train", str(recipe), *overrides, "--results-dir", str(results_dir)]
    args += ["--tracking-uri", tracking_uri] if tracking_uri else []
    args += [a for p in plugins for a in ("--plugin", str(p))]
    resume_hint = "resume it: " + shlex.join(["clipbench", *args, "--resume"])
    if n > 1 and not under_torchrun():  # this process only launches the ranks
        rc = launch_ranks(n, "clipbench", args + (["--resume"] if resume else []), rd, signals=preempt_signals(cfg))
        if rd.status().get("state") == RunState.PREEMPTED:
            raise RunPreempted(
                f"run {rd.run_id} on {n} processes stopped at a checkpoint; {resume_hint}",
                signal=rd.status().get("signal", ""),
            )
        if rc != 0:
            raise RunFailed(
                f"training on {n} processes failed (torchrun exit code {rc}; the failing rank's error "
                f"is above); {rd.status_path} says failed; rerun with --resume to continue from the "
                f"last checkpoint"
            )
        return {"run_id": rd.run_id, "run_dir": str(rd.path), "steps": cfg.train.steps}

    console = Console(stderr=True)

    def on_rank(dist) -> None:
        console.quiet = not dist.main
        if resume and find_checkpoint(rd.checkpoint_dir) is None:
            console.print(f"[yellow]no checkpoint in {rd.path}; starting from step 0[/]")
        where = f" on {dist.world} processes" if dist.sharded else ""
        console.print(
            f"run {rd.run_id}: {cfg.objective.name} on {cfg.task.name}, {cfg.train.steps} steps{where} -> {rd.path}"
        )

    told = []

    def progress(ev: dict) -> None:
        if not told:  # what resuming set aside or restored, once the run is under way
            told.append(True)
            for note in rd.status().get("checkpoint_notes") or ():
                console.print(f"[yellow]warning:[/] {note}", soft_wrap=True, highlight=False)
        console.print(
            f"  step {ev['step']:>4}/{ev['steps']}  reward {ev['reward']:.3f}  acc {ev['accuracy']:.3f}  "
            f"entropy {ev['entropy']:.3f}  clip events {int(ev['clip_events'])}  skipped {ev.get('skipped', 0)}"
        )

    try:
        summary = run_as_rank(
            cfg,
            rd,
            resume=resume,
            progress=progress,
            on_rank=on_rank,
            make_sink=lambda: run_sink(
                cfg, rd, results_dir=results_dir, sweep="train", tracking_uri=tracking_uri, resume=resume
            ),
        )
    except RunPreempted as e:
        raise RunPreempted(f"{e}; {resume_hint}", signal=e.signal) from None
    except DiskFull as e:
        raise DiskFull(e.path, status_written=e.status_written, remedy=f"free space, then {resume_hint}") from None
    for k, v in sorted(summary.items()):
        if k.startswith("eval/"):
            console.print(f"  {k} = {v:.4f}")
    console.print(f"finished: {rd.path}")
    return summary
