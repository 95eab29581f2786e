"""The results store: one directory per run, plain files, atomic writes. The source of truth.

    <results>/<sweep>/<run_id>/config.yaml     resolved run config
    <results>/<sweep>/<run_id>/status.json     {"state": pending|running|finished|failed, ...}
    <results>/<sweep>/<run_id>/metrics.jsonl   one JSON object per optimizer step (append-only)
    <results>/<sweep>/<run_id>/hist/log_ratio.jsonl   log-ratio histograms per rollout step (summed over its optimizer steps)
    <results>/<sweep>/<run_id>/eval/step_<k>/<benchmark>.json   correctness matrix + summary
    <results>/<sweep>/<run_id>/checkpoints/last/     sharded model + optimizer, trainer state (clipbench.train.checkpoint)

Design choices:
- Whole files are written to a temp file in the same directory and `os.replace`d, so a `kill -9` at
  any moment leaves either the old or the new file. Temp files are created with mode 0666 minus the
  umask (as `open` would), so a store on a shared filesystem is as readable as its umask says.
- Appended jsonl files may end in a torn line after a crash: readers skip that last line with a
  note (`notes=`), and resume truncates it away. Any other line that is not a JSON object is a
  damaged file: `StoreError` naming the file and the line, never a silently dropped row.
- Every reader of a store file (`read_json`, `read_jsonl`, `RunDir.read_config`, `RunDir.status`,
  `RunDir.read_evals`) turns a damaged file into one `StoreError` line: the file, what is wrong and
  what the user can do (`REMEDIES`). Nothing is guessed from a damaged file.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any, Iterable

from clipbench.errors import StoreError, UserError
from clipbench.yamlio import YamlError, decode_utf8, dump_yaml, load_yaml_text

STATES = ("pending", "running", "finished", "failed")
# Sub-directories of a results dir that are not sweeps (`train` is: single `clipbench train` runs).
NOT_SWEEPS = ("reports", "bench", "eval", "mlartifacts")

# What a user can do about a damaged file, by kind.
REMEDIES = {
    "manifest": "move it away and rerun `clipbench sweep FILE` to freeze the plan again (finished runs are "
                "found again by their run ids)",
    "status": "delete it: the run then counts as interrupted and resumes from its checkpoint (or restarts) "
              "on the next `clipbench sweep`",
    "config": "restore it (the sweep's manifest.json holds the same config) or delete the run directory to "
              "train the run again",
    "eval": "move it away (the evaluation is then left out) or delete the run directory to train the run again",
    "mlflow": "delete it (it only remembers the run's MLflow ids; `clipbench sync` finds them again by tags)",
    "jsonl": "repair or delete that line (the other rows are intact), or delete the run directory to train "
             "the run again",
}


# ---------------------------------------------------------------------------------------------
# Writing


def _temp_beside(path: Path) -> tuple[int, str]:
    """A new temp file next to `path`, opened for writing, mode 0666 minus the umask."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp name beside {path}")


def current_umask() -> int:
    """The process's umask (from /proc on Linux; elsewhere set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_umask(root: str | Path) -> None:
    """Give a freshly written tree the modes `open`/`mkdir` would (0666/0777 minus the umask): some
    writers (safetensors, mkdtemp) create 0600 files or 0700 directories whatever the umask says."""
    mask = current_umask()
    root = Path(root)
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
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


def check_writable_dir(path: str | Path, what: str = "--results-dir") -> Path:
    """Fail before anything is written when `path` cannot hold the store: it (or the ancestor it
    would be created under) must be a directory this process may write. Creates nothing."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise UserError(f"{what} {path}: {probe} is a broken symbolic link")
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        where = "exists and is not a directory" if probe == path else f"cannot be created: {probe} is not a directory"
        raise UserError(f"{what} {path}: {where}")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        raise UserError(f"{what} {path}: {where} by this user")
    return path


def check_store_dir(path: str | Path) -> Path:
    """A results dir to read: it must exist and be a directory (one UserError line otherwise)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"--results-dir {path}: exists and is not a directory")
    if not path.is_dir():
        raise UserError(f"--results-dir {path}: does not exist (no results yet; `clipbench sweep FILE "
                        f"--results-dir {path}` writes them)")
    return path


# ---------------------------------------------------------------------------------------------
# Reading (every damaged file is one StoreError line)


def _read_text(path: Path, kind: str) -> str | None:
    """The file's UTF-8 text, or None when it does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise StoreError(path, "is a directory, not a file", REMEDIES[kind]) from None
    except OSError as e:
        raise StoreError(path, f"cannot be read ({e.strerror or e})", "check its permissions") from None
    try:
        return decode_utf8(data)
    except YamlError as e:
        raise StoreError(path, e.reason.split(";")[0], REMEDIES[kind]) from None


