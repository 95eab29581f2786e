"""Read a sweep from the results store (offline: plain files only) and group its runs.

A sweep's runs live in ``<results>/<sweep>/<run_id>/`` (docs/architecture.md). Runs are grouped
into *blocks* by base model (the paper's Table 3 has one block per model) and, within a block, by
*method label*: the objective method plus the settings that vary within the sweep (e.g.
``nsr(p=0.5)``). The runs of one label differ only by seed: every other key in which a sweep's runs
differ (an evaluation setting, the checkpoint interval) makes an arm of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from clipbench.config import flatten
from clipbench.config.claims import ClaimFamily, parse_family
from clipbench.config.identity import outside_id
from clipbench.config.labels import METHOD_KEY, OBJ, group_label
from clipbench.config.schema import Slot, slot_of
from clipbench.config.slots import stored_form
from clipbench.config.stored import recorded, recorded_slot, setting
from clipbench.errors import StoreError, UserError, did_you_mean
from clipbench.objectives import METHODS, effective_bounds
from clipbench.objectives.plugins import load_plugin, merge_specs, plugin_specs
from clipbench.report.problems import check_problem_ids
from clipbench.tracking.files import OVERFLOW, REMEDIES, check_store_dir, complete_lines, read_json, read_jsonl
from clipbench.tracking.provenance import read_provenance, weights_checksum
from clipbench.tracking.store import RunDir, RunState, check_run_path, list_sweeps
from clipbench.tracking.store_format import read_format
from clipbench.train.checkpoint import lost_rows, lost_text

# Keys out of a label: the seed, the model (it makes the block), what is observed rather than trained
# (evaluation, checkpoints, histograms) and every key outside the run's identity
# (config.identity.NOT_IN_ID: its name, tracking, the paths of its plugins, how it is launched, records),
# except where they set runs of one label apart (`_split_pooled`): runs never pool as seeds.
_NOT_IN_LABEL_PREFIXES = (
    "seed",
    "model.name",
    "eval.",
    "train.checkpoint_every",
    "train.log_histograms",
)
# Keys that cannot change what a run computes: arms that differ in these alone are still kept apart
# (never pooled as seeds), and the report says that their runs cannot differ.
_SAME_COMPUTATION = ("train.checkpoint_every", "train.log_histograms")


@dataclass
class RunRecord:
    run_id: str
    path: Path
    config: dict
    state: str
    status: dict = field(default_factory=dict)  # status.json (state, step, error, ...)
    metrics: list[dict] = field(default_factory=list)
    evals: dict[int, dict[str, dict]] = field(default_factory=dict)
    hist: list[dict] = field(default_factory=list)
    label: str = ""
    provenance: list[dict] = field(default_factory=list)  # provenance.json: one record per start or resume
    lost: list[str] = field(default_factory=list)  # what the store lost that nothing restores (load_run)

    @property
    def checksums(self) -> list[str | None]:
        """The base model's weights sha256 of each start ([None] for a run without a record of it)."""
        return sorted({weights_checksum(p) for p in self.provenance} or {None}, key=lambda c: c or "")

    @property
    def objective(self) -> Slot | None:
        """The rule the run trained, None for a partial config that records none."""
        return recorded_slot(self.config, "objective")

    @property
    def method(self) -> str:
        return self.objective.name if self.objective else "?"  # a partial config: unknown

    @property
    def seed(self) -> int:
        return int(recorded(self.config, "seed") or 0)

    @property
    def model(self) -> str:
        return str(recorded(self.config, "model.name") or "?")

    @property
    def final_step(self) -> int | None:
        return max(self.evals) if self.evals else None

    def ref_bands(self) -> dict[str, tuple[float, float]] | None:
        """The run's reference band per advantage sign in ratio units, ``{"pos": (lo, hi), "neg":
        (lo, hi)}``: the band its ``out_of_band`` counts use, from its own rule and parameters
        (``clipbench.objectives.effective_bounds``). None when this install does not know the rule."""

        rule = self.objective
        try:
            bounds = effective_bounds(rule.name if rule else None, rule.params if rule else {})
        except ValueError:
            return None
        return {"pos": _parse_interval(bounds["ref_band_pos"]), "neg": _parse_interval(bounds["ref_band_neg"])}


