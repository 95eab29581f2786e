"""A finished sweep whose files were damaged afterwards: a real two-run sweep of the tiny model (grpo,
seeds 0 and 1; 2 rollout steps of 2 optimizer steps each, a checkpoint at the end, an evaluation at
steps 0 and 2), trained once per module and copied for each test, then damaged as a user or a
machine does it, and read with the commands a user types.

- A finished run that lost its metrics.jsonl (deleted, emptied, a torn last row) dropped out of the
  training tables and the claims while its Runs row said "ok", and no rerun restored it though its
  last checkpoint holds a copy. Now the report reads the copy (with a note) and `clipbench sweep`
  writes it back; what no checkpoint holds is named first and in the Runs table.
- A dangling run-directory symlink: a 118-line traceback (with `--jobs 2`, FileExistsError).
- A sweep whose recipe was deleted could not resume, or took the shipped recipe of the same name
  for new runs; it resumes from its manifest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.config.shipped import shipped_recipe
from clipbench.tracking.store import RunDir

pytestmark = pytest.mark.slow  # trains the tiny model (about 20 s for the module)

REPO = Path(__file__).resolve().parent.parent
SWEEP = "tiny"
TINY = {
    "train.steps": 2,
    "train.prompts_per_step": 2,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.checkpoint_every": 2,
    "eval.n": 2,
    "eval.limit": 4,
    "tracking.mlflow": False,
}
runner = CliRunner()


def write_sweep(where: Path, **extra) -> Path:
    f = where / f"{SWEEP}.yaml"
    spec = {
        "name": SWEEP,
        "base": str(REPO / "recipes" / "arith_tiny.yaml"),
        "overrides": TINY,
        "grid": {"seed": [0, 1]},
    }
    f.write_text(yaml.safe_dump({**spec, **extra}, sort_keys=False))
    return f


def sweep(f: Path, results: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipbench", "sweep", str(f), "--results-dir", str(results), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The sweep, finished: <tmp>/results (and its file beside it)."""
    tmp = tmp_path_factory.mktemp("tiny")
    p = sweep(write_sweep(tmp), tmp / "results")
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp


@pytest.fixture
def store(trained, tmp_path) -> tuple[Path, Path]:
    """(a copy of the finished sweep's results dir, the sweep file its manifest was frozen from)."""
    shutil.copytree(trained / "results", tmp_path / "results")
    return tmp_path / "results", trained / f"{SWEEP}.yaml"


def runs(results: Path) -> dict[int, RunDir]:
    """{seed: the run}."""
    out = {}
    for d in (results / SWEEP).iterdir():
        if (d / "config.yaml").is_file():
            out[yaml.safe_load((d / "config.yaml").read_text())["seed"]] = RunDir(d)
    return out


