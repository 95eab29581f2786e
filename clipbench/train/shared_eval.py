"""The evaluation before the first step, computed once for the runs of a sweep that share it.

    key = start_eval_key(cfg, rd, backend=..., device=..., world=...)     # None: not shared
    payloads = read_shared(rd, key, benchmarks)                            # None until one run left it
    share(rd, key, benchmarks)                                             # after computing it

Every run of a sweep evaluates its base model before its first step (eval.at_start). Runs that
differ only in what they train (the rule and its parameters, train.*) evaluate the same weights with
the same seed and settings on the same machine, so each would compute the same payload bit for bit:
the first to finish leaves it in `<sweep>/.shared/eval_step_0/<key>/<benchmark>.json` and the others
store it as their own `eval/step_000000/`, without sampling (about 8 s of a quickstart run's 80).
Two runs that start together both compute it (no lock: nothing waits for another run).

The key is a sha256 of everything that evaluation reads: the run seed; the model, task, sampler and
eval sections of the run config; the sampler backend; and the run's start record (provenance.json:
the machine, the software versions, torch's threads, the world size and the base model's checksum,
which decide whether floats repeat). Any other difference (the objective, train.*, tracking.*)
cannot reach that evaluation: it runs before the first step.

What is not promised: sharing beyond one process on a CPU with the hf sampler. On a GPU, vLLM or
several processes the evaluation is computed by every run, as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from clipbench.config import to_dict
from clipbench.errors import StoreError
from clipbench.tracking.files import atomic_write_json, read_json
from clipbench.tracking.provenance import read_provenance
from clipbench.tracking.store import RunDir

SECTIONS = ("model", "task", "sampler", "eval")  # the run config's sections the evaluation reads
NOT_KEYED = ("step", "time")  # a start record's fields that differ on every start


def start_eval_key(cfg, rd: RunDir, *, backend: str, device, world: int) -> str | None:
    """The key of this run's evaluation before its first step, or None where it is not shared (a run
    outside a sweep, not on one CPU process with the hf sampler, or without a start record)."""
    if rd.shared_dir is None or backend != "hf" or world != 1 or getattr(device, "type", str(device)) != "cpu":
        return None
    starts = read_provenance(rd.path)  # rank 0's start record, written by setup
    if not starts:
        return None
    run = to_dict(cfg)
    what = {
        "seed": cfg.seed,
        "backend": backend,
        **{s: run[s] for s in SECTIONS},
        "start": {k: v for k, v in starts[-1].items() if k not in NOT_KEYED},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _path(rd: RunDir, key: str, benchmark: str) -> Path:
    return rd.shared_dir / "eval_step_0" / key / f"{benchmark}.json"


def read_shared(rd: RunDir, key: str, benchmarks) -> dict | None:
    """{benchmark: payload} when another run left every benchmark's payload, else None (a missing
    or damaged file: this run computes the evaluation itself)."""
    out = {}
    for name in benchmarks:
        path = _path(rd, key, name)
        try:
            payload = read_json(path, None, kind="eval") if path.is_file() else None
        except StoreError:
            return None
        if payload is None:
            return None
        out[name] = payload
    return out


def share(rd: RunDir, key: str, benchmarks) -> None:
    """Leave this run's evaluation at step 0 (its stored payloads) for the sweep's other runs."""
    for name in benchmarks:
        atomic_write_json(_path(rd, key, name), read_json(rd.eval_path(0, name), kind="eval"))
