"""The mirrors besides MLflow (clipbench.tracking.sinks): a real 2-step run logged to MLflow, TensorBoard
and W&B (offline mode: no network) at once; each mirror read back (TensorBoard's event reader; W&B's
transaction log with W&B's own record protobuf) and held to the results store, point for point; a
replay adds nothing twice; an outage is filled in by `clipbench sync --sink`; a sink that fails never
fails the run and says so once."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.tracking.mirror import expected_metrics
from clipbench.tracking.sinks import FanoutSink, MirrorSink, TensorBoardSink, read_scalars
from clipbench.tracking.store import RunDir

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()
TINY = ["train.steps=2", "train.prompts_per_step=4", "train.mini_batches=2", "eval.every=0", "eval.limit=8", "eval.n=2"]


def tb_points(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def wandb_records(path: Path):
    """The records of a W&B transaction log (.wandb): a 7-byte header (':W&B', magic 0xBEE1, version 0),
    then LevelDB log blocks of 32 KiB (7-byte chunk headers: crc, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def wandb_points(run_dir: Path) -> tuple[set[str], dict[str, list[tuple[int, float]]]]:
    """(run ids, {metric: [(opt_step, value)]}) over every offline W&B run of a store run."""
    ids, out = set(), {}
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in wandb_records(f):
            if rec.HasField("run"):
                ids.add(rec.run.run_id)
            if rec.HasField("history"):
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                for k, v in row.items():
                    if not k.startswith("_") and k != "opt_step":
                        out.setdefault(k, []).append((int(row["opt_step"]), v))
    return ids, out


def store_points(rd: RunDir) -> dict[str, list[tuple[int, float]]]:
    return {k: sorted(v.items()) for k, v in expected_metrics(rd).items()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One real run of the tiny recipe with all three mirrors (W&B offline)."""
    root = tmp_path_factory.mktemp("sinks")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        res = runner.invoke(
            app,
            [
                "train",
                str(REPO / "recipes" / "arith_tiny.yaml"),
                *TINY,
                "tracking.sinks=[mlflow,tensorboard,wandb]",
                "--results-dir",
                str(root / "results"),
            ],
        )
    finally:
        mp.undo()
    assert res.exit_code == 0, res.output
    (d,) = (root / "results" / "train").iterdir()
    return d


@pytest.mark.slow
def test_every_mirror_holds_what_the_store_holds(run_dir):
    rd = RunDir(run_dir)
    want = store_points(rd)
    # 68 clipbench names and 13 aliases under verl's and TRL's names (actor/entropy, clip_ratio/low_mean, ...);
    # loss at 2 rollout steps x 2 mini-batches
    assert len(want) == 81 and [s for s, _ in want["loss"]] == [1, 2, 3, 4]
    assert {
        "actor/entropy",
        "clip_ratio/low_mean",
        "completions/mean_length",
        "val-core/arith/reward/mean_at_2",
    } <= set(want)
    got = tb_points(run_dir / "tensorboard")
    assert set(got) == set(want)
    for k in want:
        assert [s for s, _ in got[k]] == [s for s, _ in want[k]], k  # one point per step, the same steps
        assert [v for _, v in got[k]] == pytest.approx([v for _, v in want[k]], rel=1e-6), k  # float32 in TB
    ids, wb = wandb_points(run_dir)
    assert ids == {f"train-{rd.run_id}"}
    assert {k: sorted(v) for k, v in wb.items()} == want  # JSON floats: exact
    assert json.loads((run_dir / "mlflow.json").read_text())  # MLflow still mirrors the run
    assert json.loads((run_dir / "sinks.json").read_text()) == {
        "tensorboard": {"needs_sync": False, "error": None},
        "wandb": {"needs_sync": False, "error": None},
    }


@pytest.mark.slow
def test_sync_fills_an_outage_and_adds_nothing_twice(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    results = run_dir.parent.parent
    before = tb_points(run_dir / "tensorboard")
    for sink in ("tensorboard", "wandb"):  # nothing missing: nothing sent, and the W&B run is the same run
        res = runner.invoke(app, ["sync", "train", "--sink", sink, "--results-dir", str(results)])
        assert res.exit_code == 0, res.output
    assert tb_points(run_dir / "tensorboard") == before
    ids, wb = wandb_points(run_dir)
    assert ids == {f"train-{RunDir(run_dir).run_id}"} and {k: sorted(v) for k, v in wb.items()} == store_points(
        RunDir(run_dir)
    )
    # TensorBoard was down for the whole run: its directory is missing; sync writes it from the store
    import shutil

    shutil.rmtree(run_dir / "tensorboard")
    res = runner.invoke(app, ["sync", "train", "--sink", "tensorboard", "--results-dir", str(results)])
    assert res.exit_code == 0, res.output
    assert {k: [s for s, _ in v] for k, v in tb_points(run_dir / "tensorboard").items()} == {
        k: [s for s, _ in v] for k, v in before.items()
    }


@pytest.mark.slow
def test_a_resumed_run_continues_its_mirrors_without_repeating_a_point(run_dir, monkeypatch):
    """After a resume from step 0 the trainer logs every row again: the sink every run gets
    (`run_sink`, resume=True) continues the same W&B run and TensorBoard directory, sending nothing twice."""
    from clipbench.tracking.mlflow_sink import run_sink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rd = RunDir(run_dir)
    before = tb_points(run_dir / "tensorboard")
    sink = run_sink(rd.read_config(), rd, results_dir=run_dir.parent.parent, sweep="train", resume=True)
    assert isinstance(sink, FanoutSink) and [type(s).__name__ for s in sink.sinks] == [
        "MlflowSink",
        "TensorBoardSink",
        "WandbSink",
    ]
    for row in rd.read_metrics():
        sink.log_metrics(row["opt_step"], {k: v for k, v in row.items() if isinstance(v, (int, float))})
    sink.close()
    assert tb_points(run_dir / "tensorboard") == before
    ids, wb = wandb_points(run_dir)
    assert ids == {f"train-{rd.run_id}"} and {k: sorted(v) for k, v in wb.items()} == store_points(rd)


class Broken(MirrorSink):
    name = "broken"

    def _write(self, at, values):
        raise ConnectionError("tracker down")


def test_a_failing_sink_never_fails_the_run_and_says_so_once(tmp_path, caplog):
    rd = RunDir(tmp_path / "results" / "s" / "r1")
    rd.path.mkdir(parents=True)
    tb = TensorBoardSink(rd, resume=False)
    fan = FanoutSink([Broken(rd), tb], rd, sweep="s")
    with caplog.at_level(logging.WARNING, logger="clipbench.tracking"):
        for k in range(3):
            fan.log_metrics(k, {"step": k, "opt_step": k + 1, "train/loss": 0.5 * k})
        fan.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "broken sink failed during log_metrics (ConnectionError: tracker down)"
    )
    assert f"clipbench sync s --sink broken --results-dir {tmp_path / 'results'}" in warnings[0]
    assert read_scalars(rd.path / "tensorboard")[0] == {"train/loss": 3}  # the other mirror got every point
    assert json.loads((rd.path / "sinks.json").read_text())["broken"] == {
        "needs_sync": True,
        "error": "ConnectionError: tracker down",
    }


def test_an_unknown_or_missing_sink_is_refused_in_one_line(tmp_path, monkeypatch):
    res = runner.invoke(
        app,
        [
            "train",
            str(REPO / "recipes" / "arith_tiny.yaml"),
            "tracking.sinks=[mlflow,neptune]",
            "--results-dir",
            str(tmp_path / "r"),
        ],
    )
    assert (
        res.exit_code == 2
        and "tracking.sinks: item 1: unknown 'neptune'; valid: mlflow, wandb, tensorboard" in res.stderr
    )
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    res = runner.invoke(
        app,
        [
            "train",
            str(REPO / "recipes" / "arith_tiny.yaml"),
            "tracking.sinks=[wandb]",
            "--results-dir",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2 and res.stderr.strip() == (
        "error: tracking.sinks: 'wandb' is not installed here; pip install 'clipbench[wandb]' (or drop it from "
        "tracking.sinks)"
    )
    assert not (tmp_path / "r").exists()


def test_wandb_restart_from_scratch_is_a_new_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    from clipbench.tracking.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rd = RunDir(tmp_path / "results" / "s" / "r1")
    rd.path.mkdir(parents=True)
    row = {"step": 0, "opt_step": 1, "loss": 0.25}
    for resume in (False, False, True):  # a first attempt, a restart from scratch, a resume of the restart
        sink = WandbSink(rd, {}, sweep="s", run_name="grpo seed=0", resume=resume)
        sink.log_metrics(1, row)
        sink.close()
        sent = sink.n_points
    assert sent == 0  # the resume had it already
    ids, points = wandb_points(rd.path)
    assert ids == {"s-r1", "s-r1-1"} and points == {"loss": [(1, 0.25), (1, 0.25)]}  # one point per W&B run
    assert json.loads((rd.path / "wandb.json").read_text()) == {"run": "s-r1-1", "attempt": 1, "sent": {"loss": 1}}
