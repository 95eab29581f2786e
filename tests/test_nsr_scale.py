"""The NSR-paper-scale recipes (recipes/nsr_scale/): the published settings they claim, the sweeps'
runs equal to the recipes, `clipbench plan` on the GPUs each recipe declares, the headers' estimates,
and the tiny pipeline (`make reproduce-nsr SCALE=tiny`) for real.

The recipes are rehearsed with the other shipped recipes (tests/test_rehearse.py: the four MoE ones
here, on their declared GPUs; tests/test_vllm_rehearse.py: the three vLLM ones in .venv-vllm); one
vLLM recipe is also rehearsed here with the HF sampler (vllm is not installed in .venv).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.config import load_run_config, to_dict
from clipbench.config.schema import Slot

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "recipes" / "nsr_scale"
MOE = ["qwen3_30b_a3b_gspo", "qwen3_30b_a3b_gspo_nsr", "qwen3_30b_a3b_gspo_decay", "qwen3_30b_a3b_grpo_r2"]
DENSE = ["qwen2_5_7b_dapo", "qwen2_5_7b_dapo_nsr", "qwen2_5_7b_dapo_decay"]
runner = CliRunner()


def header(name: str) -> str:
    """The recipe's leading comment block."""
    lines = (HERE / f"{name}.yaml").read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))])


def header_plan_args(name: str) -> list[str]:
    """The `clipbench plan ...` command the header prints, as arguments after `plan`."""
    m = re.search(r"^#\s+clipbench plan (.+)$", header(name), re.M)
    assert m, f"{name}: no `clipbench plan` line in the header"
    return m.group(1).split("#")[0].split()


def _expand(path: Path) -> list[dict]:
    from clipbench.sweep.expand import expand
    from clipbench.sweep.spec import load_spec

    return list(expand(load_spec(path)).runs.values())


def _same_run(run: dict, recipe: Path) -> None:
    want = to_dict(load_run_config(recipe, [f"seed={run['seed']}"]))
    want.pop("tracking"), want.pop("name")
    got = {k: v for k, v in run.items() if k not in ("tracking", "name")}
    assert got == want, recipe.name


