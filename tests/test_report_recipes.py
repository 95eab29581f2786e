"""The papers' recipes: every file validates, and each sweep's runs are exactly the single-run recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from clipbench.config import load_run_config, to_dict
from clipbench.config.schema import Slot
from clipbench.objectives import METHODS

ROOT = Path(__file__).resolve().parent.parent / "recipes"
TABLE3 = ROOT / "abc_grpo_table3"
NSR = ROOT / "nsr"
NSR_SCALE = ROOT / "nsr_scale"  # tests/test_nsr_scale.py checks its settings and sweeps
RECIPES = sorted(p for d in (TABLE3, NSR, NSR_SCALE) for p in d.glob("*.yaml") if not p.name.startswith("sweep"))


def _expand(path: Path) -> list[dict]:
    from clipbench.sweep.expand import expand
    from clipbench.sweep.spec import load_spec

    return list(expand(load_spec(path)).runs.values())


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_validates(path):
    cfg = load_run_config(path)
    method = cfg.objective.name
    assert method in METHODS
    assert set(cfg.objective.params) == set(METHODS[method].defaults)  # parameters all exist
    assert cfg.train.mini_batches > 1  # off-policy, or clipping never acts


@pytest.mark.parametrize(
    "model,slug,prompts,max_new,steps,warmup",
    [
        ("Qwen/Qwen3-1.7B-Base", "qwen3_1p7b", 512, 4096, 165, 66),
        ("Qwen/Qwen3-4B-Base", "qwen3_4b", 256, 3072, 335, 134),
    ],
)
def test_table3_recipes_follow_the_paper(model, slug, prompts, max_new, steps, warmup):
    grpo = load_run_config(TABLE3 / f"{slug}_grpo.yaml")
    abc = load_run_config(TABLE3 / f"{slug}_abc.yaml")
    assert grpo.objective == Slot("grpo", {"eps_low": 0.2, "eps_high": 0.2})
    assert abc.objective == Slot("abc", {"eps1": 0.2, "eps2": 0.2, "eps3": 0.2, "eps4": 0.2})
    for cfg in (grpo, abc):
        assert cfg.model.name == model and cfg.model.dtype == "bfloat16"
        assert (cfg.task.name, cfg.task.path, cfg.task.template) == ("math", "open-r1/DAPO-Math-17k-Processed", "dapo")
        assert cfg.sampler.group_size == 8 and cfg.train.mini_batches == 4 and cfg.sampler.backend == "vllm"
        assert cfg.train.advantage.name == "group_mean" and cfg.train.agg.name == "seq-mean-token-mean"
        assert (cfg.train.prompts_per_step, cfg.sampler.max_new_tokens, cfg.train.steps, cfg.train.warmup_steps) == (
            prompts,
            max_new,
            steps,
            warmup,
        )
        # 5 epochs over 17,398 prompts; warmup = 10% of the optimizer steps
        assert cfg.train.steps == 5 * (17398 // prompts) and warmup == cfg.train.steps * 4 // 10
        assert cfg.eval.benchmarks == ["aime24", "aime25", "amc23"] and cfg.eval.n == 64 and cfg.eval.limit is None
    # the two recipes differ only in the objective
    a, b = to_dict(grpo), to_dict(abc)
    a.pop("objective"), b.pop("objective")
    assert a == b


def _same_run(run: dict, recipe: Path) -> None:
    want = to_dict(load_run_config(recipe, [f"seed={run['seed']}"]))
    want.pop("tracking"), want.pop("name")
    got = {k: v for k, v in run.items() if k not in ("tracking", "name")}
    assert got == want, recipe.name


def test_table3_sweep_runs_are_the_recipes():
    runs = _expand(TABLE3 / "sweep.yaml")
    assert len(runs) == 4
    for run in runs:
        slug = "qwen3_1p7b" if "1.7B" in run["model"]["name"] else "qwen3_4b"
        _same_run(run, TABLE3 / f"{slug}_{run['objective']['method']}.yaml")


def test_table3_tiny_sweep():
    runs = _expand(TABLE3 / "sweep_tiny.yaml")
    assert sorted((r["objective"]["method"], r["seed"]) for r in runs) == [
        ("abc", 0),
        ("abc", 1),
        ("abc", 2),
        ("grpo", 0),
        ("grpo", 1),
        ("grpo", 2),
    ]
    for run in runs:
        assert run["model"]["name"] == "builtin:arith-tiny" and run["eval"]["benchmarks"] == ["arith"]
        assert run["train"]["advantage"] == "group_mean" and run["train"]["agg"] == "seq-mean-token-mean"
        assert run["train"]["mini_batches"] == 4 and run["sampler"]["group_size"] == 8


def test_nsr_sweeps_runs_are_the_recipes():
    runs = _expand(NSR / "sweep_dapo.yaml")
    assert len(runs) == 9
    for run in runs:
        _same_run(
            run,
            NSR / {"dapo": "dapo.yaml", "nsr": "dapo_nsr.yaml", "decay": "dapo_decay.yaml"}[run["objective"]["method"]],
        )
    runs = _expand(NSR / "sweep_gspo.yaml")
    assert len(runs) == 9
    for run in runs:
        _same_run(
            run,
            NSR / {"gspo": "gspo.yaml", "nsr": "gspo_nsr.yaml", "decay": "gspo_decay.yaml"}[run["objective"]["method"]],
        )
