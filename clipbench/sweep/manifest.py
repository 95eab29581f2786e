"""The frozen manifest: `<results>/<sweep>/manifest.json`, written once, then only appended to.

    {"sweep": name, "source": sweep file, "base": recipe, "created": iso time, "updated": iso time,
     "runs": {run_id: resolved config}, "points": {run_id: {axis key: value}},
     "plugins": [{"path": rule file, "sha256": its content hash}],
     "claims": the preregistered family (config/claims.py), when the sweep file declares one}

The claims are frozen with the first write, as the runs are: a rerun with other claims in the sweep
file keeps the frozen ones and says so (a family written after the runs started is not preregistered).

The plugin files the runs use are recorded with their content hash: a rerun whose plugin changed
stops with one line (the frozen runs would no longer be what was planned).

A rerun never re-plans a run already in the manifest: the current sweep file is expanded only to
find runs it adds (appended, with a warning). A grid point that is already frozen keeps its frozen
config even if the recipe or the overrides changed since (warning), so editing a recipe mid-sweep
cannot change runs that are under way. When the recipe the manifest was frozen from is gone and the
sweep file's `base` no longer finds it, the frozen runs resume alone (`frozen_plan`).
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipbench.config.labels import label
from clipbench.errors import ConfigError, StoreError
from clipbench.objectives.plugins import check_plugin_records, plugin_records
from clipbench.sweep.expand import Expansion
from clipbench.sweep.spec import SweepSpec, base_not_found
from clipbench.tracking.files import REMEDIES, atomic_write_json, read_json
from clipbench.tracking.lock import manifest_lock
from clipbench.tracking.store_format import STORE_FORMAT, read_format

MANIFEST = "manifest.json"


def manifest_path(results_dir: str | Path, sweep: str) -> Path:
    return Path(results_dir) / sweep / MANIFEST


def read_manifest(path: str | Path) -> dict | None:
    """The frozen manifest, or None when there is none; StoreError (one line) when it is damaged."""
    m = read_json(path, kind="manifest")
    if m is None:
        return None
    m = read_format(path, m)  # an older store format migrated; a newer one refused (one line)
    runs, points = m.get("runs"), m.get("points", {})
    if not isinstance(runs, dict) or not all(isinstance(c, dict) for c in runs.values()):
        raise StoreError(path, "not a clipbench manifest ('runs' must map run ids to configs)", REMEDIES["manifest"])
    if not isinstance(points, dict):
        raise StoreError(
            path, "not a clipbench manifest ('points' must map run ids to axis values)", REMEDIES["manifest"]
        )
    return m


@dataclass(frozen=True)
class Merge:
    manifest: dict
    new: list[str]  # run ids appended (all of them for a new manifest)
    kept_frozen: list[str]  # current grid points whose frozen config differs from today's expansion
    not_in_file: list[str]  # frozen runs the current sweep file no longer produces
    changed: bool  # the manifest must be (re)written
    warnings: list[str]

    def new_runs(self) -> list[tuple[str, dict]]:
        """(run id, config) of the runs this merge adds to the manifest."""
        return [(rid, self.manifest["runs"][rid]) for rid in self.new]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _pkey(point: dict) -> str:
    return json.dumps(point, sort_keys=True, default=str)


def merge(existing: dict | None, spec: SweepSpec, exp: Expansion) -> Merge:
    """Pure: the manifest after this invocation (nothing is written). A UserError when a plugin the
    frozen runs use changed."""

    if existing is None:
        m = {
            "store_format": STORE_FORMAT,
            "sweep": spec.name,
            "source": str(spec.file.resolve()),
            "base": str(spec.base),
            "created": _now(),
            "runs": dict(exp.runs),
            "points": dict(exp.points),
        }
        records = plugin_records(exp.runs.values())
        if records:
            m["plugins"] = records
        if spec.claims is not None:
            m["claims"] = spec.claims.to_dict()
        return Merge(m, list(exp.runs), [], [], True, [])
    check_plugin_records(existing.get("plugins", []), f"sweep '{spec.name}'")
    runs = dict(existing["runs"])
    points = dict(existing.get("points", {}))
    frozen_by_point = {_pkey(p): rid for rid, p in points.items()}
    new, kept = [], []
    for rid, cfg in exp.runs.items():
        if rid in runs:
            continue
        if _pkey(exp.points[rid]) in frozen_by_point:
            kept.append(rid)
            continue
        runs[rid] = cfg
        points[rid] = exp.points[rid]
        new.append(rid)
    current = set(exp.runs) | {frozen_by_point[_pkey(exp.points[r])] for r in kept}
    gone = [rid for rid in existing["runs"] if rid not in current]
    warnings = []
    src = str(spec.file.resolve())
    if existing.get("source") and existing["source"] != src:
        warnings.append(f"the manifest of sweep '{spec.name}' was frozen from {existing['source']}, not {src}")
    if kept:
        warnings.append(
            f"{len(kept)} run(s) of the current sweep file differ from their frozen configs "
            "(the recipe or overrides changed); the frozen configs are kept. Use a new sweep "
            "name to plan them afresh"
        )
    if new:
        shown = ", ".join(f"{r} ({label(points[r])})" for r in new[:5]) + (" ..." if len(new) > 5 else "")
        warnings.append(f"{len(new)} new run(s) appended to the frozen manifest: {shown}")
    declared = spec.claims.to_dict() if spec.claims is not None else None
    if declared != existing.get("claims"):
        warnings.append(
            f"the claims of the sweep file differ from those frozen in the manifest of sweep '{spec.name}' "
            "when its runs were first planned; the frozen claims are kept (a family written later is not "
            "preregistered: use a new sweep name to declare another)"
        )
    if gone:
        warnings.append(
            f"{len(gone)} frozen run(s) are no longer produced by the sweep file; they stay in the manifest"
        )
    m = dict(existing, runs=runs, points=points)
    known = {r["path"] for r in existing.get("plugins", [])}
    added = [r for r in plugin_records(runs[rid] for rid in new) if r["path"] not in known]
    if added:
        m["plugins"] = list(existing.get("plugins", [])) + added
    if new:
        m["updated"] = _now()
    return Merge(m, new, kept, gone, bool(new), warnings)


def frozen_plan(spec: SweepSpec, existing: dict | None) -> Expansion | None:
    """The frozen runs alone, when the recipe the manifest was frozen from is gone and the sweep file's
    `base` no longer names it (no such file: nothing, or the shipped recipe of the same name, which is
    another recipe): the runs resume from their frozen configs, and no new run is planned from a
    recipe that is not theirs. None otherwise (the sweep file is expanded as usual); a first
    invocation whose recipe is missing is the usual one line."""
    frozen = (existing or {}).get("base")
    gone = frozen is not None and frozen != str(spec.base) and not Path(frozen).is_file()
    if existing is None or not (spec.base_found == "missing" or (gone and spec.base_found == "by_name")):
        if spec.base_found == "missing":
            raise ConfigError(spec.source, "base", base_not_found(spec.base, spec.base_written))
        return None
    instead = (
        f", and its base '{spec.base_written}' now names the shipped recipe {spec.base}, another recipe"
        if (spec.base_found == "by_name")
        else ""
    )
    runs, points = dict(existing["runs"]), dict(existing.get("points", {}))
    line = (
        f"the recipe {frozen or spec.base} that sweep '{spec.name}' was frozen from is gone{instead}: its "
        f"{len(runs)} frozen runs resume from the manifest (each holds its whole config) and no new run is "
        "planned; restore the recipe to plan new ones"
    )
    return Expansion(runs, points, len(runs), 0, (line,))


def freeze(results_dir: str | Path, spec: SweepSpec, exp: Expansion) -> Merge:
    """Write (or append to) the manifest under the sweep's manifest lock; atomic."""
    path = manifest_path(results_dir, spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with manifest_lock(path.parent):
        result = merge(read_manifest(path), spec, exp)
        if result.changed:
            atomic_write_json(path, result.manifest)
    return result


def manifest_runs(manifest: dict[str, Any]) -> list[tuple[str, dict, dict]]:
    """[(run_id, config, point)] in manifest order."""
    points = manifest.get("points", {})
    return [(rid, cfg, points.get(rid, {})) for rid, cfg in manifest["runs"].items()]