def read_json(path: str | Path, default: Any = None, *, kind: str = "status", expect: type | None = dict) -> Any:
    """A JSON file of the store (`default` when missing); StoreError when damaged or not an `expect`."""
    path = Path(path)
    text = _read_text(path, kind)
    if text is None:
        return default
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreError(path, f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})", REMEDIES[kind]) from None
    if expect is not None and not isinstance(obj, expect):
        raise StoreError(path, f"expected a JSON {'object' if expect is dict else expect.__name__}, got "
                         f"{type(obj).__name__}", REMEDIES[kind])
    return obj


def read_jsonl(path: str | Path, *, notes: list[str] | None = None) -> list[dict]:
    """Every row of an append-only jsonl file ([] when missing).

    The last line without a newline is a torn write (a crash mid-append): it is skipped and, when
    `notes` is given, a note is appended to it. Any other line that is not a JSON object raises
    StoreError naming the file and the line; blank lines are ignored."""
    path = Path(path)
    text = _read_text(path, "jsonl")
    if not text:
        return []
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rows.append(_jsonl_row(path, i, line))
    if tail.strip():
        if notes is not None:
            notes.append(f"{path}: skipped an incomplete last line {len(lines) + 1} (a crash or a write in "
                         "progress; a resumed run rewrites it)")
    return rows


def _jsonl_row(path: Path, lineno: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise StoreError(path, f"not valid JSON ({e.msg}, column {e.colno})", REMEDIES["jsonl"],
                         where=f"line {lineno}") from None
    if not isinstance(row, dict):
        raise StoreError(path, f"expected a JSON object, got {type(row).__name__}", REMEDIES["jsonl"],
                         where=f"line {lineno}")
    return row


def check_eval_payload(path: Path, payload: dict) -> dict:
    """An evaluation payload as the report needs it: P problem ids, a P x n matrix of 0/1, n."""
    import numpy as np

    def bad(problem: str):
        raise StoreError(path, problem, REMEDIES["eval"])

    ids, correct = payload.get("problem_ids"), payload.get("correct")
    if not isinstance(ids, list) or not ids:
        bad("'problem_ids' is missing or empty")
    if not isinstance(correct, list) or len(correct) != len(ids):
        bad(f"'correct' must be a list of {len(ids)} rows (one per problem id)")
    try:
        m = np.asarray(correct, dtype=float)
    except (TypeError, ValueError):
        bad("'correct' is not a rectangular matrix of numbers")
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

    def eval_path(self, step: int, benchmark: str) -> Path:
        return self.path / "eval" / f"step_{step:06d}" / f"{benchmark}.json"

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
            raise StoreError(self.config_path, e.reason, REMEDIES["config"],
                             where=f"line {e.line}" if e.line else None) from None
        if not isinstance(cfg, dict):
            raise StoreError(self.config_path, f"expected a mapping (the run config), got "
                             f"{type(cfg).__name__ if cfg is not None else 'an empty file'}", REMEDIES["config"])
        return cfg

    def status(self) -> dict:
        """status.json ({"state": "pending"} when missing); StoreError when damaged."""
        st = read_json(self.status_path, {"state": "pending"}, kind="status")
        if st.get("state", "pending") not in STATES:
            raise StoreError(self.status_path, f"unknown state {st.get('state')!r} (valid: {', '.join(STATES)})",
                             REMEDIES["status"])
        return st

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

    def read_metrics(self, notes: list[str] | None = None) -> list[dict]:
        return read_jsonl(self.metrics_path, notes=notes)

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
    return [d.name for d in sorted(root.iterdir())
            if d.is_dir() and d.name not in NOT_SWEEPS and not d.name.startswith(".") and list_run_dirs(d)]


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


def load_sweep_metrics(results_dir: str | Path, sweep: str, *, run_ids: Iterable[str] | None = None,
                       filename: str = "metrics.jsonl", cache: bool = True, notes: list[str] | None = None):
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
    import numpy as np
    import pandas as pd

    root = Path(results_dir) / sweep
    wanted = set(run_ids) if run_ids is not None else None
    runs = [rd for rd in list_run_dirs(root) if wanted is None or rd.run_id in wanted]
    sigs = {rd.run_id: _signature(rd.path / filename) for rd in runs}
    runs = [rd for rd in runs if sigs[rd.run_id] is not None]
    if not runs:
        return pd.DataFrame({"run_id": pd.Series([], dtype=object)})
    if notes is not None:
        notes += [f"{rd.path / filename}: skipped an incomplete last line (a crash or a write in progress; "
                  "a resumed run rewrites it)" for rd in runs if _torn_tail(rd.path / filename)]

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
    except Exception:  # noqa: BLE001 - anything Arrow rejects: the line reader decides (and names bad lines)
        return _load_slow(runs, filename)


def _load_slow(runs: list[RunDir], filename: str):
    import numpy as np
    import pandas as pd

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
