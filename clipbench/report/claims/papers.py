"""The papers' claims, one row each: what the paper claims, whose claim it is, the arms it compares,
the endpoint (endpoints.py), its kind and margin, and when a pair of arms applies. A claim applies
to a sweep when the sweep has the arms it compares (on the same base model), at the same setting
(`comparisons.setting`: the learning rate and its schedule, the routing replay) and with every other
key that can change what a run computes equal (`comparisons.comparable`), so a sweep with a
learning-rate axis gets each claim once per rate, and one with a routing-replay axis (a
mixture-of-experts model: docs/moe.md) once per replay setting; the routing claims (ROUTING)
compare the replay settings themselves.

At the learning-rate cliff, the rates where GRPO's mean gain over the base model is below 0
(`stability.losing_rates`; without grpo in the block, where the claim's reference arm loses), the
stability claims the rules' papers make apply (STABILITY): the rule keeps more held-out accuracy than
its reference there (Avg@n at the last evaluation, the same test as every accuracy claim; both arms
start from the same base model on the same problems, so this is also the difference of their gains
over it), and does not lose its own base model's accuracy (non-inferiority within STABLE_MARGIN). At
those rates "NSR improves stability over DAPO" takes the place of "NSR beats DAPO".

The rows are walked in groups (PAIRED, then the routing claims, then STABILITY): for each arm of the
group's anchor rule, its rows in order, the rows that compare the same two rules pair by pair. A new
claim is a row here and its line in docs/reports.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from clipbench.report.analysis import block_benchmarks
from clipbench.report.claims.comparisons import (
    SEED_TEST_MIN,
    accuracy_claim,
    blocks,
    comparable,
    params,
    q4_claim,
    seed_avg,
    seed_claim,
    seed_test,
    setting,
)
from clipbench.report.claims.endpoints import ENDPOINTS, avg_col
from clipbench.report.claims.verdicts import DIFFERENCE, EQUIVALENCE, NONINFERIORITY, ClaimResult
from clipbench.report.load import RunRecord
from clipbench.report.stability import losing_rates, run_lr

BASE = "base model (step 0)"  # b: the arm's own base model (its step-0 evaluation)
ALONE = ""  # b: none, the arm by itself
# The margins of the claims tested as non-inferiority ("does not lose") or equivalence ("no
# difference"), declared with the claims, in the figure's unit (Avg@n points), before any data:
# 2 points is about one seed-to-seed sd of the base model's Avg@8 on the studies' regime (1.5) and a
# fifth of GRPO's loss at the learning-rate cliff (about 9): a loss smaller than that is "not lost".
STABLE_MARGIN = 2.0
REPLAY_MARGIN = 2.0  # points of Avg@n: the same yardstick as STABLE_MARGIN
BASE_CLAIM = "{name} trains stably: does not lose the base model's held-out accuracy at the lr cliff"


@dataclass(frozen=True)
class Block:
    """One base model's compared runs, by label: what the rows' conditions read."""

    runs: dict[str, list[RunRecord]]
    cliff: set[float]

    def method(self, label: str) -> str:
        return self.runs[label][0].method

    def arms(self, rule: str) -> list[str]:
        return [lb for lb in self.runs if self.method(lb) == rule]

    def same(self, a: str, b: str) -> bool:
        """Whether arms a and b may be compared (`comparisons.comparable`)."""
        return comparable(self.runs[a], self.runs[b])


Condition = Callable[[Block, str, str], bool]  # (block, a's label, b's label) -> does the pair apply


def same_params(block: Block, a: str, b: str) -> bool:
    return params(block.runs[a][0]) == params(block.runs[b][0])


def off_cliff(block: Block, a: str, b: str) -> bool:
    return run_lr(block.runs[a][0]) not in block.cliff


def at_cliff(block: Block, a: str, b: str) -> bool:
    return run_lr(block.runs[a][0]) in block.cliff


def on_sequence(block: Block, a: str, b: str) -> bool:
    """a acts on GSPO's sequence ratio (`objective.base: sequence`)."""
    return params(block.runs[a][0]).get("base") == "sequence"


@dataclass(frozen=True)
class PaperClaim:
    """One paper's claim: arm `a` (a rule) is higher than `b` (a rule at the same setting, BASE, or
    ALONE) on `endpoint`, as a difference (claimed sign +), non-inferiority or equivalence claim."""

    claim: str
    source: str
    a: str
    b: str
    endpoint: str = "avg"
    kind: str = DIFFERENCE
    margin: float | None = None
    when: tuple[Condition, ...] = ()  # beyond the same setting (rule against rule)

    def partner(self, anchor: str) -> str:
        """The other side of the anchor rule's arm: a rule, BASE or ALONE."""
        return self.b if self.a == anchor else self.a