def _parse_interval(text: str) -> tuple[float, float]:
    """'[0.8, 1.2]' -> (0.8, 1.2) (``effective_bounds`` writes intervals as text, for MLflow params)."""
    lo, hi = text.strip("[]() ").split(",")
    return float(lo), float(hi)


@dataclass
class Sweep:
    name: str
    path: Path
    runs: list[RunRecord]
    notes: list[str] = field(default_factory=list)  # what the readers skipped (a torn last line)
    planned: list[str] | None = None  # the run ids its manifest.json plans (None: no manifest)
    claims: ClaimFamily | None = None  # the preregistered family its manifest froze (config/claims.py)

    def incomplete(self) -> dict | None:
        """What keeps the sweep from being complete: {"planned", "finished", "not_run": [run ids
        planned without a run directory], STATE: [run ids of runs in that unfinished state]}; None
        when every planned run (every run, without a manifest) is finished."""
        have = {r.run_id: r.state for r in self.runs}
        planned = self.planned if self.planned is not None else list(have)
        out: dict = {"planned": len(planned), "finished": sum(1 for s in have.values() if s == RunState.FINISHED)}
        out["not_run"] = [rid for rid in planned if rid not in have]
        for r in self.runs:
            if r.state != RunState.FINISHED:
                out.setdefault(r.state, []).append(r.run_id)
        return out if len(out) > 3 or out["not_run"] else None

    def incomplete_line(self, role: str = "") -> str | None:
        """The report's first line when the sweep is not complete (its numbers may still change);
        `role`: what the sweep is to the report, e.g. "the replication"."""
        inc = self.incomplete()
        if inc is None:
            return None
        parts = [
            f"{len(ids)} {'not yet run' if k == 'not_run' else k}: {_ids(ids)}"
            for k, ids in inc.items()
            if k not in ("planned", "finished") and ids
        ]
        return (
            f"INCOMPLETE: sweep '{self.name}'{f' ({role})' if role else ''} has {inc['finished']} of its {inc['planned']} planned runs finished "
            f"({'; '.join(parts)}); what follows is of the finished runs only and may change "
            f"(`clipbench sweep` finishes it)."
        )

    def lost_line(self) -> str | None:
        """The report's first line when finished runs lost training rows that nothing restores."""
        lost = [r for r in self.runs if r.lost]
        if not lost:
            return None
        shown = "; ".join(f"{r.label} seed {r.seed} ({r.run_id}): {', '.join(r.lost)}" for r in lost[:6])
        more = f"; and {len(lost) - 6} more (see the Runs table)" if len(lost) > 6 else ""
        return (
            f"LOST: {len(lost)} finished run(s) of sweep '{self.name}' lack training rows that nothing can "
            f"restore ({shown}{more}); the training tables and the claims on them are of the other runs."
        )

    def blocks(self) -> dict[str, list[RunRecord]]:
        """{model name: runs}, in order of first appearance."""
        out: dict[str, list[RunRecord]] = {}
        for r in self.runs:
            out.setdefault(r.model, []).append(r)
        return out

    def labels(self) -> list[str]:
        return list(dict.fromkeys(r.label for r in self.runs))


def load_results(results_dir: str | Path, name: str) -> Sweep:
    """All runs of a sweep, labelled; UserError listing the sweeps that exist when unknown or empty."""
    root = check_store_dir(results_dir)
    sweeps = list_sweeps(root)
    if name not in sweeps:
        valid = ", ".join(sweeps) if sweeps else "(none)"
        raise UserError(f"no runs for sweep '{name}' in {root}{did_you_mean(name, sweeps)}; sweeps with runs: {valid}")
    planned, claims = planned_runs(root / name), frozen_claims(root / name)
    for rid in planned or ():
        check_run_path(root / name / rid)  # a dangling symbolic link is not "not yet run"
    notes: list[str] = []
    runs = [load_run(d, notes) for d in sorted((root / name).iterdir()) if (d / "config.yaml").is_file()]
    notes += load_recorded_plugins(runs)
    check_problem_ids(runs)  # an evaluation that lost problems would cut every run down to them
    notes += assign_labels(runs)
    return Sweep(name=name, path=root / name, runs=runs, notes=notes, planned=planned, claims=claims)


