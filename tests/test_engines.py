"""The engines' table (clipbench/engines/keys.py) is complete and true.

- Every leaf of the run config has an entry for every engine, and nothing else does.
- Refused: a run config that sets the key to another value fails the engine's check with one line
  naming the key; a value an entry refuses (`refuse=`) does too.
- Mapped, and true: changing the key changes the engine settings the entry names (TRL: the
  GRPOConfig fields `engines.trl.grpo_args` builds; verl: the main_ppo overrides and worker
  environment `engines.verl.verl_overrides` builds), and every setting that changes is one the entry
  mentions.
- docs/engines.md is `clipbench engines --format markdown`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from clipbench.config import load_run_config, to_dict
from clipbench.config.schema import leaf_keys, value_at
from clipbench.engines import check
from clipbench.engines.keys import KEYS, settings
from clipbench.errors import ConfigError, UserError

pytestmark = pytest.mark.usefixtures("unload_plugins")  # the test value of `plugins` registers a rule

REPO = Path(__file__).resolve().parent.parent
RECIPE = str(REPO / "recipes" / "arith_tiny.yaml")
PLUGIN = str(REPO / "examples" / "plugins" / "lower_only.py")

# For every leaf key, a value other than the base run's (arith_tiny.yaml) that the config accepts.
CHANGES = {
    "seed": 7,
    "name": "other",
    "engine": "trl",
    "trl": {"logging_first_step": True},
    "model.name": "builtin:arith-steps",
    "model.dtype": "bfloat16",
    "model.device": "cuda",
    "model.gradient_checkpointing": True,
    "model.routing_replay": "r2",
    "task.name": "math",
    "task.path": str(REPO / "tests"),
    "task.config": "all",
    "task.split": "test",
    "task.template": "dapo",
    "task.limit": 10,
    "task.holdout": 5,
    "task.operands": 3,
    "task.digits": 1,
    "task.ops": "+",
    "task.format": "steps",
    "task.train_size": 100,
    "task.test_size": 50,
    "sampler.backend": "vllm",
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 16,
    "sampler.temperature": 0.7,
    "sampler.top_p": 0.9,
    "sampler.old_logp": "sampler",
    "sampler.prompts_per_call": 2,
    "sampler.lag": 2,
    "sampler.gpu_memory_utilization": 0.5,
    "sampler.sleep_mode": True,
    "sampler.correction": "icepop",
    "train.steps": 5,
    "train.prompts_per_step": 4,
    "train.mini_batches": 2,
    "train.epochs": 2,
    "train.lr": 2e-5,
    "train.weight_decay": 0.1,
    "train.betas": [0.8, 0.99],
    "train.warmup_steps": 3,
    "train.lr_schedule": "cosine",
    "train.advantage": "group_mean",
    "train.agg": "seq-mean-token-mean",
    "train.beta": 0.04,
    "train.grad_clip": 0.5,
    "train.router_aux_loss_coef": 0.01,
    "train.max_skipped_frac": 0.2,
    "train.micro_batch_tokens": 4096,
    "train.dynamic_sampling": True,
    "train.max_resample_rounds": 1,
    "train.overlong.enabled": True,
    "train.overlong.buffer": 4,
    "train.overlong.penalty": 0.5,
    "train.checkpoint_every": 5,
    "train.log_histograms": False,
    "objective": {"method": "dapo"},
    "plugins": [PLUGIN],
    "eval.every": 5,
    "eval.benchmarks": ["gsm8k"],
    "eval.n": 4,
    "eval.n_ends": 16,
    "eval.limit": 8,
    "eval.data_dir": str(REPO / "tests"),
    "eval.temperature": 0.6,
    "eval.top_p": 0.95,
    "eval.max_new_tokens": 16,
    "eval.at_start": False,
    "tracking.mlflow": False,
    "tracking.tracking_uri": "http://127.0.0.1:5000",
    "tracking.experiment": "other",
    "tracking.batch_every": 5,
    "tracking.sinks": ["mlflow", "tensorboard"],
    "launch.nproc_per_node": 2,
    "launch.preempt_signal": "SIGUSR1",
    "launch.gpu": "H200",
    "launch.gpu_memory": 139.0,
    "train.record.every": 1,
    "train.record.state": "none",
    "train.record.max_mb": 64,
}
COMPANIONS = {"task.name": {"task.path": str(REPO / "tests")}}  # what a test value needs beside it


def changed(key: str):
    return config(**{key: CHANGES[key], **COMPANIONS.get(key, {})})


def config(**changes):
    """The base run (arith_tiny.yaml, evaluation on its own split) with `changes` (dotted keys)."""
    over = ["eval.benchmarks=[arith]"]
    for key, value in changes.items():
        if key == "objective":
            over += [f"objective.{k}={v}" for k, v in value.items()]
        elif key == "trl":
            over += [f"trl.{k}={json.dumps(v)}" for k, v in value.items()]
        else:
            over.append(f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
    return load_run_config(RECIPE, over)


def test_every_schema_key_has_an_entry_for_every_engine_and_a_test_value():
    keys = set(leaf_keys())
    for engine, table in KEYS.items():
        assert set(table) == keys, (engine, keys ^ set(table))
    assert set(CHANGES) == keys, keys ^ set(CHANGES)  # a new key needs a value here: its entries get tested
    for key in keys:
        assert changed(key) != config(), key  # each test value really changes the run


@pytest.mark.parametrize("engine", list(KEYS))
def test_a_refused_key_set_to_another_value_fails_the_check_naming_it(engine):
    table = KEYS[engine]
    for key, support in table.items():
        if support.kind == "refused":
            with pytest.raises(ConfigError, match=rf"(^|: ){key}: engine '{engine}' cannot honour it"):
                check(changed(key), "r.yaml", engine=engine)
    check(config(), "r.yaml", engine=engine)  # the base run itself passes (no refused key set)


@pytest.mark.parametrize(
    "engine,key,value",
    [
        ("trl", "train.advantage", "rloo"),
        ("trl", "sampler.old_logp", "sampler"),
        ("verl", "sampler.old_logp", "sampler"),
        ("verl", "model.device", "cpu"),
        ("verl", "sampler.backend", "hf"),
    ],
)
def test_a_value_an_entry_refuses_fails_the_check(engine, key, value):
    cfg = config(**{key: value})
    assert KEYS[engine][key].problem(value_at(cfg, key), value_at(config(), key))  # a component's entry: its Slot
    with pytest.raises(ConfigError, match=rf"{key}: engine '{engine}' cannot honour it"):
        check(config(**{key: value}), "r.yaml", engine=engine)


@pytest.mark.parametrize(
    "engine, key, value, why",
    [
        ("trl", "objective", {"method": "rollout_is"}, "reads the sampler's log-probs of the sampled tokens"),
        ("verl", "objective", {"method": "rollout_is"}, "which verl's policy-loss signature does not pass"),
        ("trl", "sampler.correction", {"name": "vaco"}, "correction 'vaco' has no counterpart in TRL"),
        ("verl", "sampler.correction", {"name": "vaco"}, "correction 'vaco' has no counterpart in verl"),
    ],
)
def test_an_input_or_correction_the_engine_cannot_feed_is_refused_in_one_line(engine, key, value, why):
    """rollout_is reads the sampler's log-probs, which neither TRL's loss nor verl's policy-loss signature
    passes; vaco has no counterpart in either. The built-in loop runs both; the other rules of issue 38
    run everywhere."""
    cfg = config(**{key: value})
    with pytest.raises(ConfigError) as err:
        check(cfg, "r.yaml", engine=engine)
    assert f"{key}: engine '{engine}' cannot honour it" in str(err.value) and why in str(err.value)
    assert "\n" not in str(err.value)
    check(cfg, "r.yaml", engine="builtin")
    for method in ("opsm", "ipo", "cfpo", "kimi15"):
        check(config(objective={"method": method}), "r.yaml", engine=engine)
    check(config(objective={"method": "cispo", "unified_mask": True}), "r.yaml", engine=engine)


# ---- what an engine feeds: declared once per engine, every refusal derived -----------------------


def refusal(cfg, engine: str) -> str | None:
    """The engine's check of a run config: None when it passes, else its one-line message."""
    try:
        check(cfg, "r.yaml", engine=engine)
    except ConfigError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


