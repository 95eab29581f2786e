"""The recipes and sweeps shipped in the package, by name from any directory (clipbench.config.shipped),
`clipbench recipes`, `clipbench init` and `clipbench --version`. The installed wheel is tested in
test_package.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.config import load_run_config
from clipbench.config.shipped import CATALOG, RECIPES, SWEEPS, catalog, recipe_path, shipped_files, sweep_path
from clipbench.errors import ConfigError
from clipbench.sweep import load_spec
from clipbench.yamlio import load_yaml_file

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_the_repository_paths_are_the_shipped_files():
    """recipes/ and sweeps/ at the top of the repository are the package's directories (one copy)."""
    assert (REPO / "recipes").resolve() == RECIPES and (REPO / "sweeps").resolve() == SWEEPS
    assert RECIPES.parent == SWEEPS.parent == REPO / "clipbench"


def test_every_shipped_file_has_one_catalog_entry_and_reads():
    items = catalog()
    keys = [s.key for s in items]
    assert sorted(keys) == sorted(k for k, _, _ in shipped_files()) and len(set(keys)) == len(keys)
    assert len(items) == len(load_yaml_file(CATALOG))  # the catalog (shipped.yaml): one entry a file, the one list
    kinds = {s.key: s.kind for s in items}
    assert kinds["recipes/quickstart"] == "recipe" and kinds["sweeps/quickstart"] == "sweep"
    assert kinds["recipes/abc_grpo_table3/sweep_tiny"] == "sweep"
    for s in items:  # every one loads by the name `clipbench recipes` prints
        if s.kind == "recipe":
            assert load_run_config(s.name).seed is not None
        else:
            assert load_spec(s.name).file == s.path


@pytest.mark.parametrize(
    "ref, want",
    [
        ("quickstart", "recipes/quickstart.yaml"),
        ("quickstart.yaml", "recipes/quickstart.yaml"),
        ("recipes/quickstart.yaml", "recipes/quickstart.yaml"),  # the README's spelling, from any directory
        ("abc_grpo_table3/qwen3_4b_grpo", "recipes/abc_grpo_table3/qwen3_4b_grpo.yaml"),
    ],
)
def test_recipe_by_name_from_any_directory(ref, want, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert recipe_path(ref) == REPO / "clipbench" / want


def test_sweep_by_name_and_a_local_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sweep_path("nsr_vs_decay") == SWEEPS / "nsr_vs_decay.yaml"
    assert sweep_path("abc_grpo_table3/sweep_tiny") == RECIPES / "abc_grpo_table3" / "sweep_tiny.yaml"
    assert sweep_path("quickstart") == SWEEPS / "quickstart.yaml"  # sweeps/ before recipes/
    (tmp_path / "quickstart").write_text("name: mine\nbase: recipes/quickstart.yaml\ngrid: {seed: [0]}\n")
    assert sweep_path("quickstart") == Path("quickstart")  # a local file wins
    spec = load_spec("quickstart")
    assert spec.name == "mine" and spec.base == RECIPES / "quickstart.yaml"  # no such local base: the shipped recipe


def test_a_local_directory_of_that_name_does_not_hide_the_shipped_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").mkdir()  # e.g. what `clipbench init quickstart` made
    assert sweep_path("quickstart") == SWEEPS / "quickstart.yaml"
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError, match="^mine: not a regular file"):
        load_spec("mine")