def load_recorded_plugins(runs: list[RunRecord]) -> list[str]:
    """Import the plugins the runs recorded (each config's `plugins`: absolute paths or module names), so
    that the report knows their rules (the log-ratio figure's bands) without `--plugin`. Returns one
    note per plugin that could not be loaded (moved, broken) and per rule still unknown; a rule already
    known (`--plugin` gave it from another file) is not loaded again."""
    notes = []
    for spec in merge_specs(*(plugin_specs(r.config) for r in runs)):
        users = sorted({r.method for r in runs if spec in plugin_specs(r.config)})
        if all(m in METHODS for m in users):
            continue
        try:
            load_plugin(spec)
        except UserError as e:
            notes.append(f"could not load the plugin the runs of {', '.join(users)} recorded: {e}")
    unknown = sorted({r.method for r in runs if r.objective is not None and r.method not in METHODS})
    if unknown:
        many, its = len(unknown) > 1, "their" if len(unknown) > 1 else "its"
        notes.append(
            f"rule{'s' * many} {', '.join(unknown)} unknown to this install: the log-ratio figure leaves out "
            f"{its} clip band{'s' * many}; pass {its} file with --plugin FILE"
        )
    return notes


def _manifest(sweep_dir: Path) -> tuple[Path, dict | None]:
    path = sweep_dir / "manifest.json"
    m = read_json(path, None, kind="manifest")
    return path, None if m is None else read_format(path, m)


def planned_runs(sweep_dir: Path) -> list[str] | None:
    """The run ids the sweep's manifest.json plans (None without one); a damaged manifest or one of a
    newer store format: StoreError (one line)."""
    path, m = _manifest(sweep_dir)
    if m is None:
        return None
    runs = m.get("runs")
    if not isinstance(runs, dict):
        raise StoreError(path, "'runs' is missing or not a JSON object", REMEDIES["manifest"])
    return list(runs)


def frozen_claims(sweep_dir: Path) -> ClaimFamily | None:
    """The preregistered claims the manifest froze (None: the sweep declared none); a damaged family is
    a ConfigError naming the manifest and the key."""
    path, m = _manifest(sweep_dir)
    if m is None or m.get("claims") is None:
        return None
    return parse_family(m["claims"], str(path))


def _ids(ids: list[str], shown: int = 6) -> str:
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def load_run(path: str | Path, notes: list[str] | None = None) -> RunRecord:
    """One run from the store; a damaged file raises StoreError (one line), a torn last line of a
    jsonl file is skipped with a note in `notes`. A finished run's metrics or histograms that lost
    rows its last checkpoint holds are read from that copy (with a note; `clipbench sweep` writes them
    back); training rows nothing holds are named in `RunRecord.lost` and its rows are left out."""
    rd = RunDir(path)
    status = rd.status()
    config = stored_form(rd.read_config() or {})
    state = status.get("state", "pending")
    run = RunRecord(run_id=rd.run_id, path=rd.path, config=config, state=state, status=status, evals=rd.read_evals())
    copies = lost_rows(rd, run_id=rd.run_id, seed=run.seed) if state == RunState.FINISHED else {}
    for p in copies:
        kept = len(complete_lines(p).splitlines())
        (notes if notes is not None else []).append(
            f"run {rd.run_id}: {lost_text(p, rd, kept, len(copies[p]))}: read from its last checkpoint's copy "
            "(`clipbench sweep`, the same command, writes them back)"
        )
    rows = {p: [json.loads(line) for line in lines if line.strip()] for p, lines in copies.items()}
    run.metrics = _overflow_as_inf(rows.get(rd.metrics_path) or rd.read_metrics(None if copies else notes))
    run.hist = rows.get(rd.hist_path) or read_jsonl(rd.hist_path, notes=None if copies else notes)
    run.provenance = read_provenance(rd.path)
    if state == RunState.FINISHED and (missing := missing_steps(run)):
        run.lost = [
            f"metrics.jsonl lacks the rows of rollout steps {_spans(missing)} (no checkpoint of the run holds "
            "them): its training rows are left out"
        ]
        run.metrics = []
    return run


