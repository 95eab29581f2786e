"""The results store: one directory per run, plain files, atomic writes. The source of truth.

    <results>/<sweep>/<run_id>/config.yaml     resolved run config
    <results>/<sweep>/<run_id>/status.json     {"state": pending|running|finished|failed, ...}
    <results>/<sweep>/<run_id>/metrics.jsonl   one JSON object per optimizer step (append-only)
    <results>/<sweep>/<run_id>/hist/log_ratio.jsonl   log-ratio histograms per rollout step (summed over its optimizer steps)
    <results>/<sweep>/<run_id>/eval/step_<k>/<benchmark>.json   correctness matrix + summary
    <results>/<sweep>/<run_id>/checkpoints/last/     sharded model + optimizer, trainer state (clipbench.train.checkpoint)

Whole files are written to a temp file in the same directory and `os.replace`d, so a `kill -9` at
any moment leaves either the old or the new file. Appended jsonl files may end in a torn line after
a crash; readers skip it and resume truncates it away.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import yaml

STATES = ("pending", "running", "finished", "failed")


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item") and callable(x.item):  # 0-d tensors / numpy scalars
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else (1e308 if x > 0 else -1e308)
    return x


def dumps(obj: Any) -> str:
    if isinstance(obj, dict):
        obj = {k: _jsonable(v) for k, v in obj.items()}
    return json.dumps(obj, sort_keys=False, default=_jsonable)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, default=_jsonable) + "\n")


def read_json(path: str | Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


def read_jsonl(path: str | Path) -> list[dict]:
    """All complete lines; a torn last line (crash mid-append) is skipped."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    except FileNotFoundError:
        pass
    return rows


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

    def eval_path(self, step: int, benchmark: str) -> Path:
        return self.path / "eval" / f"step_{step:06d}" / f"{benchmark}.json"

    # config and status
    def write_config(self, cfg: dict) -> None:
        atomic_write_text(self.config_path, yaml.safe_dump(cfg, sort_keys=False))

    def read_config(self) -> dict | None:
        try:
            return yaml.safe_load(self.config_path.read_text())
        except FileNotFoundError:
            return None

    def status(self) -> dict:
        return read_json(self.status_path, {"state": "pending"})

    def set_status(self, state: str, **extra: Any) -> None:
        assert state in STATES, state
        cur = self.status()
        cur.update(extra)
        cur["state"] = state
        atomic_write_json(self.status_path, cur)

    # metrics (append-only jsonl)
    def append_jsonl(self, path: Path, rows: Iterable[dict]) -> None:
        rows = list(rows)
        if not rows:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_torn_tail(path)
        with open(path, "a") as f:  # closed = in the OS page cache: survives kill -9 (not power loss);
            f.write("".join(dumps(r) + "\n" for r in rows))  # checkpoints and whole files are fsynced

    def append_metrics(self, rows: Iterable[dict]) -> None:
        self.append_jsonl(self.metrics_path, rows)

    def read_metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_path)

    def append_hist(self, rows: Iterable[dict]) -> None:
        self.append_jsonl(self.hist_path, rows)

    def truncate_after(self, step: int) -> None:
        """Keep only rows with row['step'] < step in every jsonl (resume from a checkpoint at step)."""
        for path in (self.metrics_path, self.hist_path):
            if path.exists():
                keep = [r for r in read_jsonl(path) if r.get("step", -1) < step]
                atomic_write_text(path, "".join(dumps(r) + "\n" for r in keep))

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
        """{step: {benchmark: payload}} for every finished evaluation."""
        out: dict[int, dict[str, dict]] = {}
        root = self.path / "eval"
        if not root.exists():
            return out
        for d in sorted(root.glob("step_*")):
            step = int(d.name.split("_")[1])
            for f in sorted(d.glob("*.json")):
                out.setdefault(step, {})[f.stem] = json.loads(f.read_text())
        return out


# ---------------------------------------------------------------------------------------------
# Whole-sweep readers (fast paths for reports and benchmarks)


def list_run_dirs(sweep_dir: str | Path) -> list[RunDir]:
    """Run directories of a sweep (those with a config.yaml or metrics), sorted by run id."""
    root = Path(sweep_dir)
    if not root.is_dir():
        return []
    return [RunDir(d) for d in sorted(root.iterdir())
            if d.is_dir() and not d.name.startswith(".") and ((d / "config.yaml").is_file() or (d / "metrics.jsonl").is_file())]


def _complete_lines(path: Path) -> bytes:
    """The file's bytes up to its last newline (a torn last line, left by a crash, is dropped)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return b""
    end = data.rfind(b"\n")
    return data[: end + 1] if end >= 0 else b""


CACHE_DIR = ".cache"


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def _parse_jsonl_arrow(ids: list[str], chunks: list[bytes]):
    """Concatenated complete lines of several runs -> one Arrow table with a leading run_id column."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.json as pj

    counts = [c.count(b"\n") for c in chunks]
    table = pj.read_json(io.BytesIO(b"".join(chunks)))
    if table.num_rows != sum(counts):  # blank lines would shift the run ids
        raise pa.ArrowInvalid("row count mismatch")
    for i, f in enumerate(table.schema):  # all-null columns (NaN is written as null) -> float NaN
        if pa.types.is_null(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(pa.float64()))
    return table.add_column(0, "run_id", pa.array(np.repeat(np.array(ids, dtype=object), counts), pa.string()))