@pytest.fixture
def aggregations():
    """Aggregations a test registers are removed afterwards (the config's closed lists re-read)."""
    from clipbench.config.schema import choices
    from clipbench.objectives import AGGREGATIONS

    before = dict(AGGREGATIONS)
    choices.cache_clear()
    yield AGGREGATIONS
    for name in set(AGGREGATIONS) - set(before):
        del AGGREGATIONS[name]
    choices.cache_clear()


def test_engines_compact_view_a_line_per_key_and_the_keys_a_word_names_in_full():
    """`clipbench engines`: one line per key some engine maps or refuses (a word per engine) within 80
    columns, the keys every engine honours on a few lines; `clipbench engines train.agg`: that key's
    treatment by each engine in full (was 638 lines at 80 columns)."""
    from rich.console import Console

    from clipbench.commands.engines import engines_command
    from clipbench.engines.keys import rows

    console = Console(record=True, width=80)
    engines_command(console=console)
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80 and len(lines) < len(rows()) + 12
    (agg,) = [line.split() for line in lines if line.startswith("train.agg ")]
    assert " ".join(agg[1:]) == "honoured honoured (some) mapped (some)"  # trl: not prompt-mean; verl: no counterpart
    assert any(line.startswith("honoured by every engine: ") for line in lines)
    console = Console(record=True, width=80)
    engines_command(console=console, words=["train.agg"])
    text = " ".join(console.export_text().split())
    assert "verl mapped: actor_rollout_ref.actor.loss_agg_mode" in text and "no counterpart: prompt-mean" in text
    with pytest.raises(UserError, match="no run-config key holds 'warp'"):
        engines_command(console=console, words=["warp"])


