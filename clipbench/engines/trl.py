"""`engine: trl`: one clipbench run trained by TRL's GRPOTrainer, written to the same results store.

    clipbench train recipes/quickstart.yaml engine=trl objective.name=nsr
    accelerate launch --num_processes 8 -m clipbench train RECIPE engine=trl trl.deepspeed=ds_z3.json

The run config maps onto GRPOConfig so that one rollout step is one TRL generation batch and one
clipbench mini-batch is one TRL optimizer step:

    B = train.prompts_per_step x sampler.group_size     sequences per rollout step (= generation_batch_size)
    M = train.mini_batches, E = train.epochs            optimizer steps per rollout step: M x E
    K = trl.gradient_accumulation_steps (default 1)     micro-batches per optimizer step (micro-batching)
    per_device_train_batch_size = B / (M K W)           W = processes (WORLD_SIZE)
    steps_per_generation = M K, num_iterations = E, max_steps = train.steps x M x E
    learning_rate, adam betas, weight_decay, warmup_steps, lr schedule, max_grad_norm, beta, seed,
    temperature, top_p, max_completion_length, bf16/fp16, gradient_checkpointing, use_vllm: from
    the run config; scale_rewards: group -> "group", group_mean -> "none"

The loss is `ClipbenchGRPOTrainer` (objective.name and its parameters, train.agg, exact global
normalisation per optimizer step). Anything else TRL offers (DeepSpeed ZeRO-3, FSDP, vLLM server mode,
report_to backends, ...) goes in the run config's `trl:` mapping of extra GRPOConfig fields; multi-GPU
and multi-node runs start the same command under `accelerate launch`.

The results store is the built-in loop's: config.yaml, status.json, metrics.jsonl with one row per
optimizer step under the same metric names (TRL's other metrics as `trl/<name>`), hist/, eval/ (the
same evaluation code, on the TRL model), and `checkpoints/last/` (state.json + `model/`, which is
TRL's own checkpoint directory, so `--resume` continues through TRL's resume and `clipbench eval`
loads it). Only the main process writes. Differences from the built-in loop, by TRL's design: prompts
are drawn by TRL's seeded sampler, epochs reuse one shuffle of the batch, and the advantage std has
TRL's epsilon (1e-4). Settings TRL has no counterpart for are refused by `check_config`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from clipbench.config.schema import Slot
from clipbench.errors import ConfigError, UserError, did_you_mean
from clipbench.eval.suite import eval_suite, run_eval
from clipbench.integrations.trl_settings import FEEDS
from clipbench.models import compute_dtype, load_model_and_tokenizer, resolve_model_name
from clipbench.objectives import CELLS
from clipbench.objectives.corrections import NONE
from clipbench.rollout import build_sampler, resolve_backend
from clipbench.tasks import build_run_task
from clipbench.tracking.files import atomic_write_json, read_json
from clipbench.tracking.records import record_steps
from clipbench.tracking.run_entry import run_finished, run_started, run_summary
from clipbench.tracking.sink import NullSink
from clipbench.tracking.store import RunDir, RunState
from clipbench.train.checkpoint import checkpoint_owner, find_checkpoint, install_checkpoint, not_own
from clipbench.train.distributed import resolve_device

# GRPOConfig fields clipbench derives from the run config (a `trl:` entry may not set them).
DERIVED = (
    "output_dir",
    "seed",
    "num_generations",
    "per_device_train_batch_size",
    "steps_per_generation",
    "generation_batch_size",
    "max_steps",
    "num_train_epochs",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "learning_rate",
    "adam_beta1",
    "adam_beta2",
    "weight_decay",
    "warmup_steps",
    "lr_scheduler_type",
    "max_grad_norm",
    "beta",
    "scale_rewards",
    "logging_steps",
    "save_strategy",
    "save_steps",
    "eval_strategy",
    "use_cpu",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "use_vllm",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
    "loss_type",
    "epsilon",
    "epsilon_high",
)


def correction_args(correction: Slot) -> dict:
    """GRPOConfig's vllm_importance_sampling_* fields of a (validated) sampler.correction: its
    counterpart in what TRL's loss call is fed (integrations/trl_settings.py; the preflight refuses the
    others)."""
    return FEEDS.settings("correction", correction)


def _grpo_fields() -> list[str]:
    from trl import GRPOConfig  # noqa: PLC0415 - optional: trl

    return [f.name for f in fields(GRPOConfig)]


def check_config(cfg, source: str | None = None) -> None:
    """ConfigError for bad `trl:` entries and for what needs two keys together (the one-key refusals
    are the engines' table, clipbench.engines.keys)."""
    if cfg.sampler.correction.name != NONE and not _uses_vllm(cfg):
        raise ConfigError(
            source,
            "sampler.correction.name",
            "engine 'trl' corrects the sampler mismatch only with "
            "sampler.backend=vllm (TRL has no sampler log-probs without vLLM)",
        )
    if cfg.trl:
        known = _grpo_fields()
        for k in cfg.trl:
            if k not in known:
                raise ConfigError(source, f"trl.{k}", "not a GRPOConfig field" + did_you_mean(k, known))
            if k in DERIVED:
                raise ConfigError(
                    source,
                    f"trl.{k}",
                    "clipbench sets it from the run config; set the run config's "
                    "own key instead (`clipbench engines` lists the mapping)",
                )
    k = cfg.trl.get("gradient_accumulation_steps", 1)
    per_step = cfg.train.prompts_per_step * cfg.sampler.group_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or per_step % (cfg.train.mini_batches * k):
        raise ConfigError(
            source,
            "trl.gradient_accumulation_steps",
            f"must be an integer >= 1 that splits each mini-batch of {per_step} sequences / "
            f"{cfg.train.mini_batches} mini-batches evenly, got {k!r}",
        )


def _uses_vllm(cfg) -> bool:
    return resolve_backend(cfg.sampler.backend) == "vllm"


def optimizer_steps_per_rollout(cfg) -> int:
    return cfg.train.mini_batches * cfg.train.epochs


def grpo_args(cfg, run_dir: Path, *, world_size: int):
    """The GRPOConfig of a run (see the module docstring for the mapping; engines/keys.py lists it)."""
    from trl import GRPOConfig  # noqa: PLC0415 - optional: trl

    tc, sc = cfg.train, cfg.sampler
    device = resolve_device(cfg.model.device)
    dtype = compute_dtype(cfg.model.dtype, device)
    extra = dict(cfg.trl)
    k = int(extra.pop("gradient_accumulation_steps", 1))
    per_step = tc.prompts_per_step * sc.group_size
    if per_step % (tc.mini_batches * k * world_size):
        raise UserError(
            f"engine trl: {per_step} sequences per rollout step do not split into {tc.mini_batches} "
            f"mini-batches x {k} micro-batches x {world_size} processes"
        )
    per_rollout = optimizer_steps_per_rollout(cfg)
    schedule = {"constant": "constant_with_warmup" if tc.warmup_steps else "constant", "cosine": "cosine"}
    kw = dict(
        output_dir=str(Path(run_dir) / "checkpoints" / "trl"),
        seed=cfg.seed,
        num_generations=sc.group_size,
        per_device_train_batch_size=per_step // (tc.mini_batches * k * world_size),
        gradient_accumulation_steps=k,
        steps_per_generation=tc.mini_batches * k,
        num_iterations=tc.epochs,
        max_steps=tc.steps * per_rollout,
        max_completion_length=sc.max_new_tokens,
        temperature=sc.temperature,
        top_p=sc.top_p,
        learning_rate=tc.lr,
        adam_beta1=tc.betas[0],
        adam_beta2=tc.betas[1],
        weight_decay=tc.weight_decay,
        warmup_steps=tc.warmup_steps,
        lr_scheduler_type=schedule[tc.lr_schedule],
        max_grad_norm=tc.grad_clip,
        router_aux_loss_coef=tc.router_aux_loss_coef,
        beta=tc.beta,
        **FEEDS.settings("advantage", tc.advantage),  # scale_rewards
        logging_steps=1,
        save_strategy="steps",
        save_steps=tc.checkpoint_every * per_rollout,
        eval_strategy="no",
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        use_vllm=_uses_vllm(cfg),
        vllm_gpu_memory_utilization=sc.gpu_memory_utilization,
        vllm_enable_sleep_mode=sc.sleep_mode,
        **correction_args(sc.correction),
        report_to="none",
        disable_tqdm=True,
    )
    kw.update(extra)
    return GRPOConfig(**kw)


# metrics.jsonl names of TRL's logged values (the rest are kept as trl/<name>)
RENAME = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "completions/mean_length": "response_length/mean",
    "completions/clipped_ratio": "truncated_frac",
    "frac_reward_zero_std": "zero_var_groups_frac",
    "learning_rate": "lr",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "entropy": "entropy",
    "accuracy": "accuracy",
    "aux_loss": "router_aux_loss",
}
# values of the rollout step (logged by TRL once per generation): repeated on each of its rows
ROLLOUT_KEYS = (
    "reward/mean",
    "reward/std",
    "accuracy",
    "response_length/mean",
    "truncated_frac",
    "zero_var_groups_frac",
)


