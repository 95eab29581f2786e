"""`clipbench sweep FILE --engine verl`: each run of a sweep as a verl trainer command.

    clipbench sweep sweeps/nsr_vs_decay.yaml --engine verl --dry-run      # the commands, nothing written
    clipbench sweep sweeps/nsr_vs_decay.yaml --engine verl --json         # {"run_id", "env", "command"} per run
    clipbench sweep sweeps/nsr_vs_decay.yaml --engine verl --launcher ray hydra.launcher.ray.init.address=HEAD:6379
    clipbench sweep sweeps/nsr_vs_decay.yaml --engine verl --launcher submitit_slurm hydra.launcher.partition=gpu

A run config maps onto verl's `main_ppo` Hydra overrides (`verl_overrides`): the model; the batch
(data.train_batch_size = prompts per step, rollout.n = group size, actor.ppo_mini_batch_size =
prompts / mini_batches, ppo_epochs, token-budget micro-batches); the rule
(actor.policy_loss.loss_mode=clipbench.<method>, verl's clip_ratio_* / tau_* fields where they mean
the same, every parameter in CLIPBENCH_RULE_PARAMS, carried to the Ray workers by
ray_kwargs.ray_init.runtime_env.env_vars); the aggregation; the seed (data, actor data loader,
rollout); the optimizer and schedule; KL (beta -> actor KL loss, k3 = low_var_kl); evaluation
cadence; the logger (console + MLflow, experiment = tracking.experiment) and the checkpoint directory
(<results>/<sweep>/<run_id>/verl). The task is exported once per task config to verl's parquet
format (`export_task`) with clipbench's own reward as verl's custom reward function
(`clipbench.integrations.verl_reward`).

A real launch freezes the manifest, writes each run's config.yaml and a status.json that records the
submission (a rerun does not submit it again), and submits: to a Ray cluster as Ray jobs, to SLURM
through submitit, or, without --launcher, runs the commands here one after another. verl's trainer
needs GPUs and verl itself: without them the command stops with one line saying so (--dry-run still
prints everything). verl's runs log through verl's own loggers; the results store keeps their configs
and submissions, not their metrics, so `clipbench report` does not read them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from clipbench.config import RunConfig, from_dict
from clipbench.config.schema import Slot
from clipbench.errors import UserError
from clipbench.eval.suite import eval_suite
from clipbench.integrations.verl_settings import (
    FEEDS,
    MODULE,
    PARAMS_ENV,
    PLUGINS_ENV,
    RECORD_DIR_ENV,
    RECORD_MAX_MB_ENV,
    VERL_FIELDS,
)
from clipbench.models import PROMPT_TOKENS, compute_dtype, dtype_name, resolve_model_name
from clipbench.tasks import build_task
from clipbench.tasks.benchmarks import ARITH_SPLITS

A, R, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
_PLAIN = re.compile(r"[A-Za-z_/.~][A-Za-z0-9_./:@+~-]*")


def _hydra_value(v: Any) -> str:
    """A value in Hydra's override grammar."""
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    s = str(v)
    if _PLAIN.fullmatch(s) and s.lower() not in ("true", "false", "null", "none", "nan", "inf"):
        try:
            float(s)
        except ValueError:
            return s  # a plain string in Hydra's grammar (names, paths)
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def task_data_dir(sweep_dir: Path, cfg: dict) -> Path:
    """One export per distinct task and evaluation set."""
    key = json.dumps(
        {"task": cfg["task"], "eval": {k: cfg["eval"][k] for k in ("benchmarks", "limit", "data_dir")}}, sort_keys=True
    )
    return Path(sweep_dir) / "verl_data" / hashlib.sha256(key.encode()).hexdigest()[:12]


