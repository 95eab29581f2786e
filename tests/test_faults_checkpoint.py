"""Checkpoints that are not to be trusted (issue 39, cases 1, 2 and 4): resume never continues a run
from a checkpoint that is not its own or not whole, never loses a metrics row, and says what it did.

Each test interrupts a real run with a real SIGTERM (in this process, at a fixed rollout step, so the
checkpoint is the same every time), damages or swaps a real file, and resumes with the command a user
types (`clipbench train ... --resume`, a child process): its output says in one line what was set
aside or restored, and the finished run equals an uninterrupted one (metrics rows, histograms and
final parameters, exactly: one thread, the same arithmetic).

- case 1: seed 1's checkpoint copied over seed 0's (before: seed 0 "finished" on seed 1's weights).
- case 2: the last metrics row torn (its append not on disk while the checkpoint was; before: 7 of 8
  rows, for good).
- an older layout's checkpoint (no run id, seed or checksums) of another run: it cannot show it is
  the run's own, so it is set aside (before: resumed without a word).
- case 4: a truncated DCP shard, a zero-byte rollout.pt, a truncated state.json (before: a torch
  traceback and a failed run that a rerun skipped; a one-line failure that never retried; a silent
  restart), and an older clipbench's checkpoint without checksums whose shard is truncated (it fails
  to load: one line, restarted).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import yaml

from clipbench.config import load_run_config, run_id
from clipbench.errors import RunPreempted
from clipbench.tracking.store import RunDir
from clipbench.train.checkpoint import checkpoint_step, load_partial, load_policy
from clipbench.train.loop import run_training
from clipbench.train.preempt import StopRequest

pytestmark = pytest.mark.slow  # trains the tiny model

REPO = Path(__file__).resolve().parent.parent
RECIPE = str(REPO / "recipes" / "arith_tiny.yaml")
# 4 rollout steps x 2 mini-batches = 8 optimizer steps (metrics rows); a checkpoint every 2 steps
RUN = {
    "train.steps": 4,
    "train.prompts_per_step": 2,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.checkpoint_every": 2,
    "eval.benchmarks": [],
    "tracking.mlflow": False,
}


def overrides(seed: int) -> list[str]:
    return [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}" for k, v in RUN.items()
    ] + [f"seed={seed}"]


CFG = {seed: load_run_config(RECIPE, overrides(seed)) for seed in (0, 1)}
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This process and the `clipbench train` children on one thread: the same float arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Seeds 0 and 1, uninterrupted."""
    root = tmp_path_factory.mktemp("clean")
    out = {}
    for seed, cfg in CFG.items():
        rd = RunDir(root / f"seed{seed}")
        run_training(cfg, rd.path)
        out[seed] = rd
    return out


def interrupted(results: Path, seed: int = 0, at: int = 2) -> RunDir:
    """Seed `seed`'s run in `results/train/<run id>` (where `clipbench train` keeps it), stopped by a
    real SIGTERM once rollout step `at` is logged: status preempted, a checkpoint at step `at`."""
    rd = RunDir(results / "train" / run_id(CFG[seed]))
    stop = StopRequest.install(["SIGTERM"])

    def progress(ev):
        if ev["step"] == at:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        with pytest.raises(RunPreempted):
            run_training(CFG[seed], rd.path, stop=stop, progress=progress)
    finally:
        stop.restore()
    assert rd.status()["state"] == "preempted" and checkpoint_step(rd.checkpoint_dir) == at
    return rd


