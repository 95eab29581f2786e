"""What a report reads that would change its numbers without a word: each case damages or widens a
real results store (the hand-checkable fixture of tests/fixtures/make_report_fixture.py: grpo, abc,
nsr x seeds 0 and 1, n = 4 samples, arith 4 problems and gsm8k 3) and runs `clipbench report` as a
user does.

- A grid axis the labels left out (`eval.n`, `eval.limit`, `train.checkpoint_every`) was pooled as
  seeds: "grpo: seeds 0, 0, 1, 1", a mean of 4 "seeds" and an interval over duplicates. Every key
  in which runs differ but the seed is an arm.
- An evaluation file that covers part of its problems, or holds one twice, changed the report's
  numbers with no note. Its problem ids are checked against the benchmark's split.
- `--format csv` and `--format latex` of an unfinished sweep said nothing of it.
- NaN, infinity or text in a stored metrics row, histogram or evaluation matrix: 70-132-line
  tracebacks, a blank cell, or (1e308, how clipbench writes an infinite value) a 309-digit cell. Now
  one line naming the file, row and key, and an overflow reads as 'inf'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.config.stored import setting

runner = CliRunner()


@pytest.fixture
def store(tmp_path, report_fixture) -> Path:
    return report_fixture.build(tmp_path / "results")


def report(store: Path, out: Path, *extra: str):
    res = runner.invoke(app, ["report", "fixture", "--results-dir", str(store), "--out", str(out), *extra])
    return res, (json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None)


def one_line(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines at the terminal's width


def add_grid_point(
    store: Path, report_fixture, key: str, value, *, n: int | None = None, problems: int | None = None
) -> list[str]:
    """grpo's two runs again at `key: value` (the other grid point of that axis), as a sweep with
    `grid: {seed: [0, 1], objective.name: [grpo], KEY: [fixture's, value]}` leaves them; `n`, `problems`:
    the copies' evaluations have that many samples per problem, problems per benchmark (the fixture's
    first). Returns the new run ids."""
    sweep = store / report_fixture.SWEEP
    manifest = json.loads((sweep / "manifest.json").read_text())
    new = []
    for seed in (0, 1):
        src = sweep / report_fixture.run_id("grpo", seed)
        rid = f"g{seed}{key.replace('.', '')}"[:12].ljust(12, "0")
        dst = sweep / rid
        shutil.copytree(src, dst)
        cfg = yaml.safe_load((dst / "config.yaml").read_text())
        head, _, tail = key.partition(".")
        cfg.setdefault(head, {})[tail] = value
        (dst / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        for f in (dst / "eval").rglob("*.json") if n or problems else ():
            ev = json.loads(f.read_text())
            ev["problem_ids"] = ev["problem_ids"][:problems]
            ev["correct"] = [row[:n] for row in ev["correct"][:problems]]
            ev["n"] = len(ev["correct"][0])
            f.write_text(json.dumps(ev))
        manifest["runs"][rid] = cfg
        new.append(rid)
    (sweep / "manifest.json").write_text(json.dumps(manifest))
    return new


def test_an_evaluation_axis_is_two_arms_never_four_seeds(store, report_fixture, tmp_path):
    add_grid_point(store, report_fixture, "eval.n", 2, n=2)
    res, rep = report(store, tmp_path / "rep")
    assert res.exit_code == 0, res.output
    out = one_line(res.stdout)
    assert "grpo(eval.n=2): seeds 0, 1 (final step 2)" in out
    assert "grpo(eval.n=4): seeds 0, 1 (final step 2)" in out
    assert "seeds 0, 0" not in out
    (block,) = rep["blocks"]
    assert {lb: info["seeds"] for lb, info in block["labels"].items()} == {
        "grpo(eval.n=4)": [0, 1],
        "grpo(eval.n=2)": [0, 1],
        "abc": [0, 1],
        "nsr": [0, 1],
    }
    # grpo at n = 4 keeps the fixture's numbers: arith Avg@4 of seeds 7/16 and 6/16 -> 0.40625
    assert block["benchmarks"]["arith"]["rows"]["grpo(eval.n=4)"]["metrics"]["avg"]["mean"] == pytest.approx(0.40625)
    # the claims compare arms at one evaluation setting: abc (n = 4) against grpo at n = 4 only
    compared = {c["comparison"] for c in rep["claims"] if c["claim"].startswith("ABC-GRPO")}
    assert compared == {"abc - grpo(eval.n=4)"}


@pytest.mark.parametrize(("key", "value"), [("eval.limit", 2), ("train.checkpoint_every", 7)])
def test_any_key_in_which_runs_differ_but_the_seed_is_an_arm(store, report_fixture, tmp_path, key, value):
    add_grid_point(store, report_fixture, key, value, problems=value if key == "eval.limit" else None)
    res, rep = report(store, tmp_path / "rep")
    assert res.exit_code == 0, res.output
    labels = set(rep["blocks"][0]["labels"])
    section, _, leaf = key.partition(".")  # the fixture's value, or what its configs, not setting it, mean
    default = report_fixture.config("grpo", 0)[section].get(leaf, setting({}, key))
    assert {f"grpo({key}={value})", f"grpo({key}={default})"} <= labels and "grpo" not in labels
    assert all(info["seeds"] == [0, 1] for info in rep["blocks"][0]["labels"].values())
    cannot_differ = [n for n in rep["notes"] if "cannot differ" in n]
    if key == "train.checkpoint_every":  # the checkpoint interval does not change what a run computes
        assert cannot_differ == [
            f"grpo({key}={default}) and grpo({key}={value}) differ only in {key}, which does not change what a run "
            "computes: their runs cannot differ, and they are kept apart (not pooled as seeds)"
        ]
        assert f"Note: {cannot_differ[0]}" in one_line(res.stdout)
    else:
        assert cannot_differ == []


def cut(path: Path, keep: int | None = None, twice: bool = False) -> None:
    """An evaluation file that lost all but `keep` problems, or holds its first problem twice."""
    ev = json.loads(path.read_text())
    if twice:
        ev["problem_ids"][1], ev["correct"][1] = ev["problem_ids"][0], ev["correct"][0]
    else:
        ev["problem_ids"], ev["correct"] = ev["problem_ids"][:keep], ev["correct"][:keep]
    path.write_text(json.dumps(ev))


@pytest.mark.parametrize(
    ("bench", "damage", "problem"),
    [
        (  # arith is generated: its split at the run's eval.limit (4) is read here
            "arith",
            {"keep": 2},
            "covers 2 of the 4 problems of benchmark 'arith' (its split at the run's eval settings) (missing: "
            "arith-test-00002, arith-test-00003)",
        ),
        (  # gsm8k would come from the Hugging Face hub: the ids the sweep's other evaluations hold
            "gsm8k",
            {"keep": 2},
            "covers 2 of the 3 problems the sweep's other evaluations of 'gsm8k' with the same settings hold "
            "(missing: gsm8k-2)",
        ),
        ("arith", {"twice": True}, "problem id 'arith-test-00000' is held 2 times (each problem once)"),
    ],
)
def test_an_evaluation_that_lost_problems_is_one_line(store, report_fixture, tmp_path, bench, damage, problem):
    """Before: the report aligned every run on the problems all evaluated, so one file cut to half its
    problems cut every run of its benchmark (a Finding of -7.8 became +3.1); an id held twice counted
    one problem's row for another's."""
    f = store / report_fixture.SWEEP / report_fixture.run_id("abc", 1) / "eval" / "step_000002" / f"{bench}.json"
    cut(f, **damage)
    res, _ = report(store, tmp_path / "rep")
    assert res.exit_code == 2
    assert res.stderr == (
        f"error: {f}: {problem}; move it away (the evaluation is then left out) or delete the run directory to "
        "train the run again\n"
    )
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("fmt", ["csv", "latex"])
def test_csv_and_latex_of_an_unfinished_sweep_say_so(store, report_fixture, tmp_path, fmt):
    """Markdown, HTML and the terminal said first that the sweep was unfinished; CSV and LaTeX said
    nothing. Now report.tex opens with it, CSV's header.txt holds it, and the command says it on stderr."""
    sweep = store / report_fixture.SWEEP
    running = report_fixture.run_id("nsr", 1)
    status = sweep / running / "status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "state": "running"}))
    res, _ = report(store, tmp_path / "rep", "--format", fmt)
    assert res.exit_code == 0, res.output
    line = (
        f"INCOMPLETE: sweep '{report_fixture.SWEEP}' has 5 of its 6 planned runs finished (1 running: {running}); "
        "what follows is of the finished runs only and may change (`clipbench sweep` finishes it)."
    )
    assert res.stderr == f"warning: {line}\n"
    if fmt == "csv":
        assert (tmp_path / "rep" / "header.txt").read_text().splitlines()[0] == line
    else:
        tex = (tmp_path / "rep" / "report.tex").read_text()
        first = tex.split("\n\n")[1].splitlines()[0]  # after the comment line: before any table
        assert first == "\\noindent\\textbf{" + line.replace("_", "\\_") + "}\\par\\medskip"