def export_task(cfg: dict, out_dir: Path) -> tuple[Path, Path]:
    """The run's data as verl parquet files: train = the task's training pool; val = every evaluation
    benchmark of the run (eval.benchmarks, eval.limit problems each; data_source clipbench/<benchmark>,
    so verl reports each one). Each row: data_source, prompt (one user message: clipbench's rendered
    prompt), ability, reward_model.ground_truth, extra_info (what verl_reward.compute_score needs)."""
    import pandas as pd  # noqa: PLC0415 - pandas is heavy

    out_dir = Path(out_dir)
    train, val = out_dir / "train.parquet", out_dir / "val.parquet"
    if train.is_file() and val.is_file():
        return train, val
    run = from_dict(cfg)
    task = build_task(run.task)
    task_json = json.dumps(cfg["task"], sort_keys=True)

    def rows(source: str, problems, scorer: dict) -> list[dict]:
        return [
            {
                "data_source": f"clipbench/{source}",
                "prompt": [{"role": "user", "content": p.prompt}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": p.answer},
                "extra_info": {**scorer, "id": p.id, "prompt": p.prompt, "meta": json.dumps(p.meta, default=str)},
            }
            for p in problems
        ]

    train_rows = rows(cfg["task"]["name"], task.train_problems(), {"task": task_json, "benchmark": ""})
    val_rows = []
    for name, (problems, _) in (eval_suite(run, task) if run.eval.benchmarks else {}).items():
        own = name in ARITH_SPLITS and run.task.name == "arith"  # the run's own held-out split, graded by the task
        val_rows += rows(name, problems, {"task": task_json, "benchmark": "" if own else name})
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, data in ((train, train_rows), (val, val_rows)):
        tmp = path.with_suffix(".tmp")
        pd.DataFrame(data).to_parquet(tmp)
        os.replace(tmp, path)
    return train, val


def rule_env(run: RunConfig) -> dict[str, str]:
    """The environment of verl's workers: the module to import, the rule's parameters, the run's plugins
    (absolute paths once the config is composed: they must exist on the workers' nodes)."""
    env = {"VERL_USE_EXTERNAL_MODULES": MODULE, PARAMS_ENV: json.dumps(run.objective.params, sort_keys=True)}
    if run.plugins:
        env[PLUGINS_ENV] = os.pathsep.join(run.plugins)
    return env


def record_env(run: RunConfig, run_dir: Path) -> dict[str, str]:
    """train.record.every=1: the registered loss records every call into the run's record/ (docs/replay.md)."""
    rec = run.train.record
    if not rec.every:
        return {}
    return {RECORD_DIR_ENV: str(Path(run_dir) / "record"), RECORD_MAX_MB_ENV: str(rec.max_mb)}


def correction_overrides(correction: Slot) -> dict[str, Any]:
    """verl's algorithm.rollout_correction of a (validated) sampler.correction: its counterpart in what
    verl's loss call is fed (integrations/verl_settings.py; the preflight refuses the others); verl
    0.9.1 computes the rollout log-probs by default."""
    return FEEDS.settings("correction", correction)


def verl_overrides(
    cfg: dict,
    *,
    run_dir: Path,
    data: tuple[Path, Path],
    experiment: str,
    n_gpus: int = 8,
    nnodes: int = 1,
    tracking_uri: str | None = None,
) -> list[str]:
    """verl main_ppo Hydra overrides for one resolved clipbench run config, as a manifest stores it
    (see the module docstring)."""

    run = from_dict(cfg)  # also a manifest frozen before sampler.correction
    tc, sc, ev, rule = run.train, run.sampler, run.eval, run.objective
    P, M = tc.prompts_per_step, tc.mini_batches
    if P % M:
        raise UserError(
            f"engine verl: verl's mini-batches count prompts; train.prompts_per_step={P} does not split "
            f"into train.mini_batches={M}"
        )
    model = resolve_model_name(run.model.name)
    dtype = dtype_name(compute_dtype(run.model.dtype, "cuda", bf16_supported=True))  # verl runs on GPUs
    o: dict[str, Any] = {
        **FEEDS.settings("advantage", tc.advantage),  # algorithm.adv_estimator, norm_adv_by_std_in_grpo
        "algorithm.use_kl_in_reward": False,
        "data.train_files": str(data[0]),
        "data.val_files": str(data[1]),
        "data.train_batch_size": P,
        "data.max_prompt_length": PROMPT_TOKENS,  # verl drops longer prompts
        "data.max_response_length": sc.max_new_tokens,
        "data.seed": run.seed,
        "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.model.enable_gradient_checkpointing": run.model.gradient_checkpointing,
        f"{A}.fsdp_config.dtype": dtype,
        f"{R}.dtype": dtype,
        f"{R}.free_cache_engine": sc.sleep_mode,
        f"{A}.policy_loss.loss_mode": f"clipbench.{rule.name}",
        **FEEDS.settings("aggregation", tc.agg),  # actor.loss_agg_mode
        f"{A}.loss_scale_factor": sc.max_new_tokens,
        f"{A}.ppo_mini_batch_size": P // M,
        f"{A}.ppo_epochs": tc.epochs,
        f"{A}.use_dynamic_bsz": True,
        f"{A}.optim.lr": tc.lr,
        f"{A}.optim.weight_decay": tc.weight_decay,
        f"{A}.optim.betas": tc.betas,
        f"{A}.optim.lr_warmup_steps": tc.warmup_steps,
        f"{A}.optim.lr_scheduler_type": tc.lr_schedule,
        f"{A}.grad_clip": tc.grad_clip,
        f"{A}.entropy_coeff": 0.0,
        f"{A}.data_loader_seed": run.seed,
        f"{A}.use_kl_loss": tc.beta > 0,
        f"{A}.kl_loss_coef": tc.beta,
        f"{A}.kl_loss_type": "low_var_kl",
        f"{R}.name": "vllm",
        f"{R}.n": sc.group_size,
        f"{R}.temperature": sc.temperature,
        f"{R}.top_p": sc.top_p,
        f"{R}.seed": run.seed,
        f"{R}.gpu_memory_utilization": sc.gpu_memory_utilization,
        f"{R}.log_prob_use_dynamic_bsz": True,
        f"{REF}.log_prob_use_dynamic_bsz": True,
        f"{R}.val_kwargs.n": ev.n,
        f"{R}.val_kwargs.temperature": ev.temperature,
        f"{R}.val_kwargs.top_p": ev.top_p,
        f"{R}.val_kwargs.do_sample": True,
        "reward.custom_reward_function.path": str(Path(__file__).with_name("verl_reward.py")),
        "reward.custom_reward_function.name": "compute_score",
        "trainer.logger": ["console"] + [s for s in run.tracking.sinks if s != "mlflow" or run.tracking.mlflow],
        "trainer.project_name": run.tracking.experiment,
        "trainer.experiment_name": experiment,
        "trainer.total_training_steps": tc.steps,
        "trainer.save_freq": tc.checkpoint_every,
        "trainer.test_freq": ev.every or -1,
        "trainer.val_before_train": bool(ev.at_start and ev.benchmarks),
        "trainer.default_local_dir": str(Path(run_dir) / "verl"),
        "trainer.resume_mode": "auto",
        "trainer.n_gpus_per_node": n_gpus,
        "trainer.nnodes": nnodes,
    }
    for param, fields in VERL_FIELDS.items():  # verl's own fields, where they mean the same
        if param in rule.params:
            o[f"{A}.{fields[0]}"] = rule.params[param]
    if tc.micro_batch_tokens:
        o[f"{A}.ppo_max_token_len_per_gpu"] = tc.micro_batch_tokens
    o.update(correction_overrides(sc.correction))
    out = [f"{k}={_hydra_value(v)}" for k, v in o.items()]
    env = {**rule_env(run), **record_env(run, run_dir)}
    tracking_uri = tracking_uri or run.tracking.tracking_uri
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    out += [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={_hydra_value(v)}" for k, v in env.items()]
    return out


def verl_command(overrides: list[str]) -> list[str]:
    return ["python3", "-m", "verl.trainer.main_ppo", *overrides]


def shell_line(cmd: list[str], env: dict[str, str], sep: str = " ") -> str:
    """The command as one shell line (sep=" \\\n    ": one override per line)."""
    head = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, cmd[:3])])
    return sep.join([head, *map(shlex.quote, cmd[3:])])


