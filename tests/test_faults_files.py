"""Sweep files and recipes that said nothing where they should: each is a real file, read by the
command a user types (`clipbench sweep FILE --dry-run`, which writes nothing).

- `exclude:` entries that match nothing (`{seed: 5}`, or `{seed: '1'}` where the axis holds the
  number 1) were ignored without a word, and the run meant to be left out trained.
- A 548-byte YAML file of nested aliases (a "billion laughs") ran for minutes and took gigabytes;
  the `<<:` merge-then-override idiom was refused as a duplicate key.
"""

from __future__ import annotations

import json
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


LAUGHS = 'lol: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"l{i}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


def test_aliases_that_expand_a_file_a_billion_times_are_one_line(tmp_path):
    """A YAML 'billion laughs' (nested aliases, about 550 bytes) ran for minutes and took gigabytes."""
    f = sweep_file(tmp_path, GRID + LAUGHS)
    res = dry_run(f, tmp_path / "results")
    one_line_exit_2(
        res,
        f"error: {f}: its aliases (*name) expand it to 490,329,078 values from the 42 written: more than 100,000 "
        "added, refused (a YAML 'billion laughs'); write the values out or repeat fewer",
    )


def test_a_merge_key_then_an_override_is_the_yaml_idiom_not_a_duplicate(tmp_path):
    """`<<: *sampling` then a key of its own was refused as a duplicate key; the own key wins, as in YAML."""
    (tmp_path / "r.yaml").write_text(
        "model: {name: 'builtin:arith-tiny'}\n"
        "sampler: &sampling\n  temperature: 1.0\n  max_new_tokens: 24\n"
        "eval:\n  <<: *sampling\n  temperature: 0.6\n"
    )
    f = sweep_file(tmp_path, "name: s\nbase: r.yaml\ngrid:\n  seed: [0]\n")
    res = runner.invoke(app, ["sweep", str(f), "--results-dir", str(tmp_path / "results"), "--json"])
    assert res.exit_code == 0, res.output
    (run,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert run["config"]["eval"]["temperature"] == 0.6 and run["config"]["eval"]["max_new_tokens"] == 24
    assert run["config"]["sampler"]["temperature"] == 1.0
