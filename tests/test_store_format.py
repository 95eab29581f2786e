"""The results store's format version (clipbench.tracking.store_format): a store clipbench 0.1.0 wrote
(format 1, no version field; tests/fixtures/store_format1) still reads to the same report tables and
is continued without being rewritten; a store of a newer format is refused in one line that names the
version found, the versions read and what to do; new writes record the version."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.errors import StoreError
from clipbench.sweep.manifest import read_manifest
from clipbench.tracking.store import RunDir
from clipbench.tracking.store_format import STORE_FORMAT

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "store_format1"
RUNS = ("165d77441001", "51201d1ff3f0")  # grpo, dapo
runner = CliRunner()


@pytest.fixture
def store(tmp_path) -> Path:
    """A copy of the 0.1.0 store (readers may write caches beside it)."""
    shutil.copytree(FIXTURE / "fixture_v1", tmp_path / "results" / "fixture_v1")
    return tmp_path / "results"


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_format_1_reads_as_today_without_a_write(store):
    before = snapshot(store)
    assert STORE_FORMAT == 2
    for rid in RUNS:
        st = RunDir(store / "fixture_v1" / rid).status()
        assert st["state"] == "finished" and st["step"] == 2 and st["store_format"] == 2  # migrated in memory
    m = read_manifest(store / "fixture_v1" / "manifest.json")
    assert sorted(m["runs"]) == sorted(RUNS) and m["store_format"] == 2
    assert snapshot(store) == before  # reading writes nothing


def test_format_1_store_reports_the_same_tables_as_0_1_0(store, tmp_path):
    """The report of today's release on the 0.1.0 store equals the one 0.1.0 built (table3.csv: Avg@2
    18.8 -> 25.0 for both rules over the 16 held-out problems at step 0 and step 2; runs.csv: both
    finished at 2/2)."""
    res = runner.invoke(
        app,
        [
            "report",
            "fixture_v1",
            "--results-dir",
            str(store),
            "--format",
            "csv",
            "--out",
            str(tmp_path / "rep"),
            "--baseline",
            "grpo",
        ],
    )
    assert res.exit_code == 0, res.output
    for name in ("table3.csv", "runs.csv"):
        assert (tmp_path / "rep" / name).read_text() == (FIXTURE / name).read_text(), name


@pytest.mark.slow
def test_format_1_sweep_is_continued_not_rewritten(store):
    """Today's `clipbench sweep` on the 0.1.0 store: both runs found finished, nothing rewritten."""
    before = snapshot(store / "fixture_v1")
    res = runner.invoke(app, ["sweep", str(FIXTURE / "fixture_v1.sweep.yaml"), "--results-dir", str(store)])
    assert res.exit_code == 0, res.output
    assert "2 finished" in res.output
    after = snapshot(store / "fixture_v1")
    assert {k: v for k, v in after.items() if not k.startswith(".")} == {
        k: v for k, v in before.items() if not k.startswith(".")
    }


def _set(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def test_a_newer_run_is_refused_in_one_line(store, tmp_path):
    status = store / "fixture_v1" / RUNS[1] / "status.json"
    _set(status, store_format=3)
    res = runner.invoke(
        app, ["report", "fixture_v1", "--results-dir", str(store), "--format", "csv", "--out", str(tmp_path / "rep")]
    )
    assert res.exit_code == 2 and res.stderr == (
        f"error: {status}: written in results-store format 3; this clipbench reads formats 1 to 2; read it with "
        "the clipbench release that wrote it, or upgrade this one (pip install -U clipbench); `clipbench "
        "--version` prints the format a release writes\n"
    )
    assert not (tmp_path / "rep").exists()


def test_a_newer_manifest_is_refused_before_anything_is_written(store):
    manifest = store / "fixture_v1" / "manifest.json"
    _set(manifest, store_format=3)
    before = snapshot(store)
    res = runner.invoke(app, ["sweep", str(FIXTURE / "fixture_v1.sweep.yaml"), "--results-dir", str(store)])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {manifest}: written in results-store format 3")
    assert len(res.stderr.splitlines()) == 1 and snapshot(store) == before


@pytest.mark.parametrize("bad", ["2", 0, True, None])
def test_a_version_that_is_not_one_is_a_damaged_file(store, bad):
    status = store / "fixture_v1" / RUNS[0] / "status.json"
    _set(status, store_format=bad)
    with pytest.raises(StoreError, match=r"store_format is .*, not a results-store format version"):
        RunDir(status.parent).status()


def test_new_writes_record_the_format(tmp_path):
    rd = RunDir(tmp_path / "r")
    rd.set_status("running", step=0)
    assert json.loads(rd.status_path.read_text()) == {"state": "running", "step": 0, "store_format": 2}