def plan_runs(runs, *, results_dir: Path, sweep: str, tracking_uri: str | None, n_gpus: int, nnodes: int) -> list[dict]:
    """[{run_id, label, config, data (paths), env, command}] for the runs of a frozen/planned manifest."""
    sweep_dir = Path(results_dir).resolve() / sweep
    plans = []
    for rid, cfg, label in runs:
        data_dir = task_data_dir(sweep_dir, cfg)
        data = (data_dir / "train.parquet", data_dir / "val.parquet")
        overrides = verl_overrides(
            cfg,
            run_dir=sweep_dir / rid,
            data=data,
            experiment=sweep,
            n_gpus=n_gpus,
            nnodes=nnodes,
            tracking_uri=tracking_uri,
        )
        env = {"VERL_USE_EXTERNAL_MODULES": MODULE}
        plans.append(
            {
                "run_id": rid,
                "label": label,
                "config": cfg,
                "data_dir": str(data_dir),
                "env": env,
                "command": verl_command(overrides),
            }
        )
    return plans


def check_can_launch(launcher: str | None) -> None:
    """verl's trainer runs where verl is installed with GPUs: refuse clearly when it cannot."""
    if launcher in ("ray", "submitit_slurm"):
        return  # the GPUs and verl are on the cluster
    if launcher is not None:
        raise UserError(f"--engine verl: --launcher {launcher} is not supported; use ray, submitit_slurm, or none")

    if importlib.util.find_spec("verl") is None:
        raise UserError(
            "--engine verl: verl is not installed here (pip install verl, with its GPU dependencies); "
            "--dry-run prints the commands, --launcher ray or submitit_slurm submits them to a cluster"
        )

    if not torch.cuda.is_available():
        raise UserError(
            "--engine verl: verl's trainer needs GPUs and this machine has none; --dry-run prints the "
            "commands, --launcher ray or submitit_slurm submits them to a cluster"
        )


