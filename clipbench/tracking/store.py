"""The results store: one directory per run, plain files, atomic writes. The source of truth.

    <results>/<sweep>/<run_id>/config.yaml     resolved run config
    <results>/<sweep>/<run_id>/status.json     {"state": pending|running|finished|failed|preempted, ...}
    <results>/<sweep>/<run_id>/metrics.jsonl   one JSON object per optimizer step (append-only)
    <results>/<sweep>/<run_id>/hist/log_ratio.jsonl   log-ratio histograms per rollout step (summed over its optimizer steps)
    <results>/<sweep>/<run_id>/eval/step_<k>/<benchmark>.json   correctness matrix + summary
    <results>/<sweep>/<run_id>/checkpoints/last/     sharded model + optimizer, trainer state (clipbench.train.checkpoint)
    <results>/<sweep>/<run_id>/record/step_<k>/      the rule's inputs of recorded rollout steps (records.py)
    <results>/<sweep>/.shared/eval_step_0/<key>/     evaluations the sweep's runs share (train/shared_eval.py)

Design choices: whole files are written atomically and appended JSON lines survive a kill -9
(files.py); every reader of a store file (`read_json`, `read_jsonl`, `RunDir.read_config`,
`RunDir.status`, `RunDir.read_evals`) turns a damaged file into one `StoreError` line: the file,
what is wrong and what the user can do (`REMEDIES`). The whole-sweep metrics table (with its parse
cache) is metrics_table.py's.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from clipbench.errors import DiskFull, StoreError, disk_reason
from clipbench.tracking.files import (
    REMEDIES,
    _read_text,
    atomic_write_json,
    atomic_write_text,
    dumps,
    raise_naming,
    read_json,
    read_jsonl,
)
from clipbench.tracking.store_format import read_format, stamp
from clipbench.yamlio import YamlError, dump_yaml, load_yaml_text


class RunState(str, Enum):
    """A run's state in status.json (a str, so the file holds the plain name)."""

    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    PREEMPTED = "preempted"  # checkpointed, resumable


STATES = tuple(s.value for s in RunState)
CHECKPOINT_LOGS = "logs"  # a checkpoint's copy of the run's metrics.jsonl and histograms (train.checkpoint)
# Sub-directories of a results dir that are not sweeps (`train` is: single `clipbench train` runs).
NOT_SWEEPS = ("reports", "bench", "eval", "mlartifacts")


def check_eval_payload(path: Path, payload: dict) -> dict:
    """An evaluation payload as the report needs it: P problem ids, a P x n matrix of 0/1, n."""

    def bad(problem: str):
        raise StoreError(path, problem, REMEDIES["eval"])

    ids, correct = payload.get("problem_ids"), payload.get("correct")
    if not isinstance(ids, list) or not ids:
        bad("'problem_ids' is missing or empty")
    twice = [i for i, c in Counter(map(str, ids)).items() if c > 1]
    if twice:
        bad(f"problem id {twice[0]!r} is held {Counter(map(str, ids))[twice[0]]} times (each problem once)")
    if not isinstance(correct, list) or len(correct) != len(ids):
        bad(f"'correct' must be a list of {len(ids)} rows (one per problem id)")
    try:
        m = np.asarray(correct)
    except (TypeError, ValueError):
        bad("'correct' is not a rectangular matrix of numbers")
    if m.dtype.kind not in "biuf":  # text among the numbers (numpy would read "1" as 1): name the first
        for i, row in enumerate(correct):
            x = (
                next((x for x in row if x.__class__ not in (int, bool, float)), correct)
                if isinstance(row, list)
                else row
            )
            if x is not correct:
                bad(f"'correct' row {i} (problem {ids[i]!r}) holds {x!r}, not 0 or 1")
        bad("'correct' is not a rectangular matrix of numbers")
    m = m.astype(float)
    if m.ndim != 2 or m.shape[1] == 0:
        bad(f"'correct' must be a (problems x samples) matrix, got shape {m.shape}")
    if not np.isin(m, (0.0, 1.0)).all():
        bad("'correct' holds values other than 0 and 1")
    n = payload.get("n", m.shape[1])
    if isinstance(n, bool) or not isinstance(n, int) or n != m.shape[1]:
        bad(f"'n' ({n!r}) does not match the {m.shape[1]} samples per problem in 'correct'")
    summary = payload.get("summary", {})
    if not isinstance(summary, dict):
        bad("'summary' is not a JSON object")
    return payload


_STEP_DIR = re.compile(r"^step_(\d+)$")


