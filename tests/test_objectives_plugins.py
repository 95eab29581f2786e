"""Plugins: a user's rule in one file. Loading (paths, modules, entry points), one-line errors naming
the file, config and sweep wiring, and end to end through the CLI (methods, train, sweep + report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from clipbench import registry as generic
from clipbench.config import load_run_config, run_id
from clipbench.errors import ConfigError, UserError
from clipbench.objectives import METHODS, policy_loss, registry
from clipbench.objectives import plugins as plug

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "arith_tiny.yaml"
EXAMPLE = REPO / "examples" / "plugins" / "lower_only.py"
LOWER_ONLY = EXAMPLE.read_text()
SMALL = [
    "train.prompts_per_step=4",
    "sampler.group_size=4",
    "sampler.max_new_tokens=8",
    "eval.limit=4",
    "eval.n=2",
    "eval.every=0",
    "eval.at_start=false",
    "tracking.mlflow=false",
]


@pytest.fixture
def isolated():
    """Whatever a test loads is unloaded afterwards (METHODS and the loader's caches)."""
    methods, loaded, ep = dict(METHODS), dict(registry.LOADED), set(generic.GROUPS_LOADED)
    mods = set(sys.modules)
    yield
    METHODS.clear()
    METHODS.update(methods)
    registry.LOADED.clear()
    registry.LOADED.update(loaded)
    generic.GROUPS_LOADED.clear()
    generic.GROUPS_LOADED.update(ep)
    for m in set(sys.modules) - mods:
        if m.startswith("clipbench_plugin_") or m.startswith("cb_test_"):
            del sys.modules[m]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_the_example_file_loads_once_and_runs(isolated, tmp_path):
    f = write(tmp_path / "lower_only.py", LOWER_ONLY)
    origin = plug.load_plugin(str(f))
    assert METHODS["lower_only"].origin == origin and origin.path == str(f.resolve())
    assert plug.load_plugin(str(f)) is origin  # loading the same file twice is a no-op
    lp = torch.tensor([[0.0, -0.5]], requires_grad=True)
    out = policy_loss("lower_only", lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize(
    "text, match",
    [
        ("import torch\nraise RuntimeError('boom')\n", r"bad\.py:2: cannot import plugin: RuntimeError: boom$"),
        ("def f(:\n", r"bad\.py:1: cannot import plugin: SyntaxError"),
        ("import no_such_module_xyz\n", r"bad\.py:1: cannot import plugin: ModuleNotFoundError"),
        (
            "from clipbench.objectives import rule\n\n@rule('grpo', source='x')\ndef grpo(r, A):\n    return r\n",
            r"bad\.py:3: 'grpo' is a built-in rule \(built-in names win\)",
        ),
        (
            "from clipbench.objectives import rule\n\n@rule('mine', source='x')\ndef mine(r, A, eps=0.2):\n    return r\n",
            r"bad\.py:3: 'eps' is not an input",
        ),
    ],
)
def test_errors_are_one_line_naming_the_file(isolated, tmp_path, text, match):
    f = write(tmp_path / "bad.py", text)
    with pytest.raises(UserError, match=match) as e:
        plug.load_plugin(str(f))
    assert "\n" not in str(e.value)
    assert "mine" not in METHODS  # a failed import registers nothing


def test_missing_file_clash_between_files_and_failed_import_registers_nothing(isolated, tmp_path):
    with pytest.raises(UserError, match=r"nope\.py: plugin file not found"):
        plug.load_plugin(str(tmp_path / "nope.py"))
    a = write(tmp_path / "a.py", LOWER_ONLY)
    b = write(tmp_path / "b" / "lower_only.py", LOWER_ONLY + "\nraise ValueError('late')\n")
    plug.load_plugin(str(a))
    with pytest.raises(UserError, match=r"lower_only\.py:7: rule 'lower_only' is already registered by plugin .*a\.py"):
        plug.load_plugin(str(b))
    assert METHODS["lower_only"].origin.path == str(a.resolve())


def test_module_names_and_entry_points(isolated, tmp_path, monkeypatch):
    write(tmp_path / "cb_test_mod_rules.py", LOWER_ONLY.replace("lower_only", "mod_rule"))
    write(tmp_path / "cb_test_ep_rules.py", LOWER_ONLY.replace("lower_only", "ep_rule"))
    write(tmp_path / "cb_test_ep-0.1.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: cb-test-ep\nVersion: 0.1\n")
    write(tmp_path / "cb_test_ep-0.1.dist-info" / "entry_points.txt", "[clipbench.rules]\nmine = cb_test_ep_rules\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    generic.GROUPS_LOADED.discard(registry.ENTRY_POINT_GROUP)  # as in a fresh process
    # an installed package's rule is found by name, with no --plugin
    lp = torch.zeros(1, 2, requires_grad=True)
    policy_loss("ep_rule", lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    assert METHODS["ep_rule"].origin.path.endswith("cb_test_ep_rules.py")
    plug.load_plugins(["cb_test_mod_rules"])  # a module name
    assert METHODS["mod_rule"].origin.path == str((tmp_path / "cb_test_mod_rules.py").resolve())
    with pytest.raises(UserError, match="cb_test_nope: plugin module not found"):
        plug.load_plugin("cb_test_nope")


def test_recipe_plugins_are_relative_to_the_recipe_and_merge_with_the_cli(isolated, tmp_path, monkeypatch):
    write(tmp_path / "rules" / "lower_only.py", LOWER_ONLY)
    write(tmp_path / "cwd" / "other.py", LOWER_ONLY.replace("lower_only", "other_rule"))
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text(
        yaml.safe_dump(
            {
                **yaml.safe_load(RECIPE.read_text()),
                "plugins": ["../rules/lower_only.py"],
                "objective": {"method": "lower_only", "eps_low": 0.3},
            }
        )
    )
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = load_run_config(recipe, [], plugins=["other.py"])
    assert cfg.plugins == [
        str((tmp_path / "rules" / "lower_only.py").resolve()),
        str((tmp_path / "cwd" / "other.py").resolve()),
    ]
    assert cfg.objective.one_form() == {"name": "lower_only", "eps_low": 0.3}
    assert run_id(cfg) == run_id(load_run_config(recipe, []))  # where a rule lives is not the run's identity
    # without its plugin the method is unknown; a broken plugin is one line naming the key and the file
    with pytest.raises(ConfigError, match="unknown method 'other_rul'"):
        load_run_config(RECIPE, ["objective.method=other_rul"])
    write(tmp_path / "cwd" / "broken.py", "x = 1/0\n")
    with pytest.raises(
        ConfigError,
        match=r"arith_tiny\.yaml: plugins: .*broken\.py:1: cannot import plugin: "
        r"ZeroDivisionError",
    ):
        load_run_config(RECIPE, [], plugins=["broken.py"])


def test_manifest_records_hashes_and_refuses_a_changed_plugin(tmp_path):
    f = write(tmp_path / "x.py", "a = 1\n")
    rec = [{"path": str(f), "sha256": plug.sha256_file(f)}]
    plug.check_plugin_records(rec, "sweep 's'")
    f.write_text("a = 2\n")
    with pytest.raises(
        UserError,
        match=r"x\.py: plugin changed since sweep 's' was planned .*restore the file or "
        r"use a new sweep name",
    ):
        plug.check_plugin_records(rec, "sweep 's'")
    f.unlink()
    with pytest.raises(UserError, match="plugin file of sweep 's' is missing"):
        plug.check_plugin_records(rec, "sweep 's'")


# --------------------------------------------------------------------------------------------
# End to end through the CLI (subprocesses: the real command, nothing loaded into this process)
# --------------------------------------------------------------------------------------------
def cli(*args, cwd):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "clipbench.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


@pytest.mark.slow
def test_cli_methods_lists_the_plugin(tmp_path):
    write(tmp_path / "lower_only.py", LOWER_ONLY)
    res = cli("methods", "--plugin", "lower_only.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("lower_only ")]  # one line in the list
    assert line.split()[1] == "token" and "(plugin)" in line
    res = cli("methods", "lower_only", "--plugin", "lower_only.py", cwd=tmp_path)  # its card
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    for words in ("lower_only", "eps_low=0.2", "-min(r*A, max(r,", "my idea", "plugin"):
        assert words in text, words
    assert str((tmp_path / "lower_only.py").resolve()) in "".join(res.stdout.split())  # (folded at 80 columns)
    res = cli("methods", "--plugin", "nope.py", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().endswith("nope.py: plugin file not found")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_cli_train_runs_a_plugin_rule_with_full_diagnostics(tmp_path):
    write(tmp_path / "lower_only.py", LOWER_ONLY)
    res = cli(
        "train",
        str(RECIPE),
        "--plugin",
        "lower_only.py",
        "objective.method=lower_only",
        "train.steps=2",
        *SMALL,
        "--results-dir",
        "results",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (run,) = (tmp_path / "results" / "train").iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for key in ("q1/tokens", "q3/zero_grad", "q1/rescued", "q2/grad_mass", "clip_events", "ratio/max"):
        assert all(key in r for r in rows), key
    assert sum(r["q1/tokens"] + r["q2/tokens"] + r["q3/tokens"] + r["q4/tokens"] for r in rows) > 0
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["plugins"] == [str((tmp_path / "lower_only.py").resolve())]
    assert cfg["objective"] == {"method": "lower_only", "eps_low": 0.2}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.slow
def test_cli_sweep_runs_and_reports_a_plugin_rule_and_notices_a_changed_file(tmp_path):
    rule_file = write(tmp_path / "rules" / "lower_only.py", LOWER_ONLY)
    sweep = write(tmp_path / "sweeps" / "mine.yaml", "")
    sweep.write_text(
        yaml.safe_dump(
            {
                "name": "mine",
                "base": str(RECIPE),
                "plugins": ["../rules/lower_only.py"],
                "overrides": {"train.steps": 1, **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in SMALL)}},
                "grid": {"objective.method": ["grpo", "lower_only"]},
            }
        )
    )
    res = cli("sweep", str(sweep), "--results-dir", "results", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((tmp_path / "results" / "mine" / "manifest.json").read_text())
    assert manifest["plugins"] == [{"path": str(rule_file.resolve()), "sha256": plug.sha256_file(rule_file)}]
    methods = sorted(c["objective"]["method"] for c in manifest["runs"].values())
    assert methods == ["grpo", "lower_only"]
    for rid in manifest["runs"]:
        assert json.loads((tmp_path / "results" / "mine" / rid / "status.json").read_text())["state"] == "finished"
    res = cli(
        "report",
        "mine",
        "--results-dir",
        "results",
        "--baseline",
        "grpo",
        "--format",
        "markdown",
        cwd=tmp_path,
    )  # no --plugin: the report imports the rule file the runs recorded
    assert res.returncode == 0, res.stderr[-2000:]
    (page,) = [line for line in res.stdout.splitlines() if line.endswith("report.md")]
    report = (tmp_path / page).read_text()
    assert "lower_only" in report and "grpo" in report, report
    assert "could not load" not in report and "unknown to this install" not in report
    assert "| lower_only |" in report and "plugins=" not in report  # its label: the rule's name alone
    # a resumed sweep whose rule file changed stops: one line naming the file, exit 2, nothing written
    rule_file.write_text(LOWER_ONLY.replace("1 - eps_low", "1 - 2 * eps_low"))
    before = (tmp_path / "results" / "mine" / "manifest.json").read_text()
    res = cli("sweep", str(sweep), "--results-dir", "results", cwd=tmp_path)
    assert res.returncode == 2
    err = res.stderr.strip()
    assert "\n" not in err and "lower_only.py: plugin changed since sweep 'mine' was planned" in err, err
    assert (tmp_path / "results" / "mine" / "manifest.json").read_text() == before


INF_IN_TRAINING = """import torch
from clipbench.objectives import rule


@rule("inf_in_training", source="a test")
def inf_in_training(r, A):
    '''-r*A, and inf on batches of more than 4 rows: the preflight's 4 rows pass, training's do not'''
    return -(r * A) + (float("inf") if r.shape[0] > 4 else 0.0)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rule_whose_loss_is_infinite_is_skipped_by_the_non_finite_guard(tmp_path):
    """An infinite loss with a finite gradient trained on: every loss null, skipped_nonfinite 0, the run
    "ok". The step's loss now counts like its gradient norm: every step skipped, and the run fails past
    train.max_skipped_frac (after its first rollout step: 2 optimizer steps of 8 rows), in one line."""
    write(tmp_path / "inf_rule.py", INF_IN_TRAINING)
    res = cli(
        "train", str(RECIPE), "--plugin", "inf_rule.py", "objective.method=inf_in_training", "train.steps=2",
        "train.mini_batches=2", *SMALL, "--results-dir", "results", cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 1
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: train.max_skipped_frac: 2 of the run's 4 optimizer steps were skipped (a non-finite loss or gradient "
            "norm), more than 0.1 of them"
        )
    )
    (run,) = (tmp_path / "results" / "train").iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_nonfinite"] for r in rows] == [1, 2] and all(r["loss"] is None for r in rows)
    assert json.loads((run / "status.json").read_text())["state"] == "failed"