def claim(text, source, a, b, endpoint="avg", *, kind=DIFFERENCE, margin=None, when=()) -> PaperClaim:
    return PaperClaim(text, source, a, b, endpoint, kind, margin, when)


# (anchor rule, its rows): walked in this order, block by block
PAIRED = (
    (
        "grpo",
        (
            claim("RL from verifiable rewards raises held-out accuracy", "DeepSeekMath, GRPO", "grpo", BASE),
            claim("ABC-GRPO keeps entropy higher than GRPO", "ABC-GRPO", "abc", "grpo", "entropy"),
            claim("ABC-GRPO beats GRPO on held-out accuracy", "ABC-GRPO, Table 3", "abc", "grpo"),
            claim("clip-higher keeps entropy higher than GRPO", "DAPO", "dapo", "grpo", "entropy"),
            claim(
                "Q4 (A<0, r>1) is the largest share of GRPO's clip events",
                "ABC-GRPO, Fig. 4f: 41.4%",
                "grpo",
                ALONE,
                "q4_lead",
            ),
        ),
    ),
    ("dapo", (claim("NSR beats DAPO", "NSR", "nsr", "dapo", when=(off_cliff,)),)),
    ("nsr", (claim("stochastic rescue beats its deterministic twin", "NSR", "nsr", "decay", when=(same_params,)),)),
    ("nsr", (claim("NSR beats GSPO", "NSR, abstract (MoE, against GSPO)", "nsr", "gspo", when=(on_sequence,)),)),
)

# the routing claims (GSPO's Routing Replay, section 5.3 of arXiv 2507.18071): where a block has arms
# with routing replay none and r2 at the same learning rate (`routing_claims`)
ROUTING_SOURCE = "GSPO (arXiv 2507.18071), Routing Replay"
GRPO_REPLAY = claim(
    "GRPO needs routing replay on a mixture-of-experts model (r2 keeps more accuracy than none)",
    ROUTING_SOURCE,
    "grpo",
    "grpo",
)
GSPO_NO_REPLAY = claim(
    "GSPO does not need routing replay on a mixture-of-experts model (r2 and none equivalent)",
    ROUTING_SOURCE,
    "gspo",
    "gspo",
    kind=EQUIVALENCE,
    margin=REPLAY_MARGIN,
)
GSPO_REPLAY = claim(
    "routing replay matters for GRPO, not for GSPO (replay's gain is larger for GRPO than for GSPO)",
    ROUTING_SOURCE,
    "grpo",
    "gspo",
)


def _stability(rule: str, name: str, ref: str, text: str, source: str) -> tuple[str, tuple[PaperClaim, ...]]:
    """A rule's stability claims at the cliff: against its reference, and against its own base model."""
    stable = claim(
        BASE_CLAIM.format(name=name), source, rule, BASE, kind=NONINFERIORITY, margin=STABLE_MARGIN, when=(at_cliff,)
    )
    return rule, (claim(text, source, rule, ref, when=(at_cliff,)), stable)


STABILITY = (
    _stability(
        "nsr", "NSR", "dapo", "NSR improves stability over DAPO (more accuracy kept at the lr cliff)", "NSR, abstract"
    ),
    _stability(
        "cispo",
        "CISPO",
        "grpo",
        "CISPO trains stably: keeps more accuracy than GRPO at the lr cliff",
        "MiniMax-M1 (CISPO)",
    ),
    _stability("gspo", "GSPO", "grpo", "GSPO is more stable than GRPO: keeps more accuracy at the lr cliff", "GSPO"),
    _stability(
        "dual_clip",
        "dual-clip",
        "grpo",
        "dual-clip stabilizes training: keeps more accuracy than GRPO at the lr cliff",
        "dual-clip PPO (Ye et al., 2020)",
    ),
    _stability("sapo", "SAPO", "grpo", "SAPO is more stable than GRPO: keeps more accuracy at the lr cliff", "SAPO"),
)


def _test(row: PaperClaim, block: Block, a: str, b: str) -> ClaimResult | None:
    """The row's claim on arms a and b (b: a itself for BASE and ALONE), by its endpoint's test."""
    runs_a, runs_b = block.runs[a], block.runs[b]
    if row.endpoint == "q4_lead":
        return q4_claim(row.claim, row.source, a, runs_a)
    if row.endpoint == "avg":
        b_label = BASE if row.b == BASE else b
        kw = {"b_initial": row.b == BASE, "kind": row.kind, "margin": row.margin}
        return accuracy_claim(row.claim, row.source, a, runs_a, b_label, runs_b, **kw)
    e = ENDPOINTS[row.endpoint]
    return seed_claim(row.claim, row.source, a, runs_a, b, runs_b, e.figure(runs_a, ""), e.value, e.column)


def _applies(row: PaperClaim, block: Block, a: str, b: str) -> bool:
    if not all(cond(block, a, b) for cond in row.when):
        return False
    return row.b in (BASE, ALONE) or block.same(a, b)


