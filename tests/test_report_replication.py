"""Verdicts that say whether they replicate (report/replication.py), the smallest effect each claim's
design detects (claims.py, stats.mde), and the machines and base-model checksums a report spans
(report/machines.py): golden numbers on hand-built runs and stores."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from clipbench.errors import UserError
from clipbench.report import stats
from clipbench.report.build import build_report
from clipbench.report.claims import evaluate_claims
from clipbench.report.load import RunRecord
from clipbench.report.replication import halves, replicate_against, replicate_by_halves, seed_ranges, summary_line


def run(method, seed, entropy_last=0.5, final=None, base=None, n=2):
    """One finished run: 5 optimizer steps, entropy 1.0 then `entropy_last` (its last fifth); evaluations
    at step 0 (`base`) and 5 (`final`), lists of per-problem correct-sample counts out of n."""
    rows = [{"step": i, "entropy": 1.0 if i < 4 else entropy_last, "accuracy": 0.5} for i in range(5)]

    def payload(counts):
        return {
            "arith": {
                "problem_ids": [f"p{i}" for i in range(len(counts))],
                "n": n,
                "correct": [[1] * c + [0] * (n - c) for c in counts],
            }
        }

    evals = {}
    if final is not None:
        evals[5] = payload(final)
    if base is not None:
        evals[0] = payload(base)
    cfg = {"seed": seed, "model": {"name": "m"}, "objective": {"method": method}}
    return RunRecord(
        run_id=f"{method}-{seed}", path=Path("."), config=cfg, state="finished", metrics=rows, evals=evals, label=method
    )


def entropy_runs(diffs):
    """grpo at entropy 0.5 on every seed; abc at 0.5 + diffs[seed]: abc - grpo = diffs, paired by seed."""
    return [run("grpo", s) for s in range(len(diffs))] + [run("abc", s, 0.5 + d) for s, d in enumerate(diffs)]


def claim(runs, name):
    (c,) = [c for c in evaluate_claims(None, runs) if c.claim == name]
    return c


ENTROPY = "ABC-GRPO keeps entropy higher than GRPO"
LEARNS = "RL from verifiable rewards raises held-out accuracy"


def test_seed_ranges_and_halves():
    assert seed_ranges([0, 1, 2, 3, 4, 7, 9, 10]) == "0-4, 7, 9-10"
    assert halves(range(10)) == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    assert halves([3, 1, 2, 0, 4]) == ([0, 1], [2, 3, 4])  # odd: the second half is the larger


# ---- the smallest detectable effect -------------------------------------------------------------


def test_mde_of_a_paired_t_over_seeds_golden():
    # abc - grpo per seed 0.1, 0.2, 0.3, 0.4, 0.5: mean 0.3, sd = sqrt((.04 + .01 + 0 + .01 + .04) / 4)
    # = sqrt(0.025) = 0.158114, se = 0.158114 / sqrt(5) = 0.0707107, df 4; t(0.975, 4) = 2.7764,
    # t(0.80, 4) = 0.9410: MDE = 3.7174 * 0.0707107 = 0.26286
    c = claim(entropy_runs([0.1, 0.2, 0.3, 0.4, 0.5]), ENTROPY)
    assert c.se == pytest.approx(0.0707107, rel=1e-5) and c.df == 4
    assert c.mde == pytest.approx(0.26286, rel=1e-4)
    assert c.verdict == "holds" and c.needed is None  # p = 0.0046: nothing more needed


def test_inconclusive_seed_claim_says_how_many_seeds_would_detect_it():
    # diffs 0.3, -0.1, 0.5, 0.1: mean 0.2, sd = sqrt((0.01 + 0.09 + 0.09 + 0.01) / 3) = 0.258199, p = 0.22
    # seeds needed: the first n with (t(.975, n-1) + t(.80, n-1)) * 0.258199 / sqrt(n) <= 0.2:
    #   n = 15: (2.1448 + 0.8681) * 0.258199 / 3.873 = 0.2009 > 0.2;  n = 16: (2.1314 + 0.8662) * 0.258199 / 4 = 0.1935
    c = claim(entropy_runs([0.3, -0.1, 0.5, 0.1]), ENTROPY)
    assert c.verdict == "inconclusive at this scale" and c.p == pytest.approx(0.2191, abs=1e-4)
    assert c.needed == {"unit": "seeds", "n": 16, "factor": 4.0}
    assert stats.seeds_needed(1.0, 1.0) == 10  # n = 9: (2.306 + 0.889) / 3 = 1.065; n = 10: 3.146 / 3.162 = 0.995
    assert stats.seeds_needed(1.0, 0.0) is None


def test_mde_of_a_bootstrap_over_problems_golden():
    # 8 problems x 2 samples, one seed (so the test is over problems). learns: base all wrong; final
    # p0-p5 one sample of two right: per-problem differences 50 x 6, 0 x 2 (pts). mean 37.5; sd = sqrt((6 * 12.5^2 + 2 * 37.5^2) / 7) = sqrt(3750 / 7) = 23.1455; se = 23.1455 / sqrt(8)
    # = 8.18317, df 7; t(0.975, 7) = 2.3646, t(0.80, 7) = 0.8960: MDE = 3.2606 * 8.18317 = 26.682
    base = [0] * 8
    runs = [run("grpo", 0, final=[1] * 6 + [0, 0], base=base)]
    c = claim(runs, LEARNS)
    assert (
        c.estimate == pytest.approx(37.5)
        and c.n == 8
        and c.test == "paired bootstrap, problems (within-seed noise only)"
    )
    assert c.se == pytest.approx(8.18317, rel=1e-5) and c.df == pytest.approx(7)
    assert c.mde == pytest.approx(26.682, rel=1e-4)


def test_inconclusive_accuracy_claim_says_how_many_problems_would_detect_it():
    # one seed, 8 problems: diffs +50, -50, +50, then 0 x 5 (pts): mean 6.25, sd = sqrt((2 * 43.75^2
    # + 56.25^2 + 5 * 6.25^2) / 7) = sqrt(7187.5 / 7) = 32.0435, se = 11.3291, MDE = 3.2606 * 11.3291
    # = 36.940; factor = (36.940 / 6.25)^2 = 34.93 -> ceil(34.93 * 8) = 280 problems
    runs = [run("grpo", 0, final=[1, 0, 1, 0, 0, 0, 0, 0], base=[0, 1, 0, 0, 0, 0, 0, 0])]
    c = claim(runs, LEARNS)
    assert c.estimate == pytest.approx(6.25) and c.verdict == "inconclusive at this scale"
    assert c.mde == pytest.approx(36.940, rel=1e-4)
    assert c.needed["unit"] == "problems" and c.needed["n"] == 280
    assert c.needed["factor"] == pytest.approx(34.933, rel=1e-4)


# ---- halves ---------------------------------------------------------------------------------------


def replicated(runs, name):
    cs = evaluate_claims(None, runs)
    replicate_by_halves(cs, runs)
    (c,) = [c for c in cs if c.claim == name]
    return c


def test_halves_that_agree_are_consistent():
    # issue 37: two halves of one sweep are split-half consistency, not replication
    c = replicated(entropy_runs([0.10, 0.12, 0.08, 0.11, 0.09, 0.10, 0.13, 0.07, 0.10, 0.11]), ENTROPY)
    rep = c.replication
    assert c.verdict == "holds" and rep["status"] == "consistent"
    assert rep["by"] == "split-half consistency (two halves of the seeds)"
    assert [p["name"] for p in rep["parts"]] == ["seeds 0-4", "seeds 5-9"]
    assert [p["verdict"] for p in rep["parts"]] == ["holds", "holds"]
    assert rep["parts"][0]["estimate"] == pytest.approx(0.10) and rep["parts"][1]["estimate"] == pytest.approx(0.102)


def test_a_verdict_only_the_pooled_seeds_reach_is_inconsistent():
    # seeds 0-4: mean +0.10, sd 0.0158, p = 0.00015 (holds); seeds 5-9: mean +0.006, p = 0.80 (inconclusive);
    # all 10: mean 0.053, sd 0.0607, t = 0.053 / (0.0607 / sqrt 10) = 2.76, p = 0.022 (holds): the half
    # that does not reach it makes the verdict fragile
    diffs = [0.10, 0.12, 0.08, 0.11, 0.09, 0.05, -0.04, 0.06, -0.05, 0.01]
    c = replicated(entropy_runs(diffs), ENTROPY)
    assert c.verdict == "holds" and c.p == pytest.approx(0.02215, abs=1e-4)
    assert c.replication["status"] == "inconsistent"
    assert [p["verdict"] for p in c.replication["parts"]] == ["holds", "inconclusive at this scale"]


def test_inconclusive_halves_with_opposite_signs_are_inconsistent_and_same_signs_consistent():
    # halves of 5 seeds, each +0.06 (sd 0.2133, t = 0.63, p 0.56); all ten +0.06, p 0.40
    same = replicated(entropy_runs([0.3, -0.2, 0.1, 0.25, -0.15] * 2), ENTROPY)
    assert same.verdict == "inconclusive at this scale" and same.replication["status"] == "consistent"
    # halves +0.06 and -0.06 (p 0.49 each), the whole 0: opposite signs
    opposite = replicated(entropy_runs([0.3, -0.1, 0.2, 0.1, -0.2, -0.3, 0.1, -0.2, -0.1, 0.2]), ENTROPY)
    assert opposite.verdict == "inconclusive at this scale" and opposite.replication["status"] == "inconsistent"


def test_accuracy_halves_disagree_inconsistent():
    # seeds 0-4: p0-p5 learned (both samples right), seeds 5-9: nothing learned; base all wrong.
    # all ten, a paired t over seeds: gains +75 x 5, 0 x 5 -> mean +37.5, sd 39.528,
    # t = 37.5 / (39.528 / sqrt 10) = 3.0, df 9, p = 0.01496 (holds: the family is this one claim).
    # halves of 5 seeds, the same test: +75 x 5 (no spread: p = 0, holds) and 0 x 5 (p = 1,
    # inconclusive): a half that does not reach the whole's verdict makes it inconsistent
    base = [0] * 8
    runs = [run("grpo", s, final=([2] * 6 + [0, 0]) if s < 5 else [0] * 8, base=base) for s in range(10)]
    c = replicated(runs, LEARNS)
    assert c.verdict == "holds" and c.estimate == pytest.approx(37.5)
    assert c.test == "paired t, seeds" and c.n == 10 and c.p == pytest.approx(0.014956, abs=1e-5)
    parts = c.replication["parts"]
    assert [p["name"] for p in parts] == ["seeds 0-4", "seeds 5-9"]
    assert parts[0]["estimate"] == pytest.approx(75.0) and parts[0]["verdict"] == "holds"
    assert parts[1]["estimate"] == 0.0 and parts[1]["verdict"] == "inconclusive at this scale"
    assert c.replication["status"] == "inconsistent"


def test_too_few_seeds_to_split_is_said_not_guessed():
    # issue 37: 5 seeds per half (a t over 2 or 3 seeds has 1 or 2 degrees of freedom); 9 seeds split 4 + 5
    c = replicated(entropy_runs([0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3]), ENTROPY)
    assert c.replication["status"] == "not tested" and not c.replication["parts"]
    assert c.replication["reason"] == "too few seeds to split: 9, each half needs 5 (10 in all)"
    one = replicated([run("grpo", 0, final=[2, 0], base=[0, 0])], LEARNS)  # one seed: no halves
    assert one.replication["reason"] == "too few seeds to split: 1, each half needs 5 (10 in all)"
    two = replicated([run("grpo", s, final=[2, 0], base=[0, 0]) for s in (0, 1)], LEARNS)
    assert two.test == "paired t, seeds" and two.replication["status"] == "not tested"
    assert two.replication["reason"] == "too few seeds to split: 2, each half needs 5 (10 in all)"


def test_a_second_build_of_the_base_model_replicates():
    """Sweep B ran on another build (another model name, one block on each side): the claims match by
    claim and comparison; with two models on a side they match by model too."""
    a = entropy_runs([0.10, 0.12, 0.08, 0.11, 0.09])
    b = entropy_runs([0.09, 0.11, 0.10, 0.12, 0.08])
    for r in b:
        r.config["model"]["name"] = "/builds/arith-steps-seed1"
    cs = evaluate_claims(None, a)
    other = evaluate_claims(None, b)
    assert {c.model for c in other} == {"/builds/arith-steps-seed1"} and {c.model for c in cs} == {"m"}
    replicate_against(cs, other, "B")
    (e,) = [c for c in cs if c.claim == ENTROPY]
    assert e.replication["status"] == "replicates" and e.replication["parts"][0]["name"] == "B: seeds 0-4"
    replicate_against(cs, other + evaluate_claims(None, a), "B2")  # B2 has both models: matched by model
    assert e.replication["status"] == "replicates"


def test_a_second_sweep_replicates_or_not():
    a = entropy_runs([0.10, 0.12, 0.08, 0.11, 0.09])
    cs = evaluate_claims(None, a)
    replicate_against(cs, evaluate_claims(None, entropy_runs([0.09, 0.11, 0.10, 0.12, 0.08])), "B")
    (e,) = [c for c in cs if c.claim == ENTROPY]
    assert e.replication["status"] == "replicates" and e.replication["by"] == "against sweep 'B'"
    assert e.replication["parts"][0]["name"] == "B: seeds 0-4"
    replicate_against(cs, evaluate_claims(None, entropy_runs([-0.10, -0.12, -0.08, -0.11, -0.09])), "C")
    assert e.replication["status"] == "fragile" and e.replication["parts"][0]["verdict"] == "does not hold"
    replicate_against(cs, [], "D")
    assert e.replication == {
        "status": "not tested",
        "by": "against sweep 'D'",
        "parts": [],
        "reason": "sweep 'D' has no such comparison",
    }


# ---- on a store: --replicate, checksums, machines -------------------------------------------------


def machine(cpu="Test CPU A", threads=2, world=1):
    return (
        {
            "cpu": cpu,
            "cpu_flags": "fpu sse2 avx2",
            "cpu_capability": "AVX2",
            "cpus": 2,
            "gpu": None,
            "gpu_count": 0,
            "cuda": None,
        },
        threads,
        world,
    )


def write_provenance(run_dir: Path, sha: str | None, cpu: str = "Test CPU A", threads: int = 2, world: int = 1):
    m, t, w = machine(cpu, threads, world)
    record = {
        "step": 0,
        "time": 0.0,
        "engine": "builtin",
        "device": "cpu",
        "base_model": {"name": "builtin:arith-tiny", "path": "/x", "weights_sha256": sha},
        "machine": m,
        "software": {
            "python": "3.11.7",
            "os": "Linux",
            "torch": "2.13.0",
            "transformers": "5.19.0",
            "vllm": None,
            "trl": "1.16.0",
            "clipbench": "0.1.0",
        },
        "threads": t,
        "world_size": w,
    }
    (run_dir / "provenance.json").write_text(json.dumps({"starts": [record]}))


@pytest.fixture
def store(tmp_path, report_fixture) -> Path:
    return report_fixture.build(tmp_path / "results")


def test_replicate_option_checks_every_claim_against_the_second_sweep(store, tmp_path):
    shutil.copytree(store / "fixture", store / "again")
    _, result, tables, header = build_report(store, "fixture", "grpo", replicate="again")
    assert result["claims"] and all(c["replication"]["status"] == "replicates" for c in result["claims"])
    assert result["replicate"]["sweep"] == "again" and result["replicate"]["compared"] == 6
    assert any(line.startswith("Replication sweep 'again'") for line in header)
    assert any(
        line == f"Claims ({len(result['claims'])}) checked against sweep 'again': {len(result['claims'])} replicate."
        for line in header
    )
    (claims_table,) = [t for t in tables if t.key == "claims"]
    assert all(row[-1].startswith("replicates (again: seeds 0-1: holds") for row in claims_table.rows)
    # a path to a sweep directory elsewhere; abc's accuracy there no better than grpo's: fragile
    other = tmp_path / "elsewhere"
    shutil.copytree(store / "fixture", other / "b")
    for d in (other / "b").iterdir():
        if d.name.startswith("abc"):
            for f in (d / "eval" / "step_000002").glob("*.json"):
                f.write_text(f.read_text().replace('"correct": [[1, 1, 1, 1]', '"correct": [[0, 0, 0, 0]'))
    _, result, _, _ = build_report(store, "fixture", "grpo", replicate=str(other / "b"))
    status = {c["claim"]: c["replication"]["status"] for c in result["claims"]}
    assert status["ABC-GRPO beats GRPO on held-out accuracy"] == "fragile"
    assert status["RL from verifiable rewards raises held-out accuracy"] == "replicates"
    with pytest.raises(UserError, match="no runs for sweep 'nope'"):
        build_report(store, "fixture", "grpo", replicate="nope")


def test_replicate_needs_a_sweep_name(store):
    from clipbench.commands.report import report_command

    with pytest.raises(UserError, match="--replicate: name the sweep"):
        report_command(None, baseline="grpo", fmt="csv", results_dir=store, out=None, replicate="fixture")


def test_runs_compared_across_base_model_checksums_are_flagged(store):
    sha_a, sha_b = "a" * 64, "b" * 64
    for d in (store / "fixture").iterdir():
        if d.is_dir():  # grpo from one build, abc and nsr from another; seed 1 on another machine
            write_provenance(
                d, sha_a if d.name.startswith("grpo") else sha_b, cpu="Test CPU B" if "-s1" in d.name else "Test CPU A"
            )
    _, result, tables, header = build_report(store, "fixture", "grpo")
    prov = result["provenance"]
    assert prov["checksums"] == {"builtin:arith-tiny": [sha_a, sha_b]} and prov["mixed"] == ["builtin:arith-tiny"]
    assert len(prov["machines"]) == 2 and not prov["unrecorded"]
    machines = [line for line in header if line.startswith("Ran on 2 machines")]
    assert len(machines) == 1 and "Test CPU A (2 CPUs, AVX2, flags " in machines[0]
    assert "[1] Test CPU A" in machines[0] and "(grpo seed 0; abc seed 0; nsr seed 0)" in machines[0]
    assert "[2] Test CPU B" in machines[0] and "(grpo seed 1; abc seed 1; nsr seed 1)" in machines[0]
    warning = [line for line in header if line.startswith("WARNING: the runs of builtin:arith-tiny started from 2")]
    assert len(warning) == 1 and f"{sha_a[:12]}: grpo seeds 0-1" in warning[0]
    by_claim = {(c["claim"], c["comparison"]): c for c in result["claims"]}
    assert by_claim[("ABC-GRPO beats GRPO on held-out accuracy", "abc - grpo")]["checksums"] == [sha_a, sha_b]
    assert by_claim[("RL from verifiable rewards raises held-out accuracy", "grpo - base model (step 0)")][
        "checksums"
    ] == [sha_a]
    (ct,) = [t for t in tables if t.key == "claims"]
    row = next(r for r, _ in zip(ct.rows, ct.styles) if r[1] == "abc - grpo" and r[2].startswith("Avg@"))
    assert "[runs from 2 different base models: weights sha256 aaaaaaaa, bbbbbbbb]" in row[8]  # after p, p Holm
    # issue 37 (5): seeds 0 and 1 ran on two machines: said next to the verdict
    assert "[runs from 2 machines: the same run ids give different numbers on each]" in row[8]
    assert len(by_claim[("ABC-GRPO beats GRPO on held-out accuracy", "abc - grpo")]["machines"]) == 2
    assert ct.styles[ct.rows.index(row)] == "flagged"
    (pt,) = [t for t in tables if t.key == "provenance"]
    assert [r[1] for r in pt.rows] == [sha_a[:16]] * 2 + [sha_b[:16]] * 2 and set(pt.styles) == {"flagged"}
    assert [t.key for t in tables][-3:] == ["claims", "provenance", "runs"]


def test_one_checksum_is_stated_and_unrecorded_runs_are_said(store):
    for d in (store / "fixture").iterdir():
        if d.is_dir() and not d.name.startswith("nsr"):
            write_provenance(d, "c" * 64)
    _, result, _, header = build_report(store, "fixture", "grpo")
    assert "Base model builtin:arith-tiny: weights sha256 cccccccccccc for every run that recorded it." in header
    assert result["provenance"]["unrecorded"] == ["nsr-s0000000", "nsr-s1000000"]
    assert any(line.startswith("No provenance recorded for 2 run(s)") for line in header)
    assert not any(line.startswith("WARNING") for line in header)
    assert math.isfinite(result["claims"][0]["mde"])


def test_a_replication_on_another_machine_is_said():
    # issue 37 (5): a --replicate sweep whose runs ran elsewhere is said next to its verdict
    from clipbench.report.claims_table import replication_cell

    part = {"name": "B: seeds 0-4", "verdict": "holds", "estimate": 0.1, "p": 0.01, "machines": ["CPU B"]}
    c = {"machines": ["CPU A"], "replication": {"status": "replicates", "parts": [part]}}
    assert replication_cell(c).endswith("[on another machine: the same run ids need not give the same numbers]")
    c["machines"] = ["CPU B"]
    assert "another machine" not in replication_cell(c)


def test_a_replications_cell_gives_its_interval_and_the_holm_p_its_verdict_is_read_at():
    # the preregistration shows the second build's estimates and intervals beside the primary's.
    # B's abc - grpo per seed 0.09, 0.11, 0.10, 0.12, 0.08: mean 0.10, sd = sqrt(0.001 / 4) = 0.0158114,
    # se = 0.0158114 / sqrt(5) = 0.00707107, t(0.975, 4) = 2.776445: 0.10 +- 0.0196324 = [0.0804, 0.1196];
    # t = 14.14, p = 0.00015 (two-sided, df 4)
    from clipbench.report.claims_table import replication_cell

    cs = evaluate_claims(None, entropy_runs([0.10, 0.12, 0.08, 0.11, 0.09]))
    replicate_against(cs, evaluate_claims(None, entropy_runs([0.09, 0.11, 0.10, 0.12, 0.08])), "B")
    (e,) = [c for c in cs if c.claim == ENTROPY]
    (b,) = e.replication["parts"]
    assert b["ci"] == pytest.approx([0.0803676, 0.1196324], abs=1e-6) and b["p"] == pytest.approx(0.000146, rel=0.01)
    assert b["p"] <= b["p_holm"] <= 1  # Holm over B's own family of claims
    cell = replication_cell({"replication": e.replication})
    assert cell.startswith("replicates (B: seeds 0-4: holds +0.1 [+0.0804, +0.12], p <0.001, p Holm ")
    # a part written before parts kept an interval or a Holm p: neither is made up
    old = {"name": "B", "verdict": "holds", "estimate": 0.1, "p": 0.01}
    assert (
        replication_cell({"replication": {"status": "replicates", "parts": [old]}})
        == "replicates (B: holds +0.1, p 0.010)"
    )


def test_a_replication_sweep_still_running_is_said_first(store):
    """A partial replication sweep gave its verdicts without a word (the replicated sweep's own
    incompleteness was said); now the header's first lines say both."""
    shutil.copytree(store / "fixture", store / "again2")
    victim = sorted(d for d in (store / "again2").iterdir() if d.is_dir() and d.name.startswith("abc"))[0]
    status = json.loads((victim / "status.json").read_text())
    (victim / "status.json").write_text(json.dumps({**status, "state": "running"}))
    _, result, _, header = build_report(store, "fixture", "grpo", replicate="again2")
    assert header[0].startswith("INCOMPLETE: sweep 'again2' (the replication) has ")
    assert f"1 running: {victim.name}" in header[0] and result["replicate"]["compared"] == 5
    _, result, _, header = build_report(store, "fixture", "grpo", replicate="fixture")  # complete: no line
    assert result["replicate"]["incomplete"] is None and not header[0].startswith("INCOMPLETE")


def test_the_header_counts_replicated_verdicts_apart_from_inconclusive_claims():
    """The organism's confirmation: '19 replicate' over 40 claims, 16 of them inconclusive on both builds;
    of its 13 verdicts 3 replicate."""
    rep = lambda status: {"status": status, "by": "against sweep 'b2'"}  # noqa: E731
    claims = (
        [{"verdict": "holds", "replication": rep("replicates")}] * 2
        + [{"verdict": "does not hold", "replication": rep("replicates")}]
        + [{"verdict": "holds", "replication": rep("fragile")}] * 8
        + [{"verdict": "does not hold", "replication": rep("fragile")}] * 2
        + [{"verdict": "inconclusive at this scale", "replication": rep("replicates")}] * 16
        + [{"verdict": "inconclusive at this scale", "replication": rep("fragile")}] * 11
    )
    assert summary_line(claims) == (
        "Claims (40) checked against sweep 'b2': 19 replicate, 21 fragile; of the 13 that hold or do not hold, "
        "3 replicate, 10 fragile."
    )