def _read_cache(path: Path):
    """(table, {run_id: (size, mtime_ns, offset, rows)}) or (None, {})."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_file(src).read_all()
        index = json.loads(table.schema.metadata[b"clipbench.index"])
        return table, {k: tuple(v) for k, v in index.items()}
    except Exception:  # noqa: BLE001 - a missing or damaged cache is rebuilt
        return None, {}


def _write_cache(path: Path, table, index: dict) -> None:
    import pyarrow as pa

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = table.replace_schema_metadata({b"clipbench.index": json.dumps(index).encode()})
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # a read-only results dir: no cache, same answer


def load_sweep_metrics(results_dir: str | Path, sweep: str, *, run_ids: Iterable[str] | None = None,
                       filename: str = "metrics.jsonl", cache: bool = True):
    """Every run's ``metrics.jsonl`` as one pandas DataFrame with a leading ``run_id`` column (runs in
    run-id order, rows in file order; columns are the union over runs, missing values NaN/None).

    Fast path: the runs' complete lines are concatenated and parsed at once by Arrow's JSON reader,
    and the parsed table is kept in ``<sweep>/.cache/<filename>.arrow`` keyed by each file's (size,
    mtime), so a later call re-parses only the runs whose file changed (the cache is an optimisation:
    deleting it changes nothing but speed). Falls back to a line-by-line reader if Arrow rejects the
    input. ``filename="hist/log_ratio.jsonl"`` reads the histograms the same way.
    """
    import numpy as np
    import pandas as pd

    root = Path(results_dir) / sweep
    wanted = set(run_ids) if run_ids is not None else None
    runs = [rd for rd in list_run_dirs(root) if wanted is None or rd.run_id in wanted]
    sigs = {rd.run_id: _signature(rd.path / filename) for rd in runs}
    runs = [rd for rd in runs if sigs[rd.run_id] is not None]
    if not runs:
        return pd.DataFrame({"run_id": pd.Series([], dtype=object)})

    cache_path = root / CACHE_DIR / (filename.replace("/", "__") + ".arrow")
    cached, index = _read_cache(cache_path) if cache else (None, {})
    fresh_ids, fresh_chunks = [], []
    for rd in runs:
        hit = index.get(rd.run_id)
        if cached is None or hit is None or tuple(hit[:2]) != tuple(sigs[rd.run_id]):
            blob = _complete_lines(rd.path / filename)
            if blob:
                fresh_ids.append(rd.run_id)
                fresh_chunks.append(blob)
    try:
        import pyarrow as pa

        fresh = _parse_jsonl_arrow(fresh_ids, fresh_chunks) if fresh_chunks else None
        parts, new_index, offset = [], {}, 0
        fresh_at = {}
        if fresh is not None:
            rid_col = fresh.column("run_id").to_numpy(zero_copy_only=False)
            starts = np.flatnonzero(np.r_[True, rid_col[1:] != rid_col[:-1]])
            ends = np.r_[starts[1:], len(rid_col)]
            fresh_at = {rid_col[a]: (int(a), int(b - a)) for a, b in zip(starts, ends)}
        for rd in runs:
            rid = rd.run_id
            if rid in fresh_at:
                a, n = fresh_at[rid]
                part = fresh.slice(a, n)
            elif cached is not None and rid in index and tuple(index[rid][:2]) == tuple(sigs[rid]):
                part = cached.slice(index[rid][2], index[rid][3])
            else:
                continue  # an empty file
            parts.append(part)
            new_index[rid] = [*sigs[rid], offset, part.num_rows]
            offset += part.num_rows
        table = pa.concat_tables(parts, promote_options="permissive") if parts else None
        if table is None:
            return pd.DataFrame({"run_id": pd.Series([], dtype=object)})
        if cache and wanted is None and (fresh is not None or set(new_index) != set(index)):
            _write_cache(cache_path, table.combine_chunks(), new_index)
        return table.to_pandas()
    except Exception:  # noqa: BLE001 - any parse trouble: the slow, forgiving path
        return _load_slow(runs, filename)


def _load_slow(runs: list[RunDir], filename: str):
    import numpy as np
    import pandas as pd

    rows, ids, counts = [], [], []
    for rd in runs:
        part = []
        for line in _complete_lines(rd.path / filename).decode(errors="replace").splitlines():
            try:
                part.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a damaged line costs that row only
        if part:
            rows.extend(part)
            ids.append(rd.run_id)
            counts.append(len(part))
    df = pd.DataFrame.from_records(rows)
    df.insert(0, "run_id", np.repeat(np.array(ids, dtype=object), counts))
    return df