def walk(groups: Sequence[tuple[str, Sequence[PaperClaim]]], block: Block) -> list[ClaimResult]:
    """Each group's rows on the block: for each arm of the anchor rule, the rows in order, those that
    compare the same two rules pair by pair."""
    out: list[ClaimResult] = []
    for anchor, rows in groups:
        for x in block.arms(anchor):
            for partner, same in itertools.groupby(rows, key=lambda r, anchor=anchor: r.partner(anchor)):
                same = list(same)
                for y in [x] if partner in (BASE, ALONE) else block.arms(partner):
                    for row in same:
                        a, b = (x, y) if row.a == anchor else (y, x)
                        if _applies(row, block, a, b) and (res := _test(row, block, a, b)):
                            out.append(res)
    return out


def routing_claims(block: Block) -> list[ClaimResult]:
    """ROUTING's claims, per learning rate: GRPO with r2 against GRPO with none (accuracy), GSPO's r2
    and none equivalent, and the difference of replay's gains, (grpo r2 - grpo none) - (gspo r2 - gspo
    none), paired by seed (the GSPO paper: GRPO needs Routing Replay to converge on MoE, GSPO does not)."""
    arm = {}  # (method, lr, schedule, replay) -> label; one label per cell (other axes: skipped)
    for lb, runs in block.runs.items():
        key = (block.method(lb), *setting(runs))
        arm[key] = None if key in arm else lb
    by_label, out = block.runs, []
    for (method, lr, sched, replay), g_none in sorted(arm.items(), key=str):
        g_r2 = arm.get((method, lr, sched, "r2"))
        if method != "grpo" or replay != "none" or not g_none or not g_r2:
            continue
        out += _routing(GRPO_REPLAY, g_r2, g_none, by_label)
        s_none, s_r2 = arm.get(("gspo", lr, sched, "none")), arm.get(("gspo", lr, sched, "r2"))
        if not s_none or not s_r2:
            continue
        out += _routing(GSPO_NO_REPLAY, s_r2, s_none, by_label)
        res = _replay_gain(g_r2, g_none, s_r2, s_none, by_label)
        out += [res] if res else []
    return out


def _routing(row: PaperClaim, r2: str, none: str, by_label) -> list[ClaimResult]:
    res = accuracy_claim(
        row.claim, row.source, r2, by_label[r2], none, by_label[none], kind=row.kind, margin=row.margin
    )
    return [res] if res else []


def _replay_gain(g_r2: str, g_none: str, s_r2: str, s_none: str, by_label) -> ClaimResult | None:
    """(grpo r2 - grpo none) - (gspo r2 - gspo none), per seed: GSPO_REPLAY."""
    cells = [by_label[lb] for lb in (g_r2, g_none, s_r2, s_none)]
    runs = [r for c in cells for r in c if r.final_step is not None]
    benches = [b for b in block_benchmarks(runs) if all(b in block_benchmarks(c) for c in cells)]
    if not benches:
        return None
    (gr, figure), (gn, _), (sr, _), (sn, _) = (
        seed_avg([r for r in c if r.final_step is not None], benches) for c in cells
    )
    seeds = sorted(set(gr) & set(gn) & set(sr) & set(sn))
    if len(seeds) < SEED_TEST_MIN:
        return None
    diffs = np.array([(gr[s] - gn[s]) - (sr[s] - sn[s]) for s in seeds])
    comparison = f"({g_r2} - {g_none}) - ({s_r2} - {s_none})"
    res = seed_test(GSPO_REPLAY.claim, GSPO_REPLAY.source, comparison, figure, diffs, seeds, runs)
    cols = [avg_col(x) for x in benches]
    res.reads = [[g_r2, cols, 1], [g_none, cols, -1], [s_r2, cols, -1], [s_none, cols, 1]]
    return res


def _cliff(runs: Sequence[RunRecord]) -> set[float]:
    """The rates where grpo loses accuracy; without grpo, where any STABILITY reference arm does."""
    got = losing_rates(runs, "grpo")
    if got is None:
        refs = [row.b for _, rows in STABILITY for row in rows if row.b != BASE]
        got = set().union(*[losing_rates(runs, ref) or set() for ref in refs])
    return got


def cliffs(compared: Sequence[RunRecord]) -> dict[str, set[float]]:
    """{model: the rates of the learning-rate cliff} (module docstring): computed once on all the seeds,
    so the halves of a replication test the same claims."""
    return {model: _cliff(runs) for model, runs in blocks(compared).items()}


def paper_claims(runs: Sequence[RunRecord], cliff: set[float]) -> list[ClaimResult]:
    """Every paper's claim that applies to one block's runs, uncorrected."""
    by_label: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_label.setdefault(r.label, []).append(r)
    block = Block(by_label, cliff)
    return walk(PAIRED, block) + routing_claims(block) + walk(STABILITY, block)