class RunDir:
    """The files of one run. Cheap to construct; touches nothing until written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # paths
    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def status_path(self) -> Path:
        return self.path / "status.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def hist_path(self) -> Path:
        return self.path / "hist" / "log_ratio.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints" / "last"

    def rows_lost(self) -> bool:
        """Whether metrics.jsonl or the histograms hold less than the last checkpoint's copy of them (a
        cheap look, sizes and the last byte only: train.checkpoint.lost_rows says what and mends it)."""
        for path in (self.metrics_path, self.hist_path):
            copy = self.checkpoint_dir / CHECKPOINT_LOGS / path.name
            if not copy.is_file() or copy.stat().st_size == 0:
                continue
            if not path.is_file() or path.stat().st_size < copy.stat().st_size:
                return True
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    return True
        return False

    def eval_path(self, step: int, benchmark: str) -> Path:
        return self.path / "eval" / f"step_{step:06d}" / f"{benchmark}.json"

    @property
    def shared_dir(self) -> Path | None:
        """`<results>/<sweep>/.shared/`: what the runs of one sweep share (train/shared_eval.py), or
        None for a run outside a sweep (no manifest.json beside it). Hidden: no reader takes it for a run."""
        return self.path.parent / ".shared" if (self.path.parent / "manifest.json").is_file() else None

    # config and status
    def write_config(self, cfg: dict) -> None:
        atomic_write_text(self.config_path, dump_yaml(cfg))

    def read_config(self) -> dict | None:
        """The run's resolved config, or None when it has none yet; StoreError when damaged."""
        text = _read_text(self.config_path, "config")
        if text is None:
            return None
        try:
            cfg = load_yaml_text(text)
        except YamlError as e:
            raise StoreError(
                self.config_path, e.reason, REMEDIES["config"], where=f"line {e.line}" if e.line else None
            ) from None
        if not isinstance(cfg, dict):
            raise StoreError(
                self.config_path,
                f"expected a mapping (the run config), got "
                f"{type(cfg).__name__ if cfg is not None else 'an empty file'}",
                REMEDIES["config"],
            )
        return cfg

    def status(self) -> dict:
        """status.json ({"state": "pending"} when missing), read as today's store format
        (store_format.py); StoreError when damaged or written by a newer format."""
        st = read_json(self.status_path, None, kind="status")
        st = {"state": RunState.PENDING.value} if st is None else read_format(self.status_path, st)
        if st.get("state", RunState.PENDING.value) not in STATES:
            raise StoreError(
                self.status_path, f"unknown state {st.get('state')!r} (valid: {', '.join(STATES)})", REMEDIES["status"]
            )
        return st

    @property
    def state(self) -> RunState:
        return RunState(self.status().get("state", RunState.PENDING.value))

    def set_status(self, state: RunState, *, drop: Iterable[str] = (), **extra: Any) -> None:
        """The one writer of status.json: `state` and `extra` over what it holds (less the keys `drop`)."""
        cur = {k: v for k, v in self.status().items() if k not in drop}
        cur.update(extra)
        cur["state"] = RunState(state).value
        atomic_write_json(self.status_path, stamp(cur))

    def fail_for_disk(self, err: OSError) -> DiskFull:
        """A run the disk stopped (`err`: no space left): its temporary files removed first (a
        half-written checkpoint, the temp files of atomic writes: that also frees room for the
        status), then marked failed where status.json can still be written. Returns the one-line
        error to raise; finished files and the last whole checkpoint are not touched."""
        self.remove_temporaries()
        path = err.filename or self.path
        try:
            self.set_status(
                RunState.FAILED,
                error=f"{disk_reason(err)} writing {path}",
                reason="disk-full",
                failed_at=time.time(),
            )
            written = True
        except OSError:
            written = False
        return DiskFull(path, status_written=written, reason=disk_reason(err))

    def remove_temporaries(self) -> None:
        """A checkpoint being written (`checkpoints/.tmp-*`) and atomic writes' temp files (`.NAME.*.tmp`)."""
        for tmp in [*self.checkpoint_dir.parent.glob(".tmp-*"), *self.checkpoint_dir.glob(".tmp-*")]:
            shutil.rmtree(tmp, ignore_errors=True)
        for tmp in self.path.rglob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def clear_generated(self) -> None:
        """What a start from step 0 owns and writes again: metrics, histograms, evaluations,
        checkpoints and records (the config, status and provenance are rewritten by the start)."""
        for p in (
            self.metrics_path,
            self.hist_path.parent,
            self.path / "eval",
            self.checkpoint_dir.parent,
            self.path / "record",
        ):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def update_status(self, **extra: Any) -> None:
        """Fields added to status.json, its state kept."""
        self.set_status(self.state, **extra)

    def start_attempt(self, **extra: Any) -> None:
        """A sweep starts (or resumes) the run: state running, one more attempt, the last attempt's
        error, traceback and checkpoint notes dropped."""
        prev = self.status() if self.status_path.exists() else {}
        self.path.mkdir(parents=True, exist_ok=True)
        cur = {k: v for k, v in prev.items() if k not in ("error", "traceback", "checkpoint_notes")}
        cur.update(extra, state=RunState.RUNNING.value, attempts=int(prev.get("attempts", 0)) + 1)
        atomic_write_json(self.status_path, stamp(cur))

    # metrics (append-only jsonl)
    def append_jsonl(self, path: Path, rows: Iterable[dict]) -> None:
        rows = list(rows)
        if not rows:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_torn_tail(path)
        try:
            with open(path, "a") as f:  # closed = in the OS page cache: survives kill -9 (not power loss);
                f.write("".join(dumps(r) + "\n" for r in rows))  # checkpoints and whole files are fsynced
        except OSError as e:  # a torn last line is dropped by the next append or read
            raise_naming(e, path)
            raise

    def append_metrics(self, rows: Iterable[dict]) -> None:
        self.append_jsonl(self.metrics_path, rows)

    def read_metrics(self, notes: list[str] | None = None) -> list[dict]:
        return read_jsonl(self.metrics_path, notes=notes)

    def append_hist(self, rows: Iterable[dict]) -> None:
        self.append_jsonl(self.hist_path, rows)

    def truncate_after(self, step: int, opt_step: int | None = None) -> None:
        """Keep only rows with row['step'] < step in every jsonl, and the records of steps < step
        (resume from a checkpoint at step); `opt_step` (a checkpoint taken inside rollout step `step`):
        also that step's metrics rows up to this optimizer step."""
        for path in (self.metrics_path, self.hist_path):
            if path.exists():
                inside = opt_step is not None and path == self.metrics_path
                keep = [
                    r
                    for r in read_jsonl(path)
                    if r.get("step", -1) < step
                    or (inside and r.get("step") == step and r.get("opt_step", opt_step + 1) <= opt_step)
                ]
                atomic_write_text(path, "".join(dumps(r) + "\n" for r in keep))
        from clipbench.tracking.records import truncate_records  # noqa: PLC0415 - records pulls in torch

        kept = truncate_records(self.path, step)
        if "records" in self.status():
            self.update_status(records=kept)

    @staticmethod
    def _drop_torn_tail(path: Path) -> None:
        if not path.exists() or path.stat().st_size == 0:
            return
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
        rows = read_jsonl(path)
        atomic_write_text(path, "".join(dumps(r) + "\n" for r in rows))

    # evaluation outputs
    def write_eval(self, step: int, benchmark: str, payload: dict) -> Path:
        p = self.eval_path(step, benchmark)
        atomic_write_json(p, payload)
        return p

    def read_evals(self) -> dict[int, dict[str, dict]]:
        """{step: {benchmark: payload}} for every finished evaluation; StoreError for a damaged one."""
        out: dict[int, dict[str, dict]] = {}
        root = self.path / "eval"
        if not root.is_dir():
            return out
        for d in sorted(root.iterdir()):
            m = _STEP_DIR.match(d.name)
            if m is None or not d.is_dir():
                continue  # not an evaluation step (e.g. a file a user left there)
            for f in sorted(d.glob("*.json")):
                if not f.name.startswith("."):
                    payload = read_json(f, kind="eval")
                    out.setdefault(int(m.group(1)), {})[f.stem] = check_eval_payload(f, payload)
        return out