# ---- what each recipe claims ---------------------------------------------------------------------
def test_the_moe_recipes_follow_gspo_published_settings():
    """GSPO (arXiv 2507.18071, Sec. 5.1): 4 mini-batches per rollout batch, GSPO bounds 3e-4 / 4e-4,
    GRPO bounds 0.2 / 0.27 with routing replay on a MoE model; the four differ only in the objective
    (and GRPO's replay)."""
    cfgs = {n: load_run_config(HERE / f"{n}.yaml") for n in MOE}
    assert cfgs["qwen3_30b_a3b_gspo"].objective == Slot("gspo", {"eps_low": 3e-4, "eps_high": 4e-4})
    assert cfgs["qwen3_30b_a3b_grpo_r2"].objective == Slot("grpo", {"eps_low": 0.2, "eps_high": 0.27})
    for rule in ("nsr", "decay"):
        obj = cfgs[f"qwen3_30b_a3b_gspo_{rule}"].objective
        assert obj.name == rule and obj.params == {
            "base": "sequence",
            "eps_low": 3e-4,
            "eps_high": 4e-4,
            "delta": 2e-4,  # half of eps_high: the estimate its header states
            "p": 0.5,
            "schedule": "const",
            "sides": "both",
        }
    for name, cfg in cfgs.items():
        assert cfg.model.name == "Qwen/Qwen3-30B-A3B-Base" and cfg.model.dtype == "bfloat16"
        assert cfg.model.routing_replay == ("r2" if name.endswith("_r2") else "none")
        assert cfg.train.mini_batches == 4 and cfg.train.advantage.name == "group" and cfg.train.beta == 0.0
        assert cfg.sampler.backend == "hf" and cfg.launch.nproc_per_node == 8
        # 2 epochs of 17,398 prompts in batches of 256: 67 x 2 rollout steps; warmup 10% of 134 x 4
        assert cfg.train.steps == 2 * (17398 // 256) == 134 and cfg.train.warmup_steps == 134 * 4 // 10
        assert cfg.eval.benchmarks == ["aime24", "aime25", "amc23"] and cfg.eval.n == 32 and cfg.eval.limit is None
    base = to_dict(cfgs["qwen3_30b_a3b_gspo"])
    for cfg in cfgs.values():
        d = to_dict(cfg)
        d["model"]["routing_replay"] = "none"
        assert {**d, "objective": None} == {**base, "objective": None}


def test_the_dense_recipes_follow_dapo_published_settings():
    """DAPO (arXiv 2503.14476, Sec. 4.1): 512 prompts x 16, mini-batches of 512 samples (16 per
    rollout step), lr 1e-6 with warmup over 20 rollout steps, clip 0.2 / 0.28, token-mean, dynamic
    sampling, 20,480 tokens with overlong shaping over the last 4,096, no KL, avg@32 at T 1.0, top-p 0.7."""
    cfgs = {n: load_run_config(HERE / f"{n}.yaml") for n in DENSE}
    assert cfgs["qwen2_5_7b_dapo"].objective == Slot("dapo", {"eps_low": 0.2, "eps_high": 0.28})
    for rule in ("nsr", "decay"):
        obj = cfgs[f"qwen2_5_7b_dapo_{rule}"].objective
        assert obj.name == rule and (obj["eps_low"], obj["eps_high"], obj["base"]) == (0.2, 0.28, "token")
    for cfg in cfgs.values():
        t, s = cfg.train, cfg.sampler
        assert cfg.model.name == "Qwen/Qwen2.5-7B" and s.backend == "vllm" and cfg.launch.nproc_per_node == 8
        assert (t.prompts_per_step, s.group_size, t.prompts_per_step * s.group_size // t.mini_batches) == (512, 16, 512)
        assert t.lr == 1e-6 and t.warmup_steps == 20 * t.mini_batches and t.lr_schedule == "constant"
        assert t.agg.name == "token-mean" and t.dynamic_sampling and t.beta == 0.0
        assert s.max_new_tokens == 20480 and t.overlong.enabled and t.overlong.buffer == 4096
        assert (cfg.eval.n, cfg.eval.temperature, cfg.eval.top_p) == (32, 1.0, 0.7)
    a, b = to_dict(cfgs["qwen2_5_7b_dapo"]), to_dict(cfgs["qwen2_5_7b_dapo_nsr"])
    a.pop("objective"), b.pop("objective")
    assert a == b


def test_the_headers_mark_every_unpublished_figure_as_an_estimate():
    for name in MOE + DENSE:
        text = header(name)
        flat = " ".join(line.lstrip("#").strip() for line in text.splitlines())
        assert "ESTIMATES (the project's choices, not published)" in flat and "Time, an ESTIMATE" in flat, name
        assert f"clipbench train recipes/nsr_scale/{name}.yaml" in text


# ---- the sweeps ----------------------------------------------------------------------------------
def test_the_full_sweeps_runs_are_the_recipes():
    moe = {"gspo": "gspo", "nsr": "gspo_nsr", "decay": "gspo_decay", "grpo": "grpo_r2"}
    runs = _expand(HERE / "sweep_moe.yaml")
    assert len(runs) == 4
    for run in runs:
        _same_run(run, HERE / f"qwen3_30b_a3b_{moe[run['objective']['method']]}.yaml")
    runs = _expand(HERE / "sweep_dense.yaml")
    assert len(runs) == 3
    for run in runs:
        method = run["objective"]["method"]
        _same_run(run, HERE / f"qwen2_5_7b_dapo{'' if method == 'dapo' else '_' + method}.yaml")


def test_the_tiny_sweeps_are_the_full_ones_on_the_builtin_models():
    """Same arms, same objectives (but the band: 1e-2 at this scale), the built-in models."""
    full = {r["objective"]["method"]: r for r in _expand(HERE / "sweep_moe.yaml")}
    tiny = {r["objective"]["method"]: r for r in _expand(HERE / "sweep_moe_tiny.yaml")}
    assert set(tiny) == set(full) == {"gspo", "nsr", "decay", "grpo"}
    for method, run in tiny.items():
        want = dict(full[method]["objective"], **({"delta": 1e-2} if method in ("nsr", "decay") else {}))
        assert run["objective"] == want
        assert run["model"]["name"] == "builtin:arith-steps-moe"
        assert run["model"]["routing_replay"] == full[method]["model"]["routing_replay"]
        assert run["train"]["mini_batches"] == 4 and run["train"]["agg"] == "seq-mean-token-mean"
    full = {r["objective"]["method"]: r for r in _expand(HERE / "sweep_dense.yaml")}
    tiny = {r["objective"]["method"]: r for r in _expand(HERE / "sweep_dense_tiny.yaml")}
    assert set(tiny) == set(full) == {"dapo", "nsr", "decay"}
    for method, run in tiny.items():
        assert run["objective"] == full[method]["objective"] and run["model"]["name"] == "builtin:arith-steps"
        assert run["train"]["dynamic_sampling"] and run["train"]["overlong"]["enabled"]


# ---- the memory plan on the GPUs each recipe declares -----------------------------------------------
@pytest.mark.parametrize("name", MOE + DENSE)
def test_each_recipe_passes_clipbench_plan_on_its_declared_gpus(name):
    args = header_plan_args(name)
    assert args[0] == f"recipes/nsr_scale/{name}.yaml"
    res = runner.invoke(app, ["plan", str(REPO / args[0]), *args[1:]])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert args[1:] == []  # the recipe declares its GPUs (launch.gpu, launch.gpu_memory): no flag
    if name in MOE:  # 8 x H200 (139 GiB as the device reports it), the HF sampler
        assert "fits: ~110 of 139 GiB per GPU" in out and "8 GPUs of 139 GiB" in out
        assert out.startswith("hardware: 8 x H200 of 139 GiB (GPUs: launch.nproc_per_node; memory: launch.gpu_memory)")
    else:  # 8 x 80 GB, vLLM asleep while training
        assert "fits: ~75 of 80 GiB per GPU" in out and out.startswith("hardware: 8 x H100 of 80 GiB")


def test_the_moe_header_says_why_not_8_x_80_gb():
    """Its figures: 8 x 80 GB does not fit (training ~81 GiB before the margin: the state alone is
    16 B x 30.53B / 8 = 57 GiB); 16 x 80 GB over 2 nodes fits with 4 prompts per generate call."""
    recipe = str(HERE / "qwen3_30b_a3b_gspo.yaml")
    res = runner.invoke(app, ["plan", recipe, "--json", "--gpu-memory", "80"])
    assert res.exit_code == 1
    import json

    plan = json.loads(res.stdout)
    state = sum(r["bytes"] for r in plan["rows"] if r["name"].startswith(("parameters", "gradients", "AdamW")))
    assert state == 16 * 30_532_122_624 // 8 and round(state / 2**30) == 57
    assert round(plan["training_bytes"] * 1.1 / 2**30) == 89  # the header's ~89 GiB
    assert plan["hardware"] == {
        "gpus_per_node": 8,
        "nnodes": 1,
        "gpu_memory_gib": 80.0,
        "gpu": None,  # the recipe's H200 is not what --gpu-memory 80 plans on
        "from": {"gpus_per_node": "launch.nproc_per_node", "gpu_memory_gib": "--gpu-memory"},
    }
    two_nodes = runner.invoke(
        app, ["plan", recipe, "--nnodes", "2", "--gpu-memory", "80", "sampler.prompts_per_call=4"]
    )
    assert two_nodes.exit_code == 0 and "fits: ~58 of 80 GiB per GPU" in " ".join(two_nodes.output.split())


# ---- rehearsal and the tiny pipeline -------------------------------------------------------------
def test_rehearse_plans_on_the_gpu_memory_it_is_given(tmp_path):
    """`clipbench rehearse --gpu-memory`: the real recipe's plan on those GPUs (the MoE recipes name
    141 GB ones); bad input is one line, exit 2, nothing written."""
    res = subprocess.run(
        [sys.executable, "-m", "clipbench", "rehearse", str(HERE / "qwen3_30b_a3b_gspo.yaml"), "--gpu-memory", "0"]
        + ["--results-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 2 and res.stderr.strip() == "error: --gpu-memory must be > 0 (GiB), got 0.0"
    assert not (tmp_path / "r").exists()

    from clipbench.rehearse import Rehearsal, memory_plan

    real = load_run_config(HERE / "qwen3_30b_a3b_gspo.yaml")
    at80, at139 = Rehearsal("x", tmp_path, [], nproc=8), Rehearsal("x", tmp_path, [], nproc=8)
    memory_plan(at80, real, gpu_memory=80)
    memory_plan(at139, real)  # the recipe's launch.gpu_memory
    assert not at80.plan.fits and at139.plan.fits and at139.plan.setup.device_gib == 139
    assert at139.hardware.describe().startswith("8 x H200 of 139 GiB") and at80.hardware.gpu_gib_from == "--gpu-memory"


def test_the_rehearsal_names_the_routing_replay():
    from clipbench.rehearse.scale import Machine, rehearsal_config

    real = to_dict(load_run_config(HERE / "qwen3_30b_a3b_grpo_r2.yaml"))
    parts = {p.name: p for p in rehearsal_config(real, Machine(2, False, False)).parts}
    assert parts["model.routing_replay"].how == "as" and parts["model.routing_replay"].detail == "r2"
    plain = to_dict(load_run_config(HERE / "qwen3_30b_a3b_gspo.yaml"))
    assert "model.routing_replay" not in {p.name for p in rehearsal_config(plain, Machine(2, False, False)).parts}


def test_the_rehearsal_scales_dapo_overlong_buffer_with_the_completion_length():
    """A bug the 7B recipe's rehearsal found: 12 new tokens kept the 4,096-token overlong buffer, which
    the loader refuses (buffer <= max_new_tokens). The buffer keeps its share: 4096 / 20480 x 12 = 2.4 -> 2."""
    from clipbench.rehearse.scale import Machine, rehearsal_config

    real = to_dict(load_run_config(HERE / "qwen2_5_7b_dapo.yaml"))
    plan = rehearsal_config(real, Machine(2, False, False))
    part = {p.name: p for p in plan.parts}["train.overlong"]
    assert plan.config["sampler"]["max_new_tokens"] == 12 and plan.config["train"]["overlong"]["buffer"] == 2
    assert part.how == "scaled" and part.detail == "buffer 4096 -> 2, penalty 1.0"
    small = to_dict(load_run_config(REPO / "recipes/nsr/dapo.yaml", ["train.overlong.enabled=true"]))
    kept = rehearsal_config(small, Machine(2, False, False))  # a buffer of 8 within 12 tokens: as it is
    assert {p.name: p for p in kept.parts}["train.overlong"].how == "as"
    assert kept.config["train"]["overlong"]["buffer"] == 8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dense_recipe_rehearses_with_the_hf_sampler(tmp_path):
    """Without vllm (this .venv), the 7B recipe's rehearsal runs everything but the vLLM sampler:
    a random 2-layer Qwen2 model, DAPO's dynamic sampling and overlong shaping, NSR, 16 mini-batches,
    micro-batches, 2 processes, kill and resume, MLflow, the report; its plan fits 8 x 80 GB."""
    from test_rehearse import NEEDS_HARDWARE

    from clipbench.rehearse import rehearse
    from clipbench.rollout.vllm_engine import is_available

    if is_available():
        pytest.skip("vllm installed: tests/test_vllm_rehearse.py rehearses it with vLLM")
    result = rehearse(HERE / "qwen2_5_7b_dapo_nsr.yaml", results_dir=tmp_path)
    parts = {p.name: p for p in result.parts}
    assert result.ok, result.verdict()
    assert {p.name for p in result.parts if p.how == "skipped"} <= NEEDS_HARDWARE | {"sampler.backend"}
    assert "qwen2 of 2 layers" in parts["model"].detail and parts["train.mini_batches"].how == "as"
    for name in ("checkpoint, kill, resume", "results store", "micro-batches", "evaluation", "report"):
        assert parts[name].how == "ran", (name, parts[name])
    assert result.plan.fits


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reproduce_nsr_tiny_runs_both_arms_end_to_end(tmp_path):
    """reproduce.sh tiny (what `make reproduce-nsr SCALE=tiny` runs), one rollout step a run: every
    arm trains (GRPO with r2 replays routes), each sweep is reported against its baseline. Measured
    on 2 cores shared with other work: 96 s as written (load average ~6), 206 s with 2 steps and all
    five formats (load ~10)."""
    import json
    import os

    from clipbench.yamlio import load_yaml_file

    # the HTML report (the other formats are the report tests' business)
    env = {**os.environ, "CLIPBENCH": str(Path(sys.executable).parent / "clipbench"), "FORMATS": "html"}
    res = subprocess.run(
        ["bash", str(HERE / "reproduce.sh"), "tiny", str(tmp_path / "results")]
        + ["train.steps=1", "eval.every=0", "eval.n=4", "eval.limit=8", "tracking.mlflow=false"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=580,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for sweep in ("nsr_scale_moe_tiny", "nsr_scale_dense_tiny"):
        report = tmp_path / "results" / "reports" / sweep
        assert (report / "report.html").exists()
    r2 = next(
        p
        for p in (tmp_path / "results" / "nsr_scale_moe_tiny").glob("*/config.yaml")
        if load_yaml_file(p)["model"]["routing_replay"] == "r2"
    )
    rows = [json.loads(line) for line in (r2.parent / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["ratio/max"] == rows[0]["ratio/min"] == 1.0  # 1 step x 4 mini-batches
    assert rows[0]["routing/changed_frac"] == 0.0 < max(r["routing/changed_frac"] for r in rows[1:])
