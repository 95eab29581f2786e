"""A sweep's report, from the results store only (works offline): the analysis, the tables, the files.

    sweep, result, tables, header = build_report(results_dir, "quickstart", baseline="grpo")
    write_report(sweep, result, tables, header, "html", out_dir)     # -> the paths written

Files per format, in ``out_dir``: ``report.json`` (every number) and the tidy CSVs (``results_tidy.csv``,
``claims_tidy.csv``: one number per column, report/tidy.py) always, plus
    markdown  report.md and the figures as plots/*.png, and per_seed.csv
    latex     report.tex (booktabs fragment; what its numbers lack first, as text)
    csv       one <table>.csv per table, and header.txt (the header lines, what the numbers lack first)
    html      report.html: one self-contained page (tables + figures as base64 PNG), and per_seed.csv
per_seed.csv (report/per_seed.py): one row per compared run (the replication sweep's too) with the
endpoints its claims' tests read, so a published verdict can be tested again without the store.
(`rich`, the terminal, writes report.json and the tidy CSVs only: the command prints the tables.)
"""

from __future__ import annotations

from pathlib import Path

from clipbench.errors import UserError, unknown_choice
from clipbench.report import paper as paper_ref
from clipbench.report import render
from clipbench.report.analysis import analyze
from clipbench.report.claims import as_dicts, evaluate_claims
from clipbench.report.claims_table import add_claim_tables
from clipbench.report.correction_table import correction_table
from clipbench.report.finding import finding_line
from clipbench.report.health import exclusion_reason
from clipbench.report.load import Sweep, load_results
from clipbench.report.machines import provenance_lines, provenance_summary
from clipbench.report.per_seed import per_seed_rows, write_per_seed
from clipbench.report.replay import replay_figures, replay_tables, sweep_replay
from clipbench.report.replication import replicate_against, replicate_by_halves, summary_line
from clipbench.report.routing_table import routing_table
from clipbench.report.stability_table import stability_table
from clipbench.report.tables import Table, build_tables, model_title
from clipbench.report.tidy import tidy_tables
from clipbench.report.tidy import to_csv as tidy_csv
from clipbench.tracking.files import atomic_write_json
from clipbench.tracking.records import list_records


def warning_lines(sweep: Sweep, result: dict) -> list[str]:
    """The report's first lines: what its numbers lack (runs not finished, rows lost), in every format."""
    lines = [sweep.incomplete_line(), sweep.lost_line(), (result.get("replicate") or {}).get("incomplete")]
    return [line for line in lines if line]


def header_lines(sweep: Sweep, result: dict) -> list[str]:
    runs = result["runs"]
    states = ", ".join(f"{v} {k}" for k, v in sorted(runs["states"].items()))
    finding = finding_line(result)
    lines = (
        warning_lines(sweep, result)  # first: the numbers below may still change
        + ([finding] if finding else [])
        + [
            f"Sweep '{sweep.name}' ({sweep.path}): {runs['total']} runs ({states}); {runs['compared']} compared.",
            f"Models: {', '.join(model_title(b['model']) for b in result['blocks']) or '(none compared)'}. "
            f"Baseline: {result['baseline'] or 'none (no Gain row or p-values)'}.",
        ]
    )
    for b in result["blocks"]:
        seeds = "; ".join(
            f"{lb}: seeds {', '.join(map(str, info['seeds']))} (final step {'/'.join(map(str, info['final_steps']))})"
            for lb, info in b["labels"].items()
        )
        if seeds:
            lines.append(f"{model_title(b['model'])}: {seeds}.")
    if result.get("replicate"):
        rep = result["replicate"]
        lines.append(
            f"Replication sweep '{rep['sweep']}' ({rep['path']}): {rep['compared']} runs compared; each claim "
            f"is computed on it alone and must reach the same verdict."
        )
    lines += provenance_lines(result.get("provenance"))
    if result.get("prereg"):
        pre = result["prereg"]
        lines.append(
            f"Claims: the preregistered family frozen in the sweep's manifest ({pre['declared']} hypotheses "
            f"declared, {pre['tested']} tested; accuracy on {pre['benchmark']}); the papers' claims are not added."
        )
    claims_line = summary_line(result.get("claims", []))
    if claims_line:
        lines.append(claims_line)
    if runs["excluded"]:
        shown = "; ".join(f"{e['label']} seed {e['seed']} ({e['run_id']}): {e['reason']}" for e in runs["excluded"][:8])
        more = f"; and {len(runs['excluded']) - 8} more (see the Runs table)" if len(runs["excluded"]) > 8 else ""
        lines.append(f"Not compared ({len(runs['excluded'])} run(s)): {shown}{more}.")
    flagged = [(h, rid) for rid, h in result["health"].items() if h["flags"]]
    if flagged:
        shown = "; ".join(f"{h['label']} seed {h['seed']}: {', '.join(h['flags'])}" for h, _ in flagged[:8])
        lines.append(f"Flagged ({len(flagged)} run(s), see the Runs table): {shown}.")
    for model, groups in result.get("identical", {}).items():
        for g in groups:
            lines.append(
                f"Identical results: {' and '.join(g)} have the same correctness matrix for every seed and "
                f"benchmark ({model_title(model)}); their rows and curves coincide."
            )
    lines += [f"Note: {n}" for n in result.get("notes", [])]
    return lines


