"""The papers' claims, tested on a sweep: each claim is a figure, its interval, a paired test and a
verdict ("holds", "does not hold", "inconclusive at this scale").

A claim applies to a sweep when the sweep has the arms it compares (on the same base model):

    learns          RL from verifiable rewards raises held-out accuracy         grpo vs its base model (step 0)
    abc_entropy     ABC-GRPO keeps entropy higher than GRPO (ABC-GRPO)          abc vs grpo
    abc_accuracy    ABC-GRPO beats GRPO on held-out accuracy (ABC-GRPO Table 3) abc vs grpo
    dapo_entropy    clip-higher keeps entropy higher than GRPO (DAPO)           dapo vs grpo
    q4_share        Q4 (A<0, r>1) is the largest share of GRPO's clip events    grpo alone
                    (ABC-GRPO, Figure 4f: 41.4%)
    nsr_vs_dapo     NSR beats DAPO (NSR)                                        each nsr arm vs dapo
    nsr_vs_decay    stochastic rescue beats its deterministic twin (NSR)        nsr vs decay, same parameters
    grpo_replay     GRPO needs routing replay on MoE (GSPO)                     grpo r2 vs grpo none
    gspo_replay     routing replay matters for GRPO, not for GSPO (GSPO)        (grpo r2 - none) - (gspo r2 - none)
    nsr_vs_gspo     NSR beats GSPO (NSR, on MoE)                                nsr on gspo's sequence ratio vs gspo

A sweep whose file declares a preregistered family (`claims:`, config/claims.py, frozen in its
manifest) is tested on exactly that family instead (`family_claims`): each comparison a - b of two
rules, each at its one setting (its own tuned rate, say), on each of its endpoints (Avg@n or Pass@n
at the last evaluation on the family's benchmark, or the last fifth's entropy), a difference claim
with the claimed sign + ("a beats b"), and for the equivalence endpoints an equivalence claim within
the declared margin; Holm over all of them, as below.

Arms are compared at the same learning rate (``train.lr`` and ``train.lr_schedule``) and the same
``model.routing_replay``, so a sweep with a learning-rate axis gets each claim once per rate, and one
with a routing-replay axis (a mixture-of-experts model: docs/moe.md) once per replay setting; the
routing claims (ROUTING) compare the replay settings themselves. At the learning-rate cliff, the rates where GRPO's
mean gain over the base model is below 0 (`stability.losing_rates`; without grpo in the block, where
the claim's reference arm loses), the stability claims the rules' papers make apply (STABILITY): the
rule keeps more held-out accuracy than its reference there (Avg@n at the last evaluation, the same
test as every accuracy claim; both arms start from the same base model on the same problems, so this
is also the difference of their gains over it). At those rates "NSR improves stability over DAPO"
takes the place of "NSR beats DAPO".

Statistics (stated in every row):
- Training figures (entropy, quadrant shares) are one number per run. Arms are paired by seed (the
  same seed draws the same prompts and the same initial samples for both); the interval is Student's
  t over the per-seed differences, the test a paired t-test (`scipy.stats.ttest_rel`; for one arm,
  `ttest_1samp`).
- Accuracy (Avg@n at the last evaluation): with at least `SEED_TEST_MIN` (2) paired seeds, one number
  per run as for the training figures: each seed's Avg@n (the mean over its problems; benchmarks
  averaged) paired by seed, Student's t interval over the per-seed differences and a paired t-test.
  Another seed trains another model, so this is the test of whether a rerun with other seeds would
  agree (and the split halves use the same test). With one seed the seed noise cannot be estimated:
  the difference is paired by problem, the interval Student's t over problems and the p-value the
  paired bootstrap over problems (`stats.paired_bootstrap_p`). That test shows within-seed noise
  only: it speaks for the trained model at hand, not for another seed, and the row says so.
- The family: the claims of one report (`evaluate_claims`) are one family; `correct_family` adjusts
  their p-values by Holm (`stats.holm`: statsmodels) and every verdict is read at the adjusted p
  (p_holm; the raw p is kept beside it).
- Kinds: a difference claim is tested against 0, two-sided: "holds" when the difference has the
  claimed sign and p_holm < 0.05, "does not hold" when it has the opposite sign and p_holm < 0.05, else
  "inconclusive at this scale" (not detected with these seeds: never "no difference"). A "does not
  lose" claim (BASE_CLAIM) is non-inferiority against its declared margin (STABLE_MARGIN): the same
  test against -margin (`stats.noninferiority`). A "no difference" claim (GSPO_NO_REPLAY) is
  equivalence within +-margin (REPLAY_MARGIN) by two one-sided tests (`stats.tost`).
- Whether a verdict is consistent over the halves of the seeds, or replicates on a second sweep, is
  replication.py's. The machines a claim's runs ran on are kept (`machines`): one claim over several
  machines is said next to its verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from clipbench.config.claims import ENDPOINTS, ClaimFamily
from clipbench.config.stored import recorded
from clipbench.errors import UserError
from clipbench.eval.passk import pass_at_k_array
from clipbench.report import stats
from clipbench.report.analysis import (
    _initial_step,
    _paired_diffs,
    _payload_at,
    block_benchmarks,
    block_n,
    run_dynamics,
    run_quadrants,
    seed_values,
)
from clipbench.report.load import RunRecord, Sweep, arm_setting
from clipbench.report.stability import losing_rates, run_lr
from clipbench.tracking.provenance import describe_machine

ALPHA = stats.ALPHA
QUADRANTS = ("q1", "q2", "q3", "q4")
SEED_TEST_MIN = 2  # paired seeds from which accuracy is tested over seeds (one seed: over problems)
# (rule, its reference, the claim, the source): tested at the learning-rate cliff (module docstring)
STABILITY = (
    ("nsr", "dapo", "NSR improves stability over DAPO (more accuracy kept at the lr cliff)", "NSR, abstract"),
    ("cispo", "grpo", "CISPO trains stably: keeps more accuracy than GRPO at the lr cliff", "MiniMax-M1 (CISPO)"),
    ("gspo", "grpo", "GSPO is more stable than GRPO: keeps more accuracy at the lr cliff", "GSPO"),
    (
        "dual_clip",
        "grpo",
        "dual-clip stabilizes training: keeps more accuracy than GRPO at the lr cliff",
        "dual-clip PPO (Ye et al., 2020)",
    ),
    ("sapo", "grpo", "SAPO is more stable than GRPO: keeps more accuracy at the lr cliff", "SAPO"),
)
# the routing claims (GSPO's Routing Replay, section 5.3 of arXiv 2507.18071): where a block has arms
# with routing replay none and r2 at the same learning rate
ROUTING_SOURCE = "GSPO (arXiv 2507.18071), Routing Replay"
GRPO_REPLAY = "GRPO needs routing replay on a mixture-of-experts model (r2 keeps more accuracy than none)"
GSPO_REPLAY = "routing replay matters for GRPO, not for GSPO (replay's gain is larger for GRPO than for GSPO)"
NSR_GSPO = "NSR beats GSPO"
NAMES = {"nsr": "NSR", "cispo": "CISPO", "gspo": "GSPO", "dual_clip": "dual-clip", "sapo": "SAPO"}
BASE_CLAIM = "{name} trains stably: does not lose the base model's held-out accuracy at the lr cliff"
# The margins of the claims tested as non-inferiority ("does not lose") or equivalence ("no
# difference"), declared with the claims, in the figure's unit (Avg@n points), before any data:
# 2 points is about one seed-to-seed sd of the base model's Avg@8 on the studies' regime (1.5) and a
# fifth of GRPO's loss at the learning-rate cliff (about 9): a loss smaller than that is "not lost".
STABLE_MARGIN = 2.0
GSPO_NO_REPLAY = "GSPO does not need routing replay on a mixture-of-experts model (r2 and none equivalent)"
REPLAY_MARGIN = 2.0  # points of Avg@n: the same yardstick as STABLE_MARGIN
DIFFERENCE, NONINFERIORITY, EQUIVALENCE = "difference", "non-inferiority", "equivalence"
# The per-run endpoints the seed-level tests read, as named in per_seed.csv (report/per_seed.py)
ENTROPY_COL, Q4_COL = "entropy_last_fifth", "q4_lead"


def avg_col(bench: str, start: bool = False) -> str:
    return f"avg_{'start' if start else 'end'}:{bench}"


def pass_col(bench: str) -> str:
    return f"pass_end:{bench}"


@dataclass
class ClaimResult:
    claim: str  # the claim as the paper states it
    source: str  # the paper
    comparison: str  # the arms, e.g. "abc - grpo"
    figure: str  # what is measured
    estimate: float  # the mean difference (or the share), in the figure's unit
    ci: tuple[float, float]
    p: float
    test: str  # the paired test
    n: int  # seeds or problems behind the estimate
    verdict: str
    model: str = ""  # the block (base model name)
    seeds: list[int] = field(default_factory=list)  # the seeds behind it (both arms have them)
    se: float = math.nan  # the test's standard error, in the figure's unit
    df: float = math.nan
    mde: float = math.nan  # smallest effect detectable at 80% power
    needed: dict | None = None  # inconclusive: {"unit": seeds|problems, "n", "factor"}
    checksums: list = field(default_factory=list)  # base-model weights sha256 of its runs (None: unrecorded)
    replication: dict | None = None  # replication.py: consistent/inconsistent (halves) or replicates/fragile
    kind: str = DIFFERENCE  # difference (two-sided, claimed sign) | non-inferiority | equivalence
    margin: float | None = None  # non-inferiority / equivalence: the declared margin, figure's unit
    p_holm: float = math.nan  # Holm-adjusted over the report's claim family (correct_family)
    family: int = 0  # the claims in that family
    p_outside: float = math.nan  # equivalence: two-sided p against the nearer margin (does not hold)
    machines: list = field(default_factory=list)  # the machines its runs ran on (report/machines.py)
    # what its test reads per seed: [label, [per_seed.csv columns (averaged)], sign] terms summed
    # (report/per_seed.py); None: not a seed-level test (one seed: tested over problems)
    reads: list | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        """What names a claim across sweeps and halves (the figure's text carries numbers)."""
        return (self.model, self.claim, self.comparison)


def verdict(estimate: float, p: float, *, claimed_sign: int = 1, margin: float | None = None) -> str:
    """At level ALPHA on `p` (after the family's correction, `correct_family`): "holds" when the
    estimate lies on the claimed side of 0 (non-inferiority: of -margin) and p < ALPHA, "does not
    hold" on the other side, else "inconclusive at this scale"."""
    if not (math.isfinite(estimate) and math.isfinite(p)):
        return "inconclusive at this scale"
    shifted = estimate + (margin or 0.0) * claimed_sign
    if p < ALPHA and shifted * claimed_sign > 0:
        return "holds"
    if p < ALPHA and shifted * claimed_sign < 0:
        return "does not hold"
    return "inconclusive at this scale"


def decide(c: ClaimResult, p: float, family: int = 1) -> str:
    """The verdict of a claim at its (corrected) p. Equivalence: "holds" when the TOST p < ALPHA; "does
    not hold" when the estimate lies outside +-margin and its two-sided p against the nearer margin,
    Bonferroni over the family (conservative), is < ALPHA; else inconclusive."""
    if c.kind == EQUIVALENCE:
        if math.isfinite(p) and p < ALPHA:
            return "holds"
        if math.isfinite(c.p_outside) and abs(c.estimate) > c.margin and c.p_outside * family < ALPHA:
            return "does not hold"
        return "inconclusive at this scale"
    return verdict(c.estimate, p, margin=c.margin if c.kind == NONINFERIORITY else None)


def correct_family(claims: Sequence[ClaimResult]) -> None:
    """Holm over the claims of one report (its family), in place: each claim's p_holm, family and its
    verdict at the adjusted p ("holds" only after the correction)."""
    adjusted = stats.holm([c.p for c in claims])
    family = sum(math.isfinite(c.p) for c in claims)
    for c, p in zip(claims, adjusted):
        c.p_holm, c.family = p, family
        c.verdict = decide(c, p, family)


def _t_ci(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=float)
    if v.size < 2:
        return (math.nan, math.nan)
    return stats.t_interval(v)


def _per_seed(runs: Sequence[RunRecord], value) -> dict[int, float]:
    out = {}
    for r in runs:
        v = value(r)
        if v is not None and math.isfinite(v):
            out[r.seed] = float(v)
    return out


def _paired_seeds(a: dict[int, float], b: dict[int, float]) -> np.ndarray:
    return np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])