def test_a_new_aggregation_is_refused_by_the_engines_that_cannot_feed_it(aggregations):
    """A new aggregation (registered here, named nowhere in engines/): verl has no counterpart in its
    loss_agg_mode (it raised "Invalid loss_agg_mode" on verl's workers before), TRL and the built-in loop
    run clipbench's aggregation; one that reads the prompt groups is refused by TRL too (its rows are
    shuffled), and the built-in loop, which passes them, runs it."""
    aggregations.register("half-token-mean", lambda token_loss, maskf, n: 0.5 * token_loss.sum() / n.tokens)
    aggregations.register(
        "half-prompt-mean", lambda token_loss, maskf, n: 0.5 * token_loss.sum() / n.prompts, needs_groups=True
    )
    plain, grouped = config(**{"train.agg": "half-token-mean"}), config(**{"train.agg": "half-prompt-mean"})
    assert refusal(plain, "verl") == (
        "r.yaml: train.agg: engine 'verl' cannot honour it: aggregation 'half-token-mean' has no counterpart in "
        "verl 0.9.1's loss_agg_mode (it has token-mean, token-sum, seq-mean-token-mean, seq-mean-token-sum, "
        "seq-mean-token-sum-norm)"
    )
    assert refusal(plain, "trl") is None and refusal(plain, "builtin") is None
    assert refusal(grouped, "trl") == (
        "r.yaml: train.agg: engine 'trl' cannot honour it: aggregation 'half-prompt-mean' reads each row's "
        "prompt group, which TRL's loss call does not pass"
    )
    assert "'half-prompt-mean' has no counterpart" in refusal(grouped, "verl")
    assert refusal(grouped, "builtin") is None
    from clipbench.engines.keys import KEYS

    assert "prompt-mean (reads prompt groups)" in KEYS["trl"]["train.agg"].describe()  # `clipbench engines`
    assert "no counterpart: prompt-mean, half-token-mean, half-prompt-mean" in KEYS["verl"]["train.agg"].describe()


