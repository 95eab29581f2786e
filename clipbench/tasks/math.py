"""Math word problems from a local file/directory or a Hugging Face dataset, graded by ``grader``.

Sources (``load_rows``): a ``.jsonl``/``.json``/``.parquet`` file; a directory (a ``save_to_disk``
dataset, or data files that ``datasets.load_dataset(dir)`` understands); anything else is a Hugging
Face dataset name loaded with ``datasets.load_dataset(name, config, split=split)``.

Schemas are detected from the columns (nested dicts are also seen as dotted keys, so
``reward_model.ground_truth`` matches both the nested and the flat layout); first match wins:

    dapo             prompt + reward_model.ground_truth   DAPO-Math-17k(-Processed)
    roll             prompt + ground_truth                alibaba/ROLL math_benchmarks.jsonl
    problem_answer   problem + answer                     AIME24/25, AMC23, MATH-500
    question_answer  question + answer                    GSM8K (answer after '####'), AIME25/AMC23 hub copies
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clipbench.errors import UserError
from clipbench.tasks.base import Problem
from clipbench.tasks.grader import grade, normalize_gold
from clipbench.tasks.hub import endpoint, hub_or_cache
from clipbench.tasks.templates import render, resolve_template
from clipbench.yamlio import flatten

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Schema:
    name: str
    problem_key: str
    answer_key: str
    id_keys: tuple[str, ...] = ()
    meta_keys: tuple[str, ...] = ()

    def matches(self, columns: set[str]) -> bool:
        return {self.problem_key, self.answer_key} <= columns


SCHEMAS: tuple[Schema, ...] = (
    Schema("dapo", "prompt", "reward_model.ground_truth", ("extra_info.index",), ("data_source", "ability")),
    Schema("roll", "prompt", "ground_truth", ("id",), ("source", "tag", "difficulty")),
    Schema("problem_answer", "problem", "answer", ("id", "unique_id"), ("subject", "level", "url")),
    Schema("question_answer", "question", "answer", ("id", "idx"), ()),
)


# ---- reading rows ---------------------------------------------------------------------------


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict):  # {"data": [...]}-style wrappers: the single list value
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of objects (or JSON lines)")
    return data


def _from_datasets(obj, split: str, label: str) -> list[dict]:
    """Rows of a ``datasets.Dataset``, or of ``split`` of a ``DatasetDict``."""
    import datasets  # noqa: PLC0415 - datasets is heavy

    if isinstance(obj, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in obj:
            raise UserError(f"{label}: no split '{split}'; available: {', '.join(sorted(obj))}")
        obj = obj[split]
    return obj.to_list()


def _read_dir(path: Path, split: str, config: str | None) -> list[dict]:
    import datasets  # noqa: PLC0415 - datasets is heavy

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        return _from_datasets(datasets.load_from_disk(str(path)), split, str(path))
    return _load_hub_or_files(str(path), split, config, hub=False)


def _load_hub_or_files(name: str, split: str, config: str | None, *, hub: bool = True) -> list[dict]:
    """`datasets.load_dataset(name)`: a local directory of data files, or (`hub`) a hub dataset, read
    from the local cache at once when the hub cannot be reached (tasks/hub.py)."""
    import datasets  # noqa: PLC0415 - datasets is heavy

    with hub_or_cache() if hub else contextlib.nullcontext(True) as online:
        try:
            ds = datasets.load_dataset(name, config, split=split)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - hub, network, split and file errors all end here
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            cfg = f", config '{config}'" if config else ""
            why = (
                f"{type(e).__name__}: {first}"
                if online
                else f"the Hugging Face hub ({endpoint()}) cannot be reached and the local cache does not hold it"
            )
            raise UserError(f"could not load dataset '{name}' (split '{split}'{cfg}): {why}") from None
    return _from_datasets(ds, split, name)


def load_rows(source: str | Path, split: str = "train", config: str | None = None) -> list[dict]:
    """Raw rows of a local file, a local directory, or a Hugging Face dataset name."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # noqa: PLC0415 - pyarrow is heavy

            return pq.read_table(path).to_pylist()
        if path.suffix in (".jsonl", ".json"):
            return _read_json(path)
        raise UserError(f"{path}: unsupported file type '{path.suffix}'; use one of {', '.join(LOCAL_SUFFIXES)}")
    if path.is_dir():
        return _read_dir(path, split, config)
    if path.suffix in LOCAL_SUFFIXES or str(source).startswith((".", "/", "~")):
        raise UserError(f"{source}: no such file or directory")
    return _load_hub_or_files(str(source), split, config)


