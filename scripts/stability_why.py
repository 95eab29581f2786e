"""Why rules differ, across rules: does the size of a rule's step on the same batches go with its
outcome? Study (d)'s at the learning-rate cliff (docs/studies/stability.md), and the organism's tuned
comparison (docs/studies/organism_confirm.md: each rule replayed at its own tuned rate).

    python scripts/stability_why.py --results-dir results [--outcomes study_stability]
        [--replay docs/studies/stability_replay/report.json]
    python scripts/stability_why.py --from-pages     # from the published pages' tables (no store needed)
    python scripts/stability_why.py --results-dir results --outcomes organism_confirm --bench arith \
        --by-method --families organism --replay docs/studies/organism_confirm/replay/replay.json --drift

Reads two things the study already wrote: each rule's gain over the base model at the cliff (final
Avg@n minus the run's own step 0, `clipbench.report.stability.run_gain`, mean over the seeds of the
outcome sweep) and the replay report of the recorded runs (`clipbench report study_stability_replay
--format markdown`, its report.json). For every trained rule whose batches were replayed (the
reference), each replayed rule's step is its one-step parameter gradient norm over GRPO's on the same
recorded mini-batches (the replay's `param/grad_norm_ratio`, each divided by GRPO's: the norm of the
rule's parameter gradient before gradient clipping, not the step the optimizer takes), and its KL the
same ratio of the one-step look-ahead KL (KL(new || old) after one AdamW step with the rule's gradient:
the measure of how far the policy moves). It prints, as markdown, a row per rule and Spearman's rank
correlation of the mean gain with the gradient norm and with the KL.

`--drift` adds a scale-free measure the replay's look-ahead lacks: the look-ahead steps with the
reference run's AdamW moments, so a rule whose gradient is k times GRPO's moves about k times as far
there, while Adam in the rule's own run divides that scale out. Each rule's own runs' mean
`approx_kl` (how far its own updates moved the policy from the rollout policy) is measured under its
own moments; its rank correlation with the gain is printed beside the replay's.

`--bench B` reads every gain on benchmark B alone (the organism's test split), `--by-method` keys the
outcomes by rule (the organism's arms are one rule each, at its own rate, so their labels name the
rate too), `--families organism` groups the organism's ten rules (ORGANISM_FAMILIES), and `--replay`
takes a report's report.json or `clipbench replay`'s replay.json.

The rules are not independent: several are near-identical variants of one rule (FAMILIES: the same
clip with another default, a cap that never binds, the token form of a sequence rule), and counting
each as a data point inflates the evidence. The test is at the family level: a family's gain, gradient
norm and KL are the means over its rules, and Spearman's rho is over the families (scipy.stats.
spearmanr). The rule-level rho is printed beside it, labelled as such, and the rho within the rules
that lose a middling amount (WITHIN: the group the study's first reading rested on). A rank
correlation is an association between rule families, not a cause: it says whether the families that
lose more are the ones that move the policy further, not that the step makes them lose.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from clipbench.report.load import load_results  # noqa: E402
from clipbench.report.stability import run_gain  # noqa: E402

# near-identical rules (one clip idea, other defaults or forms): one data point each in the family test
FAMILIES = (
    ("gppo", "ce_gppo", "gpg"),
    ("grpo", "dapo", "nsr", "decay", "clip_cov", "dual_clip"),
    ("cispo", "cispo_cap"),
    ("gspo", "gspo_token"),
)
# the organism's ten rules: GRPO's clip with its variants (clip-higher, a dual clip that never binds
# here, NSR's rescue and its decay twin), the two sequence-ratio rules, and the rest one each
ORGANISM_FAMILIES = (("grpo", "dapo", "dual_clip", "nsr", "decay"), ("gspo", "luspo"))
PRESETS = {"stability": FAMILIES, "organism": ORGANISM_FAMILIES}
WITHIN = (-11.5, -5.5)  # mean gains (points) of the group that loses 6-11 points at the cliff


def by_rule(runs: Sequence, value, by_method: bool = False) -> dict[str, list[float]]:
    """{label (or rule, `by_method`): [value(run) per finished run where it is not None]}."""
    out: dict[str, list[float]] = {}
    for run in runs:
        if run.state == "finished" and (v := value(run)) is not None:
            out.setdefault(run.method if by_method else run.label, []).append(v)
    return out


def gains_by_rule(runs: Sequence, bench: str | None = None, by_method: bool = False) -> dict[str, list[float]]:
    """Each finished run's gain over its base model (`run_gain`; on `bench` alone when given)."""
    return by_rule(runs, lambda run: run_gain(run, bench), by_method)


