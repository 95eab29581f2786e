"""A damaged results store, as every command meets it: `sweep`, `sweep --dry-run`, `report`, `sync`
and `eval --model RUN_DIR` answer with one line naming the file, what is wrong and what to do
(exit 2), and write nothing. The store is the report fixture (no training): ~2 s in all."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clipbench.cli import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def damage(res: Path, kind: str) -> Path:
    run = res / "fixture" / "grpo-s000000"
    target = {
        "manifest": res / "fixture" / "manifest.json",
        "status": run / "status.json",
        "config": run / "config.yaml",
        "eval": run / "eval" / "step_000002" / "arith.json",
        "metrics": run / "metrics.jsonl",
    }[kind]
    if kind == "metrics":
        lines = target.read_text().splitlines(keepends=True)
        lines[1] = lines[1][: len(lines[1]) // 2] + "\n"  # a row cut in half, mid-file
        target.write_text("".join(lines))
    elif kind == "config":
        target.write_text("seed: 0\nmodel: {name: x\n")
    else:
        target.write_text(target.read_text()[:-7])
    return target


# (damaged file, commands that read it)
CASES = [
    ("manifest", ["sweep", "dry-run", "sync"]),
    ("status", ["sweep", "dry-run", "report", "sync"]),
    ("config", ["sweep", "dry-run", "report", "sync", "eval"]),
    ("eval", ["report", "sync"]),
    ("metrics", ["report", "sync"]),
]


@pytest.mark.parametrize("kind,commands", CASES, ids=[c[0] for c in CASES])
def test_damaged_store_files_are_one_line_and_nothing_is_written(tmp_path, report_fixture, kind, commands):
    res = report_fixture.build(tmp_path / "results")
    sweep_file = tmp_path / "fixture.yaml"
    sweep_file.write_text(
        yaml.safe_dump({"name": "fixture", "base": str(REPO / "recipes" / "arith_tiny.yaml"), "grid": {"seed": [0]}})
    )
    path = damage(res, kind)
    before = snapshot(res)
    argv = {
        "sweep": ["sweep", str(sweep_file)],
        "dry-run": ["sweep", str(sweep_file), "--dry-run"],
        "report": ["report", "fixture"],
        "sync": ["sync", "fixture"],
        "eval": ["eval", "--model", str(path.parent), "--benchmarks", "arith"],
    }
    for cmd in commands:
        extra = [] if cmd == "eval" else ["--results-dir", str(res)]
        r = runner.invoke(app, argv[cmd] + extra)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code == 2, (kind, cmd, r.output[-2000:])
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), (kind, cmd, lines)
        assert snapshot(res) == before, (kind, cmd)  # nothing written
    assert not (res / "reports").exists() and not (res / "mlflow.db").exists()


def test_results_dir_that_is_a_file_is_one_line(tmp_path):
    f = tmp_path / "results"
    f.write_text("not a directory")
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(
        yaml.safe_dump({"name": "s", "base": str(REPO / "recipes" / "arith_tiny.yaml"), "grid": {"seed": [0]}})
    )
    for argv in (
        ["sweep", str(sweep_file)],
        ["sweep", str(sweep_file), "--dry-run"],
        ["report", "s"],
        ["sync"],
        ["train", str(REPO / "recipes" / "arith_tiny.yaml")],
    ):
        r = runner.invoke(app, argv + ["--results-dir", str(f)])
        assert r.exit_code == 2, (argv, r.output)
        assert r.stderr.strip() == f"error: --results-dir {f}: exists and is not a directory", (argv, r.stderr)
    assert f.read_text() == "not a directory"