PLUGIN_READS = """
from clipbench.objectives import rule


@rule("reads_reward", source="a test: a rule reading the sequence's reward")
def reads_reward(r, A, reward):
    \"\"\"-r*A*reward\"\"\"
    return -r * A * reward


@rule("reads_entropy", source="a test: a rule reading the token entropy")
def reads_entropy(r, A, entropy):
    \"\"\"-r*A*(1+entropy)\"\"\"
    return -r * A * (1 + entropy)
"""


@pytest.mark.parametrize(
    "rule, fed_by",
    [("reads_reward", {"builtin"}), ("reads_entropy", {"builtin", "trl"})],
)
def test_a_plugin_rule_reading_an_input_an_engine_does_not_feed_is_refused_at_the_preflight(rule, fed_by, tmp_path):
    """A plugin rule is judged by the given inputs it reads against what each engine declares it
    passes (the built-in loop: every one; TRL: the entropy of its forward; verl: none): refused in one
    line naming the key, the engine and the input, exit 2 and nothing written (clipbench train; clipbench
    sweep --engine verl, which plans the runs' commands); the built-in loop's preflight passes."""
    from typer.testing import CliRunner

    from clipbench.cli import app
    from clipbench.engines import preflight

    plugin = tmp_path / "reads.py"
    plugin.write_text(PLUGIN_READS)
    cfg = config(plugins=[str(plugin)], objective={"name": rule})
    what = {"reads_reward": "each sequence's reward (the input 'reward')", "reads_entropy": "(the input 'entropy')"}
    for engine in ("builtin", "trl", "verl"):
        why = refusal(cfg, engine)
        assert (why is None) == (engine in fed_by), (engine, why)
        if why is not None:
            assert why.startswith(f"r.yaml: objective: engine '{engine}' cannot honour it: method '{rule}' reads ")
            assert what[rule] in why and why.endswith("does not pass")
    preflight(cfg, "r.yaml")  # the built-in loop: model, task, benchmarks and the plugin's own code too
    runner, res = CliRunner(), tmp_path / "results"
    over = [f"plugins=[{plugin}]", f"objective.name={rule}", "eval.benchmarks=[arith]"]
    if "trl" not in fed_by:
        r = runner.invoke(app, ["train", RECIPE, "engine=trl", *over, "--results-dir", str(res)])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
        assert f"objective: engine 'trl' cannot honour it: method '{rule}' reads " in r.stderr
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"name": "s", "base": RECIPE, "plugins": [str(plugin)], "grid": {"seed": [0]}}))
    r = runner.invoke(
        app, ["sweep", str(sweep), f"objective.name={rule}", "--engine", "verl", "--dry-run", "--results-dir", str(res)]
    )
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert f"objective: engine 'verl' cannot honour it: method '{rule}' reads " in r.stderr
    assert not res.exists()


def test_a_new_rule_input_no_engine_feeds_is_refused_by_each(monkeypatch):
    """A given rule input added to RuleInputs (here its declaration in objectives.inputs, as the field
    would make it) that no engine declares it passes: a rule reading it is refused by every engine,
    the built-in loop too, until the code that passes it is written and its engine declares it."""
    from clipbench.objectives import METHODS, rule
    from clipbench.objectives import inputs as rule_inputs

    spec = {"doc": "(B, 1) a value per sequence", "keyword": "values", "kind": "rule", "shape": rule_inputs.SEQUENCE}
    monkeypatch.setitem(rule_inputs.INPUTS, "value", spec["doc"])
    monkeypatch.setitem(rule_inputs.GIVEN, "value", {**spec, "hint": "each sequence's value"})

    @rule("reads_value", source="a test: a rule reading a new input")
    def reads_value(r, A, value):
        """-r*(A - value)"""
        return -r * (A - value)

    try:
        cfg = config(objective={"name": "reads_value"})
        for engine in ("builtin", "trl", "verl"):
            assert refusal(cfg, engine).endswith(
                f"objective: engine '{engine}' cannot honour it: method 'reads_value' reads each sequence's value "
                "(the input 'value'), which "
                + {"builtin": "the built-in loop", "trl": "TRL's loss call", "verl": "verl's policy-loss signature"}[
                    engine
                ]
                + " does not pass"
            )
    finally:
        del METHODS["reads_value"]