# ---- rows -> problems -----------------------------------------------------------------------


def detect_schema(columns: set[str], label: str) -> Schema:
    """First schema whose problem and answer columns are present; UserError naming the columns."""
    for schema in SCHEMAS:
        if schema.matches(columns):
            return schema
    wanted = "; ".join(f"{s.name}: {s.problem_key} + {s.answer_key}" for s in SCHEMAS)
    raise UserError(f"{label}: no known problem schema fits the columns {sorted(columns)}; expected one of: {wanted}")


def _row_id(row: dict, schema: Schema, index: int) -> str:
    for key in schema.id_keys:
        if row.get(key) not in (None, ""):
            return str(row[key])
    return str(index)


def row_to_problem(row: dict, index: int, schema: Schema, label: str, template: str) -> Problem:
    text, gold = row.get(schema.problem_key), row.get(schema.answer_key)
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{label}: row {index}: '{schema.problem_key}' is not a non-empty string")
    answer = normalize_gold(gold) if gold is not None else ""
    if not answer:
        raise UserError(f"{label}: row {index}: empty answer in '{schema.answer_key}'")
    meta = {"source": label, "schema": schema.name, "row": index, "problem": text}
    meta.update({k: row[k] for k in schema.meta_keys if row.get(k) is not None})
    return Problem(id=f"{label}/{_row_id(row, schema, index)}", prompt=render(template, text), answer=answer, meta=meta)


def source_label(source: str | Path) -> str:
    """Short name of a source for problem ids: the file stem, or the dataset name."""
    path = Path(source)
    return path.stem if path.suffix in LOCAL_SUFFIXES else str(source).rstrip("/")


def rows_to_problems(
    rows: Sequence[dict], label: str, template: str = "dapo", limit: int | None = None
) -> list[Problem]:
    template = resolve_template(template)
    if limit is not None:
        if limit < 0:
            raise UserError(f"{label}: limit must be >= 0, got {limit}")
        rows = rows[:limit]

    flat = [flatten(r, sections=True) for r in rows]
    if not flat:
        raise UserError(f"{label}: no rows")
    columns = set().union(*(r.keys() for r in flat))
    schema = detect_schema(columns, label)
    return [row_to_problem(r, i, schema, label, template) for i, r in enumerate(flat)]


def load_problems(
    source: str | Path,
    template: str = "dapo",
    split: str = "train",
    limit: int | None = None,
    *,
    config: str | None = None,
    label: str | None = None,
) -> list[Problem]:
    """Problems of a file, directory or Hugging Face dataset (first ``limit`` rows)."""
    rows = load_rows(source, split=split, config=config)
    return rows_to_problems(rows, label or source_label(source), template, limit)


# ---- the task -------------------------------------------------------------------------------


def hold_out(problems: Sequence[Problem], n: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, test): ``n`` problems drawn by ``np.random.default_rng(seed)`` form the test split;
    both keep the source order."""
    if not 0 <= n < len(problems):
        raise UserError(f"holdout must be in 0..{len(problems) - 1} for {len(problems)} problems, got {n}")
    picked = set(np.random.default_rng(seed).choice(len(problems), size=n, replace=False).tolist())
    train = [p for i, p in enumerate(problems) if i not in picked]
    test = [p for i, p in enumerate(problems) if i in picked]
    return train, test


class MathTask:
    """Math problems graded by ``grader.grade`` (math-verify, numeric-aware)."""

    name = "math"

    def __init__(self, train: Sequence[Problem], test: Sequence[Problem] = (), *, strict: bool = False):
        self._train, self._test, self.strict = tuple(train), tuple(test), strict

    @classmethod
    def from_source(
        cls,
        path: str | Path,
        *,
        split: str = "train",
        template: str = "auto",
        limit: int | None = None,
        config: str | None = None,
        holdout: int = 0,
        seed: int = 0,
        test: Sequence[Problem] = (),
    ) -> MathTask:
        """Training pool from ``path``; ``holdout`` of its problems (seeded) become the test split,
        followed by any ``test`` problems given (e.g. a benchmark)."""
        problems = load_problems(path, template, split, limit, config=config)
        train, held = hold_out(problems, holdout, seed) if holdout else (problems, [])
        return cls(train, [*held, *test])

    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def test_problems(self) -> Sequence[Problem]:
        return self._test

    def is_correct(self, completion: str, problem: Problem) -> bool:
        return grade(completion, problem.answer, strict=self.strict)

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if self.is_correct(completion, problem) else 0.0

    def __repr__(self) -> str:
        return f"MathTask(train={len(self._train)}, test={len(self._test)})"
