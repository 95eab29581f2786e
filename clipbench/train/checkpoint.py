"""Checkpoints: sharded model and optimizer state (torch.distributed.checkpoint), trainer state.

    checkpoints/last/
        state.json     trainer state: step, opt_step, skipped_nonfinite, LR scheduler, world size
                       (+ "partial": true for a checkpoint taken mid-rollout-step by a preemption);
                       whose it is: run_id, seed; the clipbench version that wrote it;
                       "files": every other file's bytes and sha256
        rollout.pt     with "partial": the interrupted rollout step (train/preempt.py: Partial)
        logs/          a copy of the run's metrics.jsonl and hist/log_ratio.jsonl as they were when it
                       was written: resume restores rows the store lost (a torn or unsynced append)
        lag/<step>/    with sampler.lag: the policies a lagged sampler still samples from (train/lag.py),
                       torch.distributed.checkpoint each; state.json's "lag_steps" lists them
        dcp/           torch.distributed.checkpoint of {"model": ..., "optim": ...}: one file per rank
                       (__<rank>_0.distcp) + .metadata; parameter names are the HF model's
        model/         config.json, generation config and tokenizer (no weights): rebuilds the model
    (engine trl: `model/` is TRL's own checkpoint, an HF model directory, and there is no `dcp/`)

Design choices
- One format for 1 and N processes: DCP stores each tensor with its global shape and the pieces each
  rank owned, so a checkpoint written by N ranks loads into M ranks or into one process (resuming on
  a different number of processes is supported), and `load_policy` rebuilds a plain HF model from it
  (for `clipbench eval RUN_DIR`).
- Atomic: every rank writes into `checkpoints/.tmp-<step>`, rank 0 writes state.json last and swaps
  the directory in with renames, so `checkpoints/last` is always complete (a crash mid-swap leaves it
  as `checkpoints/prev`). With several nodes, `checkpoints/` must be on a filesystem all ranks share.
- Checked before it is trusted (`check_checkpoint`): a checkpoint names its run (run id, seed) and
  the size and sha256 of each of its files, so resume refuses one copied in from another run, a
  truncated or zero-byte shard or rollout.pt and a damaged state.json, in one line each, and falls
  back to the run's own older checkpoint (`prev`) or to step 0 (`usable_checkpoint`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import resource
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from clipbench.config import run_id as run_id_of
from clipbench.errors import no_space_left
from clipbench.models import compute_dtype
from clipbench.tracking.files import atomic_write_text, complete_lines, share_like_umask
from clipbench.tracking.provenance import clipbench_version
from clipbench.tracking.store import CHECKPOINT_LOGS, RunDir
from clipbench.train.distributed import Dist


@contextlib.contextmanager
def one_process_ok():
    """DCP warns that it assumes one process when no process group exists: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


ROLLOUT = "rollout.pt"