def load_replicate(results_dir: Path, spec: str) -> Sweep:
    """`--replicate B`: a sweep name in the same results dir, or a path to a sweep directory (with a '/')."""
    if "/" in spec or "\\" in spec:
        path = Path(spec).expanduser()
        return load_results(path.parent, path.name)
    return load_results(results_dir, spec)


TUNING_NOTE = (
    "no claims are tested on a tuning sweep (--tune-on without a preregistered family): its runs chose "
    "the rates; the claims are for runs on seeds the tuning never saw"
)


def claims_with_replication(sweep: Sweep, result: dict, replicate: Sweep | None, tuning: bool = False) -> None:
    """result["claims"] (each with its smallest detectable effect and whether it replicates: on the
    halves of its seeds, or on sweep `replicate`) and result["provenance"] (the machines and
    base-model checksums of the runs compared, the replication sweep's included), in place.
    `tuning` (--tune-on) without a preregistered family: no claims (TUNING_NOTE)."""
    excluded = {e["run_id"] for e in result["runs"]["excluded"]}
    compared = [r for r in sweep.runs if r.run_id not in excluded]
    if tuning and sweep.claims is None:
        claims = []
        result["notes"].append(TUNING_NOTE)
    else:
        claims = evaluate_claims(sweep, compared)
    runs, group = compared, (lambda r: r.label)
    result["per_seed"] = per_seed_rows(compared, sweep.name)
    if replicate is None:
        replicate_by_halves(claims, compared, sweep.claims)
    else:  # the replication tests this sweep's family (a preregistered one), whatever its own manifest says
        other = [r for r in replicate.runs if exclusion_reason(r) is None]
        replicate_against(claims, evaluate_claims(replicate, other, family=sweep.claims), replicate.name)
        result["per_seed"] += per_seed_rows(other, replicate.name)
        mine = {id(r) for r in compared}
        runs, group = compared + other, (lambda r: r.label if id(r) in mine else f"{replicate.name}: {r.label}")
        result["replicate"] = {
            "sweep": replicate.name,
            "path": str(replicate.path),
            "compared": len(other),
            "incomplete": replicate.incomplete_line("the replication"),  # None when every planned run finished
        }
    result["claims"] = as_dicts(claims)
    if sweep.claims is not None:  # declared and tested: the family's size, as frozen and as the runs allow
        result["prereg"] = {**sweep.claims.to_dict(), "declared": sweep.claims.size(), "tested": len(claims)}
    result["provenance"] = provenance_summary(runs, group)


