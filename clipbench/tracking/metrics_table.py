"""Every run's metrics.jsonl of a sweep as one table, fast: an Arrow parse cache per sweep.

    df = load_sweep_metrics("results", "nsr_vs_decay")   # pandas DataFrame, one row per optimizer step

The first load parses every run's JSON lines with Arrow and writes `<sweep>/.cache/`; later loads
read the cache back, re-parsing only files whose size or mtime changed. A torn last line (a crash
mid-append) is skipped with a note, as the line reader does (files.read_jsonl).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from clipbench.tracking.files import _temp_beside, complete_lines, read_jsonl
from clipbench.tracking.store import RunDir, list_run_dirs

CACHE_DIR = ".cache"


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def _parse_jsonl_arrow(ids: list[str], chunks: list[bytes]):
    """Concatenated complete lines of several runs -> one Arrow table with a leading run_id column."""

    # PLC0415, deferred: pyarrow is heavy
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.json as pj  # noqa: PLC0415

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
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is heavy

    try:
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_file(src).read_all()
        index = json.loads(table.schema.metadata[b"clipbench.index"])
        return table, {k: tuple(v) for k, v in index.items()}
    except Exception:  # noqa: BLE001 - a missing or damaged cache is rebuilt
        return None, {}


def _write_cache(path: Path, table, index: dict) -> None:
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is heavy

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = table.replace_schema_metadata({b"clipbench.index": json.dumps(index).encode()})
        fd, tmp = _temp_beside(path)
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


def _torn_tail(path: Path) -> bool:
    """True when the file's last byte is not a newline (a crash mid-append, or a write in progress)."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:  # missing or empty
        return False


def load_sweep_metrics(
    results_dir: str | Path,
    sweep: str,
    *,
    run_ids: Iterable[str] | None = None,
    filename: str = "metrics.jsonl",
    cache: bool = True,
    notes: list[str] | None = None,
):
    """Every run's ``metrics.jsonl`` as one pandas DataFrame with a leading ``run_id`` column (runs in
    run-id order, rows in file order; columns are the union over runs, missing values NaN/None).

    Fast path: the runs' complete lines are concatenated and parsed at once by Arrow's JSON reader,
    and the parsed table is kept in ``<sweep>/.cache/<filename>.arrow`` keyed by each file's (size,
    mtime), so a later call re-parses only the runs whose file changed (the cache is an optimisation:
    deleting it changes nothing but speed). Falls back to a line-by-line reader if Arrow rejects the
    input, which names the file and line of a damaged row (StoreError) as `read_jsonl` does.
    A torn last line is skipped, with a note in `notes` when given.
    ``filename="hist/log_ratio.jsonl"`` reads the histograms the same way.
    """
    import pandas as pd  # noqa: PLC0415 - pandas is heavy

    root = Path(results_dir) / sweep
    wanted = set(run_ids) if run_ids is not None else None
    runs = [rd for rd in list_run_dirs(root) if wanted is None or rd.run_id in wanted]
    sigs = {rd.run_id: _signature(rd.path / filename) for rd in runs}
    runs = [rd for rd in runs if sigs[rd.run_id] is not None]
    if not runs:
        return pd.DataFrame({"run_id": pd.Series([], dtype=object)})
    if notes is not None:
        notes += [
            f"{rd.path / filename}: skipped an incomplete last line (a crash or a write in progress; "
            "a resumed run rewrites it)"
            for rd in runs
            if _torn_tail(rd.path / filename)
        ]

    cache_path = root / CACHE_DIR / (filename.replace("/", "__") + ".arrow")
    cached, index = _read_cache(cache_path) if cache else (None, {})
    fresh_ids, fresh_chunks = [], []
    for rd in runs:
        hit = index.get(rd.run_id)
        if cached is None or hit is None or tuple(hit[:2]) != tuple(sigs[rd.run_id]):
            blob = complete_lines(rd.path / filename)
            if blob:
                fresh_ids.append(rd.run_id)
                fresh_chunks.append(blob)
    try:
        import pyarrow as pa  # noqa: PLC0415 - pyarrow is heavy

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
    except Exception:  # noqa: BLE001 - anything Arrow rejects: the line reader decides (and names bad lines)
        return _load_slow(runs, filename)


def _load_slow(runs: list[RunDir], filename: str):
    import pandas as pd  # noqa: PLC0415 - pandas is heavy

    rows, ids, counts = [], [], []
    for rd in runs:
        part = read_jsonl(rd.path / filename)
        if part:
            rows.extend(part)
            ids.append(rd.run_id)
            counts.append(len(part))
    df = pd.DataFrame.from_records(rows)
    df.insert(0, "run_id", np.repeat(np.array(ids, dtype=object), counts))
    return df