# ---------------------------------------------------------------------------------------------
# Whole-sweep readers (fast paths for reports and benchmarks)


def list_sweeps(results_dir: str | Path) -> list[str]:
    """Sweep names of a results dir: sub-directories (not `NOT_SWEEPS`, not hidden) holding a run."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    return [
        d.name
        for d in sorted(root.iterdir())
        if d.is_dir() and d.name not in NOT_SWEEPS and not d.name.startswith(".") and list_run_dirs(d)
    ]


def check_formats(run_dirs: Iterable[str | Path]) -> None:
    """Every reader of a store (report, replay, sync) first: each run's status.json and its sweep's
    manifest.json in a format this release reads (StoreError, one line, for a newer or damaged one)."""
    seen = set()
    for d in run_dirs:
        rd = RunDir(d)
        rd.status()
        manifest = rd.path.parent / "manifest.json"
        if manifest not in seen:
            seen.add(manifest)
            data = read_json(manifest, None, kind="manifest")
            if data is not None:
                read_format(manifest, data)


def check_run_path(path: str | Path) -> None:
    """StoreError (one line) when a run's directory cannot be one: a symbolic link whose target does
    not exist (a run directory moved to another disk and linked back, then lost), or a file."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise StoreError(
            path,
            f"a symbolic link to {os.readlink(path)}, which does not exist",
            "restore what it points to (the run's files), or remove the link to train the run again",
        )
    if path.exists() and not path.is_dir():
        raise StoreError(path, "not a directory (a run's files live in a directory of this name)", "move it away")


def list_run_dirs(sweep_dir: str | Path) -> list[RunDir]:
    """Run directories of a sweep (those with a config.yaml or metrics), sorted by run id."""
    root = Path(sweep_dir)
    if not root.is_dir():
        return []
    return [
        RunDir(d)
        for d in sorted(root.iterdir())
        if d.is_dir()
        and not d.name.startswith(".")
        and ((d / "config.yaml").is_file() or (d / "metrics.jsonl").is_file())
    ]
