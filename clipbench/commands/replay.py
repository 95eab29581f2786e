"""`clipbench replay RUN_OR_SWEEP [--rules all|a,b,c] [--lr RULE=RATE,...] [--plugin F] [--steps ...] [--json] [--format F --out DIR]`.

Replays the recorded optimizer steps of a run (its directory, or SWEEP/RUN_ID) or of every run of a
sweep (a name in --results-dir, or its directory) under every requested rule (clipbench.replay).
`--json` prints one JSON object per line per (recorded optimizer step, rule), nothing else on stdout;
otherwise the summary tables are printed and the report is written (default
<results>/reports/<sweep>/replay/): replay.json, replay.jsonl and the format's files. `--lr
cispo=1e-4,grpo=2e-4`: the look-ahead step of each named rule (a label as `--rules` makes it) at
that learning rate instead of the run's (each rule at its own tuned rate). `--rules sweep`: every rule
the target's runs trained, with its parameters; `--lr sweep`: each rule's look-ahead at the rate its
own runs trained at (a sweep of tuned rates: `clipbench replay organism_confirm --rules sweep --lr sweep`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from clipbench.config.stored import recorded, recorded_slot
from clipbench.errors import UserError, unknown_choice
from clipbench.replay.rules import RuleSpec, parse_rules
from clipbench.replay.run import finished_runs, replay_runs
from clipbench.replay.summary import summarize
from clipbench.report import render
from clipbench.report.replay import replay_tables, write_replay
from clipbench.tracking.files import check_store_dir, check_writable_dir, dumps
from clipbench.tracking.records import INDEX, REMEDY, damaged_records, list_records
from clipbench.tracking.store import RunDir, check_formats, list_run_dirs

FORMATS = ("rich", "markdown", "html", "csv", "latex")


def parse_steps(text: str | None) -> set[int] | None:
    """`--steps 24,30-40`: optimizer steps as metrics.jsonl numbers them (None: every recorded one)."""
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise UserError(
                f"--steps: {part.strip()!r} is not an optimizer step or a range a-b (e.g. --steps 24,30-40)"
            ) from None
        if lo < 1 or hi < lo:
            raise UserError(f"--steps: {part.strip()!r}: optimizer steps count from 1, ranges go up (a-b with a <= b)")
        out.update(range(lo, hi + 1))
    return out


def parse_rates(text: str | None, specs) -> dict[str, float]:
    """`--lr cispo=1e-4,grpo=2e-4`: {rule label: learning rate} for the look-ahead; every name is a rule
    of --rules (its label, or its method when that is one label), every rate a number in (0, 1]."""
    if not text:
        return {}
    labels = [s.label for s in specs]
    by_method: dict[str, list[str]] = {}
    for s in specs:
        by_method.setdefault(s.method, []).append(s.label)
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, eq, value = part.rpartition("=")
        name = name.strip()
        if not eq or not name.strip():
            raise UserError(f"--lr: {part!r} is not RULE=RATE (e.g. --lr cispo=1e-4,grpo=2e-4)")
        if name not in labels and len(by_method.get(name, [])) > 1:
            raise UserError(
                f"--lr: {name!r} names {len(by_method[name])} rules of --rules ({', '.join(by_method[name])}): name one by its label"
            )
        label = name if name in labels else (by_method[name][0] if name in by_method else None)
        if label is None:
            raise UserError("--lr: " + unknown_choice("rule of --rules", name, labels))
        try:
            rate = float(value)
        except ValueError:
            raise UserError(f"--lr: {part!r}: {value!r} is not a number") from None
        if not 0 < rate <= 1:
            raise UserError(f"--lr: {part!r}: a learning rate in (0, 1], got {rate:g}")
        out[label] = rate
    return out


SWEEP = "sweep"  # --rules sweep / --lr sweep: what the target's own runs trained


def trained_settings(runs: list[Path]) -> list[tuple[RuleSpec, float | None]]:
    """(rule with its parameters, learning rate) of every setting the runs trained, in run order; a rule
    trained at several rates is listed once per rate."""
    out: list[tuple[RuleSpec, float | None]] = []
    for run in runs:
        cfg = RunDir(run).read_config() if (run / "config.yaml").is_file() else None
        rule = recorded_slot(cfg, "objective") if cfg is not None else None
        if rule is None:
            continue
        lr = recorded(cfg, "train.lr")
        item = (RuleSpec.of(rule.name, dict(rule.params)), float(lr) if lr is not None else None)
        if item not in out:
            out.append(item)
    return out


def sweep_rates(settings: list[tuple[RuleSpec, float | None]], target: str) -> dict[str, float]:
    """`--lr sweep`: {rule label: the rate its runs trained at}; a rule at several rates is refused."""
    rates: dict[str, set[float]] = {}
    for spec, lr in settings:
        if lr is not None:
            rates.setdefault(spec.label, set()).add(lr)
    several = {k: v for k, v in rates.items() if len(v) > 1}
    if several:
        k, v = next(iter(several.items()))
        raise UserError(
            f"--lr sweep: rule {k} trained at {len(v)} rates in {target} ({', '.join(f'{x:g}' for x in sorted(v))}): "
            "name each rule's rate (--lr RULE=RATE,...)"
        )
    return {k: next(iter(v)) for k, v in rates.items()}


def resolve(target: str, results_dir: Path) -> tuple[str, list[Path], bool]:
    """(a name for the output, the run directories, whether the target is a sweep) of RUN_OR_SWEEP."""
    path = Path(target)
    candidates = [path] if path.is_dir() else []
    if not path.is_absolute():
        candidates.append(results_dir / target)
    for p in candidates:
        if p.is_dir() and ((p / "record").is_dir() or (p / "config.yaml").is_file()):
            return f"{p.parent.name}/{p.name}", [p], False
        runs = [r.path for r in list_run_dirs(p)] if p.is_dir() else []
        if runs:
            return p.name, runs, True
    raise UserError(
        f"{target}: not a run directory, a sweep directory or a sweep in {results_dir} "
        f"(e.g. `clipbench replay quickstart` or `clipbench replay {results_dir}/quickstart/<run_id>`)"
    )


def replay_command(
    target: str,
    *,
    rules: str | None,
    steps: str | None,
    json_out: bool,
    results_dir: Path,
    fmt: str,
    out: Path | None,
    draws: int,
    top: int,
    params: bool,
    device: str,
    lr: str | None = None,
) -> list[Path]:

    if fmt not in FORMATS:
        raise UserError("--format: " + unknown_choice("format", fmt, FORMATS))
    if draws < 1 or top < 0:
        raise UserError(f"--draws must be >= 1 and --top >= 0, got --draws {draws} --top {top}")
    results_dir = check_store_dir(results_dir) if not Path(target).is_dir() else Path(results_dir)
    name, runs, is_sweep = resolve(target, results_dir)
    check_formats(runs)  # a store of a newer format: one line, nothing replayed
    # a sweep: its finished runs; a run named on its own: as it stands
    recorded, left_out = finished_runs(runs) if is_sweep else ([r for r in runs if list_records(r)], None)
    if not recorded and (damaged := [d for r in runs for d in damaged_records(r)]):
        raise UserError(f"{damaged[0]}: damaged record: no {INDEX} ({len(damaged)} such record(s)); {REMEDY}")
    if not recorded and left_out:
        raise UserError(f"{target}: no finished run has records yet ({left_out})")
    if not recorded:
        raise UserError(f"{target}: no records in {len(runs)} run(s); train with train.record.every=N (docs/replay.md)")
    settings = trained_settings(runs) if SWEEP in (rules, lr) else []
    specs = list(dict.fromkeys(s for s, _ in settings)) if rules == SWEEP else parse_rules(rules)
    rates = sweep_rates(settings, target) if lr == SWEEP else parse_rates(lr, specs)
    if lr == SWEEP:
        rates = {k: v for k, v in rates.items() if k in {s.label for s in specs}}
    if rates and not params:
        raise UserError("--lr sets the look-ahead's rate, which is the parameter level: drop --no-params")
    opt_steps = parse_steps(steps)
    out_dir = None
    if not json_out:
        out_dir = check_writable_dir(out or results_dir / "reports" / name.replace("/", "_") / "replay", "--out")
    progress = None if json_out else (lambda msg: print(f"replaying {msg}", file=sys.stderr, flush=True))
    result = replay_runs(
        recorded,
        specs,
        opt_steps=opt_steps,
        draws=draws,
        top=top,
        params=params,
        device=device,
        progress=progress,
        rates=rates,
    )
    if left_out:
        result.notes.append(
            f"left out: {left_out}: their records cover part of their steps; replay them by run directory, "
            "or when they finish"
        )
    if not result.rows:
        raise UserError(f"{target}: no recorded optimizer step matches --steps {steps}")
    partial = (
        [
            f"PARTIAL: this replay lacks recorded steps ({'; '.join(result.partial)}); its numbers are of the other steps only."
        ]
        if result.partial
        else []
    )
    if json_out:
        for line in partial:
            print(f"warning: {line}", file=sys.stderr)
        for row in result.rows:
            print(dumps(row))
        return []
    summary = summarize(result)
    header = [
        *partial,
        f"Replay of '{name}': {len(recorded)} run(s) with records, {len(result.matrices)} optimizer steps, "
        f"{len({r['rule'] for r in result.rows})} rules ({'token and parameter level' if params else 'token level'}).",
        *(f"Note: {n}" for n in summary["notes"] + summary["skipped"]),
    ]
    written = write_replay(
        summary, result.rows, "markdown" if fmt == "rich" else fmt, out_dir, f"clipbench replay: {name}", header
    )
    if fmt == "rich":
        console = render.report_console()
        for line in header:
            console.print(line, highlight=False)
        render.print_rich(replay_tables(summary), console)
    for p in written:
        if p.suffix != ".png":
            print(p)
    return written