def test_a_sweeps_preflight_checks_every_objective_against_the_engine():
    """A sweep's preflight loads the model and task once per setting (its objectives share one) and
    checks each objective against what the engine feeds: topr beside grpo on engine trl is refused
    before the manifest is written."""
    from clipbench.commands.sweep import preflight_runs

    runs = [to_dict(config(engine="trl", objective={"name": m})) for m in ("grpo", "topr")]
    with pytest.raises(ConfigError, match=r"objective: engine 'trl' cannot honour it: method 'topr' reads each"):
        preflight_runs(runs)
    preflight_runs(runs[:1])


def test_each_engine_declares_what_it_feeds_in_one_place_and_the_engines_read_it():
    """Each engine's one declaration (FEEDS): what the built-in loop declares it passes, it passes
    (train/step.py's per-row inputs and the forward's entropy); the TRL and verl settings of a mapped
    component are read from it (engines/trl.py grpo_args, engines/verl.py verl_overrides)."""
    from clipbench.engines import ENGINES
    from clipbench.engines.keys import FEEDS
    from clipbench.integrations.feeds import GROUPS
    from clipbench.objectives.inputs import GIVEN
    from clipbench.train.step import ROW_INPUTS

    assert set(FEEDS) == set(ENGINES) and all(ENGINES[name].feeds is FEEDS[name] for name in ENGINES)
    fed = {name for name, given in GIVEN.items() if given["keyword"] in ROW_INPUTS} | {"entropy", GROUPS}
    assert set(FEEDS["builtin"].passes) == fed  # every given input the loop fills, the forward's entropy
    assert set(FEEDS["builtin"].passes) - {GROUPS} == set(GIVEN)
    assert trl_settings(config(**{"train.advantage": "group_mean"}))["scale_rewards"] == "none"
    assert trl_settings(config())["scale_rewards"] == "group"


# ---- mapped entries are true -------------------------------------------------------------------


def trl_settings(cfg) -> dict:
    """Every GRPOConfig field of the run (the world size of one process)."""
    from clipbench.engines.trl import grpo_args

    args = grpo_args(cfg, Path("/tmp/clipbench-test-engines"), world_size=1)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}


def verl_settings(cfg, tmp_path) -> dict:
    """Every main_ppo override and worker environment variable of the run, as `clipbench sweep --engine
    verl` plans it (GPUs per node from launch.nproc_per_node)."""
    from clipbench.engines import ENGINES
    from clipbench.sweep.submitted import plans_of

    (plan,) = plans_of(
        ENGINES["verl"], {"runs": {"r": to_dict(cfg)}}, "s", results_dir=tmp_path, hydra_overrides=[], tracking_uri=None
    )
    out = {}
    for o in plan["command"][3:]:
        key, _, value = o.partition("=")
        key = key.lstrip("+").removeprefix("ray_kwargs.ray_init.runtime_env.env_vars.")
        out[key] = value
    return out


def mentioned(name: str, detail: str) -> bool:
    """A setting the entry's text names (verl: its last dotted part, as the entries abbreviate)."""
    return name in detail or name.rsplit(".", 1)[-1] in detail


@pytest.mark.parametrize("engine", ["trl", "verl"])
def test_changing_a_mapped_key_changes_the_settings_its_entry_names_and_no_other(engine, tmp_path):
    read = trl_settings if engine == "trl" else (lambda c: verl_settings(c, tmp_path))
    base = read(config())
    checked = 0
    for key, support in KEYS[engine].items():
        if support.kind != "mapped":
            continue
        names = settings(support)
        new = read(changed(key))
        diff = {k for k in base.keys() | new.keys() if base.get(k) != new.get(k)}
        if key == "trl":  # extra GRPOConfig fields: each one is set as given
            assert diff == {"logging_first_step"}, diff
            continue
        assert all(n in base or n in new for n in names), (key, names)  # real settings of the engine
        assert diff & set(names), (key, names, sorted(diff))  # ... that the key moves
        assert all(mentioned(d, support.detail) for d in diff), (key, sorted(diff), support.detail)
        checked += 1
    assert checked >= 20