def resume(results: Path, seed: int = 0) -> subprocess.CompletedProcess:
    args = ["train", RECIPE, *overrides(seed), "--results-dir", str(results), "--resume"]
    p = subprocess.run(
        [sys.executable, "-m", "clipbench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=ONE_THREAD,
        timeout=400,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def same_run(a: RunDir, b: RunDir) -> None:
    assert strip(a.read_metrics()) == strip(b.read_metrics())
    assert len(a.read_metrics()) == 8  # 4 rollout steps x 2 mini-batches
    assert a.hist_path.read_text() == b.hist_path.read_text()
    pa, pb = (load_policy(rd.checkpoint_dir)[0].state_dict() for rd in (a, b))
    assert all(bool((pa[k] == pb[k]).all()) for k in pa)


def warnings_of(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("warning:")]


def test_a_checkpoint_copied_in_from_another_run_is_set_aside_and_the_run_restarts(clean, tmp_path):
    rd = interrupted(tmp_path)
    shutil.rmtree(rd.checkpoint_dir)
    shutil.copytree(clean[1].checkpoint_dir, rd.checkpoint_dir)  # seed 1's final checkpoint (step 4)
    p = resume(tmp_path)
    rid1 = run_id(CFG[1])
    assert warnings_of(p) == [
        f"warning: checkpoint checkpoints/last set aside (removed): it belongs to run {rid1} (seed 1), "
        f"not to this run {rd.run_id} (seed 0)",
        "warning: the run restarts from step 0",
    ]
    st = rd.status()
    assert st["state"] == "finished" and st["resumed_from"] is None and len(st["checkpoint_notes"]) == 2
    same_run(rd, clean[0])  # seed 0's own numbers, not seed 1's
    assert strip(rd.read_metrics()) != strip(clean[1].read_metrics())


def test_a_torn_last_metrics_row_is_restored_from_the_checkpoint(clean, tmp_path):
    rd = interrupted(tmp_path)  # checkpoint at step 2: 4 rows (steps 0 and 1)
    text = rd.metrics_path.read_text()
    assert text.count("\n") == 4
    body, last = text[:-1].rsplit("\n", 1)
    rd.metrics_path.write_text(body + "\n" + last[: len(last) // 2])  # the 4th row cut (power loss)
    p = resume(tmp_path)
    assert warnings_of(p) == [
        "warning: metrics.jsonl had lost its last 1 row(s) (a torn or unsynced append): restored from the "
        "checkpoint's copy"
    ]
    assert rd.status()["resumed_from"] == 2
    same_run(rd, clean[0])  # 8 of 8 rows, the uninterrupted run's


def test_an_older_layout_checkpoint_of_another_run_is_set_aside(clean, tmp_path):
    """Seed 1's final checkpoint in the layout from before checkpoints named their run (no run id,
    seed, checksums or copy of the rows) copied over seed 0's: before, seed 0 "finished" on seed 1's
    weights without a word. A checkpoint that cannot show it is the run's own is another run's."""
    rd = interrupted(tmp_path)
    shutil.rmtree(rd.checkpoint_dir)
    shutil.copytree(clean[1].checkpoint_dir, rd.checkpoint_dir)
    state = json.loads((rd.checkpoint_dir / "state.json").read_text())
    assert state["clipbench"] == version("clipbench")  # checkpoints record the version that wrote them
    for k in ("files", "run_id", "seed", "clipbench"):
        state.pop(k)
    (rd.checkpoint_dir / "state.json").write_text(json.dumps(state))
    shutil.rmtree(rd.checkpoint_dir / "logs")
    p = resume(tmp_path)
    assert warnings_of(p) == [
        "warning: checkpoint checkpoints/last set aside (removed): it does not name its run (a checkpoint of an "
        "older clipbench, written before checkpoints recorded their run id and seed): it cannot show it is this "
        "run's own",
        "warning: the run restarts from step 0",
    ]
    same_run(rd, clean[0])  # seed 0's own numbers, not seed 1's


def test_a_checkpoint_ahead_of_its_metrics_without_a_copy_is_set_aside(clean, tmp_path):
    """An older clipbench's checkpoint (its run named, but no copy of the rows, no checksums) at step 2
    while metrics.jsonl lost the rows of step 1: it cannot be continued without a hole, so the run
    restarts."""
    rd = interrupted(tmp_path)
    state = json.loads((rd.checkpoint_dir / "state.json").read_text())
    state.pop("files")
    (rd.checkpoint_dir / "state.json").write_text(json.dumps(state))
    shutil.rmtree(rd.checkpoint_dir / "logs")
    rows = rd.metrics_path.read_text().splitlines(keepends=True)
    rd.metrics_path.write_text("".join(rows[:2]))  # only step 0's two rows
    p = resume(tmp_path)
    assert warnings_of(p)[0] == (
        "warning: checkpoint checkpoints/last set aside (removed): it is ahead of metrics.jsonl, which lacks "
        "the rows of optimizer steps 3 to 4 (and this checkpoint, written by an older clipbench, holds no copy of them)"
    )
    same_run(rd, clean[0])


def damage_shard(rd: RunDir) -> tuple[str, int, int]:
    shard = rd.checkpoint_dir / "dcp" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    return "dcp/__0_0.distcp", size // 2, size


def test_a_truncated_shard_is_set_aside_and_the_run_restarts(clean, tmp_path):
    rd = interrupted(tmp_path)
    rel, now, was = damage_shard(rd)
    p = resume(tmp_path)
    assert warnings_of(p) == [
        f"warning: checkpoint checkpoints/last set aside (removed): its file {rel} has {now} bytes, not the "
        f"{was} it was written with",
        "warning: the run restarts from step 0",
    ]
    assert "Traceback" not in p.stderr
    same_run(rd, clean[0])


def test_a_zero_byte_rollout_pt_is_set_aside_and_the_run_restarts(clean, tmp_path, monkeypatch):
    """A checkpoint taken inside a rollout step (a signal during its 3rd optimizer step) holds the
    interrupted rollout step in rollout.pt; zero bytes of it: set aside, restarted."""
    import clipbench.train.loop as loop

    rd = RunDir(tmp_path / "train" / run_id(CFG[0]))
    real, calls = loop.optimizer_step, []

    def step(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    monkeypatch.setattr(loop, "optimizer_step", step)
    stop = StopRequest.install(["SIGTERM"])
    try:
        with pytest.raises(RunPreempted, match="at rollout step 1 .optimizer step 3."):
            run_training(CFG[0], rd.path, stop=stop)
    finally:
        stop.restore()
    monkeypatch.undo()
    assert load_partial(rd.checkpoint_dir) is not None
    (rd.checkpoint_dir / "rollout.pt").write_bytes(b"")
    p = resume(tmp_path)
    assert warnings_of(p)[0].startswith(
        "warning: checkpoint checkpoints/last set aside (removed): its file rollout.pt has 0 bytes, not the "
    )
    same_run(rd, clean[0])


def test_a_truncated_state_json_is_said_and_the_run_restarts(clean, tmp_path):
    rd = interrupted(tmp_path)
    state = rd.checkpoint_dir / "state.json"
    state.write_text(state.read_text()[:40])
    p = resume(tmp_path)
    (first, second) = warnings_of(p)
    assert first.startswith(
        "warning: checkpoint checkpoints/last set aside (removed): its state.json is damaged (JSONDecodeError: "
    )
    assert second == "warning: the run restarts from step 0"
    same_run(rd, clean[0])


def test_an_older_checkpoint_that_fails_to_load_is_one_line_and_the_run_restarts(clean, tmp_path):
    """Without checksums (an older clipbench's checkpoint) a truncated shard is found when it loads:
    one line (not DCP's traceback), set aside, restarted."""
    rd = interrupted(tmp_path)
    state = json.loads((rd.checkpoint_dir / "state.json").read_text())
    del state["files"]
    (rd.checkpoint_dir / "state.json").write_text(json.dumps(state))
    damage_shard(rd)
    p = resume(tmp_path)
    first, second = warnings_of(p)
    assert first.startswith("warning: checkpoint checkpoints/last set aside (removed): it could not be loaded (")
    assert second == "warning: the run restarts from step 0"
    assert "Traceback" not in p.stderr
    same_run(rd, clean[0])