def build_report(
    results_dir: Path,
    sweep_name: str,
    baseline: str | None,
    replicate: str | None = None,
    tune_on: str | None = None,
    replay: bool = True,
):
    """(sweep, analysis dict, tables, header lines) for one sweep; UserError when it has nothing to show.
    `replicate`: a second sweep (name or path) every claim is checked against, instead of seed halves.
    `tune_on`: the benchmark a learning-rate axis is read on (a validation split). `replay=False`: no
    replay section (its cost grows with rules x recorded steps; `clipbench replay` writes it alone)."""
    sweep = load_results(results_dir, sweep_name)
    other = load_replicate(results_dir, replicate) if replicate else None
    if tune_on is not None:
        evaluated = sorted({b for r in sweep.runs for ev in r.evals.values() for b in ev})
        if tune_on not in evaluated:
            raise UserError(
                f"--tune-on: sweep '{sweep_name}' has no evaluation on '{tune_on}' "
                f"(its benchmarks: {', '.join(evaluated) or 'none yet'})"
            )
    result = analyze(sweep, baseline, tune_on=tune_on)
    result["incomplete"] = sweep.incomplete()  # None when every planned run finished
    result["lost"] = {r.run_id: r.lost for r in sweep.runs if r.lost}  # training rows nothing restores
    claims_with_replication(sweep, result, other, tuning=tune_on is not None)
    tables = add_claim_tables(build_tables(result, paper_ref.load_paper()), result)
    stab = stability_table(result.get("stability"))
    if stab:  # after the accuracy tables, before the quadrants, dynamics, claims and runs
        at = next(
            (i for i, t in enumerate(tables) if t.key not in ("table3", "significance", "paper_reference")), len(tables)
        )
        tables[at:at] = stab
    result["replay"] = sweep_replay(sweep) if replay else None  # None unless the sweep's runs recorded
    if not replay and any(list_records(r.path) for r in sweep.runs):
        result.setdefault("notes", []).append(
            f"the runs' records were not replayed (--no-replay): `clipbench replay {sweep_name}` writes that section"
        )
    tables += replay_tables(result["replay"])
    for line in (result["replay"] or {}).get("partial", []):
        result["notes"].append(f"the replay section is partial: {line}")
    corr = correction_table(result.get("correction", {}), result["baseline"])
    if corr is not None:  # before the claims and the runs table
        at = next((i for i, t in enumerate(tables) if t.key in ("claims", "runs")), len(tables))
        tables.insert(at, corr)
    routes = routing_table(result.get("routing", {}), result["baseline"])
    if routes is not None:  # MoE runs: before the claims and the runs table
        at = next((i for i, t in enumerate(tables) if t.key in ("claims", "runs")), len(tables))
        tables.insert(at, routes)
    if not any(t.key in ("table3", "quadrants") for t in tables):
        states = ", ".join(f"{v} {k}" for k, v in sorted(result["runs"]["states"].items()))
        why = "; ".join(f"{e['run_id']}: {e['reason']}" for e in result["runs"]["excluded"][:3])
        retry = " (with --retry-failed for the failed ones)" if result["runs"]["states"].get("failed") else ""
        planned = f" of {len(sweep.planned)} planned" if sweep.planned is not None else ""
        raise UserError(
            f"sweep '{sweep_name}' has no finished runs to compare yet ({len(sweep.runs)}{planned} runs: "
            f"{states}{'; ' + why if why else ''}); run `clipbench sweep` to finish it{retry}"
        )
    return sweep, result, tables, header_lines(sweep, result)


def _figures_png(sweep: Sweep, result: dict) -> dict[str, bytes]:
    from clipbench.report.plots import close_figures, make_figures, png  # noqa: PLC0415 - report.plots pulls in matplotlib

    figs = {**make_figures(sweep, result), **replay_figures(result.get("replay"))}
    out = {name: png(fig) for name, fig in figs.items()}
    close_figures(figs)
    return out


def write_report(
    sweep: Sweep, result: dict, tables: list[Table], header: list[str], fmt: str, out_dir: Path
) -> list[Path]:
    """Write the files of one format (and report.json); returns the paths written (HTML page last)."""
    if fmt not in render.FORMATS:
        raise UserError("--format: " + unknown_choice("format", fmt, render.FORMATS))
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"clipbench report: {sweep.name}"
    written: list[Path] = []
    atomic_write_json(out_dir / "report.json", result)
    written.append(out_dir / "report.json")
    if fmt in ("markdown", "html"):  # the published formats: each run's endpoints beside them
        written.append(write_per_seed(out_dir / "per_seed.csv", result.get("per_seed", [])))
    for name, rows in tidy_tables(result).items():  # one number per column, for pandas (report/tidy.py)
        written.append(render.write_text(out_dir / f"{name}.csv", tidy_csv(rows)))
    if fmt == "markdown":
        rel = {}
        for name, png in _figures_png(sweep, result).items():
            p = out_dir / "plots" / f"{name}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(png)
            rel[name] = f"plots/{name}.png"
            written.append(p)
        written.append(render.write_text(out_dir / "report.md", render.markdown_document(title, header, tables, rel)))
    elif fmt == "latex":
        warnings = warning_lines(sweep, result)
        written.append(render.write_text(out_dir / "report.tex", render.latex_document(tables, warnings)))
    elif fmt == "csv":
        for name, t in zip(render.unique_names(tables), tables):
            written.append(render.write_text(out_dir / f"{name}.csv", render.to_csv(t)))
        written.append(render.write_text(out_dir / "header.txt", "".join(line + "\n" for line in header)))
    elif fmt == "html":
        page = render.html_document(title, header, tables, _figures_png(sweep, result))
        written.append(render.write_text(out_dir / "report.html", page))
    return written