def _ttest_rel_p(diffs: np.ndarray) -> float:
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    if diffs.size < 2 or np.allclose(diffs, diffs[0]):
        return 0.0 if diffs.size >= 2 and diffs[0] != 0 else (1.0 if diffs.size >= 2 else math.nan)
    return float(sps.ttest_1samp(diffs, 0.0).pvalue)  # = ttest_rel on the pairs


def _last_entropy(r: RunRecord) -> float | None:
    d = run_dynamics(r.metrics)
    return None if d is None else d["entropy"][1]  # (first, last) fifth


def _q4_lead(r: RunRecord) -> float | None:
    q = run_quadrants(r.metrics)
    if q is None or not math.isfinite(q["share"]["q4"]):
        return None
    return q["share"]["q4"] - max(q["share"][k] for k in ("q1", "q2", "q3"))


def _q4_share(r: RunRecord) -> float | None:
    q = run_quadrants(r.metrics)
    return None if q is None else q["share"]["q4"]


def _checksums(runs: Sequence[RunRecord]) -> list:
    return sorted({c for r in runs for c in r.checksums}, key=lambda c: c or "")


def _machines(runs: Sequence[RunRecord]) -> list[str]:
    """The machines a claim's runs ran on (`describe_machine` of each start; unrecorded ones left out)."""
    return sorted({describe_machine(s) for r in runs for s in (r.provenance or []) if s})