def submit(plans: list[dict], *, launcher: str | None, hydra_overrides: list[str], sweep_dir: Path) -> list[dict]:
    """Export the tasks, then run or submit each command; returns [{run_id, job}]."""
    for p in plans:
        export_task(p["config"], Path(p["data_dir"]))
    settings = {
        o.split("=", 1)[0].lstrip("+")[len("hydra.launcher.") :]: o.split("=", 1)[1]
        for o in hydra_overrides
        if o.lstrip("+").startswith("hydra.launcher.")
    }
    if launcher == "ray":
        return _submit_ray(plans, settings)
    if launcher == "submitit_slurm":
        return _submit_slurm(plans, settings, sweep_dir)
    out = []
    for p in plans:  # here, one after another
        env = {**os.environ, **p["env"]}
        rc = subprocess.run(p["command"], env=env).returncode
        out.append({"run_id": p["run_id"], "job": f"local exit {rc}"})
    return out


def _submit_ray(plans: list[dict], settings: dict) -> list[dict]:
    from ray.job_submission import JobSubmissionClient  # noqa: PLC0415 - optional: ray

    address = settings.get("ray.init.address") or os.environ.get("RAY_ADDRESS")
    if not address:
        raise UserError(
            "--engine verl --launcher ray: give the cluster's address "
            "(hydra.launcher.ray.init.address=HEAD:6379 or RAY_ADDRESS); jobs go to its dashboard port"
        )
    host = address.split("://")[-1].rsplit(":", 1)[0]
    url = address if address.startswith("http") else f"http://{host}:8265"
    try:
        client = JobSubmissionClient(url)
    except Exception as e:  # noqa: BLE001 - unreachable cluster: one line
        raise UserError(f"--engine verl --launcher ray: cannot reach the Ray job server at {url}: {e}") from None
    return [
        {
            "run_id": p["run_id"],
            "job": client.submit_job(entrypoint=shlex.join(p["command"]), runtime_env={"env_vars": p["env"]}),
        }
        for p in plans
    ]


def _submit_slurm(plans: list[dict], settings: dict, sweep_dir: Path) -> list[dict]:
    import submitit  # noqa: PLC0415 - optional: submitit

    if shutil.which("sbatch") is None:
        raise UserError("--engine verl --launcher submitit_slurm: sbatch not found (not on a SLURM login node)")
    ex = submitit.AutoExecutor(folder=str(Path(sweep_dir) / ".verl-submitit" / "%j"), cluster="slurm")
    params = {k: (json.loads(v) if v.replace(".", "", 1).isdigit() else v) for k, v in settings.items()}
    ex.update_parameters(
        **{
            (
                k
                if k in ("timeout_min", "gpus_per_node", "cpus_per_task", "mem_gb", "nodes", "tasks_per_node", "name")
                else f"slurm_{k}"
            ): v
            for k, v in params.items()
        }
    )
    out = []
    for p in plans:
        job = ex.submit(submitit.helpers.CommandFunction(p["command"], env={**os.environ, **p["env"]}))
        out.append({"run_id": p["run_id"], "job": str(job.job_id)})
    return out
