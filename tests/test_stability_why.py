"""scripts/stability_why.py: the rank association of a rule's loss at the cliff with its replayed step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "stability_why.py"


@pytest.fixture(scope="module")
def why():
    spec = importlib.util.spec_from_file_location("stability_why", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ref(name, runs, step, kl):
    return {
        "reference": name,
        "runs": runs,
        "per_rule": {r: {"param/grad_norm_ratio": {"mean": step[r]}, "lookahead/kl": {"mean": kl[r]}} for r in step},
    }


def test_spearman_of_mean_gain_with_step_over_grpos(why):
    # mean gains: a (-1-3)/2 = -2, grpo -5, c (-10-12)/2 = -11, d -20 (e is d's twin: not counted)
    gains = {"a": [-1.0, -3.0], "grpo": [-5.0], "c": [-10.0, -12.0], "d": [-20.0], "e": [-20.0]}
    # steps over grpo's 0.5: a 0.5, grpo 1, c 3, d 2; KL over grpo's 2: a 0.5, grpo 1, c 2, d 3
    ref = _ref(
        "grpo",
        ["r0", "r1"],
        {"a": 0.25, "grpo": 0.5, "c": 1.5, "d": 1.0, "e": 1.0},
        {"a": 1.0, "grpo": 2.0, "c": 4.0, "d": 6.0, "e": 6.0},
    )
    out = why.association(gains, [ref], identical=[["d", "e"]])
    assert [r["rule"] for r in out["rules"]] == ["a", "grpo", "c", "d"]  # by mean gain, best first
    assert [r["gain"] for r in out["rules"]] == [-2.0, -5.0, -11.0, -20.0]
    assert [r["step"]["grpo"] for r in out["rules"]] == [0.5, 1.0, 3.0, 2.0]
    # gain ranks a4 grpo3 c2 d1; step ranks a1 grpo2 c4 d3: d = 3, 1, -2, -2, sum d^2 = 18,
    # rho = 1 - 6*18 / (4*(16-1)) = -0.8
    assert out["rho"][("grpo", "step")][0] == pytest.approx(-0.8)
    # KL ranks a1 grpo2 c3 d4 against gain ranks a4 grpo3 c2 d1: a perfect reversal, rho = -1
    assert out["rho"][("grpo", "kl")][0] == pytest.approx(-1.0)
    text = why.markdown(out)
    assert "| c | 2 | -11.0 | 3.00 | 2.00 |" in text  # the pre-clip gradient norm, then the one-step KL
    assert "rho of the mean gain with the pre-clip gradient norm over GRPO's = -0.80" in text and "4 rules" in text


def test_the_test_is_at_the_family_level(why, monkeypatch):
    # issue 37 (7): near-identical rules are one data point. Families {grpo, b} and {c}, {d}, {a}:
    # gains grpo -5, b -7 -> family -6; a -2, c -11, d -20. KL over grpo's: grpo 1, b 1.5 -> 1.25; a 0.5, c 2, d 3
    monkeypatch.setattr(why, "FAMILIES", (("grpo", "b"),))
    gains = {"a": [-2.0], "grpo": [-5.0], "b": [-7.0], "c": [-11.0], "d": [-20.0]}
    ref = _ref(
        "grpo",
        ["r0"],
        {"a": 0.5, "grpo": 1.0, "b": 1.0, "c": 5.0, "d": 2.0},
        {"a": 0.5, "grpo": 1.0, "b": 1.5, "c": 2.0, "d": 3.0},
    )
    out = why.association(gains, [ref])
    fams = {f["family"]: f for f in out["families"]}
    assert set(fams) == {"grpo/b", "a", "c", "d"} and fams["grpo/b"]["gain"] == -6.0
    assert fams["grpo/b"]["kl"]["grpo"] == 1.25
    # family gains -2, -6, -11, -20 against KL 0.5, 1.25, 2, 3: a perfect reversal over 4 families
    assert out["rho_family"][("grpo", "kl")][0] == pytest.approx(-1.0)
    text = why.markdown(out)
    assert "Spearman's rho of the family's mean gain with its one-step KL over GRPO's = -1.00" in text
    assert "4 families)" in text and "Rule level (near-identical rules counted separately" in text
    # the rule with the largest pre-clip gradient norm is named with the rank of its gain
    assert "the largest pre-clip gradient norm on grpo's batches: c (5.0x grpo's), whose mean gain ranks 4 of 5" in text


def test_from_pages_reads_the_published_tables(why):
    studies = SCRIPT.parent.parent / "docs" / "studies"
    gains, refs, identical = why.from_pages(studies / "stability.md", studies / "stability_replay" / "report.md")
    assert gains["luspo"][:2] == [-4.2, -10.2] and len(gains) == 27
    grpo = next(r for r in refs if r["reference"] == "grpo")
    # luspo on grpo's batches: its printed |grad| ratio over grpo's = 12.11 (why.md's luspo row)
    out = why.association(gains, refs, identical)
    luspo = next(r for r in out["rules"] if r["rule"] == "luspo")
    assert luspo["step"]["grpo"] == pytest.approx(12.11, abs=0.01) and len(grpo["per_rule"]) == 27


def test_a_rule_without_a_replay_or_without_a_gain_is_left_out(why):
    gains = {"grpo": [-5.0], "a": [-2.0], "b": [-1.0], "only_outcome": [0.0]}
    ref = _ref(
        "grpo",
        ["r0"],
        {"grpo": 1.0, "a": 2.0, "b": 3.0, "only_replay": 9.0},
        {"grpo": 1.0, "a": 2.0, "b": 3.0, "only_replay": 9.0},
    )
    out = why.association(gains, [ref])
    assert [r["rule"] for r in out["rules"]] == ["b", "a", "grpo"]
    assert out["rho"][("grpo", "step")][0] == pytest.approx(1.0)  # the larger step, the better here


def test_the_organism_preset_groups_its_families_and_has_no_within_group(why):
    # issue 36 (4): the organism's rules; grpo/dapo/dual_clip/nsr/decay one family, gspo/luspo another
    rules = ["grpo", "dapo", "dual_clip", "nsr", "decay", "gspo", "luspo", "abc", "cispo", "sapo"]
    gains = {r: [float(i)] for i, r in enumerate(rules)}  # grpo 0 ... sapo 9
    ref = _ref("grpo", ["r0"], {r: 1.0 for r in rules}, {r: 1.0 + i for i, r in enumerate(rules)})
    out = why.association(gains, [ref], groups=why.ORGANISM_FAMILIES, within=None)
    fams = {f["family"]: f for f in out["families"]}
    assert set(fams) == {"grpo/dapo/dual_clip/nsr/decay", "gspo/luspo", "abc", "cispo", "sapo"}
    assert fams["grpo/dapo/dual_clip/nsr/decay"]["gain"] == 2.0  # (0 + 1 + 2 + 3 + 4) / 5
    assert fams["gspo/luspo"]["kl"]["grpo"] == 6.5  # (6 + 7) / 2
    # the families' gains 2, 5.5, 7, 8, 9 and KLs 3, 6.5, 8, 9, 10 rise together: rho +1 over 5 families
    assert out["rho_family"][("grpo", "kl")][0] == pytest.approx(1.0)
    assert out["within"] == [] and "Within the rules" not in why.markdown(out)


def test_the_in_run_drift_is_each_rules_own_approx_kl_over_grpos(why, tmp_path):
    """The replay's look-ahead steps with the reference run's AdamW moments (a rule with k times
    GRPO's gradient moves about k times as far); `--drift` reads each rule's own runs' approx_kl."""
    import json

    import yaml

    for i, (rule, kls, state) in enumerate(
        [("grpo", [1.0, 3.0], "finished"), ("grpo", [2.0, 2.0], "finished"), ("luspo", [3.0, 5.0], "finished"),
         ("cispo", [1.0, 1.0], "finished"), ("cispo", [90.0], "running")]
    ):  # fmt: skip
        d = tmp_path / "s" / f"run{i}"
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(
            yaml.safe_dump({"seed": i, "objective": {"method": rule}, "train": {"lr": 1e-4}})
        )
        (d / "status.json").write_text(json.dumps({"state": state}))
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps({"opt_step": j, "approx_kl": k}) + "\n" for j, k in enumerate(kls))
        )
    from clipbench.report.load import load_results

    drift = why.drift_by_rule(load_results(tmp_path, "s").runs, by_method=True)
    # per run the mean over its steps: grpo (1+3)/2 = 2 and 2; luspo 4; cispo 1 (the running run is left out)
    assert drift == {"grpo": [2.0, 2.0], "luspo": [4.0], "cispo": [1.0]}
    gains = {"grpo": [10.0], "luspo": [5.0], "cispo": [20.0]}
    out = why.drift_association(gains, drift, groups=why.ORGANISM_FAMILIES)
    # over grpo's mean 2: cispo 0.5, grpo 1, luspo 2; gains cispo 20 > grpo 10 > luspo 5: a perfect reversal
    assert [(r["rule"], r["drift"]) for r in out["rules"]] == [("cispo", 0.5), ("grpo", 1.0), ("luspo", 2.0)]
    assert out["rho"][0] == pytest.approx(-1.0)
    text = why.drift_markdown(out)
    assert "| luspo | +5.0 | 2.00 |" in text and "rule level (not independent): rho = -1.00" in text
