"""Study (d)'s why across rules, docs/studies/stability.md: does the size of a rule's step on the same
batches go with how much accuracy it loses at the learning-rate cliff?

    python scripts/stability_why.py --results-dir results [--outcomes study_stability]
        [--replay docs/studies/stability_replay/report.json]

Reads two things the study already wrote: each rule's gain over the base model at the cliff (final
Avg@n minus the run's own step 0, `clipbench.report.stability.run_gain`, mean over the seeds of the
outcome sweep) and the replay report of the recorded runs (`clipbench report study_stability_replay
--format markdown`, its report.json). For every trained rule whose batches were replayed (the
reference), each replayed rule's step is its one-step parameter gradient norm over GRPO's on the same
recorded mini-batches (the replay's `param/grad_norm_ratio`, each divided by GRPO's), and its KL the
same ratio of the one-step look-ahead KL. It prints, as markdown, a row per rule and Spearman's rank
correlation of the mean gain with the step and with the KL over the rules (one rule per group of rules
the replay found identical). A rank correlation across rules is an association, not a cause: it says
whether the rules that lose more are the ones that step further, not that the step makes them lose.
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


def gains_by_rule(results: Path, sweep: str) -> dict[str, list[float]]:
    """{label: [gain per finished run]} of one sweep's store."""
    out: dict[str, list[float]] = {}
    for run in load_results(results, sweep).runs:
        if run.state == "finished" and (g := run_gain(run)) is not None:
            out.setdefault(run.label, []).append(g)
    return out


def relative(reference: Mapping, key: str, base: str = "grpo") -> dict[str, float]:
    """{rule: the replay's mean `key` for the rule / the same for `base`} on one reference's batches."""
    per_rule = reference["per_rule"]
    den = per_rule[base][key]["mean"]
    return {rule: v[key]["mean"] / den for rule, v in per_rule.items() if key in v}


def association(
    gains: Mapping[str, Sequence[float]], references: Sequence[Mapping], identical: Sequence[Sequence[str]] = ()
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
    return {"rules": rows, "rho": rho, "references": {n: len(ref["runs"]) for n, ref in refs.items()}}


def markdown(result: Mapping) -> str:
    names = list(result["references"])
    head = "| rule | seeds | mean gain (points) | " + " | ".join(f"step on {n}'s batches" for n in names) + " |"
    lines = [head, "|" + "---|" * 3 + "---:|" * len(names)]
    for row in result["rules"]:
        lines.append(
            f"| {row['rule']} | {row['seeds']} | {row['gain']:+.1f} | "
            + " | ".join(f"{row['step'][n]:.2f}" for n in names)
            + " |"
        )
    lines.append("")
    n_rules = len(result["rules"])
    for n in names:
        for measure in ("step", "kl"):
            r, p = result["rho"][(n, measure)]
            p_text = f"{p:.2g}" if not math.isnan(p) else "n/a"
            lines.append(
                f"- on {n}'s batches ({result['references'][n]} runs): Spearman's rho of the mean "
                f"gain with the {measure} over GRPO's = {r:+.2f} (p = {p_text}, {n_rules} rules)"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", type=Path, default=Path("results"))
    ap.add_argument("--outcomes", default="study_stability")
    ap.add_argument("--replay", type=Path, default=REPO / "docs" / "studies" / "stability_replay" / "report.json")
    args = ap.parse_args(argv)
    replay = json.loads(args.replay.read_text())["replay"]
    identical = [group for ref in replay["references"] for group in ref.get("identical") or []]
    result = association(gains_by_rule(args.results_dir, args.outcomes), replay["references"], identical)
    print(markdown(result), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
