"""Replay of a run's or a sweep's records: one row per (recorded optimizer step, rule), plus matrices.

    result = replay(["results/quickstart/3f2a..."], parse_rules("all"), opt_steps=None, draws=4, top=5)
    result.rows        # dicts: opt_step, rule, trained, loss, grad_cosine, q1/out_of_band, ..., param/*, lookahead/*
    result.matrices    # per optimizer step: the rules' token-level (and parameter-level) cosine matrices
    result.tokens      # the tokens where each rule departs most from the trained rule (text when a tokenizer loads)

Rows are numbered as metrics.jsonl numbers optimizer steps (`opt_step`); the trained rule's row also
carries the logged `logged/loss` and `logged/grad_norm` so the reproduction is visible.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clipbench.config.schema import Slot
from clipbench.config.stored import recorded_slot, setting
from clipbench.errors import StoreError, UserError
from clipbench.models import resolve_model_name
from clipbench.objectives import METHODS
from clipbench.replay import params as P
from clipbench.replay.rules import RuleSpec
from clipbench.replay.tokens import Cells, NotReplayable, OptStepView, compare, cosine_matrix, flat_g, replay_rule
from clipbench.tracking.files import read_jsonl
from clipbench.tracking.provenance import recorded_threads
from clipbench.tracking.records import (
    INDEX,
    REMEDY,
    damaged_records,
    list_records,
    load_record,
    record_step,
    record_steps,
)
from clipbench.tracking.store import RunDir, RunState


@dataclass
class ReplayResult:
    rows: list[dict] = field(default_factory=list)
    matrices: list[dict] = field(default_factory=list)
    tokens: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)  # recorded steps whose records are gone (missing_records)


def finished_runs(run_dirs: Iterable[Path]) -> tuple[list[Path], str | None]:
    """A sweep's runs that a replay reads: (the finished runs with records, a line naming the others
    with records, None when there are none). A run still training, preempted or failed has records of
    only part of its steps, and the runs still training write more while the replay reads, so a
    sweep's replay is of its finished runs; a run named on its own is replayed as it stands."""
    kept, left = [], {}
    for d in map(Path, run_dirs):
        if not list_records(d):
            continue
        state = RunDir(d).state
        if state is RunState.FINISHED:
            kept.append(d)
        else:
            left.setdefault(state.value, []).append(d.name)
    if not left:
        return kept, None
    states = "; ".join(f"{k} {len(v)}: {', '.join(v)}" for k, v in sorted(left.items()))
    return kept, f"{sum(map(len, left.values()))} run(s) with records that have not finished ({states})"


def trained_rule(record) -> RuleSpec:
    obj = record.index["objective"]
    if obj["method"] not in METHODS:
        raise UserError(
            f"{record.path}: the run trained rule '{obj['method']}', which is not registered here: "
            f"pass its file with --plugin"
        )
    return RuleSpec.of(obj["method"], obj["params"])


