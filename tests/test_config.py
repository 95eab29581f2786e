"""Recipes are validated against the schema and METHODS before anything runs."""

import pytest

from clipbench.config import compose, load_run_config, run_id, to_dict, validate
from clipbench.config.schema import Slot
from clipbench.errors import ConfigError
from clipbench.objectives import METHODS

RECIPE = "recipes/quickstart.yaml"


def test_quickstart_recipe_loads_with_method_defaults():
    cfg = load_run_config(RECIPE)
    assert cfg.train.mini_batches == 8 and cfg.train.epochs == 3 and cfg.sampler.group_size == 8
    assert cfg.model.name == "builtin:arith-steps" and cfg.task.format == "steps"
    assert cfg.objective == Slot("grpo", METHODS["grpo"].defaults)
    tiny = load_run_config("recipes/arith_tiny.yaml")  # the answer-only regime the plumbing tests use
    assert tiny.model.name == "builtin:arith-tiny" and tiny.task.format == "answer" and tiny.train.mini_batches == 4


def test_overrides_switch_method_and_fill_its_defaults():
    cfg = load_run_config(RECIPE, ["objective.method=nsr", "objective.p=0.25", "train.steps=3"])
    assert cfg.train.steps == 3
    assert cfg.objective.name == "nsr" and cfg.objective["p"] == 0.25
    assert set(cfg.objective.params) == set(METHODS["nsr"].defaults)


def test_run_id_is_deterministic_and_config_sensitive():
    a, b = load_run_config(RECIPE), load_run_config(RECIPE)
    assert run_id(a) == run_id(b) and len(run_id(a)) == 12
    assert run_id(load_run_config(RECIPE, ["seed=1"])) != run_id(a)
    # tracking settings do not change what a run computes
    assert run_id(load_run_config(RECIPE, ["tracking.experiment=x"])) == run_id(a)
    assert run_id(validate(to_dict(a))) == run_id(a)


@pytest.mark.parametrize(
    "override, key, words",
    [
        (["train.stpes=3"], "train.stpes", "did you mean 'steps'"),
        (["train.steps=abc"], "train.steps", ""),
        (["train.steps=0"], "train.steps", "must be in [1, 1000000], got 0"),
        (["objective.method=grpp"], "objective.method", "did you mean 'grpo'"),
        (["objective.method=[grpo, dapo]"], "objective.method", "must be one method name"),  # issue 28.7
        (["objective.p=0.5"], "objective.p", "p"),  # grpo has no p
        (["objective.method=nsr", "objective.p=1.5"], "objective.p", ""),
        (["objective.eps_low=-0.1"], "objective.eps_low", ""),
        (["sampler.backend=vlm"], "sampler.backend", "did you mean 'vllm'"),
        (["train.agg=token_mean"], "train.agg", "did you mean 'token-mean'"),
        (["sampler.top_p=0"], "sampler.top_p", "(0, 1]"),
        (["task.name=math"], "task.path", "needs a path"),
        # values that used to pass and fail only at run time, after the first write (issue 13)
        (["model.name=/no/such/model"], "model.name", "no such path '/no/such/model'"),
        (["model.name=./no-such-dir/model"], "model.name", "no such path"),
        (["task.digits=0"], "task.digits", "must be in [1, 6], got 0"),
        (["task.ops=+/"], "task.ops", "must be characters of '+-*'"),
        (["model.name=builtin:a/b/c"], "model.name", "not a built-in model name"),
        (["train.betas=[1.5, -2]"], "train.betas", "item 0: must be in [0, 1), got 1.5"),
        (["train.betas=[0.9]"], "train.betas", "must have 2 items"),
        (["train.lr=1.0e+400"], "train.lr", "must be a finite number in (0, 1], got inf"),
        (["train.steps=100000000000000000000000000000"], "train.steps", "must be in [1, 1000000]"),
        (["sampler.temperature=.inf"], "sampler.temperature", "must be a finite number in (0, 10], got inf"),
        (["eval.temperature=.nan"], "eval.temperature", "got nan"),
        (["train.max_skipped_frac=1.5"], "train.max_skipped_frac", "must be in [0, 1], got 1.5"),
        (["train.grad_clip=-1"], "train.grad_clip", "must be in [0, 1e+06], got -1"),
        (["eval.data_dir=/no/such/dir"], "eval.data_dir", "no such directory '/no/such/dir'"),
        (["eval.benchmarks=[arith, arith]"], "eval.benchmarks", "twice"),
        (["objective.eps_low=.inf"], "objective.eps_low", ""),
        (["tracking.experiment="], "tracking.experiment", "non-empty string"),
        (
            ["train.overlong.enabled=true", "train.overlong.buffer=64"],
            "train.overlong.buffer",
            "<= sampler.max_new_tokens",
        ),
        (["task.format=stepz"], "task.format", "stepz"),
        (["task.operands=9"], "task.operands", "9"),
    ],
)
def test_bad_values_name_file_key_and_reason(override, key, words):
    with pytest.raises(ConfigError) as e:
        load_run_config(RECIPE, override)
    msg = str(e.value)
    assert "\n" not in msg
    given = [o for o in override if o.split("=")[0] in (key, key.rsplit(".", 1)[0])]
    # a key an override set names that override (issue 28), one it did not set names the recipe
    assert msg.startswith(f"command line ({given[0]}): " if given else RECIPE) and e.value.key == key, msg
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


