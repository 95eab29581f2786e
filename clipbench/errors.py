"""User-facing errors (see docs/architecture.md).

`UserError`: bad input; one line, exit code 2, nothing written. `RunFailed`: a run that started and
then stopped for a reason the user must read (one line, exit code 1; status.json says failed).
`RunPreempted`: a run that a signal stopped at a safe point with a checkpoint (status.json says
preempted; the CLI prints the resume command, exit code 75, EX_TEMPFAIL: try again).
"""

from __future__ import annotations

import difflib
import errno
import os
from collections.abc import Iterable, Iterator


class UserError(Exception):
    """Bad input from the user. The CLI prints ``str(err)`` on one line and exits with code 2."""


class ConfigError(UserError):
    """A config problem, rendered as ``FILE: KEY: REASON`` (file omitted when unknown)."""

    def __init__(self, file: str | None, key: str | None, reason: str):
        self.file, self.key, self.reason = file, key, reason
        parts = [str(p) for p in (file, key) if p]
        super().__init__(": ".join(parts + [reason]))


class RuleDefinitionError(UserError):
    """A rule whose definition is wrong (bad signature, clashing name); names its file and line."""


class RuleError(UserError):
    """A rule that misbehaves at call time (e.g. returns the wrong shape); names the rule and file."""


class RunFailed(Exception):
    """A run that started and then failed for a stated reason (diverged, a rank died). The CLI prints
    ``str(err)`` on one line and exits with code 1; the run's status.json says failed."""


class RunPreempted(Exception):
    """A run a signal (SIGTERM, the run's launch.preempt_signal, Ctrl-C's SIGINT, SIGHUP) stopped at a
    safe point after writing a checkpoint; status.json says preempted and resuming continues it.
    Exit code 75 (130 for SIGINT, 129 for SIGHUP: `stop_exit_code`)."""

    def __init__(self, message: str, signal: str = ""):
        super().__init__(message)
        self.signal = signal


def stop_exit_code(signal: str | None) -> int:
    """The exit code of a command a signal stopped at a checkpoint: 128 + n for Ctrl-C (SIGINT) and a
    closed terminal (SIGHUP), as a shell reports them; 75 (EX_TEMPFAIL) for a preemption."""
    return {"SIGINT": 130, "SIGHUP": 129}.get(signal or "", PREEMPTED_EXIT)


class DiskFull(RunFailed):
    """No space left on the device holding the results: the run is marked failed (where its status can
    still be written), its temporary files are removed, nothing finished is touched, and a sweep starts
    no further run. One line, exit code 1; rerunning the same command after freeing space resumes."""

    def __init__(
        self,
        path,
        *,
        status_written: bool = True,
        remedy: str = "free space and rerun the same command to resume",
        reason: str = "no space left on device",
    ):
        self.path, self.status_written, self.reason = str(path), status_written, reason
        note = "" if status_written else " (its status.json could not be updated: it still says running)"
        if reason != "no space left on device":
            remedy = remedy.replace("free space", "raise the limit")
        super().__init__(
            f"{reason} writing {self.path}{note}; temporary files removed, finished work untouched: {remedy}"
        )


FILE_TOO_LARGE = "file too large for this process's file-size limit (`ulimit -f`)"


def disk_reason(err: OSError) -> str:
    """What stopped a write, in words: a full disk, or a file-size limit (EFBIG)."""
    return FILE_TOO_LARGE if err.errno == errno.EFBIG else "no space left on device"


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and every exception behind it, each once: causes, contexts, and the per-rank failures of a
    torch.distributed.checkpoint ``CheckpointException`` ({rank: exception or (exception, tb)})."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                todo.extend(x for x in (f if isinstance(f, tuple) else (f,)) if isinstance(x, BaseException))
        todo.extend(x for x in (e.__cause__, e.__context__) if isinstance(x, BaseException))


def out_of_memory(exc: BaseException | None) -> BaseException | None:
    """The memory error behind `exc` (Python's MemoryError, torch's CPU allocator failing), or None."""
    for e in _chain(exc):
        if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
            return e
    return None


def no_space_left(exc: BaseException | None) -> OSError | None:
    """The "no space left" error (ENOSPC or EDQUOT, a file-size limit's EFBIG, or SQLite's "database or
    disk is full") behind `exc`:
    searched through its causes and contexts, and through the per-rank failures of a
    torch.distributed.checkpoint ``CheckpointException``. None when the disk is not the reason."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return e
        if "database or disk is full" in str(e) and type(e).__name__ == "OperationalError":
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, the same command again resumes


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' when a close match exists, else ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_choice(kind: str, word: str, choices: Iterable[str]) -> str:
    """Message for an unknown name: "unknown method 'grpp' (did you mean 'grpo'?); valid: a, b"."""
    choices = sorted(str(c) for c in choices)
    return f"unknown {kind} '{word}'{did_you_mean(word, choices)}; valid: {', '.join(choices)}"


class StoreError(UserError):
    """A damaged or unreadable file of the results store, rendered on one line as
    ``FILE: [WHERE: ]PROBLEM; REMEDY`` (what is wrong, where, and what the user can do)."""

    def __init__(self, file, problem: str, remedy: str, where: str | None = None):
        self.file, self.problem, self.remedy, self.where = str(file), problem, remedy, where
        parts = [self.file] + ([where] if where else []) + [problem]
        super().__init__(": ".join(parts) + (f"; {remedy}" if remedy else ""))