def report(results: Path, out: Path):
    res = runner.invoke(app, ["report", SWEEP, "--results-dir", str(results), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return res, json.loads((out / "report.json").read_text())


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("damage", ["deleted", "emptied", "torn last row"])
def test_a_finished_runs_lost_metrics_come_back_from_its_checkpoint(store, trained, tmp_path, damage):
    results, f = store
    rd = runs(results)[0]
    clean = rd.metrics_path.read_bytes()
    _, before = report(results, tmp_path / "before")
    if damage == "deleted":
        rd.metrics_path.unlink()
        lost, how = 4, "it was missing"
    elif damage == "emptied":
        rd.metrics_path.write_bytes(b"")
        lost, how = 4, "it was empty"
    else:  # the last row cut in half (a power loss during its append)
        rd.metrics_path.write_bytes(clean[: clean.rstrip(b"\n").rfind(b"\n") + 1 + 30])
        lost, how = 1, "its tail was cut or torn"
    what = f"metrics.jsonl had lost {lost} of its 4 rows ({how})"
    res, after = report(results, tmp_path / "after")
    assert (
        f"Note: run {rd.run_id}: {what}: read from its last checkpoint's copy (`clipbench sweep`, the same "
        "command, writes them back)" in one_line(res.stdout)
    )
    assert "LOST" not in res.stdout
    # the training tables and claims read both seeds, as before the damage
    assert after["claims"] == before["claims"] and after["dynamics"] == before["dynamics"]
    p = sweep(f, results)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"warning: run {rd.run_id}: {what}: restored from its last checkpoint's copy" in one_line(p.stderr)
    assert rd.metrics_path.read_bytes() == clean


def test_training_rows_no_checkpoint_holds_are_named_first(store, tmp_path):
    results, _ = store
    rd = runs(results)[0]
    rd.metrics_path.unlink()
    shutil.rmtree(rd.path / "checkpoints")
    res, rep = report(results, tmp_path / "rep")
    lost = (
        "metrics.jsonl lacks the rows of rollout steps 0 to 1 (no checkpoint of the run holds them): its training "
        "rows are left out"
    )
    assert one_line(res.stdout).startswith(
        f"LOST: 1 finished run(s) of sweep '{SWEEP}' lack training rows that nothing can restore (grpo seed 0 "
        f"({rd.run_id}): {lost}); the training tables and the claims on them are of the other runs."
    )
    assert rep["lost"] == {rd.run_id: [lost]}
    assert rep["health"][rd.run_id]["flags"][0] == lost  # the Runs table's Flags cell, not "ok"
    assert rep["blocks"][0]["labels"]["grpo"]["seeds"] == [0, 1]  # its evaluation is still compared


def test_a_dangling_run_directory_link_is_one_line(store, tmp_path):
    """A run directory moved to another disk and linked back, then lost: a 118-line traceback (with
    --jobs 2, FileExistsError), and the report called the run "not yet run"."""
    results, f = store
    rd = runs(results)[0]
    moved = tmp_path / "elsewhere" / rd.run_id
    moved.parent.mkdir()
    rd.path.rename(moved)
    rd.path.symlink_to(tmp_path / "gone" / rd.run_id)
    line = (
        f"error: {rd.path}: a symbolic link to {tmp_path / 'gone' / rd.run_id}, which does not exist; restore what "
        "it points to (the run's files), or remove the link to train the run again"
    )
    for extra in ((), ("--jobs", "2")):
        p = sweep(f, results, *extra)
        assert p.returncode == 2 and p.stderr.splitlines() == [line], p.stderr[-2000:]
    res = runner.invoke(app, ["report", SWEEP, "--results-dir", str(results), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2 and res.stderr.splitlines() == [line]
    rd.path.unlink()
    rd.path.symlink_to(moved)  # the link mended: the run is found finished where it points
    p = sweep(f, results, "--jobs", "2")
    assert p.returncode == 0 and "(2 finished, 0 to resume, 0 to start)" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("recipe", ["arith_tiny.yaml", "mine.yaml"], ids=["a-shipped-name", "own-name"])
def test_a_sweep_whose_recipe_is_gone_resumes_from_its_manifest(tmp_path, recipe):
    """The sweep's recipe (beside it, `base: RECIPE`) deleted: it could not resume (recipe not found),
    though its manifest holds every run's frozen config; or, its name being a shipped recipe's, new
    runs silently took that recipe (a learning rate of 5e-5 where the deleted file said 1e-4). Now the
    frozen runs resume from the manifest and no new run is planned from another file."""
    mine = tmp_path / recipe
    mine.write_text((REPO / "recipes" / "arith_tiny.yaml").read_text().replace("lr: 5.0e-5", "lr: 1.0e-4"))
    f = tmp_path / "s.yaml"
    spec = {"name": "s", "base": recipe, "overrides": TINY, "grid": {"seed": [0]}}
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    results = tmp_path / "results"
    p = sweep(f, results)
    assert p.returncode == 0, p.stderr[-2000:]
    (run,) = [d for d in (results / "s").iterdir() if (d / "config.yaml").is_file()]
    mine.unlink()
    shutil.rmtree(run)  # planned and frozen, not yet trained (as after a kill before its start)
    f.write_text(yaml.safe_dump({**spec, "grid": {"seed": [0, 1]}}, sort_keys=False))  # and a seed added
    p = sweep(f, results)
    assert p.returncode == 0, p.stderr[-2000:]
    instead = (
        f", and its base '{recipe}' now names the shipped recipe {shipped_recipe(recipe)}, another recipe"
        if recipe == "arith_tiny.yaml"
        else ""
    )
    assert (
        f"warning: the recipe {mine} that sweep 's' was frozen from is gone{instead}: its 1 frozen runs resume "
        "from the manifest (each holds its whole config) and no new run is planned; restore the recipe to plan "
        "new ones"
    ) in one_line(p.stderr)
    assert "1/1 runs finished" in p.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == 1.0e-4  # the deleted recipe's
    assert len(json.loads((results / "s" / "manifest.json").read_text())["runs"]) == 1  # seed 1: not planned
