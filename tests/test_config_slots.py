"""The components of a run as typed slots (issue 26 part 2): the objective, the sampler correction,
the aggregation and the advantage each take one YAML form, {name: <component>, <param>: ...}; the
older forms load to the same config and the same run id; one sweep rule expands `<slot>.name` and
`<slot>.<param>` axes for all four."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from clipbench.config import from_dict, load_run_config, run_id, to_dict
from clipbench.config.schema import SLOTS, Slot
from clipbench.errors import ConfigError
from clipbench.sweep import expand, load_spec

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "quickstart.yaml"
PINNED = json.loads((Path(__file__).parent / "fixtures" / "run_ids_0b85e9e.json").read_text())


@pytest.mark.parametrize(
    "one_form, older",
    [
        ("objective={name: dapo, eps_high: 0.3}", ["objective.method=dapo", "objective.eps_high=0.3"]),
        ("objective.name=nsr", ["objective.method=nsr"]),
        ("sampler.correction={name: icepop}", ["sampler.correction=icepop"]),
        (
            "sampler.correction={name: tis, level: sequence, cap: 3.0}",
            ["sampler.mismatch_is=sequence", "sampler.mismatch_is_cap=3.0"],
        ),
        ("train.agg={name: seq-mean-token-mean}", ["train.agg=seq-mean-token-mean"]),
        ("train.agg.name=token-sum", ["train.agg=token-sum"]),
        ("train.advantage={name: rloo}", ["train.advantage=rloo"]),
    ],
)
def test_the_one_form_loads_to_the_older_forms_config_and_run_id(one_form, older):
    new, old = load_run_config(RECIPE, [one_form]), load_run_config(RECIPE, older)
    assert to_dict(new) == to_dict(old) and run_id(new) == run_id(old)
    assert run_id(new) != run_id(load_run_config(RECIPE))  # the setting took effect


def test_a_slot_is_a_typed_field_of_name_and_resolved_parameters():
    cfg = load_run_config(RECIPE, ["objective={name: dapo}", "sampler.correction={name: tis, cap: 3.0}"])
    assert cfg.objective == Slot("dapo", {"eps_low": 0.2, "eps_high": 0.28})  # dapo's registry defaults
    assert cfg.objective["eps_high"] == 0.28
    assert cfg.sampler.correction == Slot("tis", {"level": "token", "floor": 0.0, "cap": 3.0})
    assert cfg.train.agg == Slot("token-mean") and cfg.train.advantage == Slot("group")
    assert set(SLOTS) == {"objective", "correction", "aggregation", "advantage"}
    # the stored form is the older one (to_dict alone translates): every run id stays valid
    d = to_dict(cfg)
    assert d["objective"] == {"method": "dapo", "eps_low": 0.2, "eps_high": 0.28}
    assert d["sampler"]["correction"] == {"name": "tis", "level": "token", "floor": 0.0, "cap": 3.0}
    assert d["train"]["agg"] == "token-mean" and d["train"]["advantage"] == "group"
    assert from_dict(d) == cfg


@pytest.mark.parametrize(
    "override, key, reason",
    [
        ("objective={name: dapo, method: grpo}", "objective.name", "set the name once"),
        ("train.agg={name: token-mean, scale: 2}", "train.agg.scale", "takes no parameters"),
        ("train.advantage={name: grpo-ish}", "train.advantage.name", "unknown advantage 'grpo-ish'"),
        ("train.advantage=grpo-ish", "train.advantage", "unknown advantage 'grpo-ish'"),
    ],
)
def test_a_bad_slot_setting_names_its_key(override, key, reason):
    with pytest.raises(ConfigError) as e:
        load_run_config(RECIPE, [override])
    assert e.value.key == key and reason in e.value.reason


@pytest.mark.parametrize(
    "override, key, noun",
    [
        ("objective.name=grpoo", "objective.name", "method"),
        ("objective.method=grpoo", "objective.method", "method"),  # the older spelling, named as written
        ("objective={name: grpoo, eps_high: 0.3}", "objective.name", "method"),
        ("sampler.correction.name=icepp", "sampler.correction.name", "correction"),
        ("train.agg.name=token-meen", "train.agg.name", "aggregation"),
        ("train.agg=token-meen", "train.agg", "aggregation"),
    ],
)
def test_an_unknown_component_names_the_key_the_user_wrote(override, key, noun):
    """issue 38 part 2: `objective.name=grpoo` said "objective.method: unknown method 'grpoo'"."""
    with pytest.raises(ConfigError) as e:
        load_run_config(RECIPE, [override])
    assert e.value.key == key and e.value.reason.startswith(f"unknown {noun} "), (e.value.key, e.value.reason)
    assert e.value.file == f"command line ({override})"


@pytest.mark.parametrize("spelled", ["name", "method"])
def test_a_recipes_component_is_named_as_the_recipe_wrote_it(tmp_path, spelled):
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["objective"] = {spelled: "grpoo"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "r.yaml")
    assert (e.value.file, e.value.key) == (str(tmp_path / "r.yaml"), f"objective.{spelled}")
    # a later layer's name replaces the recipe's, whichever spelling each uses
    other = "method" if spelled == "name" else "name"
    assert load_run_config(tmp_path / "r.yaml", [f"objective.{other}=dapo"]).objective.name == "dapo"


def test_train_names_the_key_the_user_wrote_exit_2_nothing_written(tmp_path):
    """`clipbench train quickstart objective.name=grpoo`: one line naming objective.name, exit 2,
    nothing written (the older objective.method named as written)."""
    from typer.testing import CliRunner

    from clipbench.cli import app

    for key in ("objective.name", "objective.method"):
        res = CliRunner().invoke(app, ["train", "quickstart", f"{key}=grpoo", "--results-dir", str(tmp_path / "r")])
        assert res.exit_code == 2, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and f"{key}: unknown method 'grpoo' (did you mean 'grpo'?)" in lines[0], res.output
        assert not (tmp_path / "r").exists()


def _sweep(tmp_path: Path, body: dict, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump({"base": str(RECIPE), **body}, sort_keys=False))
    return p


def test_every_shipped_sweep_is_in_the_one_form_and_its_older_form_expands_to_the_same_run_ids(tmp_path):
    """The shipped sweeps name their components `<slot>.name` only (objective.name, never the older
    objective.method); written back in the older form (objective.name -> objective.method, ...) each
    lists the same run ids, those pinned at 0b85e9e."""
    older = {f"{d.key}.name": d.name_path for d in SLOTS.values() if d.name_path != f"{d.key}.name"}
    renamed = 0
    for rel, ids in PINNED["sweeps"].items():
        src = REPO / "clipbench" / rel
        body = yaml.safe_load(src.read_text())
        for part in ("grid", "zip", "overrides"):
            if isinstance(body.get(part), dict):
                assert not set(body[part]) & set(older.values()), (rel, part)
                renamed += sum(k in older for k in body[part])
                body[part] = {older.get(k, k): v for k, v in body[part].items()}
        for entry in body.get("exclude") or []:
            assert not set(entry) & set(older.values()), (rel, "exclude")
        body["exclude"] = [{older.get(k, k): v for k, v in e.items()} for e in body.get("exclude") or []] or None
        body["base"] = str((src.parent / body["base"]).resolve())
        f = tmp_path / rel.replace("/", "_")
        f.write_text(yaml.safe_dump(body, sort_keys=False))
        assert list(expand(load_spec(f)).runs) == ids, rel
    assert renamed >= 15  # the method axes of the shipped sweeps, and study_corrections' correction name


def test_an_exclude_names_a_component_in_either_form(tmp_path):
    """An exclude entry matches the axis whichever form each names (objective.name or the older
    objective.method); an entry naming both forms is refused, naming the key as written."""
    grid = {"objective.name": ["grpo", "dapo", "nsr"], "seed": [0, 1]}
    full = expand(load_spec(_sweep(tmp_path, {"grid": grid}, "full.yaml"))).runs
    for i, key in enumerate(("objective.name", "objective.method")):
        body = {"grid": grid, "exclude": [{key: "dapo", "seed": 1}, {key: "nsr"}]}
        runs = expand(load_spec(_sweep(tmp_path, body, f"x{i}.yaml"))).runs
        # 3 x 2 = 6 points - dapo seed 1 - nsr x 2 = 3: grpo seeds 0-1, dapo seed 0
        assert sorted((c["objective"]["method"], c["seed"]) for c in runs.values()) == [
            ("dapo", 0),
            ("grpo", 0),
            ("grpo", 1),
        ]
        assert set(runs) <= set(full)
    both = {"grid": grid, "exclude": [{"objective.name": "nsr", "objective.method": "nsr"}]}
    with pytest.raises(ConfigError) as e:
        load_spec(_sweep(tmp_path, both, "both.yaml"))
    assert e.value.key == "exclude[0].objective.method" and "same axis as objective.name" in e.value.reason
    typo = {"grid": grid, "exclude": [{"objective.nme": "nsr"}]}
    with pytest.raises(ConfigError) as e:
        load_spec(_sweep(tmp_path, typo, "typo.yaml"))
    # the axes as the sweep file writes them, not in their stored form (objective.method)
    assert e.value.key == "exclude[0].objective.nme"
    assert e.value.reason == ("not an axis of this sweep (did you mean 'objective.name'?); axes: objective.name, seed")


def test_the_aggregation_and_advantage_are_slots_of_the_sweep_rule(tmp_path):
    """train.agg.name x train.advantage.name: 3 x 2 = 6 runs, each the loader's run for its point."""
    f = _sweep(
        tmp_path,
        {
            "grid": {
                "train.agg.name": ["token-mean", "seq-mean-token-mean", "token-sum"],
                "train.advantage.name": ["group", "rloo"],
            }
        },
    )
    exp = expand(load_spec(f))
    assert len(exp.runs) == 6
    for rid, point in exp.points.items():
        assert set(point) == {"train.agg", "train.advantage"}  # the stored form's keys (labels unchanged)
        cfg = load_run_config(
            RECIPE, [f"train.agg={point['train.agg']}", f"train.advantage={point['train.advantage']}"]
        )
        assert run_id(cfg) == rid