def drift_by_rule(runs: Sequence, by_method: bool = False) -> dict[str, list[float]]:
    """Each finished run's mean over its optimizer steps of `approx_kl`: how far the rule's own training
    moved the policy from the rollout policy within an update (the k3 estimate of KL(old || new) on
    the mini-batch, docs/objectives.md), under its own optimizer state."""

    def mean_kl(run) -> float | None:
        kls = [m["approx_kl"] for m in run.metrics if m.get("approx_kl") is not None]
        return float(np.mean(kls)) if kls else None

    return by_rule(runs, mean_kl, by_method)


def drift_association(
    gains: Mapping[str, Sequence[float]],
    drift: Mapping[str, Sequence[float]],
    groups: Sequence[Sequence[str]] | None = None,
    base: str = "grpo",
) -> dict:
    """Per rule: mean gain and its runs' in-run drift over `base`'s; Spearman's rho of the two over
    the rules and over the families. Scale-free where the replay's look-ahead is not: each rule's
    drift is under its own optimizer moments, the look-ahead's under the reference run's."""
    rules = sorted((r for r in gains if r in drift), key=lambda r: -float(np.mean(gains[r])))
    den = float(np.mean(drift[base]))
    rows = [{"rule": r, "gain": float(np.mean(gains[r])), "drift": float(np.mean(drift[r])) / den} for r in rules]
    res = stats.spearmanr([r["gain"] for r in rows], [r["drift"] for r in rows])
    fams = families(rules, groups)
    fam_rows = [
        {
            "family": name,
            "gain": float(np.mean([row["gain"] for row in rows if row["rule"] in members])),
            "drift": float(np.mean([row["drift"] for row in rows if row["rule"] in members])),
        }
        for name, members in fams.items()
    ]
    fam = stats.spearmanr([f["gain"] for f in fam_rows], [f["drift"] for f in fam_rows]) if len(fam_rows) >= 3 else None
    return {
        "rules": rows,
        "rho": (float(res.statistic), float(res.pvalue)),
        "families": fam_rows,
        "rho_family": (float(fam.statistic), float(fam.pvalue)) if fam is not None else None,
    }


def drift_markdown(result: Mapping) -> str:
    lines = [
        "In-run drift: each rule's own runs' mean approx_kl (KL(old || new) within an update, under the "
        "rule's own optimizer state) over GRPO's.",
        "",
        "| rule | mean gain (points) | in-run drift / grpo's |",
        "|---|---:|---:|",
        *(f"| {r['rule']} | {r['gain']:+.1f} | {r['drift']:.2f} |" for r in result["rules"]),
        "",
    ]
    if result["rho_family"] is not None:
        r, p = result["rho_family"]
        lines.append(
            f"- family level: Spearman's rho of the mean gain with the in-run drift = {r:+.2f} "
            f"(p = {_p(p)}, {len(result['families'])} families)"
        )
    r, p = result["rho"]
    lines.append(f"- rule level (not independent): rho = {r:+.2f} (p = {_p(p)}, {len(result['rules'])} rules)")
    return "\n".join(lines) + "\n"


def relative(reference: Mapping, key: str, base: str = "grpo") -> dict[str, float]:
    """{rule: the replay's mean `key` for the rule / the same for `base`} on one reference's batches."""
    per_rule = reference["per_rule"]
    den = per_rule[base][key]["mean"]
    return {rule: v[key]["mean"] / den for rule, v in per_rule.items() if key in v}


