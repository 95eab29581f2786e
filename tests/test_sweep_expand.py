"""Sweep expansion: axis applicability, zip, exclude, overrides, deterministic ids, the frozen manifest,
and the fast path checked run by run against the full config loader."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from clipbench.config import compose, run_id, to_dict, validate
from clipbench.config.compose import deep_merge, set_dotted
from clipbench.objectives import METHODS
from clipbench.sweep import expand, freeze, load_spec, read_manifest
from clipbench.sweep.manifest import manifest_path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "quickstart.yaml"


def write_sweep(tmp_path: Path, body: dict, name: str = "s.yaml") -> Path:
    body = {"base": str(RECIPE), **body}
    p = tmp_path / name
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


NSR_VS_DECAY = {
    "name": "nsr_vs_decay",
    "overrides": {"train.steps": 40},
    "grid": {"objective.method": ["dapo", "nsr", "decay"], "objective.p": [0.25, 0.5, 1.0], "seed": [0, 1, 2]},
}


def full_loader(spec_file: Path, point: dict, overrides: dict, recipe: Path = RECIPE) -> dict:
    """The slow reference: compose(recipe, overrides + the run's axis values) -> validate -> to_dict."""
    nested: dict = {}
    for k, v in {**overrides, **point}.items():
        set_dotted(nested, k, v)
    return to_dict(validate(compose(recipe, nested), str(spec_file)))


def test_objective_axis_applies_only_to_methods_with_that_parameter(tmp_path):
    f = write_sweep(tmp_path, NSR_VS_DECAY)
    exp = expand(load_spec(f))
    # 3 methods x 3 p x 3 seeds = 27 grid points; dapo has no `p`, so its 9 points are 3 runs:
    # 3 dapo + 9 nsr + 9 decay = 21.
    assert exp.combos == 27
    assert len(exp.runs) == 21
    assert Counter(c["objective"]["method"] for c in exp.runs.values()) == {"dapo": 3, "nsr": 9, "decay": 9}
    assert "p" not in METHODS["dapo"].defaults
    for rid, cfg in exp.runs.items():
        pt = exp.points[rid]
        assert ("objective.p" in pt) == (cfg["objective"]["method"] != "dapo")
        if "objective.p" in pt:
            assert cfg["objective"]["p"] == pt["objective.p"]
        assert cfg["train"]["steps"] == 40
    # (nsr/decay, p) pairs: all 3 x 3 x 3 present exactly once
    pairs = Counter(
        (c["objective"]["method"], c["objective"].get("p"), c["seed"])
        for c in exp.runs.values()
        if c["objective"]["method"] != "dapo"
    )
    assert len(pairs) == 18 and set(pairs.values()) == {1}


def test_fast_expansion_equals_the_full_loader_run_by_run(tmp_path):
    body = {
        "overrides": {"train.steps": 7, "objective.delta": 0.2, "eval.limit": 16},
        "grid": {
            "objective.method": ["grpo", "nsr", "abc"],
            "objective.p": [0.3, 1],
            "train.lr": ["1e-5", 3.0e-4],
            "seed": [0, 4],
        },
    }
    f = write_sweep(tmp_path, body)
    exp = expand(load_spec(f))
    # grpo: 2 lr x 2 seeds = 4; abc: 4; nsr: 2 p x 4 = 8
    assert len(exp.runs) == 16
    for rid, cfg in exp.runs.items():
        pt = exp.points[rid]
        m = cfg["objective"]["method"]
        over = {"train.steps": 7, "eval.limit": 16}
        if "delta" in METHODS[m].defaults:
            over["objective.delta"] = 0.2
        ref = full_loader(f, pt, over)
        assert cfg == ref, rid
        assert rid == run_id(ref)
    nsr = [c for c in exp.runs.values() if c["objective"]["method"] == "nsr"]
    assert {c["objective"]["delta"] for c in nsr} == {0.2}  # the file override reached nsr ...
    assert all("delta" not in c["objective"] for c in exp.runs.values() if c["objective"]["method"] != "nsr")
    assert {c["train"]["lr"] for c in exp.runs.values()} == {1e-5, 3e-4}  # "1e-5" (a YAML string) -> float


def test_zip_varies_keys_together(tmp_path):
    f = write_sweep(
        tmp_path,
        {"grid": {"seed": [0, 1]}, "zip": {"train.lr": [1.0e-5, 2.0e-5, 4.0e-5], "train.warmup_steps": [0, 5, 10]}},
    )
    exp = expand(load_spec(f))
    assert len(exp.runs) == 6  # 2 seeds x 3 zipped pairs, not 2 x 3 x 3 = 18
    pairs = {(c["train"]["lr"], c["train"]["warmup_steps"]) for c in exp.runs.values()}
    assert pairs == {(1e-5, 0), (2e-5, 5), (4e-5, 10)}


def test_zip_lists_must_have_equal_length(tmp_path):
    from clipbench.errors import ConfigError

    f = write_sweep(tmp_path, {"zip": {"train.lr": [1.0e-5, 2.0e-5], "train.warmup_steps": [0]}})
    with pytest.raises(ConfigError, match="same length"):
        load_spec(f)


def test_exclude_removes_matching_points(tmp_path):
    body = dict(
        NSR_VS_DECAY, exclude=[{"objective.method": "nsr", "objective.p": 1.0}, {"seed": 2, "objective.method": "dapo"}]
    )
    exp = expand(load_spec(write_sweep(tmp_path, body)))
    # 21 - 3 (nsr p=1 x 3 seeds) - 1 (dapo seed 2) = 17
    assert len(exp.runs) == 17
    keys = {(c["objective"]["method"], c["objective"].get("p"), c["seed"]) for c in exp.runs.values()}
    assert not any(m == "nsr" and p == 1.0 for m, p, _ in keys)
    assert ("dapo", None, 2) not in keys and ("dapo", None, 1) in keys
    assert ("decay", 1.0, 0) in keys


def test_run_ids_are_deterministic_across_processes(tmp_path):
    f = write_sweep(tmp_path, NSR_VS_DECAY)
    ids = list(expand(load_spec(f)).runs)
    code = (
        "import json,sys; from clipbench.sweep import expand, load_spec; "
        "print(json.dumps(list(expand(load_spec(sys.argv[1])).runs)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(f)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ids
    assert len(set(ids)) == 21 and all(len(r) == 12 for r in ids)
    # the id is the hash of the resolved config, so a changed setting changes every id
    ids2 = list(expand(load_spec(f, ["train.lr=1e-5"])).runs)
    assert not set(ids) & set(ids2)


def test_command_line_overrides_win_and_can_pin_an_axis(tmp_path):
    f = write_sweep(tmp_path, NSR_VS_DECAY)
    exp = expand(load_spec(f, ["train.steps=5", "sampler.group_size=4"]))
    assert {c["train"]["steps"] for c in exp.runs.values()} == {5}  # the file said 40
    assert {c["sampler"]["group_size"] for c in exp.runs.values()} == {4}
    pinned = expand(load_spec(f, ["seed=7"]))
    assert len(pinned.runs) == 7  # 1 dapo + 3 nsr + 3 decay
    assert {c["seed"] for c in pinned.runs.values()} == {7}
    assert any("replaces the axis" in w for w in pinned.warnings)
    only_dapo = expand(load_spec(f, ["objective.method=dapo"]))
    assert len(only_dapo.runs) == 3  # p does not apply to dapo


def test_base_recipe_objective_params_are_dropped_for_other_methods(tmp_path):
    recipe = tmp_path / "nsr_recipe.yaml"
    text = RECIPE.read_text()
    assert "  name: grpo" in text  # the recipe's objective, in the one form
    recipe.write_text(text.replace("  name: grpo", "  name: nsr\n  p: 0.3\n  delta: 0.05", 1))
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({"base": "nsr_recipe.yaml", "grid": {"objective.method": ["grpo", "nsr"]}}))
    exp = expand(load_spec(f))
    by_m = {c["objective"]["method"]: c["objective"] for c in exp.runs.values()}
    assert by_m["grpo"] == {"method": "grpo", **METHODS["grpo"].defaults}
    assert by_m["nsr"]["p"] == 0.3 and by_m["nsr"]["delta"] == 0.05


def test_manifest_is_frozen_against_recipe_edits_and_appends_new_runs(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.read_text())
    f = tmp_path / "s.yaml"
    body = {"name": "frz", "base": "r.yaml", "grid": {"objective.method": ["grpo", "dapo"], "seed": [0, 1]}}
    f.write_text(yaml.safe_dump(body))
    res = tmp_path / "results"
    first = freeze(res, load_spec(f), expand(load_spec(f)))
    assert len(first.new) == 4 and first.warnings == []
    m0 = read_manifest(manifest_path(res, "frz"))
    assert set(m0) >= {"sweep", "source", "created", "runs", "points"} and m0["sweep"] == "frz"
    assert list(m0["runs"]) == first.new

    # edit the recipe mid-sweep: the same grid points keep their frozen configs, nothing is appended
    data = yaml.safe_load(RECIPE.read_text())
    lr0 = float(data["train"]["lr"])
    data["train"]["lr"] = lr1 = lr0 * 3
    recipe.write_text(yaml.safe_dump(data))
    again = freeze(res, load_spec(f), expand(load_spec(f)))
    assert again.new == [] and len(again.kept_frozen) == 4
    assert any("frozen configs are kept" in w for w in again.warnings)
    m1 = read_manifest(manifest_path(res, "frz"))
    assert m1["runs"] == m0["runs"]
    assert {c["train"]["lr"] for c in m1["runs"].values()} == {lr0}

    # extend the grid: only the new points are appended (from today's recipe), with a warning
    body["grid"]["seed"] = [0, 1, 2]
    f.write_text(yaml.safe_dump(body))
    more = freeze(res, load_spec(f), expand(load_spec(f)))
    assert len(more.new) == 2 and any("appended" in w for w in more.warnings)
    m2 = read_manifest(manifest_path(res, "frz"))
    assert list(m2["runs"])[:4] == list(m0["runs"]) and len(m2["runs"]) == 6
    assert {m2["runs"][r]["seed"] for r in more.new} == {2}
    assert {m2["runs"][r]["train"]["lr"] for r in more.new} == {lr1}
    for r in m0["runs"]:
        assert m2["runs"][r] == m0["runs"][r]


def test_ten_thousand_runs_expand_to_distinct_valid_configs(tmp_path):
    """The benchmark's grid (bench/bench_sweep.py times it): 10,000 distinct runs, each the loader's."""
    grid = {
        "objective.method": ["nsr", "decay"],
        "objective.p": [i / 10 for i in range(1, 11)],
        "objective.delta": [0.05, 0.1, 0.2, 0.3, 0.4],
        "train.lr": [1e-6 * (i + 1) for i in range(10)],
        "seed": list(range(10)),
    }
    f = write_sweep(tmp_path, {"grid": grid})
    exp = expand(load_spec(f))
    assert len(exp.runs) == 2 * 10 * 5 * 10 * 10 == 10_000
    sample = list(exp.runs.items())[::997]
    for rid, cfg in sample:
        assert run_id(cfg) == rid


def test_the_sampler_correction_is_an_axis_whose_parameters_apply_to_their_corrections(tmp_path):
    """sampler.correction.name x sampler.correction.cap x 2 seeds = 16 points: cap applies to tis only,
    so none, icepop and geo_mask are 2 runs each and tis 4: 10 runs, each the full loader's config;
    a tis point with cap 2 is the run of the former `sampler.mismatch_is: token` (same id)."""
    from clipbench.config import load_run_config
    from clipbench.config.labels import label

    f = write_sweep(
        tmp_path,
        {
            "name": "corr",
            "overrides": {"train.steps": 40},
            "grid": {
                "sampler.correction.name": ["none", "tis", "icepop", "geo_mask"],
                "sampler.correction.cap": [2.0, 3.0],
                "seed": [0, 1],
            },
        },
    )
    exp = expand(load_spec(f))
    assert exp.combos == 16 and len(exp.runs) == 10 and not exp.warnings
    names = Counter(cfg["sampler"]["correction"]["name"] for cfg in exp.runs.values())
    assert names == {"none": 2, "tis": 4, "icepop": 2, "geo_mask": 2}
    for rid, cfg in exp.runs.items():
        point = exp.points[rid]
        assert ("sampler.correction.cap" in point) == (cfg["sampler"]["correction"]["name"] == "tis")
        nested = {
            "sampler": {
                "correction": {
                    "name": point["sampler.correction.name"],
                    **({"cap": point["sampler.correction.cap"]} if "sampler.correction.cap" in point else {}),
                }
            }
        }
        assert cfg == to_dict(
            validate(compose(RECIPE, deep_merge(nested, {"seed": point["seed"], "train": {"steps": 40}})), "x")
        )
    former = load_run_config(RECIPE, ["sampler.mismatch_is=token", "train.steps=40"])
    assert run_id(former) in exp.runs
    rid = run_id(former)
    assert label(exp.points[rid]) == "correction=tis cap=2 seed=0"


@pytest.mark.parametrize(
    "body, where, reason",
    [
        ({"grid": {"sampler.correction.cpa": [2.0]}}, "grid.sampler.correction.cpa", "did you mean 'cap'"),
        (
            {"grid": {"sampler.correction.name": ["tis"], "sampler.correction.low": [0.5]}},
            "grid.sampler.correction.low",
            "only geo_mask, icepop, kl_rs, vaco, veto have it",
        ),
        ({"grid": {"sampler.correction.name": ["icepp"]}}, "grid.sampler.correction.name", "unknown correction"),
        ({"grid": {"sampler.mismatch_is": ["token"]}}, "grid.sampler.mismatch_is", "is now sampler.correction.name"),
    ],
)
def test_correction_axis_errors_name_the_sweep_key(tmp_path, body, where, reason):
    from clipbench.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        expand(load_spec(write_sweep(tmp_path, body)))
    assert e.value.key == where and reason in e.value.reason, str(e.value)


def test_the_former_keys_still_work_in_a_sweeps_overrides(tmp_path):
    from clipbench.config import load_run_config

    f = write_sweep(
        tmp_path,
        {"overrides": {"sampler.mismatch_is": "sequence", "sampler.mismatch_is_cap": 3}, "grid": {"seed": [0]}},
    )
    (rid,) = expand(load_spec(f)).runs
    assert rid == run_id(load_run_config(RECIPE, ["sampler.correction={name: tis, level: sequence, cap: 3}"]))


def test_a_zip_column_may_repeat_a_value_but_not_a_row(tmp_path):
    from clipbench.errors import ConfigError

    f = write_sweep(
        tmp_path, {"grid": {"seed": [0]}, "zip": {"objective.method": ["grpo", "dapo"], "train.lr": [1e-4, 1e-4]}}
    )
    assert len(expand(load_spec(f)).runs) == 2
    f = write_sweep(
        tmp_path, {"grid": {"seed": [0]}, "zip": {"objective.method": ["grpo", "grpo"], "train.lr": [1e-4, 1e-4]}}
    )
    with pytest.raises(ConfigError, match="row 1 repeats an earlier row"):
        load_spec(f)
