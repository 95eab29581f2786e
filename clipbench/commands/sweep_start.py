"""What `clipbench sweep` says and does before its heavy imports (torch, through the grid's expansion):
a status line on a terminal from its first second, and the rerun of a finished sweep without the
expansion.

    with sweep_stage(file) as stage:          # on a terminal's stderr: one transient line, updated
        stage.say("sweep x: expanding its grid")
    finished_rerun(file, overrides, ...)      # True: every run was finished; said as a full rerun says it

The status line is rich's transient status (`Console.status`), on a terminal only: it is erased
before anything else is printed (the plan, a warning, an error's one line), so piped or captured
output is unchanged.

A finished sweep's rerun: when a sweep ends with every run finished, the inputs of its expansion are
remembered in `<results>/<sweep>/.cache/rerun.json`: the command line (overrides, --plugin, working
directory), the sweep file, its base recipe and the plugin files its manifest records (each by
sha256), and clipbench's own code (the sha256 of its .py and .yaml files). A rerun whose inputs are
the same, byte for byte, whose manifest still plans the same runs and whose runs are all still
finished (their metrics and histograms no shorter than their last checkpoint's copy) prints what the full rerun prints (the warnings, the start line, "N/N runs finished")
without importing torch, expanding the grid or opening MLflow. Anything else takes the full path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from rich.console import Console

from clipbench.errors import UserError
from clipbench.yamlio import YamlError, load_yaml_file

RERUN = Path(".cache") / "rerun.json"  # under the sweep's directory


class Stage:
    """One transient status line on a terminal's stderr saying what the command does now; nothing when
    stderr is not a terminal. `done()` erases it (call it before printing anything else)."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True, highlight=False)
        self._status = None

    def say(self, text: str) -> None:
        if not self.console.is_terminal:
            return
        if self._status is None:
            self._status = self.console.status(text, spinner="dots")
            self._status.start()
        else:
            self._status.update(text)

    def done(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


@contextlib.contextmanager
def sweep_stage(file: str | Path) -> Iterator[Stage]:
    """The sweep's status line from its first second ('loading clipbench'), erased on the way out."""
    stage = Stage()
    stage.say(f"sweep {file}: loading clipbench (torch)")
    try:
        yield stage
    finally:
        stage.done()


def start_line(
    sweep: str, n_runs: int, results_dir: Path, *, finished: int, resume: int, start: int, failed: int
) -> str:
    """'sweep NAME: N runs -> DIR  (F finished, R to resume, S to start[, X failed: skipped ...])'."""
    return (
        f"sweep [bold]{sweep}[/]: {n_runs} runs -> {results_dir / sweep}  "
        f"({finished} finished, {resume} to resume, {start} to start"
        + (f", {failed} failed: skipped (rerun them with --retry-failed)" if failed else "")
        + ")"
    )


# ---- the rerun of a finished sweep ---------------------------------------------------------------


def package_digest() -> str:
    """sha256 of clipbench's own code and shipped files (.py, .yaml): what the expansion runs."""
    from clipbench.config.shipped import PACKAGE  # noqa: PLC0415 - config pulls in omegaconf

    h = hashlib.sha256()
    for p in sorted(PACKAGE.rglob("*")):
        if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts:
            h.update(p.relative_to(PACKAGE).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _sha256(path: str | Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def rerun_inputs(files: Iterable[str | Path], overrides: Iterable[str], plugins: Iterable[str]) -> dict:
    """What the expansion read and was told: each file by sha256, the command line, the working
    directory (relative --plugin paths), clipbench's code, Python's version."""
    return {
        "files": {str(Path(f).resolve()): _sha256(f) for f in dict.fromkeys(files)},
        "overrides": list(overrides),
        "plugins": list(plugins),
        "cwd": str(Path.cwd()),
        "clipbench": package_digest(),
        "python": sys.version,
    }


def remember_finished(results_dir: Path, sweep: str, inputs: dict, run_ids: list[str], warnings: list[str]) -> None:
    """After a sweep whose every run finished: what a rerun needs to see that nothing changed."""
    from clipbench.tracking.files import atomic_write_json  # noqa: PLC0415 - the status line comes first

    with contextlib.suppress(OSError):  # an optimisation only: a read-only or full store keeps the full path
        atomic_write_json(Path(results_dir) / sweep / RERUN, {**inputs, "runs": run_ids, "warnings": warnings})


def _sweep_name(file: str | Path) -> tuple[Path, str] | None:
    """(the sweep file, its name) as `load_spec` reads them, or None when anything is unusual."""
    from clipbench.config.shipped import sweep_path  # noqa: PLC0415 - config pulls in omegaconf

    try:
        path = sweep_path(file)
        data = load_yaml_file(path)
    except (UserError, YamlError, OSError):
        return None
    name = data.get("name", path.stem) if isinstance(data, dict) else None
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    return path, name


def _unchanged(remembered: dict, sweep_file: Path, overrides: list[str], plugins: list[str]) -> bool:
    files = remembered.get("files")
    if not isinstance(files, dict) or str(sweep_file.resolve()) not in files:
        return False
    now = {k: remembered.get(k) for k in ("overrides", "plugins", "cwd", "python")}
    if now != {"overrides": overrides, "plugins": plugins, "cwd": str(Path.cwd()), "python": sys.version}:
        return False
    if any(_sha256(path) != digest for path, digest in files.items()):
        return False
    return remembered.get("clipbench") == package_digest()


def finished_rerun(
    file: str | Path,
    overrides: list[str],
    *,
    results_dir: Path,
    plugins: list[str],
    plain: bool,
    stage: Stage | None = None,
    console: Console | None = None,
) -> bool:
    """The rerun of a finished sweep whose inputs have not changed: print what the full rerun prints
    and return True; False (nothing printed) whenever the full path is needed. `plain`: no option that
    changes what the command does beyond running the sweep (--dry-run, --json, --launcher, --engine)."""
    # PLC0415, deferred: numpy (tracking.store): the status line comes first
    from clipbench.tracking.files import read_json  # noqa: PLC0415
    from clipbench.tracking.store import RunDir, RunState  # noqa: PLC0415

    found = _sweep_name(file) if plain else None
    if found is None:
        return False
    sweep_file, name = found
    sweep_dir = Path(results_dir) / name
    try:
        remembered = json.loads((sweep_dir / RERUN).read_text(encoding="utf-8"))
        manifest = read_json(sweep_dir / "manifest.json", None, kind="manifest")
    except (UserError, OSError, ValueError):
        return False
    if not isinstance(remembered, dict) or not isinstance(manifest, dict) or not isinstance(manifest.get("runs"), dict):
        return False
    runs = list(manifest["runs"])
    if remembered.get("runs") != runs or not _unchanged(remembered, sweep_file, list(overrides), list(plugins)):
        return False
    try:
        if any(RunDir(sweep_dir / rid).state is not RunState.FINISHED for rid in runs):
            return False
        if any(RunDir(sweep_dir / rid).rows_lost() for rid in runs):  # the full path writes them back
            return False
    except (UserError, OSError, ValueError):
        return False
    if stage is not None:
        stage.done()
    err = console or Console(stderr=True, highlight=False, soft_wrap=True)
    for w in remembered.get("warnings") or ():
        err.print(f"[yellow]warning:[/] {w}")
    err.print(start_line(name, len(runs), Path(results_dir), finished=len(runs), resume=0, start=0, failed=0))
    err.print(f"{len(runs)}/{len(runs)} runs finished")
    return True
