"""`clipbench rehearse` on every shipped recipe (clipbench/rehearse): a recipe that cannot run as
written fails here, before anyone books a GPU for it.

Each rehearsal runs the recipe's own code path shrunk to this machine (its preflight, `clipbench
train` killed after its first checkpoint and resumed, the results store, MLflow and the report
checked) and must pass with nothing skipped but what needs hardware this machine lacks. The recipes
that sample with vLLM are rehearsed in .venv-vllm (tests/test_vllm_rehearse.py, `make test-vllm`);
here every other recipe. Measured: the 9 CPU recipes' rehearsals take 265 CPU-seconds in all (about 29
each: two `clipbench train` processes and the checks; 9.5 minutes of wall clock on 2 cores shared
with a load average of 9, about 4.5 on idle ones in one xdist worker). The four NSR-scale MoE
recipes (recipes/nsr_scale/qwen3_30b_a3b_*, a random 2-layer Qwen3-MoE, planned on their declared
139 GiB GPUs): 72-86 s each on 2 cores shared with a load average of ~6.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from clipbench.yamlio import load_yaml_file

slow = [pytest.mark.slow, pytest.mark.timeout(900)]  # the rehearsals train (2 launches of clipbench train each)

REPO = Path(__file__).resolve().parent.parent
NEEDS_HARDWARE = {"sampler.sleep_mode", "sampler.gpu_memory_utilization", "model.device"}  # CUDA only


def shipped_recipes(vllm: bool) -> list[str]:
    """Every run config under recipes/ (sweep files, which have a base, are not recipes), those that
    sample with vLLM or the others."""
    out = []
    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        data = load_yaml_file(path)
        if "base" in data or "grid" in data:
            continue
        if (data.get("sampler", {}).get("backend") == "vllm") == vllm:
            out.append(str(path.relative_to(REPO)))
    return out


def declared_gpu_memory(recipe: str) -> float | None:
    """The GiB per GPU the recipe declares (launch.gpu_memory): the GPUs it is written for."""
    return (load_yaml_file(REPO / recipe).get("launch") or {}).get("gpu_memory")


def check_rehearsal(recipe: str, tmp_path) -> None:
    from clipbench.rehearse import rehearse

    result = rehearse(REPO / recipe, results_dir=tmp_path)  # planned on the recipe's declared GPUs
    parts = {p.name: p for p in result.parts}
    failed = [f"{p.name}: {p.detail}" for p in result.parts if p.how == "failed"]
    assert result.ok, failed
    assert {p.name for p in result.parts if p.how == "skipped"} <= NEEDS_HARDWARE, result.verdict()
    for name in ("preflight", "checkpoint, kill, resume", "results store", "tracking (MLflow)"):
        assert parts[name].how == "ran", (name, parts.get(name))
    if "train.micro_batch_tokens" in parts and parts["train.micro_batch_tokens"].how == "scaled":
        assert parts["micro-batches"].how == "ran"  # every optimizer step in >= 2 micro-batches
    assert parts["evaluation"].how == "ran" and parts["report"].how == "ran"
    assert result.plan is not None and result.plan.fits  # the real recipe on its declared GPUs (80 GiB unless named)
    assert result.plan.setup.device_gib == (declared_gpu_memory(recipe) or 80.0)
    assert result.verdict().startswith("rehearsal passed")


def test_the_recipes_are_found():
    cpu, vllm = shipped_recipes(False), shipped_recipes(True)
    assert "recipes/quickstart.yaml" in cpu and "recipes/nsr/dapo_nsr.yaml" in cpu and len(cpu) >= 9
    assert sorted(vllm) == [
        f"recipes/abc_grpo_table3/qwen3_{m}_{r}.yaml" for m in ("1p7b", "4b") for r in ("abc", "grpo")
    ] + [f"recipes/nsr_scale/qwen2_5_7b_dapo{r}.yaml" for r in ("", "_decay", "_nsr")]
    moe = [f"recipes/nsr_scale/qwen3_30b_a3b_{r}.yaml" for r in ("gspo", "gspo_decay", "gspo_nsr", "grpo_r2")]
    assert set(moe) <= set(cpu) and {declared_gpu_memory(r) for r in moe} == {139}  # 8 x H200 (HF sampler)


def test_the_4b_table3_recipe_shrunk_for_a_cpu_machine():
    """What the rehearsal keeps, scales and skips of the 4B Table-3 recipe on 2 CPU cores, with and
    without vllm installed (pure: nothing is written)."""
    from clipbench.config import load_run_config, to_dict
    from clipbench.rehearse.scale import Machine, rehearsal_config

    real = to_dict(load_run_config(REPO / "recipes/abc_grpo_table3/qwen3_4b_grpo.yaml"))
    plan = rehearsal_config(real, Machine(world_cap=2, cuda=False, vllm=False))
    parts, cfg = {p.name: p for p in plan.parts}, plan.config
    assert parts["processes"].how == "scaled" and parts["processes"].detail.startswith("8 -> 2")
    assert parts["model"].how == "scaled" and "Qwen/Qwen3-4B-Base (4.02B, qwen3)" in parts["model"].detail
    assert parts["task"].how == "scaled" and plan.math_problems and cfg["task"]["template"] == "dapo"
    assert plan.benchmarks == ["aime24", "aime25", "amc23"] and cfg["eval"]["limit"] == 4 and cfg["eval"]["n"] == 2
    assert parts["sampler.backend"].how == "skipped" and cfg["sampler"]["backend"] == "hf"  # vllm not installed
    assert parts["sampler.sleep_mode"].how == "skipped" and cfg["sampler"]["sleep_mode"] is False  # no CUDA
    assert parts["model.dtype"].how == "as" and cfg["model"]["dtype"] == "bfloat16"
    # 4 mini-batches over 2 processes, >= 2 rows each: 16 rows = 4 prompts x 4 samples
    assert (cfg["train"]["prompts_per_step"], cfg["sampler"]["group_size"], cfg["train"]["mini_batches"]) == (4, 4, 4)
    assert plan.micro_batch_scaled and cfg["train"]["steps"] == 3 and cfg["train"]["checkpoint_every"] == 1
    with_vllm = rehearsal_config(real, Machine(world_cap=2, cuda=False, vllm=True))
    assert {p.name: p.how for p in with_vllm.parts}["sampler.backend"] == "as"
    assert with_vllm.config["sampler"]["backend"] == "vllm"


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    import subprocess
    import sys

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipbench",
            "rehearse",
            str(REPO / "recipes/quickstart.yaml"),
            "train.stepz=3",
            "--results-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "train.stepz" in res.stderr
    assert not (tmp_path / "r").exists()


# Recipes whose rehearsal would repeat another's code path (make test's time): the MoE arm's gspo and
# gspo_decay differ from gspo_nsr (rehearsed) only in the rule's parameters on the same sequence ratio;
# the tiny NSR-scale recipes run end to end in tests/test_nsr_scale.py (reproduce.sh tiny).
SAME_PATH_AS = {
    "recipes/nsr_scale/qwen3_30b_a3b_gspo.yaml": "recipes/nsr_scale/qwen3_30b_a3b_gspo_nsr.yaml",
    "recipes/nsr_scale/qwen3_30b_a3b_gspo_decay.yaml": "recipes/nsr_scale/qwen3_30b_a3b_gspo_nsr.yaml",
    "recipes/nsr_scale/tiny_moe.yaml": "tests/test_nsr_scale.py",
    "recipes/nsr_scale/tiny_dense.yaml": "tests/test_nsr_scale.py",
}


@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=slow) for r in shipped_recipes(vllm=False) if r not in SAME_PATH_AS]
)
def test_a_shipped_recipe_rehearses(recipe, tmp_path):
    check_rehearsal(recipe, tmp_path)


def test_a_recipe_with_a_sampler_correction_keeps_it():
    """A recipe's sampler correction runs as written, named with its parameters (pure: nothing is written)."""
    from clipbench.config import load_run_config, to_dict
    from clipbench.rehearse.scale import Machine, rehearsal_config

    real = to_dict(
        load_run_config(
            REPO / "recipes/abc_grpo_table3/qwen3_1p7b_grpo.yaml",
            ["sampler.correction.name=icepop", "sampler.correction.high=3"],
        )
    )
    plan = rehearsal_config(real, Machine(world_cap=2, cuda=False, vllm=True))
    part = {p.name: p for p in plan.parts}["sampler.correction"]
    assert part.how == "as" and part.detail == "name=icepop, level=token, low=0.5, high=3.0, weight=rho"
    assert plan.config["sampler"]["correction"] == real["sampler"]["correction"]
    plain = rehearsal_config(to_dict(load_run_config(REPO / "recipes/quickstart.yaml")), Machine(2, False, False))
    assert "sampler.correction" not in {p.name for p in plain.parts}  # none: nothing to say