def _overflow_as_inf(rows: list[dict]) -> list[dict]:
    """Rows with each ±1e308 read as the infinite value it stands for (`tracking.files.dumps` writes an
    infinite value so): a table shows 'inf', not a number of 309 digits."""
    for row in rows:
        if any(v.__class__ is float and abs(v) >= OVERFLOW for v in row.values()):
            row.update(
                {k: math.copysign(math.inf, v) for k, v in row.items() if v.__class__ is float and abs(v) >= OVERFLOW}
            )
    return rows


def missing_steps(run: RunRecord) -> list[int]:
    """The rollout steps of a finished run that no metrics row covers (a run whose config records no
    `train.steps` is not judged)."""
    steps = recorded(run.config, "train.steps")
    if not isinstance(steps, int) or isinstance(steps, bool):
        return []
    have = {r.get("step") for r in run.metrics}
    return [s for s in range(steps) if s not in have]


def _spans(steps: list[int]) -> str:
    """[0, 1, 2, 5] -> '0 to 2, 5'."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a} to {b}" for a, b in spans)


def _in_label(key: str) -> bool:
    return not outside_id(key) and not any(key == p or key.startswith(p) for p in _NOT_IN_LABEL_PREFIXES)


def assign_labels(runs: list[RunRecord]) -> list[str]:
    """Set ``run.label``: method, plus ``(k=v, ...)`` for the settings that vary within its block.

    Within the runs of one base model (a block: settings tied to the model, like batch sizes, vary
    with it and are no label): objective parameters count when they vary among the runs of the same
    method (method defaults differ between methods by design); other settings count when they vary
    across the block. Keys are shown by their last component unless that is ambiguous. Then every
    other key in which runs of one label still differ (an evaluation setting, the checkpoint
    interval, any key but the seed) joins their labels by its full name: runs that differ in anything
    but the seed are never one arm. Returns a note per pair of arms whose runs cannot differ (they
    differ only in keys that do not change what a run computes).
    """
    blocks: dict[str, list[RunRecord]] = {}
    for r in runs:
        blocks.setdefault(r.model, []).append(r)
    return [note for block in blocks.values() for note in _assign_block_labels(block)]


def _flat_configs(runs: list[RunRecord]) -> dict[str, dict]:
    """{run id: its flattened config}, a key some configs lack (written before the key existed) read as
    the schema's default where it has one, so that it sets no run apart."""
    flat = {r.run_id: {k: tuple(v) if isinstance(v, list) else v for k, v in flatten(r.config).items()} for r in runs}
    keys = {k for f in flat.values() for k in f}
    for k in keys:
        if all(k in f for f in flat.values()) or slot_of(k) is not None or k.startswith("trl."):
            continue
        try:
            default = setting({}, k)
        except KeyError:
            continue
        default = tuple(default) if isinstance(default, list) else default
        for f in flat.values():
            f.setdefault(k, default)
    return flat


def arm_setting(run: RunRecord) -> tuple:
    """What a run's arm is beside its rule and seed: its config's other keys that can change what it
    computes, those at the schema's default left out (a config written before a key existed reads
    the same). Two arms are compared in a claim only when these are equal."""
    out = []
    for k, v in sorted(flatten(run.config).items()):
        if k == "seed" or k.startswith(OBJ) or outside_id(k) or k.startswith(_SAME_COMPUTATION):
            continue
        if slot_of(k) is None and not k.startswith("trl."):
            try:
                if setting({}, k) == v:
                    continue
            except KeyError:
                pass
        out.append((k, tuple(v) if isinstance(v, list) else v))
    return tuple(out)


