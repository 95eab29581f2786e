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
from clipbench.errors import ConfigError

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
    assert KEYS[engine][key].refuse(value_at(config(**{key: value}), key))  # a component's entry judges its Slot
    with pytest.raises(ConfigError, match=rf"{key}: engine '{engine}' cannot honour it"):
        check(config(**{key: value}), "r.yaml", engine=engine)


@pytest.mark.parametrize(
    "engine, key, value, why",
    [
        ("trl", "objective", {"method": "rollout_is"}, "no sampler log-probs (rollout_is)"),
        ("verl", "objective", {"method": "rollout_is"}, "nor the sampler's log-probs (rollout_is)"),
        ("trl", "sampler.correction", {"name": "vaco"}, "VACO's TV mask"),
        ("verl", "sampler.correction", {"name": "vaco"}, "no TV mask (vaco)"),
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
