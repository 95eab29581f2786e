"""`clipbench sweep` through the CLI: bad sweep files (one line naming file, key and reason, exit 2,
nothing written), --dry-run and --json (nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.config import run_id

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "arith_tiny.yaml"
runner = CliRunner()

GOOD = {
    "name": "cli",
    "base": str(RECIPE),
    "grid": {"objective.method": ["dapo", "nsr"], "objective.p": [0.5, 1.0], "seed": [0, 1]},
}


def sweep(tmp_path: Path, *args: str):
    res = tmp_path / "results"
    return runner.invoke(app, ["sweep", *args, "--results-dir", str(res)]), res


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return p


def with_(**changes) -> str:
    body = json.loads(json.dumps(GOOD))
    for k, v in changes.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return yaml.safe_dump(body, sort_keys=False)


# (case id, sweep file text, expected key in the message, expected reason fragment)
BAD = [
    ("yaml-syntax", "name: x\ngrid: {seed: [0, 1]\n", "line", "YAML syntax error"),
    (
        "duplicate-key",
        f"name: x\nbase: {RECIPE}\ngrid: {{seed: [0]}}\ngrid: {{seed: [1]}}\n",
        "line 4",
        "duplicate key 'grid' (first at line 3)",
    ),
    (
        "duplicate-key-in-flow",
        f"name: x\nbase: {RECIPE}\ngrid: {{seed: [0], seed: [1]}}\n",
        "line 3",
        "duplicate key 'seed'",
    ),
    ("unknown-top-key", with_(gird={"seed": [0]}), "gird", "unknown key (did you mean 'grid'?)"),
    ("grid-not-mapping", with_(grid=[1, 2]), "grid", "expected a mapping"),
    ("axis-not-list", with_(grid={"seed": 3}), "grid.seed", "expected a list of values"),
    (
        "axis-wrong-type",
        with_(grid={"train.steps": ["ten"]}),
        "grid.train.steps",
        "expected an integer, got a string: ten",
    ),
    ("unknown-axis-key", with_(grid={"train.stepz": [1, 2]}), "grid.train.stepz", "did you mean 'train.steps'?"),
    (
        "unknown-method",
        with_(grid={"objective.method": ["grpo", "nsrr"]}),
        "grid.objective.method",
        "unknown method 'nsrr' (did you mean 'nsr'?)",
    ),
    (
        "unknown-param",
        with_(grid={"objective.method": ["nsr"], "objective.pp": [0.5]}),
        "grid.objective.pp",
        "has parameter 'pp' (did you mean 'p'?)",
    ),
    (
        "param-of-no-method-in-grid",
        with_(grid={"objective.method": ["grpo", "dapo"], "objective.p": [0.5]}),
        "grid.objective.p",
        "no method in this sweep (dapo, grpo) has parameter 'p'; only decay, nsr have it",
    ),
    ("empty-grid", with_(grid={}), "grid", "empty"),
    ("empty-axis", with_(grid={"seed": []}), "grid.seed", "empty list"),
    (
        "negative-eps",
        with_(grid={"objective.method": ["grpo"], "objective.eps_low": [0.2, -0.1]}),
        "grid.objective.eps_low",
        "-0.1",
    ),
    ("p-above-one", with_(grid={"objective.method": ["nsr"], "objective.p": [0.5, 1.5]}), "grid.objective.p", "1.5"),
    (
        "p-below-zero-in-overrides",
        with_(grid={"objective.method": ["nsr"], "seed": [0]}, overrides={"objective.p": -0.5}),
        "overrides.objective.p",
        "-0.5",
    ),
    ("missing-base-file", with_(base="nowhere/recipe.yaml"), "base", "recipe not found"),
    ("missing-base-key", with_(base=None), "base", "missing"),
    ("unknown-override-key", with_(overrides={"train.lrr": 1.0}), "overrides.train.lrr", "did you mean 'train.lr'?"),
    (
        "override-bad-value",
        with_(overrides={"train.steps": 0}),
        "overrides.train.steps",
        "must be in [1, 1000000], got 0",
    ),
    (
        "inf-in-an-axis",
        with_(grid={"train.lr": [1.0e-6, 1.0e400]}),
        "grid.train.lr",
        "must be a finite number in (0, 1], got inf",
    ),
    (
        "model-path-in-an-axis",
        with_(grid={"model.name": ["builtin:arith-tiny", "/no/such/model"]}),
        "grid.model.name",
        "no such path '/no/such/model'",
    ),
    ("override-is-axis", with_(overrides={"seed": 3}), "overrides.seed", "also an axis"),
    ("zip-unequal", with_(zip={"train.lr": [1.0e-5, 2.0e-5], "train.warmup_steps": [0]}), "zip", "same length"),
    ("exclude-not-axis", with_(exclude=[{"train.lr": 1.0e-5}]), "exclude[0].train.lr", "not an axis"),
    ("bad-name", with_(name="a b/c"), "name", "directory-safe"),
    (
        "cross-field-override",
        with_(overrides={"train.mini_batches": 100}),
        "overrides.train.mini_batches",
        "cannot split",
    ),
    (
        "cross-field-in-a-run",
        with_(grid={"sampler.group_size": [8, 2], "train.mini_batches": [4, 32]}),
        "grid.train.mini_batches",
        "cannot split a batch of 16 sequences (prompts_per_step x group_size) (in the run",
    ),
]


@pytest.mark.parametrize("case,text,key,reason", BAD, ids=[b[0] for b in BAD])
def test_bad_sweep_files_exit_2_with_one_line_and_write_nothing(tmp_path, case, text, key, reason):
    f = write(tmp_path, text)
    result, res = sweep(tmp_path, str(f))
    assert result.exit_code == 2, (case, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"error: {f}: ") or line.startswith(f"error: {RECIPE}"), line
    assert f": {key}" in line, line
    assert reason in line, line
    assert not res.exists() or not any(res.iterdir())


def test_bad_command_line_override_names_the_command_line(tmp_path):
    f = write(tmp_path, with_())
    result, res = sweep(tmp_path, str(f), "train.stepz=3")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: command line: train.stepz: unknown key 'train.stepz' (did you mean 'train.steps'?)"
    )
    assert not res.exists()


def test_hydras_multirun_form_on_the_command_line_is_a_sweep_axis(tmp_path):
    """`seed=0,1` (Hydra's multirun form) on a sweep's command line: an axis of those values (replacing
    the file's axis of that key, with a warning); a list stays one value; a repeated value is refused."""
    f = write(tmp_path, with_())
    rows = lambda res: [json.loads(line) for line in res.stdout.splitlines()]  # noqa: E731
    result, res = sweep(tmp_path, str(f), "--json", "seed=0,1,2", "train.lr=1e-4,2e-4")
    assert result.exit_code == 0, result.output
    # (1 dapo + 2 nsr runs per seed) x 3 seeds x 2 rates = 18 runs
    got = [(r["config"]["seed"], r["config"]["train"]["lr"]) for r in rows(result)]
    assert len(got) == 18 and {s for s, _ in got} == {0, 1, 2} and {lr for _, lr in got} == {1e-4, 2e-4}
    assert "warning: command-line override seed=0,1,2 replaces the axis grid.seed" in result.stderr
    result, _ = sweep(tmp_path, str(f), "--json", "train.betas=[0.9,0.99]")  # a list is one value
    assert result.exit_code == 0 and {tuple(r["config"]["train"]["betas"]) for r in rows(result)} == {(0.9, 0.99)}
    result, res = sweep(tmp_path, str(f), "seed=1,1")
    assert result.exit_code == 2 and result.stderr.strip() == "error: command line: seed: '1,1' repeats the value 1"
    assert not res.exists()


def test_several_values_for_one_run_are_refused_in_one_line_saying_how(tmp_path):
    for verb in ("train", "plan", "rehearse"):
        result = runner.invoke(
            app, [verb, str(RECIPE), "seed=0,1", "--results-dir", str(tmp_path)][: 3 if verb == "plan" else 5]
        )
        assert result.exit_code == 2, (verb, result.output)
        assert result.stderr.strip() == (
            "error: command line: seed: '0,1' is several values (Hydra's multirun form) and one run takes one: give "
            "one value, sweep them with `clipbench sweep SWEEP seed=0,1`, or write a list value as [0,1]"
        ), verb
    result = runner.invoke(app, ["train", str(RECIPE), "seed=[0,1]", "--results-dir", str(tmp_path)])
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: command line (seed=[0,1]): seed: expected an integer, got a list: [0, 1] (one run takes one value; "
        "to run several, sweep them: `clipbench sweep SWEEP KEY=a,b`)"
    )
    assert not any(tmp_path.iterdir())


def test_sweep_file_not_utf8(tmp_path):
    f = tmp_path / "utf16.yaml"
    f.write_bytes(with_().encode("utf-16"))
    result, res = sweep(tmp_path, str(f))
    assert result.exit_code == 2, result.output
    assert (
        result.stderr.strip() == f"error: {f}: line 1: not UTF-8 text (byte 0xff at offset 0); save the file as UTF-8"
    )
    assert not res.exists()


def test_missing_sweep_file(tmp_path):
    result, res = sweep(tmp_path, str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2 and "file not found" in result.stderr and not res.exists()


def test_bad_jobs_and_launcher(tmp_path):
    f = write(tmp_path, with_())
    r1, res = sweep(tmp_path, str(f), "--jobs", "0")
    assert r1.exit_code == 2 and "--jobs must be >= 1" in r1.stderr
    r2, res = sweep(tmp_path, str(f), "--launcher", "jooblib")
    assert r2.exit_code == 2 and "unknown launcher 'jooblib' (did you mean 'joblib'?)" in r2.stderr
    r3, res = sweep(tmp_path, str(f), "hydra.launcher.n_jobs=2")
    assert r3.exit_code == 2 and "needs --launcher" in r3.stderr
    assert not res.exists()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    f = write(tmp_path, with_())
    result, res = sweep(tmp_path, str(f), "--dry-run", "train.steps=3")
    assert result.exit_code == 0, result.output
    out = result.stdout
    # 2 methods x 2 p x 2 seeds = 8 points; dapo has no p: 2 dapo + 4 nsr = 6 runs
    assert "6 runs from 8 grid points" in out
    for col in ("run_id", "method", "parameters", "seed", "steps"):
        assert col in out
    assert out.count("│ nsr ") == 4 and out.count("│ dapo ") == 2
    assert "p=0.5" in out and "p=1" in out
    assert not res.exists()


def test_json_prints_one_object_per_run(tmp_path):
    f = write(tmp_path, with_())
    result, res = sweep(tmp_path, str(f), "--json", "train.steps=3")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 6
    for r in rows:
        assert set(r) == {"run_id", "config"}
        assert run_id(r["config"]) == r["run_id"]
        assert r["config"]["train"]["steps"] == 3
    assert not res.exists()


def test_a_model_that_does_not_load_is_refused_before_the_manifest(tmp_path):
    """The trainer's preflight runs once per distinct setting before anything is written."""
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    f = write(tmp_path, with_(overrides={"model.name": str(empty)}))
    result, res = sweep(tmp_path, str(f))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: model.name: cannot load '{empty}'"), result.stderr
    assert not res.exists()


def test_hydra_command_joins_a_running_ray_cluster(monkeypatch):
    """The Ray plugin sizes the object store of a Ray instance it would start; Ray refuses that setting
    when joining a running cluster, so clipbench clears it whenever an address is given."""
    from clipbench.sweep.hydra_app import hydra_command

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    kw = dict(launcher="ray", jobs=None, sweep_dir="/tmp/s")
    null = "+hydra.launcher.ray.init.object_store_memory=null"
    assert null not in hydra_command("/tmp/s/manifest.json", ["a"], **kw)  # starts its own instance
    assert null in hydra_command(
        "/tmp/s/manifest.json", ["a"], hydra_overrides=["hydra.launcher.ray.init.address=h:6379"], **kw
    )
    mine = "+hydra.launcher.ray.init.object_store_memory=1000000000"
    cmd = hydra_command(
        "/tmp/s/manifest.json", ["a"], hydra_overrides=["hydra.launcher.ray.init.address=h:1", mine], **kw
    )
    assert null not in cmd and mine in cmd  # the user's own setting wins
    monkeypatch.setenv("RAY_ADDRESS", "h:6379")
    assert null in hydra_command("/tmp/s/manifest.json", ["a"], **kw)


def test_a_failing_launcher_exits_1_with_one_line(tmp_path):
    f = write(tmp_path, with_(grid={"seed": [0]}, overrides={"tracking.mlflow": False}))
    result, res = sweep(tmp_path, str(f), "--launcher", "basic", "hydra.launcher.no_such_key=1")
    assert result.exit_code == 1
    assert "the basic launcher exited with code 1 and 1 run(s) did not finish" in result.stderr


def test_runs_of_several_processes_get_that_many_times_the_launchers_resources(monkeypatch):
    """Launcher resources are per process: runs with launch.nproc_per_node = N are launched apart, with
    N times each resource setting (N CPUs when none is given)."""
    import subprocess

    from clipbench.sweep import hydra_app

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    nprocs = {"a": 1, "b": 2, "c": 1, "d": 4}
    kw = dict(jobs=None, sweep_dir="/tmp/s")
    hydra_app.launch(
        "/tmp/s/manifest.json",
        list(nprocs),
        nprocs=nprocs,
        launcher="ray",
        hydra_overrides=["+hydra.launcher.ray.remote.num_gpus=1", "hydra.launcher.ray.init.address=h:1"],
        **kw,
    )
    by_ids = {next(a for a in cmd if a.startswith("run_id=")): cmd for cmd in calls}
    assert list(by_ids) == ["run_id='a','c'", "run_id='b'", "run_id='d'"]
    assert "+hydra.launcher.ray.remote.num_gpus=1" in by_ids["run_id='a','c'"]
    assert "+hydra.launcher.ray.remote.num_gpus=2" in by_ids["run_id='b'"]
    assert "+hydra.launcher.ray.remote.num_gpus=4" in by_ids["run_id='d'"]
    calls.clear()
    hydra_app.launch(
        "/tmp/s/manifest.json",
        ["b"],
        nprocs={"b": 2},
        launcher="submitit_slurm",
        hydra_overrides=["hydra.launcher.cpus_per_task=8", "hydra.launcher.mem_gb=32.5"],
        **kw,
    )
    assert {"hydra.launcher.cpus_per_task=16", "hydra.launcher.mem_gb=65"} <= set(calls[0])
    calls.clear()
    hydra_app.launch("/tmp/s/manifest.json", ["b"], nprocs={"b": 2}, launcher="ray", hydra_overrides=[], **kw)
    assert "+hydra.launcher.ray.remote.num_cpus=2" in calls[0]


def test_the_cli_loads_without_torch_and_the_sweep_verb_passes_every_option():
    """`clipbench --help` imports no verb's implementation (torch, transformers: ~1.5 s): each verb
    loads on use. The sweep verb's options are declared in cli.py and passed through one for one."""
    import inspect
    import subprocess
    import sys

    code = "import sys, clipbench.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from clipbench.cli import sweep
    from clipbench.commands.sweep import sweep_command

    # (and the terminal's status line, which cli.py opens before the import)
    assert list(inspect.signature(sweep).parameters) == list(inspect.signature(sweep_command).parameters)[:-1]
    assert list(inspect.signature(sweep_command).parameters)[-1] == "stage"


def _clipbench(*args: str, cwd: Path, importtime: bool = False):
    import subprocess
    import sys

    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "clipbench", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_a_finished_sweep_reruns_without_its_expansion_until_an_input_changes(tmp_path):
    """A sweep whose runs all finished (their status written as the trainer writes it): the full rerun
    trains nothing, opens no MLflow, and remembers its inputs; the next rerun prints the same lines
    without importing torch; an edited sweep file, another override or a run no longer finished take
    the full path again."""
    from clipbench.commands.sweep import plan
    from clipbench.sweep.manifest import freeze
    from clipbench.tracking.store import RunDir, RunState

    sweep_file = tmp_path / "done.yaml"
    sweep_file.write_text(yaml.safe_dump({"name": "done", "base": str(RECIPE), "grid": {"seed": [0, 1]}}))
    results = tmp_path / "results"
    spec, exp = plan(sweep_file)
    freeze(results, spec, exp)
    for rid in exp.runs:
        RunDir(results / "done" / rid).set_status(RunState.FINISHED)
    args = ("sweep", str(sweep_file), "--results-dir", str(results))
    lines = [
        f"sweep done: 2 runs -> {results / 'done'}  (2 finished, 0 to resume, 0 to start)",
        "2/2 runs finished",
    ]
    full = _clipbench(*args, cwd=tmp_path)
    assert full.returncode == 0 and full.stderr.splitlines() == lines, full.stderr
    assert not (results / "mlflow.db").exists()  # nothing trained: MLflow untouched
    assert (results / "done" / ".cache" / "rerun.json").is_file()

    def imports_torch(res) -> bool:
        return any(
            line.startswith("import time:") and line.rstrip().endswith(" torch") for line in res.stderr.splitlines()
        )

    fast = _clipbench(*args, cwd=tmp_path, importtime=True)
    assert fast.returncode == 0 and not imports_torch(fast)
    assert [line for line in fast.stderr.splitlines() if not line.startswith("import time:")] == lines
    # another override (outside the runs' identity: the same runs): the full path
    again = _clipbench(*args, "tracking.mlflow=false", cwd=tmp_path, importtime=True)
    assert imports_torch(again)
    sweep_file.write_text(sweep_file.read_text() + "# edited\n")
    assert imports_torch(_clipbench(*args, cwd=tmp_path, importtime=True))
    RunDir(results / "done" / next(iter(exp.runs))).set_status(RunState.FAILED)
    res = _clipbench(*args, cwd=tmp_path, importtime=True)
    assert imports_torch(res) and "1 failed: skipped" in res.stderr
    # a finished sweep remembered again, then a run's config.yaml damaged: the full path finds it (one line)
    RunDir(results / "done" / next(iter(exp.runs))).set_status(RunState.FINISHED)
    assert _clipbench(*args, cwd=tmp_path).returncode == 0
    assert not imports_torch(_clipbench(*args, cwd=tmp_path, importtime=True))
    (results / "done" / next(iter(exp.runs)) / "config.yaml").write_text("objective: [unclosed\n")
    res = _clipbench(*args, cwd=tmp_path)
    assert res.returncode == 2 and "config.yaml" in res.stderr.strip().splitlines()[-1]


def test_a_sweep_on_a_terminal_says_what_it_does_before_its_plan(tmp_path):
    """On a terminal, the sweep's first words come before torch is imported: a status line ('loading
    clipbench', then what it does), erased before the plan. (A pseudo-terminal, as a user's shell.)"""
    import os
    import pty
    import select
    import sys

    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(yaml.safe_dump({"name": "s", "base": str(RECIPE), "grid": {"seed": [0, 1]}}))
    pid, fd = pty.fork()
    if pid == 0:  # the child: clipbench on the terminal
        os.environ["COLUMNS"] = "200"
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "clipbench",
                "sweep",
                str(sweep_file),
                "--dry-run",
                "--results-dir",
                str(tmp_path / "r"),
            ],
        )
    out = b""
    while select.select([fd], [], [], 120)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    first, expanding = text.index("loading clipbench (torch)"), text.index("expanding its grid")
    assert first < expanding < text.index("2 runs from 2 grid points")