def _seed_design(res: ClaimResult, diffs: np.ndarray) -> ClaimResult:
    """se, df, mde of a paired t over seed differences; the seeds an inconclusive one would need."""
    if diffs.size >= 2:
        sd = float(diffs.std(ddof=1))
        res.se, res.df = sd / math.sqrt(diffs.size), float(diffs.size - 1)
        res.mde = stats.mde(res.se, res.df)
        n = stats.seeds_needed(sd, res.estimate, start=diffs.size) if res.verdict.startswith("inconclusive") else None
        res.needed = None if n is None else {"unit": "seeds", "n": n, "factor": n / diffs.size}
    return res


def _problem_design(res: ClaimResult, diffs: Sequence[np.ndarray]) -> ClaimResult:
    """se, df, mde of the mean per-problem difference (benchmarks combined); the multiple of the
    problems an inconclusive one would need, (mde / |estimate|)^2 (se shrinks as 1 / sqrt(problems))."""
    res.se, res.df = stats.combined_se([100.0 * d for d in diffs])
    res.mde = stats.mde(res.se, res.df)
    if res.verdict.startswith("inconclusive") and res.estimate and math.isfinite(res.mde) and res.mde > 0:
        factor = (res.mde / abs(res.estimate)) ** 2
        res.needed = {"unit": "problems", "n": math.ceil(factor * res.n), "factor": factor}
    return res


