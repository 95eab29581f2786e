"""How soon `clipbench sweep` says something, and how long the rerun of a finished sweep takes
(`make bench`): writes results/bench/sweep_start.json and prints a table.

1. First output: seconds from the start of `clipbench sweep quickstart --dry-run` on a pseudo-terminal
   to its first byte (the status line; target <= 1 s), and to its plan.
2. A finished sweep's rerun (the quickstart sweep's 6 runs, their status finished): the rerun that
   finds its inputs unchanged (target <= 2 s), and the full path beside it (the same rerun without the
   remembered inputs: the grid expanded, torch imported).

Each figure is the median of `--repeat` runs, each a fresh process; wall seconds and the process's CPU
seconds (user + system, from the children's rusage) are both reported, since a loaded machine
stretches the first and not the second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CLIPBENCH = [sys.executable, "-m", "clipbench"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def first_output(args: list[str], marker: bytes) -> dict:
    """Seconds to the first byte and to `marker` of `clipbench ARGS` on a pseudo-terminal; its CPU."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["COLUMNS"] = "200"
        os.execv(sys.executable, [*CLIPBENCH, *args])
    first = seen = None
    out = b""
    while select.select([fd], [], [], 300)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        first = first if first is not None else time.perf_counter() - t0
        out += chunk
        if seen is None and marker in out:
            seen = time.perf_counter() - t0
    os.waitpid(pid, 0)
    return {"first_output_s": first, "plan_s": seen, "cpu_s": _children_cpu() - cpu0}


def timed_run(args: list[str]) -> dict:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    res = subprocess.run([*CLIPBENCH, *args], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return {"wall_s": time.perf_counter() - t0, "cpu_s": _children_cpu() - cpu0, "stderr": res.stderr}


def finished_sweep(tmp: Path) -> tuple[list[str], Path]:
    """The quickstart sweep frozen in `tmp`, each run's status finished (as a trained run's): the
    arguments of its rerun, and the file that remembers its inputs."""
    from clipbench.commands.sweep import plan
    from clipbench.sweep.manifest import freeze
    from clipbench.tracking.store import RunDir, RunState

    spec, exp = plan("quickstart")
    freeze(tmp, spec, exp)
    for rid in exp.runs:
        RunDir(tmp / spec.name / rid).set_status(RunState.FINISHED)
    return ["sweep", "quickstart", "--results-dir", str(tmp)], tmp / spec.name / ".cache" / "rerun.json"


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "sweep_start.json"))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        starts = [
            first_output(["sweep", "quickstart", "--dry-run", "--results-dir", str(tmp / "dry")], b"runs from")
            for _ in range(a.repeat)
        ]
        args, remembered = finished_sweep(tmp / "done")
        timed_run(args)  # the full rerun that remembers the inputs
        fast = [timed_run(args) for _ in range(a.repeat)]
        full = []
        for _ in range(a.repeat):
            remembered.unlink()
            full.append(timed_run(args))
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()},
        "first_output": {
            "first_output_s": median(starts, "first_output_s"),
            "plan_s": median(starts, "plan_s"),
            "cpu_s": median(starts, "cpu_s"),
            "target_s": 1.0,
        },
        "finished_rerun": {
            "wall_s": median(fast, "wall_s"),
            "cpu_s": median(fast, "cpu_s"),
            "target_s": 2.0,
            "full_path_wall_s": median(full, "wall_s"),
            "full_path_cpu_s": median(full, "cpu_s"),
        },
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    f, r = out["first_output"], out["finished_rerun"]
    print(f"load average {out['machine']['load'][0]:.1f} on {out['machine']['cpus']} CPUs")
    print(
        f"first output of `sweep quickstart --dry-run`: {f['first_output_s']:.2f} s (target <= 1 s); plan at "
        f"{f['plan_s']:.2f} s; {f['cpu_s']:.2f} CPU s"
    )
    print(
        f"rerun of a finished sweep: {r['wall_s']:.2f} s, {r['cpu_s']:.2f} CPU s (target <= 2 s); the full "
        f"path: {r['full_path_wall_s']:.2f} s, {r['full_path_cpu_s']:.2f} CPU s"
    )
    ok = f["first_output_s"] <= f["target_s"] and r["wall_s"] <= r["target_s"]
    print("targets met" if ok else "TARGET MISSED")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
