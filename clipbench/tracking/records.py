"""Records of a run's rule inputs, for counterfactual replay (`clipbench replay`; docs/replay.md): the layout.

    <run>/record/step_<k:06d>/index.json            what was trained and how: the rule, the aggregation,
                                                   every optimizer step (rows, micro-batches per rank,
                                                   global counts), the tensors' names and shapes
    <run>/record/step_<k:06d>/tensors.safetensors   row tensors (R rows): completion_ids, mask, advantages,
                                                   old_logp, rewards, correct, groups, prompt_ids, ...;
                                                   slot tensors (E slots x R rows): logp, entropy, uniforms
    <run>/record/step_<k:06d>/state_<n:07d>/        the policy and optimizer before optimizer step n
                                                   (checkpoint layout: dcp/ and model/; train/record.py)

One record per recorded rollout step (engine builtin, trl) or per recorded loss call (verl). A
record is written into `record/.tmp-<name>` and renamed into place (a reader never sees half of
one); `truncate_records` drops the records a resumed run will write again. The writers are the
built-in loop (clipbench.train.record), `ClipbenchGRPOTrainer` and the registered verl losses; the
readers are `load_record` (clipbench.replay) and `list_records`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clipbench.errors import StoreError
from clipbench.tracking.files import atomic_write_json, share_like_umask

FORMAT = 1
RECORD_DIR = "record"
INDEX, TENSORS = "index.json", "tensors.safetensors"
REMEDY = "delete this record directory (`clipbench replay` skips runs without records) or rerun the run"


def record_root(run_path: str | Path) -> Path:
    return Path(run_path) / RECORD_DIR


def record_name(step: int) -> str:
    return f"step_{int(step):06d}"


def state_name(opt_step: int) -> str:
    return f"state_{int(opt_step):07d}"


def staging_dir(root: Path, name: str) -> Path:
    """A fresh `root/.tmp-<name>` to write a record into (a stale one, left by a crash, is removed)."""
    tmp = Path(root) / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def install_record(tmp: Path, index: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write the tensors (safetensors) and the index into `tmp`, then rename it into place; returns
    the record's directory. Tensors go to the host, contiguous."""
    from safetensors.torch import save_file  # noqa: PLC0415 - safetensors is heavy

    cpu, seen = {}, set()
    for k, v in tensors.items():  # safetensors refuses two names on one storage (old_logp is sampler_logp
        t = v.detach().to("cpu").contiguous()  # with sampler.old_logp: sampler): each gets its own
        ptr = t.untyped_storage().data_ptr()
        cpu[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(cpu, str(tmp / TENSORS), metadata={"format": str(FORMAT)})
    index = {
        **index,
        "format": FORMAT,
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in cpu.items()},
    }
    atomic_write_json(tmp / INDEX, index)
    with open(tmp / TENSORS, "rb+") as f:
        os.fsync(f.fileno())
    share_like_umask(tmp)
    final = tmp.parent / tmp.name.removeprefix(".tmp-")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def list_records(run_path: str | Path) -> list[Path]:
    """The run's complete records (directories with an index), in the order they were recorded."""
    root = record_root(run_path)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if not d.name.startswith(".") and (d / INDEX).is_file())


def damaged_records(run_path: str | Path) -> list[Path]:
    """The run's record directories without an index (damaged: not replayable), in order."""
    root = record_root(run_path)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if not d.name.startswith(".") and d.is_dir() and not (d / INDEX).is_file())


_STEP = re.compile(r"^step_(\d+)")  # step_<k>, step_<k>.rank<r> (a hook's record of one process)


def record_step(path: str | Path) -> int | None:
    """The rollout step (or call) a record directory's name holds (step_<k>), None for another name."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def record_steps(run_path: str | Path) -> list[int]:
    """The rollout steps (or calls) of the run's records, from their names (step_<k>), once each."""
    return sorted({int(m.group(1)) for p in list_records(run_path) if (m := _STEP.match(p.name))})


def truncate_records(run_path: str | Path, step: int) -> list[int]:
    """Drop the records of rollout steps >= `step` and any unfinished one (a resumed run writes them
    again); returns the steps kept."""
    root = record_root(run_path)
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP.match(d.name)
            if d.name.startswith(".tmp-") or (m is not None and int(m.group(1)) >= step):
                shutil.rmtree(d, ignore_errors=True)
    return record_steps(run_path)


def records_bytes(run_path: str | Path) -> int:
    """Bytes the run's records occupy on disk (complete and unfinished)."""
    root = record_root(run_path)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


@dataclass
class Record:
    """One record: its index and its tensors (on the host)."""

    path: Path
    index: dict
    tensors: dict[str, torch.Tensor] = field(repr=False)

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    @property
    def run_dir(self) -> Path:
        """The run this record belongs to (<run>/record/<record>)."""
        return self.path.parent.parent

    def state(self, opt_step: int) -> Path | None:
        """The directory holding the policy before `opt_step`, or None when it was not saved."""
        p = self.path / state_name(opt_step)
        return p if (p / "dcp").is_dir() else None


def load_record(path: str | Path) -> Record:
    """A record from disk; StoreError (the file, the problem, the remedy) when it is damaged."""
    # PLC0415, deferred: safetensors is heavy
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    path = Path(path)
    try:
        index = json.loads((path / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise StoreError(path / INDEX, f"unreadable record index ({type(e).__name__}: {e})", REMEDY) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("opt_steps"), list):
        raise StoreError(path / INDEX, f"not a clipbench record of format {FORMAT}", REMEDY)
    try:
        tensors = load_file(str(path / TENSORS))
    except (OSError, SafetensorError) as e:
        raise StoreError(path / TENSORS, f"unreadable tensors ({type(e).__name__}: {e})", REMEDY) from None
    missing = [k for k in ("mask", "advantages", "old_logp", "logp") if k not in tensors]
    if missing:
        raise StoreError(path / TENSORS, f"missing tensors {', '.join(missing)}", REMEDY)
    return Record(path, index, tensors)
