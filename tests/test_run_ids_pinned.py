"""Every shipped recipe and sweep keeps its run ids (issue 26: the components as typed slots and the
typed run config change no run's identity).

tests/fixtures/run_ids_0b85e9e.json holds the run id of every shipped recipe and the run ids of every
shipped sweep, in expansion order, as computed at commit 0b85e9e (before the slots), and for a file
shipped since, as computed when it was added (sweeps/study_moe.yaml, recipes/nsr_scale/,
sweeps/study_stability_build2.yaml, recipes/organism.yaml, sweeps/organism_gate.yaml,
sweeps/organism_tune.yaml, sweeps/organism_confirm.yaml, sweeps/organism_confirm_build2.yaml, the
sweeps/offpolicy_*.yaml): a run id is a hash of the canonical config, so any change in what is hashed
shows here. A new shipped recipe or sweep adds its ids to the file; a sweep whose runs change on
purpose (sweeps/quickstart.yaml, from grpo vs cispo at the worked-steps regime's cliff to grpo on the
organism) has its ids replaced, while the runs it used to list keep theirs (sweeps/study_stability.yaml
lists them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clipbench.config import load_run_config, run_id
from clipbench.sweep import load_spec
from clipbench.sweep.expand import expand

PACKAGE = Path(__file__).resolve().parent.parent / "clipbench"
PINNED = json.loads((Path(__file__).parent / "fixtures" / "run_ids_0b85e9e.json").read_text())


def test_the_pins_cover_every_shipped_file():
    shipped = {str(p.relative_to(PACKAGE)) for d in ("recipes", "sweeps") for p in (PACKAGE / d).glob("**/*.yaml")}
    assert shipped == set(PINNED["recipes"]) | set(PINNED["sweeps"])
    assert sum(len(ids) for ids in PINNED["sweeps"].values()) == 1598  # 38 sweeps


@pytest.mark.parametrize("rel", sorted(PINNED["recipes"]))
def test_a_shipped_recipe_keeps_its_run_id(rel):
    assert run_id(load_run_config(PACKAGE / rel)) == PINNED["recipes"][rel]


@pytest.mark.parametrize("rel", sorted(PINNED["sweeps"]))
def test_a_shipped_sweep_keeps_its_run_ids_and_their_order(rel):
    assert list(expand(load_spec(PACKAGE / rel)).runs) == PINNED["sweeps"][rel]


def test_a_parameter_added_to_a_rule_later_keeps_its_runs_ids():
    """cispo's unified_mask (issue 38) came after cispo's runs had ids: at its default (off) it stays out
    of the hash, so a config written before it existed, and one that spells the default, hash alike;
    turned on, it is another run. (The shipped sweeps with cispo runs are pinned above.)"""
    from clipbench.config import to_dict

    recipe = PACKAGE / "recipes" / "quickstart.yaml"
    cispo = load_run_config(recipe, ["objective.name=cispo"])
    assert cispo.objective["unified_mask"] is False
    before = to_dict(cispo)
    before["objective"] = {k: v for k, v in before["objective"].items() if k != "unified_mask"}
    assert run_id(before) == run_id(cispo)
    on = load_run_config(recipe, ["objective.name=cispo", "objective.unified_mask=true"])
    assert run_id(on) != run_id(cispo)
    # the same parameter name in another rule's objective is not dropped (only cispo's)
    assert run_id({**before, "objective": {**before["objective"], "method": "cispo_cap"}}) != run_id(
        {**before, "objective": {**before["objective"], "method": "cispo_cap", "unified_mask": False}}
    )