def _main_process() -> bool:
    """Rank 0 of an accelerate/torchrun launch (their RANK variable: known before the process group exists)."""
    return int(os.environ.get("RANK", "0")) == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class StoreCallback(TrainerCallback):
    """Writes the results store (main process) as the built-in loop does: a metrics row per optimizer
    step (TRL's values under clipbench's names), histograms, evaluations, checkpoints, progress."""

    def __init__(self, cfg, rd, *, sink, progress, suite, tokenizer):
        self.cfg, self.rd, self.sink, self.progress, self.suite, self.tokenizer = (
            cfg,
            rd,
            sink,
            progress,
            suite,
            tokenizer,
        )
        self.per_rollout = optimizer_steps_per_rollout(cfg)
        self.trainer = None  # set by run_trl (the histograms live on it)
        self.rollout: dict = {}
        self.last: dict = {}
        self.clip_events = 0.0

    def evaluate(self, step: int, model) -> dict:

        sc = self.cfg.sampler
        sampler = build_sampler(
            "hf",
            model,
            self.tokenizer,
            max_new_tokens=sc.max_new_tokens,
            temperature=sc.temperature,
            top_p=sc.top_p,
            seed=self.cfg.seed,
        )
        # every process samples (models sharded by ZeRO-3 need all of them); only the main one writes
        return run_eval(self.cfg, self.rd, step, sampler, self.suite, self.sink, write=_main_process())

    def on_train_begin(self, args, state, control, model=None, **kw):
        if (
            self.suite
            and state.global_step == 0
            and self.cfg.eval.at_start
            and not self.rd.eval_path(0, next(iter(self.suite))).exists()
        ):
            self.evaluate(0, model)

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step % self.per_rollout:
            return
        done, cfg = state.global_step // self.per_rollout, self.cfg
        if self.suite and cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps:
            self.evaluate(done, model)
        if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
            control.should_save = True

    def on_log(self, args, state, control, logs=None, **kw):
        if not logs or "loss" not in logs:  # the end-of-training summary
            return
        n = state.global_step
        row = self.metrics_row(n, logs)
        hist = None
        if self.trainer is not None and self.trainer.clipbench_histograms is not None and n % self.per_rollout == 0:
            hist = _sum_histograms(self.trainer.clipbench_histograms)
            self.trainer.clipbench_histograms.clear()
        if not _main_process():
            return
        self.rd.append_metrics([row])
        if hist is not None:
            self.rd.append_hist([{"step": row["step"], "opt_step": n, **hist}])
        self.sink.log_metrics(n, {key: v for key, v in row.items() if isinstance(v, (int, float))})
        self.last = row
        if n % self.per_rollout == 0 and self.progress:
            self.progress(
                {
                    "step": row["step"] + 1,
                    "steps": self.cfg.train.steps,
                    "reward": row.get("reward/mean", 0.0),
                    "entropy": row.get("entropy", 0.0),
                    "clip_events": self.clip_events,
                    "accuracy": row.get("accuracy", 0.0),
                }
            )
            self.clip_events = 0.0

    def metrics_row(self, n: int, logs: dict) -> dict:
        """The metrics.jsonl row of optimizer step n from TRL's logs (RENAME; the rest as trl/<name>);
        the rollout's values, logged by TRL once per generation, repeated on each of its rows."""
        step, k = divmod(n - 1, self.per_rollout)
        row = {
            "step": step,
            "opt_step": n,
            "epoch": k // self.cfg.train.mini_batches,
            "mini_batch": k % self.cfg.train.mini_batches,
        }
        named = {
            RENAME.get(key, key if _is_clipbench_stat(key) else f"trl/{key}"): float(v)
            for key, v in logs.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if "reward/mean" in named:  # a generation happened at this step: the rollout's values
            self.rollout = {key: named[key] for key in ROLLOUT_KEYS if key in named}
            self.rollout["accuracy/sampled"] = self.rollout.get("accuracy", 0.0)
            self.rollout["zero_var_groups_frac/kept"] = self.rollout.get("zero_var_groups_frac", 0.0)
            self.rollout["groups_kept"] = self.cfg.train.prompts_per_step
        row.update(self.rollout)
        row.update(named)
        row["old_logp_source"] = 0
        self.clip_events += row.get("clip_events", 0.0)
        return row

    def on_save(self, args, state, control, **kw):
        """Move TRL's checkpoint-N into checkpoints/last/model (swapped in by renames) + state.json."""

        n = state.global_step
        src = Path(args.output_dir) / f"checkpoint-{n}"
        _barrier()  # every process has written its part
        if _main_process() and n % self.per_rollout == 0 and src.is_dir():
            root = self.rd.checkpoint_dir.parent
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
            os.replace(src, tmp / "model")
            atomic_write_json(
                tmp / "state.json",
                {"step": n // self.per_rollout, "opt_step": n, "engine": "trl", **checkpoint_owner(self.cfg)},
            )
            install_checkpoint(tmp, self.rd.checkpoint_dir)
            self.rd.set_status(RunState.RUNNING, step=n // self.per_rollout)
        _barrier()


def record_options(cfg, rd) -> dict | None:
    """ClipbenchGRPOTrainer's `record` (train.record; docs/replay.md), or None when off."""
    rec = cfg.train.record
    return {"dir": str(rd.path / "record"), "every": rec.every, "max_mb": rec.max_mb} if rec.every else None


def _is_clipbench_stat(key: str) -> bool:
    return (
        key.split("/")[0] in CELLS
        or key in ("clip_events", "approx_kl", "kl_ref")
        or key.startswith(("ratio/", "seq_ratio/"))
    )


def _sum_histograms(hists: list[dict]) -> dict | None:
    """One rollout step's log-ratio histogram: counts summed over its micro-batches and processes."""
    if not hists:
        return None

    pos = torch.tensor([h["pos"] for h in hists], dtype=torch.float64).sum(0)
    neg = torch.tensor([h["neg"] for h in hists], dtype=torch.float64).sum(0)
    if dist.is_available() and dist.is_initialized():
        both = torch.cat([pos, neg])
        dist.all_reduce(both)
        pos, neg = both[: len(pos)], both[len(pos) :]
    return {"edges": hists[0]["edges"], "pos": [int(x) for x in pos.tolist()], "neg": [int(x) for x in neg.tolist()]}


def _reward_fn(task, problems):
    def clipbench_reward(prompts, completions, problem, log_metric=None, **kw):
        probs = [problems[i] for i in problem]
        if log_metric is not None:
            correct = [float(task.is_correct(c, p)) for c, p in zip(completions, probs)]
            log_metric("accuracy", sum(correct) / max(len(correct), 1))
        return [float(task.reward(c, p)) for c, p in zip(completions, probs)]

    return clipbench_reward


def _prepare_run_dir(rd, cfg, *, resume: bool, main: bool) -> tuple[Path | None, dict, list[str]]:
    """The checkpoint a resume starts from (None: a fresh start), its state and what was set aside. A
    checkpoint that does not show it is this run's (its run id and seed) is removed with a line saying
    so, and the run starts fresh. A fresh start owns the directory's generated files (removed); a
    resume drops what was written after its checkpoint."""

    ckpt = find_checkpoint(rd.checkpoint_dir) if resume else None
    state = read_json(ckpt / "state.json") if ckpt else {"step": 0}
    if ckpt and state.get("engine") != "trl":
        raise UserError(f"{ckpt}: a checkpoint of engine '{state.get('engine', 'builtin')}', not 'trl'")
    notes = []
    why = not_own(state, cfg) if ckpt else None
    if why is not None:
        notes = [f"checkpoint {ckpt.relative_to(rd.path)} set aside (removed): {why}", "the run restarts from step 0"]
        _barrier()  # every process has read it
        if main:
            shutil.rmtree(rd.checkpoint_dir.parent, ignore_errors=True)
        ckpt, state, resume = None, {"step": 0}, False
    if main and not resume:
        rd.clear_generated()
    if main and ckpt:
        rd.truncate_after(state["step"])
    rd.checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    return ckpt, state, notes


def train(cfg, run_dir: Path, *, resume: bool = False, sink=None, progress=None, dist=None, stop=None) -> dict:
    """The engine's interface (clipbench.engines.Engine.train): TRL runs its own processes and
    preemption, so `dist` and `stop` are not used (the launcher turns SIGTERM into an exit)."""
    return run_trl(cfg, run_dir, resume=resume, sink=sink, progress=progress)


def run_trl(
    cfg, run_dir: Path, *, resume: bool = False, sink=None, progress: Callable[[dict], None] | None = None
) -> dict:
    """Train `cfg` with TRL's GRPOTrainer into `run_dir` (the built-in loop's files); returns its summary."""

    from datasets import Dataset  # noqa: PLC0415 - datasets is heavy

    from clipbench.integrations.trl import ClipbenchGRPOTrainer  # noqa: PLC0415 - optional: trl (via integrations.trl)

    check_config(cfg)
    sink = sink or NullSink()
    rd = RunDir(run_dir)
    main = _main_process()
    ckpt, state, notes = _prepare_run_dir(rd, cfg, resume=resume, main=main)

    model, tok = load_model_and_tokenizer(resolve_model_name(cfg.model.name), dtype="float32", device="cpu")
    task = build_run_task(cfg)  # the run seed draws the problems, as in the builtin loop
    problems = list(task.train_problems())
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "problem": list(range(len(problems)))})
    suite = eval_suite(cfg, task) if cfg.eval.benchmarks else {}
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate's / torchrun's processes
    args = grpo_args(cfg, rd.path, world_size=world_size)
    rule = cfg.objective
    callback = StoreCallback(cfg, rd, sink=sink, progress=progress, suite=suite, tokenizer=tok)
    trainer = ClipbenchGRPOTrainer(
        model=model,
        reward_funcs=[_reward_fn(task, problems)],
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[callback],
        method=rule.name,
        params=rule.params,
        agg=cfg.train.agg.name,
        log_histograms=cfg.train.log_histograms,
        record=record_options(cfg, rd),
    )
    callback.trainer = trainer
    for cb in (PrinterCallback, ProgressCallback):  # clipbench reports progress itself
        trainer.remove_callback(cb)
    if main:
        run_started(  # config, status running, provenance, the sink's params
            cfg,
            rd,
            sink,
            engine="trl",
            backend="vllm" if args.use_vllm else "hf",
            world_size=world_size,
            device=resolve_device(cfg.model.device),
            step=state["step"],
            fresh=ckpt is None,
            drop=() if notes else ("checkpoint_notes",),
            **({"checkpoint_notes": notes, "resumed_from": None} if notes else {}),
        )

    trainer.train(resume_from_checkpoint=str(ckpt / "model") if ckpt else None)

    final = {}
    if suite and not rd.eval_path(cfg.train.steps, next(iter(suite))).exists():
        final = callback.evaluate(cfg.train.steps, trainer.model)
    _barrier()
    if main:
        run_finished(cfg, rd, sink, **({"records": record_steps(rd.path)} if cfg.train.record.every else {}))
        shutil.rmtree(args.output_dir, ignore_errors=True)  # TRL's own dir: its checkpoints were moved out
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return run_summary(cfg, rd, final, callback.last)
