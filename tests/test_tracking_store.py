"""Store additions: the whole-sweep metrics loader (Arrow fast path vs the line reader), run listing,
torn lines, and the run locks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from clipbench.errors import StoreError, UserError
from clipbench.tracking.files import atomic_write_json, check_writable_dir, read_jsonl
from clipbench.tracking.lock import run_locked_elsewhere, try_run_lock
from clipbench.tracking.metrics_table import load_sweep_metrics
from clipbench.tracking.store import RunDir, list_run_dirs


def make_runs(root, n_runs: int = 5, rows: int = 7, seed: int = 0) -> dict[str, list[dict]]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_runs):
        rd = RunDir(root / "sw" / f"run{i:03d}")
        rd.write_config({"seed": i})
        data = []
        for s in range(rows):
            row = {
                "step": s // 2,
                "opt_step": s + 1,
                "loss": float(rng.normal()),
                "clip_events": int(rng.integers(0, 9)),
            }
            if i % 2:  # some runs have an extra column (kl_ref only when beta > 0)
                row["kl_ref"] = float(rng.random())
            if s == 3:
                row["grad_norm"] = float("nan")  # stored as null
            data.append(row)
        rd.append_metrics(data)
        out[rd.run_id] = data
    return out


def test_load_sweep_metrics_matches_the_line_reader(tmp_path):
    runs = make_runs(tmp_path)
    df = load_sweep_metrics(tmp_path, "sw")
    assert list(df.columns[:1]) == ["run_id"]
    assert len(df) == 5 * 7
    for rid, rows in runs.items():
        part = df[df.run_id == rid].reset_index(drop=True)
        ref = read_jsonl(RunDir(tmp_path / "sw" / rid).metrics_path)
        assert len(part) == len(ref) == len(rows)
        np.testing.assert_allclose(part["loss"].to_numpy(), [r["loss"] for r in rows])
        assert part["opt_step"].tolist() == [r["opt_step"] for r in rows]
        assert part["clip_events"].tolist() == [r["clip_events"] for r in rows]
        if int(rid[-1]) % 2:
            np.testing.assert_allclose(part["kl_ref"].to_numpy(), [r["kl_ref"] for r in rows])
        else:
            assert part["kl_ref"].isna().all()
        assert math.isnan(part.loc[3, "grad_norm"])


def test_torn_last_line_is_skipped_and_run_filter(tmp_path):
    make_runs(tmp_path, n_runs=3, rows=4)
    p = tmp_path / "sw" / "run001" / "metrics.jsonl"
    with open(p, "a") as f:
        f.write('{"step": 9, "opt_step": 99, "lo')  # a crash mid-append
    df = load_sweep_metrics(tmp_path, "sw")
    assert len(df) == 12 and 99 not in df.opt_step.tolist()
    only = load_sweep_metrics(tmp_path, "sw", run_ids=["run002"])
    assert set(only.run_id) == {"run002"} and len(only) == 4


def test_empty_and_missing_sweeps(tmp_path):
    df = load_sweep_metrics(tmp_path, "nothing")
    assert isinstance(df, pd.DataFrame) and len(df) == 0 and "run_id" in df.columns
    (tmp_path / "sw" / ".locks").mkdir(parents=True)
    RunDir(tmp_path / "sw" / "r1").write_config({})
    assert [r.run_id for r in list_run_dirs(tmp_path / "sw")] == ["r1"]  # hidden dirs are not runs


def test_fallback_reader_handles_what_arrow_rejects(tmp_path):
    rd = RunDir(tmp_path / "sw" / "r1")
    rd.write_config({})
    # a column that is a number in one row and a list of numbers in another: Arrow refuses, pandas copes
    rd.metrics_path.write_text(
        json.dumps({"opt_step": 1, "x": 1.5}) + "\n" + json.dumps({"opt_step": 2, "x": [1, 2]}) + "\n"
    )
    df = load_sweep_metrics(tmp_path, "sw")
    assert df.x.tolist() == [1.5, [1, 2]] and df.run_id.tolist() == ["r1", "r1"]
    # text where a number belongs is a value clipbench never writes: one line naming the file, row and key
    rd.metrics_path.write_text(
        json.dumps({"opt_step": 1, "x": 1.5}) + "\n" + json.dumps({"opt_step": 2, "x": "n/a"}) + "\n"
    )
    with pytest.raises(StoreError, match=r"metrics.jsonl: line 2: key 'x' holds 'n/a' \(str\), not a number"):
        load_sweep_metrics(tmp_path, "sw")


def test_run_lock_is_exclusive_across_processes_and_released_on_kill(tmp_path):
    sweep_dir = tmp_path / "sw"
    code = (
        "import sys, time; from clipbench.tracking.lock import try_run_lock\n"
        "with try_run_lock(sys.argv[1], 'r1') as got:\n"
        "    print('got' if got else 'busy', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(sweep_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "got"
        with try_run_lock(sweep_dir, "r1") as got:
            assert got is False
        assert run_locked_elsewhere(sweep_dir, "r1")
        with try_run_lock(sweep_dir, "r2") as got:  # other runs are free
            assert got is True
    finally:
        p.kill()  # SIGKILL: the OS drops the flock
        p.wait()
    deadline = time.time() + 5
    while run_locked_elsewhere(sweep_dir, "r1") and time.time() < deadline:
        time.sleep(0.05)
    with try_run_lock(sweep_dir, "r1") as got:
        assert got is True


def test_cache_is_reused_and_only_changed_runs_are_reparsed(tmp_path, monkeypatch):
    import clipbench.tracking.metrics_table as store

    make_runs(tmp_path, n_runs=4, rows=5)
    first = load_sweep_metrics(tmp_path, "sw")
    cache = tmp_path / "sw" / ".cache" / "metrics.jsonl.arrow"
    assert cache.is_file()
    parsed: list[list[str]] = []
    real = store._parse_jsonl_arrow
    monkeypatch.setattr(store, "_parse_jsonl_arrow", lambda ids, chunks: parsed.append(list(ids)) or real(ids, chunks))

    again = load_sweep_metrics(tmp_path, "sw")
    assert parsed == []  # served from the cache
    pd.testing.assert_frame_equal(again, first)

    time.sleep(0.01)
    RunDir(tmp_path / "sw" / "run002").append_metrics([{"step": 9, "opt_step": 6, "loss": 42.0, "new_col": 1.5}])
    RunDir(tmp_path / "sw" / "run009").append_metrics([{"step": 0, "opt_step": 1, "loss": -1.0}])  # a new run
    third = load_sweep_metrics(tmp_path, "sw")
    assert parsed == [["run002", "run009"]]  # only the changed and the new run
    nocache = load_sweep_metrics(tmp_path, "sw", cache=False)
    pd.testing.assert_frame_equal(third, nocache, check_like=True)
    assert third[third.run_id == "run002"].loss.tolist()[-1] == 42.0 and len(third) == 4 * 5 + 2

    cache.write_bytes(b"garbage")  # a damaged cache is ignored and rebuilt
    parsed.clear()
    pd.testing.assert_frame_equal(load_sweep_metrics(tmp_path, "sw"), nocache, check_like=True)
    assert len(parsed[0]) == 5


# ---- damaged files: one line naming the file, where, and what to do ------------------------


def test_a_corrupt_middle_line_is_an_error_naming_file_and_line_in_every_reader(tmp_path):
    make_runs(tmp_path, n_runs=3, rows=6)
    load_sweep_metrics(tmp_path, "sw")  # builds the cache first: a changed file must be re-read, not served
    p = tmp_path / "sw" / "run001" / "metrics.jsonl"
    lines = p.read_text().splitlines(keepends=True)
    lines[2] = '{"step": 1, "opt_step": 3, "q1/out_of_ba\n'  # damaged in place, newline kept
    p.write_text("".join(lines))
    for read in (
        lambda: read_jsonl(p),
        lambda: load_sweep_metrics(tmp_path, "sw"),
        lambda: load_sweep_metrics(tmp_path, "sw", cache=False),
        lambda: RunDir(p.parent).read_metrics(),
    ):
        with pytest.raises(StoreError) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(f"{p}: line 3: not valid JSON (") and "repair or delete that line" in msg, msg
        assert "\n" not in msg
    p.write_text("".join(lines[:2]) + "[1, 2]\n" + "".join(lines[3:]))  # valid JSON, but not a row
    with pytest.raises(StoreError, match=r"line 3: expected a JSON object, got list"):
        load_sweep_metrics(tmp_path, "sw")


def test_a_torn_last_line_is_skipped_with_a_note(tmp_path):
    make_runs(tmp_path, n_runs=2, rows=4)
    p = tmp_path / "sw" / "run000" / "metrics.jsonl"
    with open(p, "a") as f:
        f.write('{"step": 9, "opt_step": 99, "lo')
    notes: list[str] = []
    assert len(read_jsonl(p, notes=notes)) == 4
    assert notes == [
        f"{p}: skipped an incomplete last line 5 (a crash or a write in progress; a resumed run rewrites it)"
    ]
    notes = []
    df = load_sweep_metrics(tmp_path, "sw", notes=notes)
    assert len(df) == 8 and len(notes) == 1 and str(p) in notes[0]


@pytest.mark.parametrize(
    "kind,text,problem",
    [
        ("status", '{"state": "finis', "not valid JSON (Unterminated string"),
        ("status", "[]", "expected a JSON object, got list"),
        ("status", '{"state": "done"}', "unknown state 'done'"),
        ("config", "seed: [0\n", "line 2: YAML syntax error"),
        ("config", "", "expected a mapping (the run config), got an empty file"),
        ("config", "seed: 0\nseed: 1\n", "line 2: duplicate key 'seed'"),
        ("eval", '{"n": 2, "problem_ids": ["a"], "correct": [[1, 0, 1]]}', "'n' (2) does not match the 3"),
        ("eval", '{"problem_ids": ["a", "b"], "correct": [[1, 0]]}', "'correct' must be a list of 2 rows"),
        ("eval", '{"problem_ids": ["a"], "correct": [[1, 7]]}', "values other than 0 and 1"),
        ("eval", "\xff\xfe{}", "not UTF-8 text"),
    ],
)
def test_damaged_run_files_are_one_line_with_a_remedy(tmp_path, kind, text, problem):
    rd = RunDir(tmp_path / "sw" / "r1")
    rd.write_config({"seed": 0})
    path = {"status": rd.status_path, "config": rd.config_path, "eval": rd.eval_path(4, "arith")}[kind]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("latin-1"))
    read = {"status": rd.status, "config": rd.read_config, "eval": rd.read_evals}[kind]
    with pytest.raises(StoreError) as e:
        read()
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and problem in msg and "\n" not in msg, msg
    remedy = {
        "status": "delete it: the run then counts as interrupted",
        "config": "restore it",
        "eval": "move it away",
    }[kind]
    assert remedy in msg


def test_atomic_writes_honour_the_umask(tmp_path):
    old = os.umask(0o002)  # a group-shared results dir
    try:
        atomic_write_json(tmp_path / "a" / "status.json", {"state": "running"})
        RunDir(tmp_path / "r").append_metrics([{"step": 0}])
        os.umask(0o077)
        atomic_write_json(tmp_path / "b.json", {})
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "status.json").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o775
    assert (tmp_path / "r" / "metrics.jsonl").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob("**/.*.tmp"))


def test_results_dir_must_be_a_writable_directory(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UserError, match=f"--results-dir {f}: exists and is not a directory"):
        check_writable_dir(f)
    with pytest.raises(UserError, match=f"cannot be created: {f} is not a directory"):
        check_writable_dir(f / "results")
    assert check_writable_dir(tmp_path / "new" / "results") == tmp_path / "new" / "results"
    assert not (tmp_path / "new").exists()  # a check writes nothing
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(UserError, match="is not writable by this user"):
            check_writable_dir(ro)
