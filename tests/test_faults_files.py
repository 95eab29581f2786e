"""Sweep files and recipes that said nothing where they should: each is a real file, read by the
command a user types (`clipbench sweep FILE --dry-run`, which writes nothing).

- `exclude:` entries that match nothing (`{seed: 5}`, or `{seed: '1'}` where the axis holds the
  number 1) were ignored without a word, and the run meant to be left out trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from clipbench.cli import app

runner = CliRunner()


def sweep_file(where: Path, text: str) -> Path:
    f = where / "s.yaml"
    f.write_text(text)
    return f


def dry_run(f: Path, results: Path, *extra: str):
    return runner.invoke(app, ["sweep", str(f), "--results-dir", str(results), "--dry-run", *extra])


def one_line_exit_2(res, line: str) -> None:
    assert res.exit_code == 2, res.output
    assert res.stderr == line + "\n"


GRID = "name: s\nbase: quickstart\ngrid:\n  seed: [0, 1]\n  objective.name: [grpo, nsr]\n"


@pytest.mark.parametrize(
    ("exclude", "reason"),
    [
        (
            "{seed: 5}",
            "exclude[0].seed: 5 is not a value of the axis grid.seed (0, 1): the entry leaves nothing out",
        ),
        (
            "{seed: '1'}",
            "exclude[0].seed: '1' is not a value of the axis grid.seed (0, 1): the entry leaves nothing out; "
            "write 1 (int), not '1' (str)",
        ),
        (
            "{objective.name: grpo, objective.p: 0.5}",  # p is nsr's parameter, not grpo's
            "exclude[0]: matches none of the sweep's 4 grid points (a component's parameter applies only to the "
            "components that have it): the entry leaves nothing out",
        ),
    ],
)
def test_an_exclude_entry_that_matches_nothing_is_one_line(tmp_path, exclude, reason):
    text = GRID.replace("  objective.name: [grpo, nsr]\n", "  objective.name: [grpo, nsr]\n  objective.p: [0.5]\n")
    f = sweep_file(tmp_path, text + f"exclude:\n  - {{objective.name: nsr, seed: 0}}\n  - {exclude}\n")
    res = dry_run(f, tmp_path / "results")
    one_line_exit_2(res, f"error: {f}: {reason.replace('exclude[0]', 'exclude[1]')}")
    assert not (tmp_path / "results").exists()


def test_an_exclude_entry_on_an_axis_the_command_line_pins_is_not_judged(tmp_path):
    """`seed=0` on the command line pins the seed axis: an entry for seed 1 then matches nothing here,
    as it should, and the plan is shown (one run of each rule)."""
    f = sweep_file(tmp_path, GRID + "exclude:\n  - {objective.name: nsr, seed: 1}\n")
    res = dry_run(f, tmp_path / "results", "seed=0")
    assert res.exit_code == 0, res.output
    assert "grpo" in res.stdout and "nsr" in res.stdout