def seed_claim(
    claim: str,
    source: str,
    a_label: str,
    a: Sequence[RunRecord],
    b_label: str,
    b: Sequence[RunRecord],
    figure: str,
    value,
    column: str,
) -> ClaimResult | None:
    va, vb = _per_seed(a, value), _per_seed(b, value)
    diffs = _paired_seeds(va, vb)
    if diffs.size == 0:
        return None
    res = _seed_t(claim, source, f"{a_label} - {b_label}", figure, diffs, sorted(set(va) & set(vb)), [*a, *b])
    res.reads = [[a_label, [column], 1], [b_label, [column], -1]]
    return res


def _seed_t(
    claim: str,
    source: str,
    label: str,
    figure: str,
    diffs,
    seeds: list,
    runs,
    kind: str = DIFFERENCE,
    margin: float | None = None,
) -> ClaimResult:
    """A claim tested by a paired t over the seeds' differences `diffs` (one per seed in `seeds`):
    against 0 (difference), -margin (non-inferiority, two-sided: the 95% interval's lower end against
    -margin) or +-margin (equivalence, TOST)."""
    est, p = float(diffs.mean()), _ttest_rel_p(diffs)
    p_outside = math.nan
    if kind == NONINFERIORITY:
        p = stats.noninferiority(diffs, margin)["p"] if diffs.size >= 2 else math.nan
    elif kind == EQUIVALENCE:
        p = stats.tost(diffs, margin)["p"] if diffs.size >= 2 else math.nan
        p_outside = stats.noninferiority(diffs if est < 0 else -diffs, margin)["p"] if diffs.size >= 2 else math.nan
    res = ClaimResult(
        claim,
        source,
        label,
        figure,
        est,
        _t_ci(diffs),
        p,
        "paired t, seeds" if kind == DIFFERENCE else f"paired t, seeds; {kind}, margin {margin:g}",
        int(diffs.size),
        "",
        seeds=seeds,
        checksums=_checksums(runs),
        kind=kind,
        margin=margin,
        p_outside=p_outside,
        machines=_machines(runs),
    )
    res.verdict = decide(res, p)
    return _seed_design(res, diffs)


def _seed_accuracy(blocks: Sequence[tuple], runs: Sequence[RunRecord], metric: str) -> dict[int, float]:
    """{seed: Avg@n in points} from seed_values' blocks (one per benchmark): each run's mean over its
    problems, benchmarks averaged (a seed missing a benchmark is left out)."""
    seed_of = {r.run_id: r.seed for r in runs}
    per: dict[int, list[float]] = {}
    for _, values, run_ids in blocks:
        for rid, v in zip(run_ids, values[metric].mean(axis=1)):
            per.setdefault(seed_of[rid], []).append(100.0 * float(v))
    return {s: float(np.mean(v)) for s, v in per.items() if len(v) == len(blocks)}


def _avg_n(runs: Sequence[RunRecord], benches: Sequence[str]) -> tuple[str, str]:
    """(the Avg@n metric's name for the runs' samples per problem, the claims' figure text)."""
    n = block_n(runs, benches)
    return stats.metric_names(stats.ks_for(n))[0], f"Avg@{n}, last eval (pts, {', '.join(benches)})"