def save_checkpoint(
    last: Path,
    *,
    model,
    optimizer,
    scheduler,
    tokenizer,
    state: dict,
    dist: Dist,
    partial: dict | None = None,
    owner: dict | None = None,
    logs: dict[str, Path] | None = None,
    also: Callable[[Path], None] | None = None,
) -> None:
    """Every rank calls this (collective); rank 0 writes the small files and swaps the directories.
    `partial`: an interrupted rollout step (the same on every rank), saved as rollout.pt; `owner`:
    whose checkpoint it is (`checkpoint_owner`); `logs`: {name: the run's file} copied into `logs/`;
    `also(dir)`: every rank writes more of the run's state into the checkpoint's directory (a lagged
    run's snapshots: train/lag.py), before its files are summed."""
    root = last.parent
    tmp = root / f".tmp-{int(state['step'])}"
    if dist.main:
        for stale in root.glob(".tmp-*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
    try:
        save_model_state(tmp, model=model, optimizer=optimizer, tokenizer=tokenizer, dist=dist)
        if also is not None:
            also(tmp)
            dist.barrier()  # every rank's files are written before rank 0 sums them
        if dist.main:
            if partial is not None:
                torch.save(partial, tmp / ROLLOUT)
            for name, src in (logs or {}).items():
                copy_synced(src, tmp / LOGS / name)
            full = {
                **state,
                **(owner or {}),
                "scheduler": scheduler.state_dict(),
                "world_size": dist.world,
                "partial": partial is not None,
                "files": file_sums(tmp),
            }
            with open(tmp / "state.json", "w") as f:
                f.write(json.dumps(full))
                f.flush()
                os.fsync(f.fileno())
            install_checkpoint(tmp, last)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        full = no_space_left(e)
        code = full.errno if full is not None else (errno.ENOSPC if _nearly_full(root) else _size_limit_hit(tmp))
        shutil.rmtree(tmp, ignore_errors=True)  # `last` is untouched: the previous checkpoint stays whole
        if code:  # torch's writers may report it as "unexpected pos" (the errno is lost in C++)
            raise OSError(code, os.strerror(code), str(tmp)) from e
        raise
    dist.barrier()


NEARLY_FULL = 1 << 20  # bytes
LOGS = CHECKPOINT_LOGS  # the copy of the run's rows (tracking.store owns the name: a finished sweep's rerun looks)
OWNER_KEYS = ("run_id", "seed", "clipbench")  # whose checkpoint, and which clipbench wrote it; not trainer state


def copy_synced(src: Path, dst: Path) -> None:
    """`src`'s bytes (none when it does not exist) at `dst`, on disk (fsynced) before state.json is."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    data = src.read_bytes() if src.is_file() else b""
    with open(dst, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_sums(root: Path) -> dict[str, list]:
    """{relative path: [bytes, sha256]} of every file under `root` but state.json (which holds it)."""
    return {
        p.relative_to(root).as_posix(): [p.stat().st_size, _sha256(p)]
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "state.json"
    }


def check_checkpoint(path: Path, *, run_id: str, seed: int, steps: int) -> tuple[dict | None, str | None]:
    """(its state.json, None) when the checkpoint at `path` is this run's and whole, else (state or
    None, why not: one clause). A checkpoint that does not name its run (one from before checkpoints
    recorded their run id and seed) cannot show it is this run's: it is treated as another run's. One
    without checksums (older still) has its files checked when they load."""
    try:
        state = json.loads((path / "state.json").read_text())
        int(state["step"])
    except FileNotFoundError:
        return None, "it has no state.json (a checkpoint cut short)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"its state.json is damaged ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(state, dict):
        return None, "its state.json is damaged (not a JSON object)"
    if (why := _not_owner(state, run_id, seed)) is not None:
        return state, why
    if int(state["step"]) > steps:
        return state, f"it is at rollout step {state['step']}, past this run's {steps} steps"
    for rel, (size, digest) in (state.get("files") or {}).items():
        f = path / rel
        if not f.is_file():
            return state, f"its file {rel} is missing"
        if f.stat().st_size != size:
            return state, f"its file {rel} has {f.stat().st_size} bytes, not the {size} it was written with"
        if _sha256(f) != digest:
            return state, f"its file {rel} is damaged (its sha256 is not the one it was written with)"
    if state.get("partial") and not (path / ROLLOUT).is_file():
        return state, f"its {ROLLOUT} (the interrupted rollout step) is missing"
    return state, None


def checkpoint_owner(cfg) -> dict:
    """What a checkpoint of run `cfg` records of whose it is: {"run_id", "seed", "clipbench" (version)}."""
    return {"run_id": run_id_of(cfg), "seed": cfg.seed, "clipbench": clipbench_version()}


def not_own(state: dict, cfg) -> str | None:
    """Why a checkpoint's state.json does not show it is run `cfg`'s own (one clause), None when it does."""
    return _not_owner(state, run_id_of(cfg), cfg.seed)


def _not_owner(state: dict, run_id: str, seed: int) -> str | None:
    if "run_id" not in state or "seed" not in state:
        return (
            "it does not name its run (a checkpoint of an older clipbench, written before checkpoints recorded "
            "their run id and seed): it cannot show it is this run's own"
        )
    if (state["run_id"], state["seed"]) != (run_id, seed):
        return f"it belongs to run {state['run_id']} (seed {state.get('seed')}), not to this run {run_id} (seed {seed})"
    return None


def logs_copy(path: Path, name: str) -> list[str] | None:
    """The lines of the checkpoint's copy of the run's file `name` (`logs/`), or None when it holds none."""
    f = path / LOGS / name
    return f.read_text().splitlines() if f.is_file() else None


def _size_limit_hit(tmp: Path) -> int | None:
    """EFBIG when a file of the failed checkpoint reached this process's file-size limit (`ulimit -f`:
    torch's writers lose that errno too), else None."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY or not tmp.is_dir():
        return None
    hit = any(p.is_file() and p.stat().st_size >= limit for p in tmp.rglob("*"))
    return errno.EFBIG if hit else None


