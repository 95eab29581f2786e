"""The problems each evaluation of a sweep covers, checked before the report compares anything.

A report aligns runs by problem id over the problems every run evaluated, so an evaluation file that
lost half its problems would quietly cut every run of its benchmark down to that half. Each
evaluation's problem ids must be those of the benchmark's split at the run's eval settings
(`eval.limit`, `eval.data_dir`, the task's knobs): read on this machine where that needs neither the
network nor a cache (a generated split such as `arith`, or a file in `eval.data_dir`), else those
that most of the sweep's evaluations of the benchmark with the same settings hold. Anything else is
one StoreError line naming the file (an id held twice is `check_eval_payload`'s).

The problem ids of a split number its problems: they do not depend on the run's seed, so the split is
read once per task setting, not once per run.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

from clipbench.config import from_dict, setting
from clipbench.errors import StoreError, UserError
from clipbench.eval.suite import benchmark_problems, local_split
from clipbench.tasks import build_run_task
from clipbench.tracking.files import REMEDIES
from clipbench.tracking.store import RunDir


def check_problem_ids(runs: Sequence) -> None:
    """StoreError for the first evaluation of `runs` (report.load's RunRecords) whose problem ids are
    not its benchmark's (above)."""
    splits: dict[tuple, tuple[str, ...] | None] = {}
    groups: dict[tuple, list[tuple]] = {}
    for r in runs:
        for step, payloads in sorted(r.evals.items()):
            for bench, p in payloads.items():
                key = (bench, json.dumps(_settings(r.config), sort_keys=True, default=str))
                if key not in splits:
                    splits[key] = _split_ids(r.config, bench)
                groups.setdefault(key, []).append((r, step, tuple(map(str, p["problem_ids"]))))
    for key, evals in groups.items():
        bench, split = key[0], splits[key]
        if split is not None:
            where = f"of benchmark '{bench}' (its split at the run's eval settings)"
        else:  # the split is not on this machine: the ids most of the sweep's evaluations hold
            counts = Counter(ids for _, _, ids in evals)
            split = max(counts, key=lambda ids: (counts[ids], len(ids)))
            where = f"the sweep's other evaluations of '{bench}' with the same settings hold"
        for r, step, ids in evals:
            if set(ids) != set(split):
                raise StoreError(RunDir(r.path).eval_path(step, bench), _mismatch(ids, split, where), REMEDIES["eval"])


def _settings(config: dict) -> dict:
    """What decides a run's problems of a benchmark: its task section and eval limit and data dir."""
    return {
        "task": config.get("task"),
        "limit": setting(config, "eval.limit"),
        "data_dir": setting(config, "eval.data_dir"),
    }


def _split_ids(config: dict, bench: str) -> tuple[str, ...] | None:
    """The problem ids of `bench` at the run's eval settings, read where that is local (module
    docstring); None where it is not, or the split does not load here (a data_dir of another machine)."""
    try:
        cfg = from_dict(config)
        if not local_split(cfg, bench):
            return None
        task = build_run_task(config) if cfg.task.name == "arith" else None  # a math task's data is not read
        problems, _ = benchmark_problems(cfg, task, bench)
    except (UserError, OSError):  # a data_dir of another machine, a file that does not load here
        return None
    except Exception:  # noqa: BLE001 - a stored config this release cannot type (OmegaConf's errors): not checked
        return None
    return tuple(str(p.id) for p in problems)


def _mismatch(ids: tuple[str, ...], split: tuple[str, ...], where: str) -> str:
    missing = [i for i in split if i not in set(ids)]
    foreign = [i for i in ids if i not in set(split)]
    if missing:
        return f"covers {len(split) - len(missing)} of the {len(split)} problems {where} (missing: {_few(missing)})"
    return f"holds {len(foreign)} problem id(s) not among the {len(split)} problems {where} ({_few(foreign)})"


def _few(ids: list[str], shown: int = 3) -> str:
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")
