"""Store additions: the whole-sweep metrics loader (Arrow fast path vs the line reader), run listing,
torn lines, and the run locks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pandas as pd

from clipbench.tracking.lock import run_locked_elsewhere, try_run_lock
from clipbench.tracking.store import RunDir, list_run_dirs, load_sweep_metrics, read_jsonl


def make_runs(root, n_runs: int = 5, rows: int = 7, seed: int = 0) -> dict[str, list[dict]]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_runs):
        rd = RunDir(root / "sw" / f"run{i:03d}")
        rd.write_config({"seed": i})
        data = []
        for s in range(rows):
            row = {"step": s // 2, "opt_step": s + 1, "loss": float(rng.normal()), "clip_events": int(rng.integers(0, 9))}
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
    # a column that is a number in one row and a string in another: Arrow refuses, pandas copes
    rd.metrics_path.write_text(json.dumps({"opt_step": 1, "x": 1.5}) + "\n" + json.dumps({"opt_step": 2, "x": "n/a"}) + "\n")
    df = load_sweep_metrics(tmp_path, "sw")
    assert df.x.tolist() == [1.5, "n/a"] and df.run_id.tolist() == ["r1", "r1"]


def test_run_lock_is_exclusive_across_processes_and_released_on_kill(tmp_path):
    sweep_dir = tmp_path / "sw"
    code = ("import sys, time; from clipbench.tracking.lock import try_run_lock\n"
            "with try_run_lock(sys.argv[1], 'r1') as got:\n"
            "    print('got' if got else 'busy', flush=True); time.sleep(60)\n")
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
    import clipbench.tracking.store as store

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