def set_row_value(path: Path, line: int, key: str, value, *, raw: str | None = None) -> None:
    """Line `line` (1-based) of a jsonl file with `key` set to `value` (or to the JSON text `raw`)."""
    lines = path.read_text().splitlines()
    row = json.loads(lines[line - 1])
    row[key] = "@@" if raw is not None else value
    lines[line - 1] = json.dumps(row).replace('"@@"', raw) if raw is not None else json.dumps(row)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("file", "key", "raw", "problem"),
    [
        (
            "metrics.jsonl",
            "entropy",
            "NaN",
            "key 'entropy' holds nan, which clipbench never writes (it writes null or ±1e308)",
        ),
        (
            "metrics.jsonl",
            "entropy",
            "1e400",
            "key 'entropy' holds inf, which clipbench never writes (it writes null or ±1e308)",
        ),
        ("metrics.jsonl", "q4/out_of_band", '"7"', "key 'q4/out_of_band' holds '7' (str), not a number"),
        ("metrics.jsonl", "q4/out_of_band", "1e308", "key 'q4/out_of_band' holds 1e+308, not a count"),
        ("hist/log_ratio.jsonl", "pos", "[1, NaN]", "key 'pos' holds a list with nan, not a list of numbers"),
    ],
)
def test_a_value_clipbench_never_writes_is_one_line_naming_file_row_and_key(
    store, report_fixture, tmp_path, file, key, raw, problem
):
    """NaN, infinity or text in a stored row: 70-132-line tracebacks (int() of a NaN count, a sum of
    text), or a blank cell."""
    path = store / report_fixture.SWEEP / report_fixture.run_id("grpo", 0) / file
    set_row_value(path, 2, key, None, raw=raw)
    res, _ = report(store, tmp_path / "rep")
    assert res.exit_code == 2
    assert res.stderr == (
        f"error: {path}: line 2: {problem}; repair or delete that line (the other rows are intact), or delete the "
        "run directory to train the run again\n"
    )


