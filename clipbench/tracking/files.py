"""The results store's files: atomic whole-file writes, appendable JSON lines, readers that name
what is damaged. Everything the store writes goes through here.

Design choices:
- Whole files are written to a temp file in the same directory and `os.replace`d, so a `kill -9` at
  any moment leaves either the old or the new file. Temp files are created with mode 0666 minus the
  umask (as `open` would), so a store on a shared filesystem is as readable as its umask says.
- Appended jsonl files may end in a torn line after a crash: readers skip that last line with a
  note (`notes=`), and resume truncates it away. Any other line that is not a JSON object is a
  damaged file: `StoreError` naming the file and the line, never a silently dropped row.
- Every reader turns a damaged file into one `StoreError` line: the file, what is wrong and what
  the user can do (`REMEDIES`). Nothing is guessed from a damaged file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clipbench.errors import StoreError, UserError
from clipbench.yamlio import YamlError, decode_utf8

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
    "provenance": "delete it: the report then counts the run's machine and base-model checksum as unknown "
    "(its next start or resume records them again)",
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
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise_naming(e, path)
        raise


def raise_naming(err: BaseException, path: str | Path) -> None:
    """Re-raise a "no space left" OSError with the file it was writing (a write to an open file
    reports none), so the one line the user reads names it; any other error: return."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) and not err.filename:
        raise OSError(err.errno, os.strerror(err.errno), str(path)) from err


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
        raise UserError(
            f"--results-dir {path}: does not exist (no results yet; `clipbench sweep FILE "
            f"--results-dir {path}` writes them)"
        )
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
        raise StoreError(
            path, f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})", REMEDIES[kind]
        ) from None
    if expect is not None and not isinstance(obj, expect):
        raise StoreError(
            path,
            f"expected a JSON {'object' if expect is dict else expect.__name__}, got {type(obj).__name__}",
            REMEDIES[kind],
        )
    return obj


def complete_lines(path: str | Path) -> bytes:
    """The file's bytes up to its last newline (a torn last line, left by a crash, is dropped); b"" when
    there is no file."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return b""
    end = data.rfind(b"\n")
    return data[: end + 1] if end >= 0 else b""


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
            notes.append(
                f"{path}: skipped an incomplete last line {len(lines) + 1} (a crash or a write in "
                "progress; a resumed run rewrites it)"
            )
    return rows


def _jsonl_row(path: Path, lineno: int, line: str) -> dict:
    try:
        row = json.loads(line, parse_constant=float)
    except json.JSONDecodeError as e:
        raise StoreError(
            path, f"not valid JSON ({e.msg}, column {e.colno})", REMEDIES["jsonl"], where=f"line {lineno}"
        ) from None
    if not isinstance(row, dict):
        raise StoreError(
            path, f"expected a JSON object, got {type(row).__name__}", REMEDIES["jsonl"], where=f"line {lineno}"
        )
    bad = row_problem(row)  # about 5 us for a row of 70 keys (json.loads: 30 us)
    if bad is not None:
        raise StoreError(path, bad, REMEDIES["jsonl"], where=f"line {lineno}")
    return row


# The values of a row that count something (tokens of a cell, steps): a finite number, never the
# ±1e308 that stands for an overflow. Cells' counts are `<cell>/<stat>` (objectives.diagnostics).
COUNTS = frozenset(("step", "opt_step", "epoch", "mini_batch", "skipped_nonfinite"))
COUNT_STATS = frozenset(("tokens", "out_of_band", "zero_grad", "rescued", "in_band_near"))
OVERFLOW = 1e308  # what `dumps` writes for an infinite value (a NaN: null)


def row_problem(row: Mapping) -> str | None:
    """Why a metrics or histogram row holds a value clipbench never writes, in one clause naming the
    key, or None. Its values are numbers, null, booleans and lists of them; a non-finite number is
    written as null (NaN) or ±1e308 (infinite), so NaN, Infinity or 1e400 (read as infinite) and text
    are damage, and so is ±1e308 for a count."""
    for k, v in row.items():
        t = v.__class__
        if t is float:
            if v - v:  # NaN or infinite
                return f"key {k!r} holds {v!r}, which clipbench never writes (it writes null or ±1e308)"
            if abs(v) >= OVERFLOW and (k in COUNTS or k.rpartition("/")[2] in COUNT_STATS):
                return f"key {k!r} holds {v!r}, not a count"
        elif t is list:
            x = next((x for x in v if not _finite(x)), row)
            if x is not row:
                return f"key {k!r} holds a list with {x!r}, not a list of numbers"
        elif not (t is int or t is bool or v is None or t is dict):
            return f"key {k!r} holds {v!r} ({t.__name__}), not a number"
    return None


def _finite(x) -> bool:
    return x is None or (x.__class__ in (int, bool)) or (x.__class__ is float and not x - x)