# ---- the one YAML reader: duplicate keys and encodings --------------------------------------


def test_duplicate_keys_are_refused_with_both_lines(tmp_path):
    r = tmp_path / "dup.yaml"
    r.write_text("train:\n  lr: 1.0e-6\n  steps: 3\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(r)
    assert str(e.value) == f"{r}: line 4: duplicate key 'lr' (first at line 2); remove one of them"
    r.write_text("seed: 0\nseed: 1\n")  # top level, too
    with pytest.raises(ConfigError, match="line 2: duplicate key 'seed' .first at line 1."):
        load_run_config(r)
    with pytest.raises(ConfigError, match="command line: train: duplicate key 'lr'"):
        load_run_config(RECIPE, ["train={lr: 1, lr: 2}"])


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    r = tmp_path / "latin1.yaml"
    r.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_run_config(r)
    assert str(e.value) == f"{r}: line 1: not UTF-8 text (byte 0xe9 at offset 9); save the file as UTF-8"
    d = tmp_path / "adir.yaml"
    d.mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        load_run_config(d)


def test_every_field_declares_its_values():
    """A new field must say what it accepts: a range (schema.RANGES), a closed choice
    (load.choices) or be a bool; eval.benchmarks and objective are checked against their registries,
    trl (GRPOConfig fields) by TRL, engine by the engines above config (clipbench.engines.check)."""
    import dataclasses
    import typing

    from clipbench.config.schema import RANGES, SLOTS, RunConfig, choices, is_section

    def leaves(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if is_section(hints[f.name]):
                yield from leaves(hints[f.name], f"{prefix}{f.name}.")
            else:
                yield prefix + f.name, hints[f.name]

    slots = {d.key for d in SLOTS.values()}  # a component: checked against its registry
    declared = set(RANGES) | set(choices()) | slots | {"eval.benchmarks", "trl", "engine"}
    missing = [k for k, t in leaves(RunConfig) if t is not bool and k not in declared]
    assert missing == []
    assert not set(RANGES) & set(choices())  # one declaration per field
    known = {k for k, _ in leaves(RunConfig)}
    assert set(RANGES) <= known and set(choices()) <= known


def test_grad_clip_zero_means_no_clipping_and_is_valid():
    cfg = load_run_config(RECIPE, ["train.grad_clip=0"])
    assert cfg.train.grad_clip == 0.0 and cfg.train.max_skipped_frac == 0.1


def test_hub_ids_and_existing_local_paths_pass(tmp_path):
    (tmp_path / "m").mkdir()
    assert load_run_config(RECIPE, [f"model.name={tmp_path / 'm'}"]).model.name == str(tmp_path / "m")
    assert load_run_config(RECIPE, ["model.name=Qwen/Qwen3-1.7B-Base"]).model.name == "Qwen/Qwen3-1.7B-Base"
    r = tmp_path / "r.yaml"  # a recipe's relative path is checked where it points, next to the recipe
    r.write_text("model: {name: ./m}\n")
    assert load_run_config(r).model.name == str(tmp_path / "m")


def test_an_override_that_is_wrong_is_named_not_the_recipe():
    # issue 28: the error named the recipe file although the recipe was fine and the override was not
    with pytest.raises(ConfigError) as e:
        load_run_config(RECIPE, ["train.lr=5"])
    assert str(e.value) == "command line (train.lr=5): train.lr: must be in (0, 1], got 5"
    with pytest.raises(ConfigError) as e:  # a key inside the section the override set
        load_run_config(RECIPE, ["objective={method: grpo, eps_low: -1}"])
    assert str(e.value).startswith(
        "command line (objective={method: grpo, eps_low: -1}): objective.eps_low: grpo: 'eps_low'"
    )


@pytest.mark.parametrize("verb", ["train", "rehearse"])
def test_objective_method_as_a_list_is_one_line_exit_2_nothing_written(verb, tmp_path):
    # issue 28: a 71-line TypeError (unhashable type: 'list')
    from typer.testing import CliRunner

    from clipbench.cli import app

    res = CliRunner().invoke(app, [verb, RECIPE, "objective.method=[grpo,dapo]", "--results-dir", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert res.output.strip() == (
        "error: command line (objective.method=[grpo,dapo]): objective.method: must be one method "
        "name, got list "
        "['grpo', 'dapo']; to compare several, make it a sweep axis (grid: objective.method: [...])"
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("verb", ["train", "rehearse", "sweep"])
def test_a_model_directory_without_weights_is_refused_before_anything_is_written(verb, tmp_path):
    # issue 28: a directory with config.json and no weights passed the preflight: the sweep wrote its
    # manifest and failed every run (exit 1), train wrote a failed run and mlflow.db, rehearse passed
    import shutil

    from typer.testing import CliRunner

    from clipbench.cli import app
    from clipbench.models import builtin_path

    model = tmp_path / "no_weights"
    model.mkdir()
    shutil.copy(builtin_path("arith-steps") / "config.json", model)
    res = CliRunner().invoke(app, [verb, "quickstart", f"model.name={model}", "--results-dir", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: model.name: cannot load '{model}': {model} has a config.json but no weights "
        "(*.safetensors, pytorch_model*.bin)"
    )
    assert not (tmp_path / "r").exists()


@pytest.fixture
def unloaded():
    """The plugins a test loads are unregistered afterwards (the registries are per process, and an
    xdist worker runs other files' registry tests after this one)."""
    from clipbench.objectives import registry
    from clipbench.objectives.corrections import CORRECTIONS

    methods, corrections, loaded = dict(registry.METHODS), dict(CORRECTIONS), dict(registry.LOADED)
    yield
    for reg, saved in ((registry.METHODS, methods), (CORRECTIONS, corrections), (registry.LOADED, loaded)):
        reg.clear()
        reg.update(saved)


RAISING_CORRECTION = """import torch
from clipbench.objectives.corrections import applied, correction


@correction("NAME", source="a test")
def NAME(d, mask):
    '''a correction with a bug'''
    return applied(torch.ones_like(d), torch.exp(d[:, :1].squeeze(9)))
"""

WRONG_SHAPE_RULE = """import torch
from clipbench.objectives import rule


@rule("NAME", source="a test")
def NAME(r, A):
    '''a rule with a bug: one number instead of the per-token loss'''
    return -(r * A).sum()
"""


NO_GRAD_RULE = """import torch
from clipbench.objectives import rule


@rule("NAME", source="a test")
def NAME(r, A):
    '''a rule with a bug: its loss is cut from the ratio'''
    return -(r * A).detach()
"""

INF_RULE = """import torch
from clipbench.objectives import rule


@rule("NAME", source="a test")
def NAME(r, A):
    '''a rule with a bug: an infinite loss with a finite gradient'''
    return -(r * A) + float("inf")
"""


@pytest.mark.parametrize("verb", ["train", "sweep"])
@pytest.mark.parametrize(
    "plugin, key, said",
    [
        (  # before: a 109-line traceback (backward of a tensor that does not require grad)
            NO_GRAD_RULE,
            "objective.method=NAME",
            "rule 'NAME' (plugin {f}) returned a loss without a gradient: it must depend on its inputs r, s, "
            "logp or log_ratio through differentiable operations",
        ),
        (  # before: trained on, every loss null, skipped_nonfinite 0, the run "ok"
            INF_RULE,
            "objective.method=NAME",
            "rule 'NAME' (plugin {f}) returned a non-finite loss (inf) on a small batch of ratios near 1",
        ),
        (
            RAISING_CORRECTION,
            "sampler.correction.name=NAME",
            "correction 'NAME' (plugin {f}) raised IndexError: Dimension out of range",
        ),
        (
            WRONG_SHAPE_RULE,
            "objective.method=NAME",
            "rule 'NAME' (plugin {f}) returned shape (): a rule returns the per-token loss (B, T) = (4, 3)",
        ),
    ],
)
def test_a_plugin_that_fails_is_caught_by_the_preflight_in_one_line(verb, plugin, key, said, tmp_path, unloaded):
    # issue 28: a raising plugin correction gave 140 lines naming neither it nor its file, and a rule
    # returning the wrong shape failed only at the first update, after the base evaluation was written
    from typer.testing import CliRunner

    from clipbench.cli import app

    name = f"buggy_{verb}_{'rule' if 'method' in key else 'correction'}"  # one registry per process: a name per test
    f = tmp_path / "mine.py"
    f.write_text(plugin.replace("NAME", name))
    key, said = key.replace("NAME", name), said.replace("NAME", name)
    res = CliRunner().invoke(app, [verb, "quickstart", key, "--plugin", str(f), "--results-dir", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and said.format(f=f.resolve()) in lines[0], res.output
    assert not (tmp_path / "r").exists()