def _assign_block_labels(runs: list[RunRecord]) -> list[str]:
    flat = _flat_configs(runs)
    keys = sorted({k for f in flat.values() for k in f})
    corr, corr_name = "sampler.correction.", "sampler.correction.name"
    varying_global = [
        k
        for k in keys
        if not k.startswith(OBJ)
        and _in_label(k)
        and (not k.startswith(corr) or k == corr_name)
        and len({flat[r.run_id].get(k) for r in runs}) > 1
    ]
    by_correction: dict = {}  # a correction's parameters count when they vary among the runs of that correction
    for r in runs:
        by_correction.setdefault(flat[r.run_id].get(corr_name), []).append(r)
    varying_corr = {
        c: [k for k in keys if k.startswith(corr) and k != corr_name and len({flat[r.run_id].get(k) for r in rs}) > 1]
        for c, rs in by_correction.items()
    }
    by_method: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(r)
    varying_obj = {
        m: [k for k in keys if k.startswith(OBJ) and k != METHOD_KEY and len({flat[r.run_id].get(k) for r in rs}) > 1]
        for m, rs in by_method.items()
    }
    all_keys = varying_global + [k for ks in [*varying_obj.values(), *varying_corr.values()] for k in ks]
    last = [k.rsplit(".", 1)[-1] for k in all_keys]

    def short(k: str) -> str:
        if k == corr_name:
            return "correction"
        tail = k.rsplit(".", 1)[-1]
        return tail if last.count(tail) == 1 or k.startswith((OBJ, corr)) else k

    settings = {}
    for r in runs:
        f = flat[r.run_id]
        own = varying_obj[r.method] + varying_global + varying_corr[f.get(corr_name)]
        settings[r.run_id] = [(short(k), f.get(k)) for k in own]
        r.label = group_label(r.method, settings[r.run_id])
    return _split_pooled(runs, flat, keys, settings)


def _split_pooled(runs: list[RunRecord], flat: dict, keys: list[str], settings: dict) -> list[str]:
    """Runs of one label that still differ in a key other than the seed get that key in their labels
    (by its full name); a note for each label so split whose runs cannot differ (`_SAME_COMPUTATION`
    and the keys outside the run id differ alone)."""
    by_label: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_label.setdefault(r.label, []).append(r)
    notes = []
    for rs in by_label.values():
        split = [k for k in keys if k != "seed" and len({flat[r.run_id].get(k) for r in rs}) > 1]
        if not split:
            continue
        for r in rs:
            r.label = group_label(r.method, settings[r.run_id] + [(k, flat[r.run_id].get(k)) for k in split])
        if all(outside_id(k) or k.startswith(_SAME_COMPUTATION) for k in split):
            arms = sorted({r.label for r in rs})
            notes.append(
                f"{' and '.join(arms)} differ only in {', '.join(split)}, which does not change what a run "
                "computes: their runs cannot differ, and they are kept apart (not pooled as seeds)"
            )
    return notes


def resolve_baseline(labels: list[str], methods_by_label: Mapping[str, str], baseline: str | None) -> str | None:
    """The label the Gain row compares against: an exact label, or a method with exactly one label.

    ``None`` picks 'grpo' when the sweep has exactly one grpo label, else no baseline."""
    if baseline is None:
        grpo = [lb for lb in labels if methods_by_label[lb] == "grpo"]
        return grpo[0] if len(grpo) == 1 else None
    if baseline in labels:
        return baseline
    matches = [lb for lb in labels if methods_by_label[lb] == baseline]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise UserError(f"--baseline '{baseline}' matches several labels; pick one of: {', '.join(matches)}")
    raise UserError(
        f"unknown baseline '{baseline}'{did_you_mean(baseline, labels)}; methods in this sweep: {', '.join(labels)}"
    )