def test_unknown_name_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^nope: file not found, nor a shipped recipe of that name"):
        recipe_path("nope")
    for ref in ("../quickstart", "/quickstart"):  # no escaping the shipped directories
        with pytest.raises(ConfigError):
            recipe_path(ref)
    res = runner.invoke(app, ["train", "nope", "--results-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and res.stderr.strip() == (
        "error: nope: file not found, nor a shipped recipe of that name (`clipbench recipes` lists them)"
    )
    assert not (tmp_path / "r").exists()
    res = runner.invoke(app, ["sweep", "nope", "--results-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "nor a shipped sweep" in res.stderr and not (tmp_path / "r").exists()


def test_recipes_command_lists_every_name():
    res = runner.invoke(app, ["recipes", "--long"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    for s in catalog():
        verb = "train" if s.kind == "recipe" else "sweep"
        assert f"clipbench {verb} {s.name} " in res.output


def test_recipes_lists_one_line_each_at_80_columns_and_filters_by_words():
    """One line per shipped file at 80 columns (its name whole, never folded mid-word; where it runs; what
    it runs, cut); words keep the entries that hold every one; none: one line, exit 2."""
    res = runner.invoke(app, ["recipes"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80 and len(lines) <= len(catalog()) + 8
    for s in catalog():
        verb = "train" if s.kind == "recipe" else "sweep"
        assert sum(line.startswith(f"{verb} {s.name} ") for line in lines) == 1, s.name
    assert any(line.startswith("train abc_grpo_table3/qwen3_4b_grpo ") and " 8 GPUs " in line for line in lines)
    res = runner.invoke(app, ["recipes", "gpu", "table3"], env={"COLUMNS": "80"})
    shown = [line.split()[1] for line in res.output.splitlines() if line.startswith(("train ", "sweep "))]
    want = [s.name for s in catalog() if "table3" in s.name and "GPU" in s.scale]
    assert res.exit_code == 0 and shown == want and len(want) == 5, shown
    res = runner.invoke(app, ["recipes", "tpu"])
    assert res.exit_code == 2 and res.stderr.strip() == (
        "error: no shipped recipe or sweep holds 'tpu' (`clipbench recipes` lists them all)"
    )
    res = runner.invoke(app, ["recipes", "--show", "nsr_vs_decay"])
    assert res.exit_code == 0 and res.output.splitlines()[0] == f"# {SWEEPS / 'nsr_vs_decay.yaml'}"
    assert "name: nsr_vs_decay" in res.output


def test_recipes_show_prints_the_recipe_the_kit_names_and_the_sweep_when_asked(tmp_path, monkeypatch):
    """`quickstart` is a recipe and a sweep: the bare name (what `clipbench train quickstart` runs, and
    what the init kit and docs/install.md tell users to print) is the recipe, with one line naming the
    sweep; `recipes/` and `sweeps/` pick one. (From a user's directory: a local file would win.)"""
    monkeypatch.chdir(tmp_path)
    for ref in ("quickstart", "recipes/quickstart", "recipes/quickstart.yaml"):
        res = runner.invoke(app, ["recipes", "--show", ref])
        assert res.exit_code == 0 and res.output.splitlines()[0] == f"# {RECIPES / 'quickstart.yaml'}", ref
        assert "\nbase:" not in res.output and "objective:" in res.output
    assert runner.invoke(app, ["recipes", "--show", "quickstart"]).output.splitlines()[1] == (
        "# the sweep of this name: clipbench recipes --show sweeps/quickstart"
    )
    res = runner.invoke(app, ["recipes", "--show", "sweeps/quickstart"])
    assert res.exit_code == 0 and res.output.splitlines()[0] == f"# {SWEEPS / 'quickstart.yaml'}"
    assert "\nbase:" in res.output
    res = runner.invoke(app, ["recipes", "--show", "sweeps/arith_tiny"])  # a recipe, not a sweep
    assert res.exit_code == 2 and "no shipped recipe or sweep of that name" in res.stderr


def test_version():
    from importlib.metadata import version

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output == f"clipbench {version('clipbench')} (results store format 2)\n"


def test_init_writes_a_kit_that_expands_and_refuses_to_overwrite(tmp_path, monkeypatch, unload_plugins):
    kit = tmp_path / "study"
    res = runner.invoke(app, ["init", str(kit)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in kit.iterdir()) == ["README.md", "lower_only.py", "sweep.yaml"]
    monkeypatch.chdir(tmp_path)  # the sweep file's base and plugin resolve from anywhere
    res = runner.invoke(app, ["sweep", str(kit / "sweep.yaml"), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    runs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    # 2 rules x 3 seeds = 6 runs, on the shipped quickstart recipe, the plugin rule included
    assert sorted((r["config"]["objective"]["method"], r["config"]["seed"]) for r in runs) == [
        ("grpo", 0),
        ("grpo", 1),
        ("grpo", 2),
        ("lower_only", 0),
        ("lower_only", 1),
        ("lower_only", 2),
    ]
    assert {r["config"]["model"]["name"] for r in runs} == {"builtin:arith-steps"}
    before = (kit / "sweep.yaml").read_text()
    (kit / "sweep.yaml").write_text(before + "# mine\n")
    res = runner.invoke(app, ["init", str(kit)])
    assert res.exit_code == 2 and "sweep.yaml: already exists; nothing written" in res.stderr
    assert (kit / "sweep.yaml").read_text().endswith("# mine\n")
