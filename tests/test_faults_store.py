"""Store readers that must not read what they cannot vouch for (issue 39, cases 3 and 9).

- case 3: a report of a sweep whose manifest plans more runs than have finished says so in its first
  line, with the planned runs not yet run and those running (before: "3 runs (2 finished)" and a
  Finding line as if complete).
- case 9: a store of a newer store_format (its manifest.json, or a run's status.json) is refused by
  `report`, `replay` and `sync` in one line, exit 2, nothing written (before: only `sweep` refused it;
  `sync` wrote the runs to MLflow, `replay` read a newer status.json).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clipbench.cli import app

runner = CliRunner()
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "store_format1"


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _set(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


@pytest.fixture
def fixture_store(tmp_path, report_fixture) -> Path:
    return report_fixture.build(tmp_path / "results")


def test_the_report_of_an_unfinished_sweep_says_so_first(fixture_store, report_fixture, tmp_path):
    sweep = fixture_store / report_fixture.SWEEP
    manifest = json.loads((sweep / "manifest.json").read_text())
    planned = list(manifest["runs"])
    not_run, running = planned[-1], planned[-2]
    shutil.rmtree(sweep / not_run)  # planned, never started
    _set(sweep / running / "status.json", state="running")  # training now
    res = runner.invoke(
        app, ["report", report_fixture.SWEEP, "--results-dir", str(fixture_store), "--out", str(tmp_path / "rep")]
    )
    assert res.exit_code == 0, res.output
    n = len(planned)
    assert " ".join(res.stdout.split()).startswith(  # the first line (rich wraps it at the terminal's width)
        f"INCOMPLETE: sweep '{report_fixture.SWEEP}' has {n - 2} of its {n} planned runs finished (1 not yet run: "
        f"{not_run}; 1 running: {running}); what follows is of the finished runs only and may change "
        "(`clipbench sweep` finishes it)."
    )
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["incomplete"] == {"planned": n, "finished": n - 2, "not_run": [not_run], "running": [running]}


def test_the_report_of_a_complete_sweep_has_no_such_line(fixture_store, report_fixture, tmp_path):
    res = runner.invoke(
        app, ["report", report_fixture.SWEEP, "--results-dir", str(fixture_store), "--out", str(tmp_path / "rep")]
    )
    assert res.exit_code == 0 and "INCOMPLETE" not in res.stdout
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["incomplete"] is None


NEWER = "written in results-store format 3; this clipbench reads formats 1 to 2"


@pytest.fixture
def v1_store(tmp_path) -> Path:
    shutil.copytree(FIXTURE / "fixture_v1", tmp_path / "results" / "fixture_v1")
    return tmp_path / "results"


@pytest.mark.parametrize(
    "command",
    [
        ["report", "fixture_v1", "--format", "csv"],
        ["replay", "fixture_v1"],
        ["sync", "fixture_v1"],
    ],
)
def test_a_newer_manifest_is_refused_by_every_reader(v1_store, command):
    manifest = v1_store / "fixture_v1" / "manifest.json"
    _set(manifest, store_format=3)
    before = snapshot(v1_store.parent)
    res = runner.invoke(app, [*command, "--results-dir", str(v1_store)])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"error: {manifest}: {NEWER}") and len(res.stderr.splitlines()) == 1
    assert snapshot(v1_store.parent) == before  # no report, no mlflow.db, no cache


def test_replay_refuses_a_newer_status(v1_store):
    status = next((v1_store / "fixture_v1").glob("*/status.json"))
    _set(status, store_format=3)
    res = runner.invoke(app, ["replay", str(status.parent), "--results-dir", str(v1_store)])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {status}: {NEWER}"), res.output