def _nearly_full(path: Path) -> bool:
    """Under 1 MiB available where a checkpoint failed to write: the disk filled (a checkpoint is
    megabytes at the least, so a write that failed with less than that left is read as no space)."""
    try:
        return shutil.disk_usage(path).free < NEARLY_FULL
    except OSError:
        return False


def save_model_state(path: Path, *, model, optimizer, tokenizer, dist: Dist) -> None:
    """`path/model` (config, generation config, tokenizer; rank 0) and `path/dcp` (model and optimizer,
    every rank its shard): a checkpoint's tensors, also the policy state a record keeps (train/record.py).
    Collective."""
    # PLC0415, deferred: torch is heavy
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict  # noqa: PLC0415

    if dist.main:
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path / "model")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(path / "model")
        tokenizer.save_pretrained(path / "model")
    dist.barrier()
    if optimizer_started(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        tensors = {"model": model_sd, "optim": optim_sd}
    else:  # no optimizer step yet: nothing to save (DCP would fill the empty state in with step=1)
        tensors = {"model": get_model_state_dict(model)}
    with one_process_ok():
        dcp.save(tensors, checkpoint_id=str(path / "dcp"))


def optimizer_started(optimizer) -> bool:
    """Whether the optimizer has taken a step (its per-parameter state exists). Before the first step
    torch.distributed.checkpoint's get_state_dict would create state with step=1 and zero moments,
    and a run resumed from it would take a different first AdamW step than an uninterrupted one."""
    return any(optimizer.state.values())


def install_checkpoint(tmp: Path, last: Path) -> None:
    """Swap a complete checkpoint directory `tmp` (with its state.json) in as `last`, by renames only
    (also used by engine trl, whose checkpoints hold TRL's own files under `model/`). Its files get
    the modes the umask gives first (safetensors and DCP may write 0600): colleagues read a shared
    results store."""
    share_like_umask(tmp)
    prev = last.parent / "prev"
    shutil.rmtree(prev, ignore_errors=True)
    if last.exists():
        os.replace(last, prev)
    os.replace(tmp, last)
    shutil.rmtree(prev, ignore_errors=True)


def find_checkpoint(last: Path) -> Path | None:
    """The newest complete checkpoint (`last`, else `prev` left by a crash mid-swap), or None."""
    for d in (last, last.parent / "prev"):
        if checkpoint_step(d) is not None:
            return d
    return None


def has_checkpoint_dir(last: Path) -> bool:
    """Whether the run has a checkpoint directory (`last` or `prev`) with something in it, whole or
    not: resuming checks it (and says what it sets aside)."""
    return any(
        d.is_dir() and any(not p.name.startswith(".tmp-") for p in d.iterdir()) for d in (last, last.parent / "prev")
    )


def checkpoint_step(path: Path) -> int | None:
    """The rollout step a checkpoint directory holds, or None when it is missing or incomplete."""
    try:
        return int(json.loads((Path(path) / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_checkpoint(path: Path, *, model, optimizer, scheduler) -> dict:
    """Restores model, optimizer and scheduler in place (sharded or not, any world size); returns
    the trainer state (step, opt_step, skipped_nonfinite)."""
    state = json.loads((path / "state.json").read_text())
    load_model_state(path, model=model, optimizer=optimizer)
    scheduler.load_state_dict(state.pop("scheduler"))
    for key in ("world_size", "files", *OWNER_KEYS):
        state.pop(key, None)
    return state


def load_model_state(path: Path, *, model, optimizer) -> None:
    """Restore `path/dcp` (save_model_state) into model and optimizer, in place, any world size."""
    # PLC0415, deferred: torch is heavy
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    saved = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    if not any(k.startswith("optim.") for k in saved):  # saved before the first step: a fresh optimizer
        model_sd = get_model_state_dict(model)
        with one_process_ok():
            dcp.load({"model": model_sd}, checkpoint_id=str(path / "dcp"))
        set_model_state_dict(model, model_sd)
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with one_process_ok():
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def load_partial(path: Path) -> dict | None:
    """The interrupted rollout step a checkpoint holds (save_checkpoint's `partial`), or None."""
    if not json.loads((path / "state.json").read_text()).get("partial"):
        return None
    return torch.load(path / ROLLOUT, weights_only=False)  # our own file: the batch's lists and tensors


def load_policy(path: Path, *, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer): a checkpoint's policy as a plain HF model in this process (any world size
    wrote it). The architecture comes from `model/`, the weights from `dcp/` (or from `model/`
    itself: an engine trl checkpoint)."""
    # PLC0415, deferred: torch is heavy
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    if (path / "dcp").is_dir():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path / "model"), dtype=torch.float32)
        sd = model.state_dict()
        with one_process_ok():
            dcp.load({"model": sd}, checkpoint_id=str(path / "dcp"))
        model.load_state_dict(sd)
    else:
        model = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)

    return (
        model.to(device=device, dtype=compute_dtype(dtype, device)).eval(),
        AutoTokenizer.from_pretrained(path / "model"),
    )


# ---- a checkpoint against the run it is to resume --------------------------------------------------
def damaged_checkpoint(e: BaseException) -> bool:
    """Whether loading a checkpoint failed for what its files hold (truncated, not a checkpoint),
    not for this process or machine (an interrupt, memory, a file it may not read, a failing disk)."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError, GeneratorExit)):
        return False
    if isinstance(e, OSError) and e.errno is not None:
        return False
    return isinstance(e, Exception) or type(e).__name__ == "CheckpointException"


def reject_checkpoints(rd: RunDir, *, run_id: str, seed: int, steps: int) -> list[str]:
    """Rank 0: remove the run's checkpoints (`last`, then `prev`) that are not its own and whole,
    newest first, until one is (it becomes `last`). Returns one line per checkpoint removed."""
    last = rd.checkpoint_dir
    notes = []
    for d in (last, last.parent / "prev"):
        if not d.is_dir():
            continue
        state, why = check_checkpoint(d, run_id=run_id, seed=seed, steps=steps)
        why = why or disagrees_with_metrics(rd, d, state)
        if why is None:
            if d != last:
                os.replace(d, last)
            break
        notes.append(f"checkpoint {d.relative_to(rd.path)} set aside (removed): {why}")
        shutil.rmtree(d, ignore_errors=True)
    return notes


def disagrees_with_metrics(rd: RunDir, ckpt: Path, state: dict) -> str | None:
    """Why the checkpoint does not continue the run's metrics.jsonl, or None. The rows the store
    holds must be the checkpoint's copy of them (`logs/`); a shorter file lost its tail (restored on
    resume). A checkpoint without a copy (an older clipbench's) must not be ahead of the file."""
    have = _complete_lines(rd.metrics_path)
    copy = logs_copy(ckpt, "metrics.jsonl")
    if copy is None:
        done = {json.loads(line).get("opt_step") for line in have if line.strip()}
        missing = [k for k in range(1, int(state.get("opt_step", 0)) + 1) if k not in done]
        if missing:
            return (
                f"it is ahead of metrics.jsonl, which lacks the rows of optimizer steps {missing[0]} to "
                f"{missing[-1]} (and this checkpoint, written by an older clipbench, holds no copy of them)"
            )
        return None
    for i, (a, b) in enumerate(zip(have, copy), 1):
        if a != b and _parsed(a) != _parsed(b):
            return f"its copy of metrics.jsonl differs from the run's at line {i}: it did not train this run's steps"
    return None


def _complete_lines(path: Path) -> list[str]:
    """The lines of a jsonl file that end in a newline (a torn last line left out)."""
    return complete_lines(path).decode().split("\n")[:-1]


def _parsed(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def restore_logs(rd: RunDir, ckpt: Path) -> list[str]:
    """Rank 0, resuming from `ckpt`: metrics.jsonl and the histograms become the checkpoint's copy
    of them (the rows after it are trained again). Returns a line per file whose rows it restored."""
    notes = []
    for path in (rd.metrics_path, rd.hist_path):
        copy = logs_copy(ckpt, path.name)
        if copy is None:
            continue
        lost = len(copy) - len(_complete_lines(path))
        if lost > 0:
            notes.append(
                f"{path.relative_to(rd.path)} had lost its last {lost} row(s) (a torn or unsynced append): "
                "restored from the checkpoint's copy"
            )
        atomic_write_text(path, "".join(line + "\n" for line in copy))
    return notes


# ---- a finished run's rows, against its last checkpoint's copy -------------------------------------
def lost_rows(rd: RunDir, *, run_id: str, seed: int) -> dict[Path, list[str]]:
    """{the run's file: the lines its last checkpoint's copy holds} for metrics.jsonl and the
    histograms, each where the file lost rows the copy has (deleted, emptied, a torn last line, its
    tail cut) and what it kept agrees with the copy. Only a checkpoint that names this run (run id and
    seed) and a copy whose checksum holds are read; {} when nothing is lost or no checkpoint tells."""
    ckpt = rd.checkpoint_dir
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict) or (state.get("run_id"), state.get("seed")) != (run_id, seed):
        return {}
    out = {}
    for path in (rd.metrics_path, rd.hist_path):
        rel = f"{LOGS}/{path.name}"
        sums, f = (state.get("files") or {}).get(rel), ckpt / rel
        if not sums or not f.is_file():
            continue
        copy = f.read_text().splitlines()
        have = _complete_lines(path)
        torn = path.is_file() and path.stat().st_size > sum(len(line.encode()) + 1 for line in have)
        if not (len(have) < len(copy) or torn) or f.stat().st_size != sums[0] or _sha256(f) != sums[1]:
            continue
        if all(a == b or _parsed(a) == _parsed(b) for a, b in zip(have, copy)):
            out[path] = copy
    return out


def restore_lost_rows(rd: RunDir, *, run_id: str, seed: int) -> list[str]:
    """A finished run's metrics.jsonl and histograms made whole again from its last checkpoint's copy
    (`lost_rows`), atomically. Returns a line per file restored."""
    notes = []
    for path, copy in lost_rows(rd, run_id=run_id, seed=seed).items():
        what = lost_text(path, rd, len(_complete_lines(path)), len(copy))
        atomic_write_text(path, "".join(line + "\n" for line in copy))
        notes.append(f"{what}: restored from its last checkpoint's copy")
    return notes


def lost_text(path: Path, rd: RunDir, kept: int, rows: int) -> str:
    """'metrics.jsonl had lost 8 of its 8 rows (it was missing)': what a file lost, in one clause."""
    rel = path.relative_to(rd.path)
    if rows == kept:
        return f"{rel} had a torn last line"
    how = "it was missing" if not path.is_file() else ("it was empty" if kept == 0 else "its tail was cut or torn")
    return f"{rel} had lost {rows - kept} of its {rows} rows ({how})"