def test_an_objective_setting_applies_to_every_method_of_the_sweep_that_declares_it(tmp_path):
    """overrides objective.eps_high with methods grpo, dapo, sapo: grpo and dapo declare eps_high,
    sapo not: 3 runs, the first two with eps_high 0.3 (the same rule for every slot)."""
    f = _sweep(
        tmp_path, {"overrides": {"objective.eps_high": 0.3}, "grid": {"objective.name": ["grpo", "dapo", "sapo"]}}
    )
    exp = expand(load_spec(f))
    by_method = {c["objective"]["method"]: c["objective"] for c in exp.runs.values()}
    assert by_method["grpo"]["eps_high"] == by_method["dapo"]["eps_high"] == 0.3
    assert "eps_high" not in by_method["sapo"]


def test_an_unknown_slot_parameter_or_name_names_the_sweep_key(tmp_path):
    for body, where, reason in (
        ({"grid": {"train.agg.name": ["token-meen"]}}, "grid.train.agg.name", "unknown aggregation 'token-meen'"),
        ({"grid": {"objective.name": ["grpoo"]}}, "grid.objective.name", "unknown method 'grpoo'"),
        ({"grid": {"objective.name": ["grpo"], "objective.epsilon": [0.1]}}, "grid.objective.epsilon", "no method"),
        (
            {"grid": {"objective.name": ["grpo"], "objective.method": ["dapo"]}},
            "grid.objective.method",
            "already an axis",
        ),
        (
            {"grid": {"seed": [0]}, "overrides": {"objective.name": "x", "objective.method": "y"}},
            "overrides.objective.method",
            "same setting",
        ),
        (
            {"grid": {"objective.name": ["grpo"]}, "overrides": {"objective.method": "dapo"}},
            "overrides.objective.method",
            "also an axis",
        ),
        (  # the other way round: the axis in the older form, the override in the one form
            {"grid": {"objective.method": ["grpo"]}, "overrides": {"objective.name": "dapo"}},
            "overrides.objective.name",
            "also an axis in grid",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            expand(load_spec(_sweep(tmp_path, body)))
        assert e.value.key == where and reason in e.value.reason, (e.value.key, e.value.reason)


@pytest.mark.parametrize("key", ["objective.name", "objective.method"])
def test_a_sweep_names_an_unknown_method_by_the_key_each_layer_wrote(tmp_path, key):
    """The sweep-file and command-line equivalents of `clipbench train quickstart objective.name=grpoo`:
    the axis, the overrides, the command line and the base recipe each name the key as written."""
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["objective"] = {key.split(".")[1]: "grpoo"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))
    sweep = str(tmp_path / "s.yaml")
    for body, cli, file, where in (
        ({"grid": {key: ["grpo", "grpoo"]}}, [], sweep, f"grid.{key}"),
        ({"grid": {"seed": [0]}, "overrides": {key: "grpoo"}}, [], sweep, f"overrides.{key}"),
        ({"grid": {"seed": [0]}}, [f"{key}=grpoo"], "command line", key),
        ({"base": str(tmp_path / "bad.yaml"), "grid": {"seed": [0]}}, [], str(tmp_path / "bad.yaml"), key),
    ):
        with pytest.raises(ConfigError) as e:
            expand(load_spec(_sweep(tmp_path, body), cli))
        assert (e.value.file, e.value.key) == (file, where), (body, cli, e.value)
        assert e.value.reason.startswith("unknown method 'grpoo' (did you mean 'grpo'?)")


def test_a_correction_setting_applies_to_every_correction_of_the_sweep_that_declares_it(tmp_path):
    """A recipe with {name: tis, level: sequence} and a name axis [tis, icepop]: tis and icepop both
    declare `level`, so both runs are sequence-level (the one rule: as objective settings always
    were; before the slots the icepop run fell back to icepop's default, token)."""
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe.setdefault("sampler", {})["correction"] = {"name": "tis", "level": "sequence"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    f = _sweep(tmp_path, {"base": str(tmp_path / "r.yaml"), "grid": {"sampler.correction.name": ["tis", "icepop"]}})
    corr = {c["sampler"]["correction"]["name"]: c["sampler"]["correction"] for c in expand(load_spec(f)).runs.values()}
    assert corr["tis"]["level"] == corr["icepop"]["level"] == "sequence"
    assert corr["icepop"]["low"] == 0.5  # the rest from icepop's own defaults