def accuracy_claim(
    claim: str,
    source: str,
    a_label: str,
    a: Sequence[RunRecord],
    b_label: str,
    b: Sequence[RunRecord],
    *,
    b_initial: bool = False,
    kind: str = DIFFERENCE,
    margin: float | None = None,
) -> ClaimResult | None:
    """``b_initial``: compare with b's step-0 evaluation (the base model) instead of its last; ``kind``
    and ``margin``: a non-inferiority or equivalence claim (points)."""
    a = [r for r in a if r.final_step is not None]
    b = [r for r in b if r.final_step is not None]
    benches = [x for x in block_benchmarks([*a, *b]) if x in block_benchmarks(a) and x in block_benchmarks(b)]
    if not benches:
        return None
    metric, figure = _avg_n([*a, *b], benches)
    blocks = [
        (ga, gb)
        for ga, gb in ((seed_values(a, bench, [1]), seed_values(b, bench, [1], initial=b_initial)) for bench in benches)
        if ga is not None and gb is not None
    ]
    if not blocks:
        return None
    va = _seed_accuracy([ga for ga, _ in blocks], a, metric)
    vb = _seed_accuracy([gb for _, gb in blocks], b, metric)
    if len(set(va) & set(vb)) >= SEED_TEST_MIN:
        res = _seed_t(
            claim,
            source,
            f"{a_label} - {b_label}",
            figure,
            _paired_seeds(va, vb),
            sorted(set(va) & set(vb)),
            [*a, *b],
            kind,
            margin,
        )
        res.reads = [
            [a[0].label, [avg_col(x) for x in benches], 1],
            [b[0].label, [avg_col(x, start=b_initial) for x in benches], -1],
        ]
        return res
    diffs = [_paired_diffs(ga[0], ga[1][metric], gb[0], gb[1][metric]) for ga, gb in blocks]
    if all(d.size == 0 for d in diffs):
        return None
    allv = 100.0 * np.concatenate(diffs)
    est = float(np.mean([100.0 * d.mean() for d in diffs]))
    p_outside, shift = math.nan, (margin or 0.0) / 100.0
    if kind == NONINFERIORITY:  # the differences against -margin
        p = stats.paired_bootstrap_p([d + shift for d in diffs])
    elif kind == EQUIVALENCE:  # TOST by the bootstrap's one-sided halves: the larger of the two
        p = max(
            stats.paired_bootstrap_p([d + shift for d in diffs]), stats.paired_bootstrap_p([d - shift for d in diffs])
        )
        p_outside = stats.paired_bootstrap_p([d + (shift if est < 0 else -shift) for d in diffs])
    else:
        p = stats.paired_bootstrap_p(diffs)
    test = "paired bootstrap, problems (within-seed noise only)"
    res = ClaimResult(
        claim,
        source,
        f"{a_label} - {b_label}",
        figure,
        est,
        _t_ci(allv),
        p,
        test if kind == DIFFERENCE else f"{test}; {kind}, margin {margin:g}",
        int(allv.size),
        "",
        seeds=sorted({r.seed for r in a} & {r.seed for r in b}),
        checksums=_checksums([*a, *b]),
        kind=kind,
        margin=margin,
        p_outside=p_outside,
        machines=_machines([*a, *b]),
    )
    res.verdict = decide(res, p)
    return _problem_design(res, diffs)


def q4_claim(label: str, runs: Sequence[RunRecord]) -> ClaimResult | None:
    """Q4's lead over the next largest quadrant, per seed; a one-sample t over the seeds."""
    shares = _per_seed(runs, _q4_share)
    leads = _per_seed(runs, _q4_lead)
    lead = np.array([leads[s] for s in sorted(leads)])
    if not lead.size:
        return None
    est, p = float(lead.mean()), _ttest_rel_p(lead)
    mean_share = float(np.mean(list(shares.values())))
    res = ClaimResult(
        "Q4 (A<0, r>1) is the largest share of GRPO's clip events",
        "ABC-GRPO, Fig. 4f: 41.4%",
        f"{label}: Q4 - next largest quadrant",
        f"share of clip events (pts; Q4 {mean_share:.1f}%)",
        est,
        _t_ci(lead),
        p,
        "paired t, seeds",
        int(lead.size),
        verdict(est, p),
        seeds=sorted(leads),
        checksums=_checksums(runs),
        machines=_machines(runs),
        reads=[[label, [Q4_COL], 1]],
    )
    return _seed_design(res, lead)


def _params(r: RunRecord) -> dict:
    return r.objective.params if r.objective else {}