def association(
    gains: Mapping[str, Sequence[float]],
    references: Sequence[Mapping],
    identical: Sequence[Sequence[str]] = (),
    groups: Sequence[Sequence[str]] | None = None,
    within: tuple[float, float] | None = WITHIN,
) -> dict:
    """Per rule: seeds, mean gain, and per reference its step and KL over GRPO's; per reference and
    measure: Spearman's rho and its p-value over the rules that have a gain and a replay. Of each group
    in `identical` only the first rule counts (the others are the same rule at its defaults)."""
    twins = {r for group in identical for r in list(group)[1:]}
    refs = {ref["reference"]: ref for ref in references}
    rules = sorted(
        (r for r in gains if r not in twins and all(r in ref["per_rule"] for ref in refs.values())),
        key=lambda r: -float(np.mean(gains[r])),
    )
    step = {name: relative(ref, "param/grad_norm_ratio") for name, ref in refs.items()}
    kl = {name: relative(ref, "lookahead/kl") for name, ref in refs.items()}
    rows = [
        {
            "rule": r,
            "seeds": len(gains[r]),
            "gain": float(np.mean(gains[r])),
            "step": {n: step[n][r] for n in refs},
            "kl": {n: kl[n][r] for n in refs},
        }
        for r in rules
    ]
    mean_gain = [row["gain"] for row in rows]
    rho = {}
    for n in refs:
        for measure, table in (("step", step), ("kl", kl)):
            res = stats.spearmanr(mean_gain, [table[n][r] for r in rules])
            rho[(n, measure)] = (float(res.statistic), float(res.pvalue))
    fams = families(rules, groups)
    fam_rows = [
        {
            "family": name,
            "rules": members,
            "gain": float(np.mean([np.mean(gains[r]) for r in members])),
            "step": {n: float(np.mean([step[n][r] for r in members])) for n in refs},
            "kl": {n: float(np.mean([kl[n][r] for r in members])) for n in refs},
        }
        for name, members in fams.items()
    ]
    rho_family, rho_within = {}, {}
    within = [row for row in rows if within is not None and within[0] <= row["gain"] <= within[1]]
    for n in refs:
        for measure in ("step", "kl"):
            if len(fam_rows) >= 3:
                res = stats.spearmanr([f["gain"] for f in fam_rows], [f[measure][n] for f in fam_rows])
                rho_family[(n, measure)] = (float(res.statistic), float(res.pvalue))
            if len(within) >= 3:
                res = stats.spearmanr([r["gain"] for r in within], [r[measure][n] for r in within])
                rho_within[(n, measure)] = (float(res.statistic), float(res.pvalue))
    return {
        "rules": rows,
        "rho": rho,
        "families": fam_rows,
        "rho_family": rho_family,
        "within": [r["rule"] for r in within],
        "rho_within": rho_within,
        "within_range": within,
        "references": {n: len(ref["runs"]) for n, ref in refs.items()},
    }


def families(rules: Sequence[str], groups: Sequence[Sequence[str]] | None = None) -> dict[str, list[str]]:
    """{family name: its rules among `rules`}: the groups' (FAMILIES by default; named by their rules
    present), every other rule a family of its own."""
    out: dict[str, list[str]] = {}
    placed = set()
    for group in FAMILIES if groups is None else groups:
        members = [r for r in group if r in rules]
        if members:
            out["/".join(members)] = members
            placed |= set(members)
    for r in rules:
        if r not in placed:
            out[r] = [r]
    return out


MEASURES = {"step": "pre-clip gradient norm", "kl": "one-step KL"}


def _p(p: float) -> str:
    return f"{p:.2g}" if not math.isnan(p) else "n/a"


def markdown(result: Mapping) -> str:
    names = list(result["references"])
    head = (
        "| rule | seeds | mean gain (points) | "
        + " | ".join(f"pre-clip grad norm / grpo's, {n}'s batches" for n in names)
        + " | "
        + " | ".join(f"one-step KL / grpo's, {n}'s batches" for n in names)
        + " |"
    )
    lines = [head, "|" + "---|" * 3 + "---:|" * (2 * len(names))]
    for row in result["rules"]:
        lines.append(
            f"| {row['rule']} | {row['seeds']} | {row['gain']:+.1f} | "
            + " | ".join(f"{row['step'][n]:.2f}" for n in names)
            + " | "
            + " | ".join(f"{row['kl'][n]:.2f}" for n in names)
            + " |"
        )
    lines.append("")
    fams = result.get("families") or []
    if fams:
        lines.append(
            f"Family level ({len(fams)} families: "
            + "; ".join(f["family"] for f in fams if len(f["rules"]) > 1)
            + "; every other rule its own):"
        )
        for n in names:
            for measure in ("kl", "step"):
                if (n, measure) in result["rho_family"]:
                    r, p = result["rho_family"][(n, measure)]
                    lines.append(
                        f"- on {n}'s batches ({result['references'][n]} runs): Spearman's rho of the family's "
                        f"mean gain with its {MEASURES[measure]} over GRPO's = {r:+.2f} (p = {_p(p)}, "
                        f"{len(fams)} families)"
                    )
        lines.append("")
    if result.get("rho_within"):
        lo, hi = result["within_range"]
        lines.append(
            f"Within the rules that lose {-hi:g}-{-lo:g} points ({len(result['within'])} rules: "
            f"{', '.join(result['within'])}):"
        )
        for n in names:
            for measure in ("kl", "step"):
                r, p = result["rho_within"][(n, measure)]
                lines.append(f"- on {n}'s batches: rho with the {MEASURES[measure]} = {r:+.2f} (p = {_p(p)})")
        lines.append("")
    n_rules = len(result["rules"])
    lines.append("Rule level (near-identical rules counted separately: not independent, for reference only):")
    for n in names:
        for measure in ("step", "kl"):
            r, p = result["rho"][(n, measure)]
            lines.append(
                f"- on {n}'s batches ({result['references'][n]} runs): Spearman's rho of the mean "
                f"gain with the {MEASURES[measure]} over GRPO's = {r:+.2f} (p = {_p(p)}, {n_rules} rules)"
            )
    for n in names:
        top = max(result["rules"], key=lambda row: row["step"][n])
        rank = [row["rule"] for row in result["rules"]].index(top["rule"]) + 1
        lines.append(
            f"- the largest pre-clip gradient norm on {n}'s batches: {top['rule']} ({top['step'][n]:.1f}x grpo's), "
            f"whose mean gain ranks {rank} of {n_rules} ({top['gain']:+.1f})"
        )
    return "\n".join(lines) + "\n"