def check_rule(run_dir: Path, path: Path) -> None:
    """Refuse a record whose rule (method or a parameter) is not the one its run's config.yaml trained
    (reads the record's index only; a damaged one is load_record's to report)."""
    cfg = RunDir(run_dir).read_config() if (run_dir / "config.yaml").is_file() else None
    try:
        rec = json.loads((path / INDEX).read_text())["objective"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if cfg is None:
        return
    ran = recorded_slot(cfg, "objective") or Slot("?")
    bad = [k for k, v in ran.params.items() if k in rec["params"] and rec["params"][k] != v]
    if ran.name != rec["method"] or bad:
        raise UserError(
            f"{path}: record of rule {rec['method']} {rec['params']}, but the run trained "
            f"{ran.name} {ran.params} (config.yaml): not this run's record; {REMEDY}"
        )


def routes_note(run_dir: Path, records: list[Path]) -> str | None:
    """One line when records of a run with routing replay r2/r3 (config.yaml) predate records holding
    their routes (their index names no routing_replay): their parameter level routes freely."""
    cfg = RunDir(run_dir).read_config() if (run_dir / "config.yaml").is_file() else None
    mode = setting(cfg, "model.routing_replay") if cfg is not None else "none"
    if mode not in ("r2", "r3"):
        return None
    old = []
    for path in records:
        try:
            if "routing_replay" not in json.loads((path / INDEX).read_text()):
                old.append(path.name)
        except (OSError, ValueError, TypeError):
            continue  # a damaged index is load_record's to report
    if not old:
        return None
    return (
        f"{run_dir}: {len(old)} record(s) ({', '.join(old[:3])}{', ...' if len(old) > 3 else ''}) of "
        f"model.routing_replay={mode} hold no routes (recorded before records held them): their parameter "
        "level routes freely, not as training did (state/logp_max_abs_diff shows how far)"
    )


def check_opt_steps(records: list[Path], logged: dict[int, dict]) -> None:
    """Refuse records whose optimizer steps cannot be the run's: one recorded twice, or one the run
    never logged (shifted or out of range); one line naming the record."""
    seen: dict[int, Path] = {}
    for path in records:
        try:
            steps = [int(o["opt_step"]) for o in json.loads((path / INDEX).read_text())["opt_steps"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged index is load_record's to report
        for n in steps:
            if n in seen:
                raise UserError(f"{path}: opt_step {n} is recorded twice (also in {seen[n].name}); {REMEDY}")
            if logged and n not in logged:
                raise UserError(
                    f"{path}: opt_step {n} is not an optimizer step the run logged "
                    f"({min(logged)}..{max(logged)} in metrics.jsonl): not this run's record; {REMEDY}"
                )
            seen[n] = path


def missing_records(run_dir: Path, logged: dict[int, dict]) -> dict[int, list[int]]:
    """{rollout step: the optimizer steps metrics.jsonl logged for it} of each record the run wrote
    (status.json lists the steps it recorded) that is no longer in its store (deleted; a damaged
    record, without its index, is noted apart). {} for a run whose status lists none."""
    listed = RunDir(run_dir).status().get("records")
    if not isinstance(listed, list):
        return {}
    here = set(record_steps(run_dir)) | {record_step(d) for d in damaged_records(run_dir)}
    gone = sorted({int(s) for s in listed if isinstance(s, int) and s not in here})
    return {k: sorted(n for n, row in logged.items() if row.get("step") == k) for k in gone}


def partial_line(run_dir: Path, gone: dict[int, list[int]]) -> str:
    """What a replay of `run_dir` lacks, in one line (`missing_records`)."""
    opt = [n for ns in gone.values() for n in ns]
    steps = f"optimizer steps {', '.join(map(str, opt))}" if opt else "their optimizer steps"
    return (
        f"{run_dir.name}: the record(s) of rollout step(s) {', '.join(map(str, gone))} are missing from "
        f"{run_dir / 'record'} (status.json lists them): {steps} are not replayed"
    )


def _same_loss(replayed, logged, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """The trained rule's replayed loss against the logged one (float32 round-off passes; a record
    of another step or batch does not). Unknown values pass."""
    if replayed is None or logged is None or not (math.isfinite(replayed) and math.isfinite(logged)):
        return True
    return abs(replayed - logged) <= abs_ + rel * abs(logged)


def _logged(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    return {r["opt_step"]: r for r in read_jsonl(path) if "opt_step" in r} if path.exists() else {}


def _with_draws(step: OptStepView, rule: RuleSpec, cells: Cells, g_ref, draws: int, top: int):
    """(row fields, RuleResult of draw 0): a rule that draws is replayed `draws` times (mean/std)."""
    n = draws if METHODS[rule.method].needs_draws(rule.kwargs) else 1
    results = [replay_rule(step, rule, d) for d in range(n)]
    row = {"loss": results[0].loss, **results[0].stats, **compare(cells, flat_g(step, results[0]), g_ref, top)}
    if n > 1:
        others = [compare(cells, flat_g(step, r), g_ref) for r in results]
        for key, vals in (
            ("loss", [r.loss for r in results]),
            ("grad_cosine", [o["grad_cosine"] for o in others]),
            ("departure", [o["departure"] for o in others]),
        ):
            vals = [v for v in vals if math.isfinite(v)]  # a departure is NaN where the trained rule has no gradient
            row[f"{key}/mean"] = statistics.fmean(vals) if vals else float("nan")
            row[f"{key}/std"] = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    row["draws"] = n
    return row, results[0]


def replay_step(
    step: OptStepView,
    rules: list[RuleSpec],
    *,
    draws: int = 1,
    top: int = 5,
    params: bool = True,
    device: str = "cpu",
    rates: Mapping[str, float] | None = None,
) -> tuple[list[dict], dict, list[dict]]:
    """(rows, matrix, disagreement tokens) of one recorded optimizer step; `rates`: {rule label: the
    learning rate its look-ahead step takes} (default: the run's own, the recorded optimizer's)."""
    trained = trained_rule(step.record)
    order = [trained] + [r for r in rules if r != trained]
    cells = Cells.of(step)
    g_ref = flat_g(step, replay_rule(step, trained, 0))
    base = {
        "record": step.record.index.get("step"),
        "opt_step": step.opt["opt_step"],
        "epoch": step.opt["epoch"],
        "mini_batch": step.opt.get("mini_batch"),
    }
    rows, results, gs = [], {}, {}
    for rule in order:
        try:
            fields, res = _with_draws(step, rule, cells, g_ref, draws, top)
        except NotReplayable as e:
            rows.append(
                {**base, "rule": rule.label, "method": rule.method, "trained": rule == trained, "skipped": str(e)}
            )
            continue
        rows.append(
            {
                **base,
                "rule": rule.label,
                "method": rule.method,
                "params": rule.kwargs,
                "trained": rule == trained,
                **fields,
            }
        )
        results[rule.label], gs[rule.label] = res, flat_g(step, res)
    labels = list(results)
    matrix = {
        **base,
        "rules": labels,
        "token": cosine_matrix([gs[k] for k in labels]),
        "norms": [float(gs[k].norm()) for k in labels],
    }
    if params:
        _param_level(step, rows, results, matrix, trained.label, device, rates or {})
    tokens = [{**base, "rule": row["rule"], **t} for row in rows for t in row.pop("disagree", [])]
    return rows, matrix, tokens


def _param_level(step, rows, results, matrix, trained: str, device, rates: Mapping[str, float]) -> None:
    # PLC0415, deferred: torch is heavy
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415 - a BaseException, not an Exception

    try:
        state = P.load_state(step.record, step.opt, device)
    except StoreError:  # already one line naming the file (a record of r2/r3 without its routes)
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged saved state (truncated): one line
        where = step.record.state(step.opt["opt_step"])
        if isinstance(e, CheckpointException) and e.failures:  # {rank: (exception, traceback)}: the cause
            e = next(iter(e.failures.values()))[0]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise StoreError(
            where, f"the saved policy state does not load ({type(e).__name__}: {first[:200]})", REMEDY
        ) from None
    if state is None:
        return
    with P.threads(recorded_threads(step.record.run_dir)):  # the run's: its forward, bit for bit
        _param_rows(state, step, rows, results, matrix, trained, rates)


def _param_rows(state, step, rows, results, matrix, trained: str, rates: Mapping[str, float]) -> None:
    grads, diff = P.param_gradients(state, step, results)
    groups = P.layer_groups(state.model)
    before = P.measure(state, step)
    ref, ref_norm = grads[trained], P.global_norm(grads[trained])
    for row in rows:
        g = grads.get(row["rule"])
        if g is None:
            continue
        norm = P.global_norm(g)
        row.update(
            {
                "param/grad_norm": norm,
                "param/grad_cosine": P.cosine(g, ref),
                "param/grad_norm_ratio": norm / ref_norm if ref_norm > 0 else float("nan"),
                "state/logp_max_abs_diff": diff,
                **{
                    f"param/cosine/{name}": P.cosine([g[i] for i in idx], [ref[i] for i in idx]) for name, idx in groups
                },
                **P.lookahead(state, step, g, before, lr=rates.get(row["rule"])),
            }
        )
    labels = matrix["rules"]
    matrix["param"] = [[P.cosine(grads[a], grads[b]) for b in labels] for a in labels]


def _selected(opt: dict, opt_steps: set[int] | None) -> bool:
    return opt_steps is None or opt["opt_step"] in opt_steps


def replay_runs(
    run_dirs: Iterable[Path],
    rules: list[RuleSpec],
    *,
    opt_steps: set[int] | None = None,
    draws: int = 1,
    top: int = 5,
    params: bool = True,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
    rates: Mapping[str, float] | None = None,
) -> ReplayResult:
    """Every selected recorded optimizer step of every run, under every rule (and the trained one);
    `rates`: {rule label: its look-ahead's learning rate} (replay_step)."""
    out = ReplayResult()
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        logged = _logged(run_dir)
        records = list_records(run_dir)
        out.notes.extend(f"{d}: damaged record skipped (no {INDEX}); {REMEDY}" for d in damaged_records(run_dir))
        if not records:
            out.notes.append(f"{run_dir}: no records (train.record.every was 0)")
            continue
        if (state := RunDir(run_dir).state) is not RunState.FINISHED:
            out.notes.append(f"{run_dir}: {state.value}: its records cover the steps it has run so far")
        for path in records:  # every record checked before any is replayed
            check_rule(run_dir, path)
        note = routes_note(run_dir, records)
        if note:
            out.notes.append(note)
        check_opt_steps(records, logged)
        gone = {
            k: ns
            for k, ns in missing_records(run_dir, logged).items()
            if opt_steps is None or not ns or opt_steps & set(ns)
        }
        if gone:
            out.partial.append(partial_line(run_dir, gone))
        for path in records:
            rec = load_record(path)
            for opt in rec.index["opt_steps"]:
                if not _selected(opt, opt_steps):
                    continue
                if progress:
                    progress(f"{run_dir.name} opt_step {opt['opt_step']}")
                rows, matrix, tokens = replay_step(
                    OptStepView(rec, opt), rules, draws=draws, top=top, params=params, device=device, rates=rates
                )
                tag = {"run_id": run_dir.name, "trained_rule": trained_rule(rec).label, "seed": rec.index.get("seed")}
                for row in rows:
                    row.update(tag)
                    if row.get("trained") and opt["opt_step"] in logged:
                        m = logged[opt["opt_step"]]
                        row.update({"logged/loss": m.get("loss"), "logged/grad_norm": m.get("grad_norm")})
                        if not _same_loss(row.get("loss"), m.get("loss")):
                            out.notes.append(
                                f"{path}: opt_step {opt['opt_step']}: the trained rule's replayed loss "
                                f"{row.get('loss'):.6g} is not the logged {m.get('loss'):.6g} (metrics.jsonl): "
                                "the record does not match its run's step; its rows are kept, marked"
                            )
                            row["logged/mismatch"] = True
                out.rows += rows
                out.matrices.append({**tag, **matrix})
                out.tokens += [{**tag, **t, **_text(rec, t)} for t in tokens]
    return out


_TOKENIZERS: dict = {}


def _tokenizer(rec):
    """The run's tokenizer (a saved state's, else the run's checkpoint's, else the model's), or None."""
    key = str(rec.path.parent.parent)
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is heavy

        tok = None
        candidates = [*(rec.path.glob("state_*/model")), rec.path.parent.parent / "checkpoints" / "last" / "model"]
        for c in candidates:
            try:
                tok = AutoTokenizer.from_pretrained(c)
                break
            except Exception:  # noqa: BLE001 - any unreadable candidate: try the next
                continue
        if tok is None:
            try:
                tok = AutoTokenizer.from_pretrained(resolve_model_name(rec.index.get("model", "")))
            except Exception:  # noqa: BLE001 - no tokenizer: tokens are shown by id
                tok = None
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


def _text(rec, t: dict) -> dict:
    out = {
        "advantage": float(rec.tensors["advantages"][t["row"]]),
        "ratio": float(
            torch.exp(rec.tensors["logp"][t["epoch"], t["row"], t["pos"]] - rec.tensors["old_logp"][t["row"], t["pos"]])
        ),
    }
    if rec.get("completion_ids") is None:  # a verl record: no token ids
        return {**out, "token_id": None}
    ids = rec.tensors["completion_ids"][t["row"]].tolist()
    out["token_id"] = ids[t["pos"]]
    tok = _tokenizer(rec)
    if tok is not None:
        out["token"] = tok.decode([ids[t["pos"]]])
        out["context"] = tok.decode(ids[max(0, t["pos"] - 12) : t["pos"]])
    return out