def _setting(runs: Sequence[RunRecord]) -> tuple:
    """What two arms must share to be compared: the learning rate (and its schedule) and the routing
    replay."""
    first = runs[0].config
    return (recorded(first, "train.lr"), recorded(first, "train.lr_schedule"), _replay(runs))


def _same(a: Sequence[RunRecord], b: Sequence[RunRecord]) -> bool:
    """Whether two arms may be compared: the same setting (`_setting`) and every other key that can
    change what a run computes (an evaluation setting included) equal."""
    return _setting(a) == _setting(b) and arm_setting(a[0]) == arm_setting(b[0])


def _replay(runs: Sequence[RunRecord]) -> str:
    return recorded(runs[0].config, "model.routing_replay") or "none"


def _seed_avg(runs: Sequence[RunRecord], benches: Sequence[str]) -> tuple[dict[int, float], str]:
    """({seed: Avg@n at the last evaluation, points, benchmarks averaged}, the figure's text)."""
    metric, figure = _avg_n(runs, benches)
    blocks = [g for g in (seed_values(runs, bench, [1]) for bench in benches) if g is not None]
    return _seed_accuracy(blocks, runs, metric), figure


def routing_claims(by_label: dict[str, list[RunRecord]], method_of: dict[str, str]) -> list[ClaimResult]:
    """ROUTING's claims, per learning rate: GRPO with r2 against GRPO with none (accuracy), and the
    difference of replay's gains, (grpo r2 - grpo none) - (gspo r2 - gspo none), paired by seed (the
    GSPO paper: GRPO needs Routing Replay to converge on MoE, GSPO does not)."""
    arm = {}  # (method, lr, schedule, replay) -> label; one label per cell (other axes: skipped)
    for lb, runs in by_label.items():
        key = (method_of[lb], *_setting(runs))
        arm[key] = None if key in arm else lb
    out = []
    for (method, lr, sched, replay), g_none in sorted(arm.items(), key=str):
        g_r2 = arm.get((method, lr, sched, "r2"))
        if method != "grpo" or replay != "none" or not g_none or not g_r2:
            continue
        res = accuracy_claim(GRPO_REPLAY, ROUTING_SOURCE, g_r2, by_label[g_r2], g_none, by_label[g_none])
        out += [res] if res else []
        s_none, s_r2 = arm.get(("gspo", lr, sched, "none")), arm.get(("gspo", lr, sched, "r2"))
        if not s_none or not s_r2:
            continue
        res = accuracy_claim(
            GSPO_NO_REPLAY,
            ROUTING_SOURCE,
            s_r2,
            by_label[s_r2],
            s_none,
            by_label[s_none],
            kind=EQUIVALENCE,
            margin=REPLAY_MARGIN,
        )
        out += [res] if res else []
        cells = [by_label[lb] for lb in (g_r2, g_none, s_r2, s_none)]
        runs = [r for c in cells for r in c if r.final_step is not None]
        benches = [b for b in block_benchmarks(runs) if all(b in block_benchmarks(c) for c in cells)]
        if not benches:
            continue
        (gr, figure), (gn, _), (sr, _), (sn, _) = (
            _seed_avg([r for r in c if r.final_step is not None], benches) for c in cells
        )
        seeds = sorted(set(gr) & set(gn) & set(sr) & set(sn))
        if len(seeds) < SEED_TEST_MIN:
            continue
        diffs = np.array([(gr[s] - gn[s]) - (sr[s] - sn[s]) for s in seeds])
        comparison = f"({g_r2} - {g_none}) - ({s_r2} - {s_none})"
        res = _seed_t(GSPO_REPLAY, ROUTING_SOURCE, comparison, figure, diffs, seeds, runs)
        cols = [avg_col(x) for x in benches]
        res.reads = [[g_r2, cols, 1], [g_none, cols, -1], [s_r2, cols, -1], [s_none, cols, 1]]
        out.append(res)
    return out


def stability_claims(
    by_label: dict[str, list[RunRecord]], cliff: set[float], method_of: dict[str, str]
) -> list[ClaimResult]:
    """STABILITY's claims at the rates in `cliff`: each rule against its reference at the same rate,
    and each rule against its own base model (a stable run does not lose the base model's accuracy;
    claimed sign +, so a significant loss does not hold), once per rule label."""
    out = []
    for rule, ref, claim, source in STABILITY:
        for a in (lb for lb in by_label if method_of[lb] == rule and run_lr(by_label[lb][0]) in cliff):
            for b in (lb for lb in by_label if method_of[lb] == ref):
                if not _same(by_label[a], by_label[b]):
                    continue
                res = accuracy_claim(claim, source, a, by_label[a], b, by_label[b])
                out += [res] if res else []
            res = accuracy_claim(
                BASE_CLAIM.format(name=NAMES[rule]),
                source,
                a,
                by_label[a],
                "base model (step 0)",
                by_label[a],
                b_initial=True,
                kind=NONINFERIORITY,
                margin=STABLE_MARGIN,
            )
            out += [res] if res else []
    return out