def test_docs_engines_md_is_the_generated_table():
    from clipbench.commands.engines import engines_markdown

    assert (REPO / "docs" / "engines.md").read_text() == engines_markdown(), (
        "docs/engines.md is stale: python -m clipbench engines --format markdown > docs/engines.md"
    )


# ---- the 4B Table-3 recipes pass the preflight ---------------------------------------------------


@pytest.mark.parametrize("method", ["grpo", "abc"])
def test_the_4b_table3_recipes_pass_the_preflight_but_for_what_needs_a_gpu(method, tmp_path, data_dir):
    """vLLM over 8 processes is no longer refused. On a machine without CUDA the one error is the
    GPU-only part (sleep mode), in one line; the rest passes offline with the model's config written
    from the shipped Qwen3-4B shape and local copies of the data, except, where vllm is not installed,
    the one line saying so."""
    import torch

    from clipbench.engines import preflight
    from clipbench.errors import UserError
    from clipbench.models.shapes import QWEN3, hf_config

    recipe = str(REPO / "recipes" / "abc_grpo_table3" / f"qwen3_4b_{method}.yaml")
    cfg = load_run_config(recipe)
    assert cfg.launch.nproc_per_node == 8 and cfg.sampler.backend == "vllm" and cfg.sampler.sleep_mode
    if not torch.cuda.is_available():
        with pytest.raises(UserError) as err:
            preflight(cfg, recipe)
        assert str(err.value).startswith("sampler.sleep_mode needs a CUDA GPU") and "\n" not in str(err.value)
    hf_config(QWEN3["Qwen/Qwen3-4B-Base"]).save_pretrained(tmp_path / "qwen3-4b")  # config only: no weights
    local = load_run_config(
        recipe,
        [
            f"sampler.sleep_mode={str(torch.cuda.is_available()).lower()}",
            f"model.name={tmp_path / 'qwen3-4b'}",
            f"task.path={data_dir / 'dapo_math_17k_sample.jsonl'}",
            f"eval.data_dir={data_dir}",
        ],
    )
    try:
        preflight(local, recipe)
    except UserError as e:  # only this environment's missing vllm may stop it
        assert str(e).startswith("sampler.backend: 'vllm' is not installed here"), e


def test_no_engine_name_branches_outside_engines():
    """Engines are registered objects (clipbench.engines.ENGINES): code outside clipbench/engines/
    reads the engine object (in_process, submits, preemptible, train, check) instead of comparing
    its name, so adding an engine is one module and one registration."""
    import re

    pkg = Path(__file__).resolve().parent.parent / "clipbench"
    branch = re.compile(r"engine\s*(==|!=|in\b)")
    found = [
        f"{p.relative_to(pkg.parent)}:{i}: {line.strip()}"
        for p in sorted(pkg.rglob("*.py"))
        if "engines" not in p.relative_to(pkg).parts[:1]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert not found, "\n".join(found)


def test_every_engine_implements_its_interface():
    """Each registered engine's module has what its kind needs (docs/architecture.md, "Adding an
    engine"): train for an engine inside a clipbench process, the four submission functions for one
    launched apart; and a keys entry for every run-config key."""
    import inspect

    from clipbench.config.schema import leaf_keys
    from clipbench.engines import ENGINES, RUN_ENGINES

    assert list(ENGINES) == ["builtin", "trl", "verl"] and RUN_ENGINES == ("builtin", "trl")
    for name, engine in ENGINES.items():
        needs = ("train",) if engine.in_process else ("check_can_launch", "plan_runs", "shell_line", "submit")
        missing = [f for f in needs if not callable(getattr(engine.impl, f, None))]
        assert not missing, f"engine {name}: {engine.module} lacks {missing}"
        assert set(leaf_keys()) <= set(engine.keys), name
        if engine.in_process:
            params = inspect.signature(engine.impl.train).parameters
            assert {"resume", "sink", "progress", "dist", "stop"} <= set(params), name
    assert [n for n, e in ENGINES.items() if e.preemptible] == ["builtin"]
    assert ENGINES["verl"].submits and not ENGINES["trl"].submits