def test_an_overflow_clipbench_wrote_reads_as_infinite_not_309_digits(store, report_fixture, tmp_path):
    """clipbench writes an infinite value as 1e308; the dynamics table printed it as a 309-digit number."""
    path = store / report_fixture.SWEEP / report_fixture.run_id("grpo", 0) / "metrics.jsonl"
    for line in (1, 2, 3, 4):
        set_row_value(path, line, "entropy", 1e308)
    res, rep = report(store, tmp_path / "rep", "--format", "markdown")
    assert res.exit_code == 0, res.output
    row = next(
        ln for ln in (tmp_path / "rep" / "report.md").read_text().splitlines() if ln.startswith("| grpo | 2 | inf")
    )
    assert len(row) < 120  # 'inf ± nan → inf ± nan', the other cells as before


def test_text_in_an_evaluation_matrix_is_one_line(store, report_fixture, tmp_path):
    """numpy read the text "1" as the number 1 (then a 70-line traceback where it summed text)."""
    path = store / report_fixture.SWEEP / report_fixture.run_id("grpo", 0) / "eval" / "step_000002" / "arith.json"
    ev = json.loads(path.read_text())
    ev["correct"][1][2] = "1"
    path.write_text(json.dumps(ev))
    res, _ = report(store, tmp_path / "rep")
    assert res.exit_code == 2
    assert res.stderr == (
        f"error: {path}: 'correct' row 1 (problem 'arith-test-00001') holds '1', not 0 or 1; move it away (the "
        "evaluation is then left out) or delete the run directory to train the run again\n"
    )