def _cliff(runs: Sequence[RunRecord]) -> set[float]:
    """The rates where grpo loses accuracy; without grpo, where any STABILITY reference arm does."""
    got = losing_rates(runs, "grpo")
    if got is None:
        got = set().union(*[losing_rates(runs, ref) or set() for _, ref, _, _ in STABILITY])
    return got


def _blocks(compared: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    blocks: dict[str, list[RunRecord]] = {}
    for r in compared:
        blocks.setdefault(r.model, []).append(r)
    return blocks


def cliffs(compared: Sequence[RunRecord]) -> dict[str, set[float]]:
    """{model: the rates of the learning-rate cliff} (module docstring): computed once on all the seeds,
    so the halves of a replication test the same claims."""
    return {model: _cliff(runs) for model, runs in _blocks(compared).items()}


def _final(run: RunRecord, bench: str) -> np.ndarray | None:
    """(P, n) correctness of the run's last evaluation on `bench`, or None."""
    if run.final_step is None or bench not in (run.evals.get(run.final_step) or {}):
        return None
    correct = run.evals[run.final_step][bench].get("correct")
    return np.asarray(correct, dtype=float) if correct else None


def _initial_avg(run: RunRecord, bench: str) -> float | None:
    """Avg@n of the run's step-0 evaluation on `bench` (its base model), points; None without one."""
    p = _payload_at(run, bench, _initial_step(run))
    return None if p is None or not p.get("correct") else 100.0 * float(np.asarray(p["correct"], dtype=float).mean())


def _endpoint(run: RunRecord, endpoint: str, bench: str) -> float | None:
    """One run's value of a family endpoint (config/claims.py: ENDPOINTS)."""
    if endpoint == "entropy":
        return _last_entropy(run)
    c = _final(run, bench)
    if c is None:
        return None
    if endpoint == "avg":
        return 100.0 * float(c.mean())
    n = c.shape[1]
    return 100.0 * float(np.mean(pass_at_k_array(n, c.sum(1).astype(int), n)))


def _figure(endpoint: str, bench: str, runs: Sequence[RunRecord]) -> str:
    ns = sorted({c.shape[1] for r in runs if (c := _final(r, bench)) is not None})
    n = ns[0] if len(ns) == 1 else "n"
    return {
        "avg": f"Avg@{n}, last eval (pts, {bench})",
        "pass": f"Pass@{n}, last eval (pts, {bench})",
        "entropy": "entropy, last fifth (nats)",
    }[endpoint]


def family_claims(family: ClaimFamily, runs: Sequence[RunRecord]) -> list[ClaimResult]:
    """The preregistered family on one block's runs (module docstring), uncorrected; a comparison whose
    rule has no run here is left out (the report lists the family's size as declared and as tested)."""
    by_rule: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_rule.setdefault(r.method, []).append(r)
    out: list[ClaimResult] = []
    for rule, rs in by_rule.items():
        if rule in family.rules() and len({r.label for r in rs}) > 1:
            raise UserError(
                f"the preregistered claims compare rule {rule!r}, which has runs at several settings here "
                f"({', '.join(sorted({r.label for r in rs}))}): a compared arm is one setting"
            )
    for c in family.comparisons:
        a, b = by_rule.get(c.a), by_rule.get(c.b)
        if not a or not b:
            continue
        source = c.source or "preregistered"
        for e in c.endpoints:
            value = lambda r, e=e: _endpoint(r, e, family.benchmark)  # noqa: E731
            diffs = _paired_seeds(_per_seed(a, value), _per_seed(b, value))
            if diffs.size == 0:
                continue
            seeds = sorted(set(_per_seed(a, value)) & set(_per_seed(b, value)))
            figure, label = _figure(e, family.benchmark, [*a, *b]), f"{c.a} - {c.b}"
            col = {"avg": avg_col, "pass": pass_col}.get(e, lambda _: ENTROPY_COL)(family.benchmark)
            reads = [[a[0].label, [col], 1], [b[0].label, [col], -1]]
            found = [_seed_t(FAMILY_CLAIMS[e].format(a=c.a, b=c.b), source, label, figure, diffs, seeds, [*a, *b])]
            if e in family.equivalence:
                m = family.margins[e]
                claim = SAME.format(a=c.a, b=c.b, what=ENDPOINTS[e][0].split(" at ")[0], m=m, unit=ENDPOINTS[e][1])
                found.append(_seed_t(claim, source, label, figure, diffs, seeds, [*a, *b], EQUIVALENCE, m))
            for res in found:
                res.reads = reads
            out += found
    return out


# the claim each endpoint of a preregistered comparison tests (claimed sign +), and its equivalence
FAMILY_CLAIMS = {
    "avg": "{a} beats {b} on held-out accuracy",
    "pass": "{a} keeps a higher Pass@n than {b}",
    "entropy": "{a} keeps entropy higher than {b}",
}
SAME = "{a} and {b} do not differ in {what} (within +-{m:g} {unit})"


def evaluate_claims(
    sweep: Sweep | None,
    compared: Sequence[RunRecord],
    cliff_rates: dict[str, set[float]] | None = None,
    family: ClaimFamily | None = None,
) -> list[ClaimResult]:
    """Every claim that applies to the compared runs of a sweep, block by block (base model): the
    preregistered `family` when there is one (default: the sweep's own), else the papers' claims.
    `cliff_rates`: the cliff per block (default: `cliffs(compared)`)."""
    family = family if family is not None else (sweep.claims if sweep is not None else None)
    if family is not None:
        out = []
        for model, runs in _blocks(compared).items():
            found = family_claims(family, runs)
            for res in found:
                res.model = model
            out += found
        correct_family(out)
        return out
    out: list[ClaimResult] = []
    cliff_rates = cliffs(compared) if cliff_rates is None else cliff_rates
    for model, runs in _blocks(compared).items():
        first = len(out)
        by_label: dict[str, list[RunRecord]] = {}
        for r in runs:
            by_label.setdefault(r.label, []).append(r)
        method_of = {lb: rs[0].method for lb, rs in by_label.items()}
        arms = lambda m: [lb for lb in by_label if method_of[lb] == m]  # noqa: E731
        same = lambda a, b: _same(by_label[a], by_label[b])  # noqa: E731
        cliff = cliff_rates.get(model, set())

        for g in arms("grpo"):
            res = accuracy_claim(
                "RL from verifiable rewards raises held-out accuracy",
                "DeepSeekMath, GRPO",
                g,
                by_label[g],
                "base model (step 0)",
                by_label[g],
                b_initial=True,
            )
            out += [res] if res else []
            for a in (a for a in arms("abc") if same(a, g)):
                res = seed_claim(
                    "ABC-GRPO keeps entropy higher than GRPO",
                    "ABC-GRPO",
                    a,
                    by_label[a],
                    g,
                    by_label[g],
                    "entropy, last fifth (nats)",
                    _last_entropy,
                    ENTROPY_COL,
                )
                out += [res] if res else []
                res = accuracy_claim(
                    "ABC-GRPO beats GRPO on held-out accuracy", "ABC-GRPO, Table 3", a, by_label[a], g, by_label[g]
                )
                out += [res] if res else []
            for d in (d for d in arms("dapo") if same(d, g)):
                res = seed_claim(
                    "clip-higher keeps entropy higher than GRPO",
                    "DAPO",
                    d,
                    by_label[d],
                    g,
                    by_label[g],
                    "entropy, last fifth (nats)",
                    _last_entropy,
                    ENTROPY_COL,
                )
                out += [res] if res else []
            res = q4_claim(g, by_label[g])
            out += [res] if res else []
        for d in arms("dapo"):
            for n in arms("nsr"):
                if not same(n, d) or run_lr(by_label[n][0]) in cliff:  # at the cliff: the stability claim
                    continue
                res = accuracy_claim("NSR beats DAPO", "NSR", n, by_label[n], d, by_label[d])
                out += [res] if res else []
        for n in arms("nsr"):
            for c in arms("decay"):
                if _params(by_label[n][0]) != _params(by_label[c][0]) or not same(n, c):
                    continue
                res = accuracy_claim(
                    "stochastic rescue beats its deterministic twin", "NSR", n, by_label[n], c, by_label[c]
                )
                out += [res] if res else []
        for n in (n for n in arms("nsr") if _params(by_label[n][0]).get("base") == "sequence"):
            for g in (g for g in arms("gspo") if same(n, g)):
                res = accuracy_claim(NSR_GSPO, "NSR, abstract (MoE, against GSPO)", n, by_label[n], g, by_label[g])
                out += [res] if res else []
        out += routing_claims(by_label, method_of)
        out += stability_claims(by_label, cliff, method_of)
        for res in out[first:]:
            res.model = model
    correct_family(out)
    return out


def as_dicts(results: Sequence[ClaimResult]) -> list[dict]:
    return [asdict(r) for r in results]
