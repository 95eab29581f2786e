"""Recipes are validated against the schema and METHODS before anything runs."""

import pytest

from clipbench.config import compose, load_run_config, run_id, to_dict, validate
from clipbench.errors import ConfigError
from clipbench.objectives import METHODS

RECIPE = "recipes/quickstart.yaml"


def test_quickstart_recipe_loads_with_method_defaults():
    cfg = load_run_config(RECIPE)
    assert cfg.train.mini_batches == 8 and cfg.train.epochs == 3 and cfg.sampler.group_size == 8
    assert cfg.model.name == "builtin:arith-steps" and cfg.task.format == "steps"
    assert cfg.objective == {"method": "grpo", **METHODS["grpo"].defaults}
    tiny = load_run_config("recipes/arith_tiny.yaml")  # the answer-only regime the plumbing tests use
    assert tiny.model.name == "builtin:arith-tiny" and tiny.task.format == "answer" and tiny.train.mini_batches == 4


def test_overrides_switch_method_and_fill_its_defaults():
    cfg = load_run_config(RECIPE, ["objective.method=nsr", "objective.p=0.25", "train.steps=3"])
    assert cfg.train.steps == 3
    assert cfg.objective["method"] == "nsr" and cfg.objective["p"] == 0.25
    assert set(cfg.objective) == {"method", *METHODS["nsr"].defaults}


def test_run_id_is_deterministic_and_config_sensitive():
    a, b = load_run_config(RECIPE), load_run_config(RECIPE)
    assert run_id(a) == run_id(b) and len(run_id(a)) == 12
    assert run_id(load_run_config(RECIPE, ["seed=1"])) != run_id(a)
    # tracking settings do not change what a run computes
    assert run_id(load_run_config(RECIPE, ["tracking.experiment=x"])) == run_id(a)
    assert run_id(validate(to_dict(a))) == run_id(a)


@pytest.mark.parametrize("override, key, words", [
    (["train.stpes=3"], "train.stpes", "did you mean 'steps'"),
    (["train.steps=abc"], "train.steps", ""),
    (["train.steps=0"], "train.steps", ">= 1"),
    (["objective.method=grpp"], "objective.method", "did you mean 'grpo'"),
    (["objective.p=0.5"], "objective.p", "p"),  # grpo has no p
    (["objective.method=nsr", "objective.p=1.5"], "objective.p", ""),
    (["objective.eps_low=-0.1"], "objective.eps_low", ""),
    (["sampler.backend=vlm"], "sampler.backend", "did you mean 'vllm'"),
    (["train.agg=token_mean"], "train.agg", "did you mean 'token-mean'"),
    (["sampler.top_p=0"], "sampler.top_p", "(0, 1]"),
    (["task.name=math"], "task.path", "needs a path"),
    (["task.format=stepz"], "task.format", "unknown format 'stepz' (did you mean 'steps'?); valid: answer, steps"),
    (["task.operands=9"], "task.operands", "operands must be in 2..8, got 9"),
    (["task.ops=+/"], "task.ops", "unknown operator '/'"),
])
def test_bad_values_name_file_key_and_reason(override, key, words):
    with pytest.raises(ConfigError) as e:
        load_run_config(RECIPE, override)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(RECIPE) and e.value.key == key, msg
    assert words in msg


def test_yaml_syntax_error_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match="file not found"):
        load_run_config(tmp_path / "nope.yaml")


def test_relative_paths_are_relative_to_the_recipe(tmp_path):
    (tmp_path / "data").mkdir()
    r = tmp_path / "r.yaml"
    r.write_text("task: {name: math, path: ./data/train.jsonl}\nobjective: {method: grpo}\n")
    d = compose(r)
    assert d["task"]["path"] == str(tmp_path / "data" / "train.jsonl")
    # HF dataset names are left alone
    r.write_text("task: {name: math, path: open-r1/DAPO-Math-17k-Processed}\n")
    assert compose(r)["task"]["path"] == "open-r1/DAPO-Math-17k-Processed"
