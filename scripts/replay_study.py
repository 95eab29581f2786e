"""Generate docs/studies/replay.md: counterfactual replay of the quickstart regime's recorded grpo runs.

    python scripts/replay_study.py --results-dir results --sweep study_replay --out docs/studies [--draws 8]

Runs after `clipbench sweep sweeps/study_replay.yaml` (`make study-replay` runs both). Replays every
registered rule on every recorded optimizer step of the sweep's runs (clipbench.replay: token level,
and the parameter level on the steps whose policy state was saved), writes the full replay report to
<out>/replay/ (replay.md, replay.json, replay.jsonl, plots/), and the study page <out>/replay.md,
whose every figure is computed here from those rows: where ABC-GRPO's gradient departs from GRPO's,
how much NSR's rescue changes versus its decay twin and across draws, which rules coincide.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from clipbench.replay.rules import RuleSpec, parse_rules  # noqa: E402
from clipbench.replay.run import replay_runs  # noqa: E402
from clipbench.replay.summary import summarize  # noqa: E402
from clipbench.replay.tokens import Cells, OptStepView, compare, flat_g, replay_rule  # noqa: E402
from clipbench.report.replay import write_replay  # noqa: E402
from clipbench.tracking.records import list_records, load_record  # noqa: E402
from clipbench.tracking.store import RunDir, list_run_dirs  # noqa: E402

QUADS = ("q1", "q2", "q3", "q4")


def ms(xs, scale: float = 1.0, digits: int = 1) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "n/a"
    m = statistics.fmean(xs) * scale
    sd = statistics.stdev(xs) * scale if len(xs) > 1 else 0.0
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def zero_grad(per_rule: dict, rule: str) -> str:
    return ", ".join(f"{q.upper()} {100 * (per_rule[rule]['zero_grad/' + q] or 0):.1f}%" for q in QUADS)


def off_policy(row: dict) -> bool:
    """Every optimizer step but the first of its rollout step (that one sees r = 1: all rules agree)."""
    return not (row["epoch"] == 0 and row["mini_batch"] == 0)


def pair_study(runs: list[Path], a: RuleSpec, b: RuleSpec, draws: int) -> dict:
    """Rule a (which draws) vs rule b on every off-policy recorded step, per draw: the departure
    sum|g_a - g_b| / sum|g_b| pooled over the steps, and the cosine per step (mean, and sd over draws)."""
    diff, ref, cos_mean, cos_sd = [0.0] * draws, 0.0, [], []
    for run in runs:
        for path in list_records(run):
            rec = load_record(path)
            for opt in rec.index["opt_steps"]:
                if opt["epoch"] == 0 and opt["mini_batch"] == 0:
                    continue
                step = OptStepView(rec, opt)
                cells = Cells.of(step)
                g_b = flat_g(step, replay_rule(step, b))
                outs = [compare(cells, flat_g(step, replay_rule(step, a, d)), g_b) for d in range(draws)]
                if outs[0]["ref_l1"] == 0:
                    continue
                ref += outs[0]["ref_l1"]
                for d, o in enumerate(outs):
                    diff[d] += o["departure"] * o["ref_l1"]
                cos = [o["grad_cosine"] for o in outs]
                cos_mean.append(statistics.fmean(cos))
                cos_sd.append(statistics.stdev(cos) if draws > 1 else 0.0)
    return {
        "departure": [x / ref for x in diff] if ref else [],
        "cosine": cos_mean,
        "cosine_sd_over_draws": cos_sd,
        "steps": len(cos_mean),
    }


def pooled(rows: list[dict], key: str) -> float:
    """sum over steps of key x ref_l1 / sum of ref_l1 (the departure over every step's tokens)."""
    pairs = [(r[key], r["ref_l1"]) for r in rows if r.get("ref_l1", 0) > 0 and r[key] == r[key]]
    w = sum(m for _, m in pairs)
    return sum(d * m for d, m in pairs) / w if w else float("nan")


def near_pairs(ref: dict, rows: list[dict], labels: list[str]) -> list[tuple[str, str, float]]:
    """Pairs of rules (not identical) whose mean token-level cosine over steps is >= 0.999."""
    out = []
    m = ref["token_cosine"] or []
    ident = {x for g in ref["identical"] for x in g}
    for i, x in enumerate(labels):
        for j, y in enumerate(labels):
            if (
                j > i
                and m
                and m[i][j] >= 0.999
                and not (x in ident and y in ident and any(x in g and y in g for g in ref["identical"]))
            ):
                out.append((x, y, m[i][j]))
    return out


def by_rule(rows: list[dict], rule: str) -> list[dict]:
    """The rule's off-policy rows (the first optimizer step of a rollout step is on-policy: all agree)."""
    return [r for r in rows if r["rule"] == rule and off_policy(r) and "skipped" not in r]


def header(ref: dict, rows: list[dict], runs: list[Path], seconds: float, args, n_records: int) -> list[str]:
    steps = len({(r["run_id"], r["opt_step"]) for r in by_rule(rows, "grpo")})
    seeds = sorted({r["seed"] for r in rows})
    status = [RunDir(r).status() for r in runs]
    train_min = (max(st.get("finished", 0) for st in status) - min(st.get("started", 0) for st in status)) / 60
    return [
        "# Study (c): counterfactual replay of the quickstart regime",
        "",
        "*Generated by `scripts/replay_study.py` (`make study-replay`); every figure below is computed from the",
        "replay's rows (one per optimizer step and rule: `<results>/reports/study_replay/replay/replay.jsonl`, ~15 MB,",
        "not shipped); the full report is [replay/replay.md](replay/replay.md), its summary",
        "[replay/replay.json](replay/replay.json).*",
        "",
        f"**What was run.** `sweeps/study_replay.yaml`: `recipes/quickstart.yaml` with `objective.method: grpo`, seeds "
        f"{', '.join(map(str, seeds))}, recording rollout steps 0, 10, 20, 30 (`train.record.every: 10`: every optimizer "
        f"step of each, 24 per rollout step) and the policy state before the last optimizer step of each "
        f"(`train.record.state: last`). {len(runs)} runs, {n_records} records, {steps} off-policy optimizer steps "
        f"(the first optimizer step of each rollout step is on-policy, r = 1, where every rule agrees, and is left out "
        f"of the figures below). Every registered rule ({len(ref['rules'])}) was replayed on every recorded optimizer "
        f"step at its default parameters, NSR with {args.draws} draws. The runs took {train_min:.0f} minutes (first start "
        f"to last finish, `--jobs 2`) and the replay {seconds / 60:.0f} minutes, on 2 CPU cores shared with other jobs. "
        "The runs used the shipped base model; the quickstart regime's training settings are the ones the recalibration kept (calibration.md: no point of its frontier reached a robust gain, and this one is its most robust with at least 5% out of band).",
        "",
        "**Reproduce.** `make study-replay` (or `clipbench sweep sweeps/study_replay.yaml --jobs 2`, then "
        "`python scripts/replay_study.py --results-dir results --sweep study_replay --out docs/studies`).",
        "",
    ]


def abc_section(ref: dict, rows: list[dict]) -> list[str]:
    by = lambda rule: by_rule(rows, rule)  # noqa: E731
    abc = by("abc")
    at_state = [r for r in abc if "param/grad_cosine" in r]
    p = ref["per_rule"]
    dep_total = pooled(abc, "departure")
    share = {q: pooled(abc, f"departure/{q}") / dep_total if dep_total > 0 else float("nan") for q in QUADS}
    cut = {q: sum(r[f"cut/{q}"] for r in abc) for q in QUADS}
    tokens = {q: sum(r[f"{q}/tokens"] for r in abc) for q in QUADS}
    ahead = [r for r in rows if "lookahead/kl" in r and r["rule"] in ("grpo", "abc")]
    la = {
        k: {rule: [r[k] for r in ahead if r["rule"] == rule] for rule in ("grpo", "abc")}
        for k in ("lookahead/kl", "lookahead/dlogp_correct", "lookahead/dlogp_incorrect", "param/grad_cosine")
    }
    return [
        "## Where ABC-GRPO's gradient departs from GRPO's",
        "",
        f"On the same batches, ABC's per-token gradient (d loss / d logp) departs from GRPO's by "
        f"{100 * dep_total:.1f}% of GRPO's gradient mass (sum |g_abc - g_grpo| / sum |g_grpo| over the tokens of all "
        f"{len(abc)} off-policy optimizer steps); per step, cosine {ms([r['grad_cosine'] for r in abc], 1, 4)} and norm "
        f"ratio {ms([r['grad_norm_ratio'] for r in abc], 1, 3)} (mean ± sd over steps).",
        "",
        "Where the departure lies (its share per token-ratio quadrant), and the tokens whose gradient ABC switches "
        "off where GRPO keeps one:",
        "",
        "| quadrant | share of the departure % | tokens cut by ABC | of the quadrant's tokens % |",
        "|---|---:|---:|---:|",
        *[
            f"| {q.upper()} | {100 * share[q]:.1f} | {cut[q]:,} | {100 * cut[q] / max(tokens[q], 1):.2f} |"
            for q in QUADS
        ],
        "",
        f"Zero-gradient share of each quadrant's tokens (all recorded steps): grpo {zero_grad(p, 'grpo')}; "
        f"abc {zero_grad(p, 'abc')}.",
        "",
        "This is the restoring gradient the outcome study blamed: in Q2 (A > 0, r below the band) and Q4 (A < 0, r "
        "above it) GRPO's clip keeps a gradient that pulls r back toward the band, and ABC's band removes it. "
        "The table says how much of GRPO's update that is on these batches; the lookahead below says what one step of "
        "it does.",
        "",
        f"On the {len(at_state)} optimizer steps with a recorded state (the last of each recorded rollout step, the "
        f"most off-policy) the token-level departure is {100 * pooled(at_state, 'departure'):.1f}% (cosine "
        f"{ms([r['grad_cosine'] for r in at_state], 1, 4)}), and the parameter gradients' cosine is "
        f"{ms([r['param/grad_cosine'] for r in at_state], 1, 4)}"
        + (
            ": the tokens ABC cuts weigh more in parameter space than their share of the token gradient."
            if statistics.fmean(r["param/grad_cosine"] for r in at_state)
            < statistics.fmean(r["grad_cosine"] for r in at_state) - 0.01
            else "."
        ),
        "",
        "One optimizer step ahead from the recorded states (parameter level, "
        f"{len(la['lookahead/kl']['grpo'])} states): parameter-gradient cosine abc vs grpo "
        f"{ms(la['param/grad_cosine']['abc'], 1, 4)}; KL(new ‖ old) ×1e3 grpo {ms(la['lookahead/kl']['grpo'], 1e3, 3)}, "
        f"abc {ms(la['lookahead/kl']['abc'], 1e3, 3)}; mean change of a correct completion's log-probability grpo "
        f"{ms(la['lookahead/dlogp_correct']['grpo'], 1, 4)}, abc {ms(la['lookahead/dlogp_correct']['abc'], 1, 4)}; of an "
        f"incorrect one grpo {ms(la['lookahead/dlogp_incorrect']['grpo'], 1, 4)}, abc "
        f"{ms(la['lookahead/dlogp_incorrect']['abc'], 1, 4)} (mean ± sd over states; the step includes AdamW's "
        "momentum, which both share).",
        "",
    ]


def nsr_section(rows: list[dict], nsr: dict, args) -> list[str]:
    by = lambda rule: by_rule(rows, rule)  # noqa: E731
    return [
        "## How much of the gradient NSR's rescue changes versus its decay twin",
        "",
        f"NSR and decay share their band (eps 0.2/0.28) and rescue width (delta 0.1, p 0.5); NSR rescues a near-band "
        f"token's full gradient with probability p, decay gives every such token p times it: decay is NSR's expected "
        f"gradient, so NSR's departure from decay is the rescue's noise. On the {nsr['steps']} off-policy steps where "
        f"decay has a gradient, NSR's gradient departs from decay's by {ms(nsr['departure'], 100, 3)}% of decay's "
        f"gradient mass (pooled over steps; mean ± sd over {args.draws} draws). With p = 0.5 a rescued and an "
        "unrescued token differ from decay by the same |g|/2, so that share cannot vary across draws; the draws move "
        f"the direction: cos(g_nsr, g_decay) {ms(nsr['cosine'], 1, 5)} (mean over draws, ± sd over steps), its sd over "
        f"draws within a step {ms(nsr['cosine_sd_over_draws'], 1, 5)}; NSR's loss varies over draws by "
        f"{ms([r.get('loss/std', 0.0) for r in by('nsr')], 1, 5)} (sd within a step). How much of GRPO's gradient each "
        f"changes (pooled departure vs grpo): nsr {100 * pooled(by('nsr'), 'departure'):.2f}%, decay "
        f"{100 * pooled(by('decay'), 'departure'):.2f}%, dapo (the same band, no rescue) "
        f"{100 * pooled(by('dapo'), 'departure'):.2f}%.",
        "",
    ]


def coincide_section(ref: dict, rows: list[dict]) -> list[str]:
    by = lambda rule: by_rule(rows, rule)  # noqa: E731
    identical = "; ".join(" = ".join(g) for g in ref["identical"]) or "none"
    near = near_pairs(ref, rows, ref["rules"])
    lines = [
        "## Which rules coincide at this scale",
        "",
        f"Identical token-level gradients on every recorded step (cosine and norm ratio within 1e-6 of 1): {identical}.",
        "",
        (
            "Nearly identical (mean cosine >= 0.999 over the steps): "
            + "; ".join(f"{x} ~ {y} ({c:.4f})" for x, y, c in near)
            + "."
        )
        if near
        else "No other pair reaches a mean cosine of 0.999.",
        "",
        "Per rule, vs grpo (all recorded steps; the full table with the per-quadrant split, the zero-gradient shares "
        "and the lookahead is in [replay/replay.md](replay/replay.md)):",
        "",
        "| rule | cos(g, g_grpo) | departure % | Q2+Q4 share of it % |",
        "|---|---:|---:|---:|",
    ]
    for lb in ref["rules"]:
        rs = by(lb)
        dep = pooled(rs, "departure")
        q24 = (pooled(rs, "departure/q2") + pooled(rs, "departure/q4")) / dep if dep > 0 else float("nan")
        lines.append(
            f"| {lb} | {ms([r['grad_cosine'] for r in rs], 1, 4)} | {100 * dep:.1f} | "
            f"{'' if q24 != q24 else f'{100 * q24:.1f}'} |"
        )
    lines += [
        "",
        "## What this scale can and cannot show",
        "",
        "These are gradients and one-step effects on the batches GRPO itself sampled, measured exactly; they say "
        "where and how much the rules differ, not which one ends up more accurate (that is the outcome studies' "
        "question, docs/studies/clip_rules.md and rescue.md). The batches are GRPO's own: a rule trained from the "
        "start would sample different ones.",
        "",
    ]
    return lines


def page(ref: dict, rows: list[dict], nsr: dict, runs: list[Path], seconds: float, args, n_records: int) -> str:
    return "\n".join(
        header(ref, rows, runs, seconds, args, n_records)
        + abc_section(ref, rows)
        + nsr_section(rows, nsr, args)
        + coincide_section(ref, rows)
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--sweep", default="study_replay")
    ap.add_argument("--out", default=str(REPO / "docs" / "studies"))
    ap.add_argument("--draws", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    runs = [r.path for r in list_run_dirs(Path(args.results_dir) / args.sweep) if list_records(r.path)]
    if not runs:
        sys.exit(f"no recorded runs in {args.results_dir}/{args.sweep}: run `clipbench sweep sweeps/study_replay.yaml`")
    t0 = time.perf_counter()
    result = replay_runs(
        runs,
        parse_rules("all"),
        draws=args.draws,
        top=5,
        params=True,
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    )
    nsr = pair_study(runs, RuleSpec.of("nsr", {}), RuleSpec.of("decay", {}), args.draws)
    seconds = time.perf_counter() - t0
    summary = summarize(result)
    (ref,) = [r for r in summary["references"] if r["reference"] == "grpo"]
    out = Path(args.out)
    header = [
        f"Replay of '{args.sweep}': {len(runs)} runs, {len(result.matrices)} optimizer steps, "
        f"{len(ref['rules'])} rules (token and parameter level), nsr with {args.draws} draws."
    ]
    write_replay(summary, None, "markdown", out / "replay", f"clipbench replay: {args.sweep}", header)
    rows_dir = Path(args.results_dir) / "reports" / args.sweep / "replay"  # every row: ~15 MB, kept with the results
    write_replay(summary, result.rows, "markdown", rows_dir, f"clipbench replay: {args.sweep}", header)
    n_records = sum(len(list_records(r)) for r in runs)
    (out / "replay.md").write_text(page(ref, result.rows, nsr, runs, seconds, args, n_records))
    print(f"wrote {out / 'replay.md'} and {out / 'replay'}/")


if __name__ == "__main__":
    main()