def _md_rows(text: str, after: str) -> list[list[str]]:
    """The cells of the first markdown table after the line starting with `after`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    rows, seen = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen = True
            if not set(line.strip()) <= set("|:- "):  # not the separator row
                rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif seen:
            break
    return rows[1:]  # without the header


def from_pages(stability_md: Path, replay_md: Path) -> tuple[dict, list[dict], list[list[str]]]:
    """(gains by rule, replay references, identical groups) read from the published pages: the per-seed
    gains of docs/studies/stability.md (shipped build) and the replay report's parameter-level tables
    (mean |grad| ratio and KL x1e3 as printed, 3 decimals)."""
    gains = {}
    for cells in _md_rows(stability_md.read_text(), "**The shipped build**"):
        gains[cells[0]] = [float(x) for x in cells[2].split(", ")]
    text = replay_md.read_text()
    refs = []
    for line in text.splitlines():
        if line.startswith("### Replay vs ") and "one optimizer step ahead" in line:
            name = line.split("### Replay vs ")[1].split(":")[0]
            per_rule = {}
            for cells in _md_rows(text, line):
                per_rule[cells[0]] = {
                    "param/grad_norm_ratio": {"mean": float(cells[3].split(" ± ")[0])},
                    "lookahead/kl": {"mean": float(cells[4].split(" ± ")[0])},
                }
            refs.append({"reference": name, "runs": [0, 1, 2], "per_rule": per_rule})
    return gains, refs, [["cispo", "cispo_cap"], ["gspo", "gspo_token"]]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", type=Path, default=Path("results"))
    ap.add_argument("--outcomes", default="study_stability")
    ap.add_argument("--replay", type=Path, default=REPO / "docs" / "studies" / "stability_replay" / "report.json")
    ap.add_argument("--from-pages", action="store_true", help="read docs/studies' published tables, not a store")
    ap.add_argument("--bench", default=None, help="read every gain on this benchmark alone (default: averaged)")
    ap.add_argument("--by-method", action="store_true", help="key the outcomes by rule, not by label")
    ap.add_argument("--families", choices=sorted(PRESETS), default="stability")
    ap.add_argument("--drift", action="store_true", help="also each rule's own in-run drift (approx_kl) vs gain")
    args = ap.parse_args(argv)
    if args.from_pages:
        studies = REPO / "docs" / "studies"
        gains, references, identical = from_pages(studies / "stability.md", studies / "stability_replay" / "report.md")
        result = association(gains, references, identical)
        print(markdown(result), end="")
        return 0
    data = json.loads(args.replay.read_text())
    replay = data.get("replay", data)  # a report's report.json, or `clipbench replay`'s replay.json
    identical = [group for ref in replay["references"] for group in ref.get("identical") or []]
    runs = load_results(args.results_dir, args.outcomes).runs
    gains = gains_by_rule(runs, args.bench, args.by_method)
    result = association(
        gains,
        replay["references"],
        identical,
        PRESETS[args.families],
        WITHIN if args.families == "stability" else None,
    )
    print(markdown(result), end="")
    if args.drift:
        drift = drift_by_rule(runs, args.by_method)
        print("\n" + drift_markdown(drift_association(gains, drift, PRESETS[args.families])), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
