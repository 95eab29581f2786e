"""The GRPO loop, top to bottom: one run, in one process or as one rank of a torchrun launch.

    run_training(cfg, run_dir)
      setup        policy (FSDP-sharded over N > 1 processes), optimizer, sampler, task, resumed state
      each rollout step
        rollout    P prompts x G completions -> rewards -> advantages           (train/batch.py)
        update     old log-probs; per epoch and mini-batch: micro-batches,
                   accumulated gradients, one AdamW step                         (train/step.py)
        log        one row per optimizer step -> metrics.jsonl and the sink
        after      skipped-step budget, evaluation every eval.every steps, checkpoint
      finish       final evaluation, status finished

Which process does what is decided in one place (train/distributed.py, `Dist`): this file asks it
for its share and whether it writes (rank 0 alone writes the results store and the sink). Every
random draw is derived from (seed, step, ...) through explicit generators (train/seeds.py), so a
resumed run replays what an uninterrupted run would have done, on any number of processes.
Evaluation runs on every rank over every problem, in lockstep (each forward of a sharded model is a
collective), and rank 0 stores it: more processes do not make evaluation faster.

Metrics, one row per optimizer step (`metrics.jsonl`):
    step, opt_step, epoch, mini_batch      rollout step, global optimizer step, position in the step
    micro_batches                          forward/backward calls of the step (per rank, padded)
    reward/mean, reward/std, accuracy      over the whole rollout batch (accuracy = raw task correctness)
    response_length/mean, truncated_frac   completion tokens; share that hit max_new_tokens
    zero_var_groups_frac                   share of sampled groups with all-equal rewards (A = 0)
    zero_var_groups_frac/kept              the same share in the trained batch (lower with dynamic sampling)
    entropy                                mean token entropy of the current policy over the mini-batch
    loss, grad_norm, lr                    mini-batch loss, pre-clip global grad norm, LR after the step
    skipped_nonfinite                      optimizer steps skipped so far (non-finite gradient norm)
    <cell>/<count>, ratio/*, approx_kl, clip_events, kl_ref     from policy_loss (docs/objectives.md)
    time/sample, time/score, time/update   seconds in sampling, scoring and updating this step (rank 0)
    old_logp_source                        0 = recomputed by the policy, 1 = the sampler's
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from clipbench.config import RunConfig, run_id, to_dict
from clipbench.errors import RunFailed, UserError
from clipbench.objectives import histogram_dict, reduce_sums
from clipbench.rollout import build_sampler, resolve_backend
from clipbench.objectives.corrections import sampler_mismatch
from clipbench.tasks import build_run_task
from clipbench.eval.evaluate import Shard
from clipbench.eval.suite import eval_suite, run_eval
from clipbench.tracking.mirror import run_params
from clipbench.tracking.sink import MetricSink, NullSink
from clipbench.tracking.store import RunDir
from clipbench.models import compute_dtype, dtype_name, load_model_and_tokenizer, resolve_model_name
from clipbench.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from clipbench.train.distributed import Dist, init_distributed, shard_model
from clipbench.train.packing import pack
from clipbench.train.batch import RolloutBatch, collect_rollout
from clipbench.seeds import generator
from clipbench.train.step import (Objective, StepInputs, StepStats, accumulate_gradients, add_histograms,
                                  draw_uniforms, frozen_logprobs, optimizer_step, own_rows, plan_update)


def lr_lambda(tc):
    """LR multiplier per optimizer step: linear warmup, then constant or cosine to 0."""
    total = planned_optimizer_steps(tc)

    def f(s: int) -> float:
        if tc.warmup_steps and s < tc.warmup_steps:
            return (s + 1) / tc.warmup_steps
        if tc.lr_schedule == "cosine":
            progress = min(1.0, (s - tc.warmup_steps) / max(1, total - tc.warmup_steps))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return f


def planned_optimizer_steps(tc) -> int:
    return max(1, tc.steps * tc.mini_batches * tc.epochs)


# ----------------------------------------------------------------------------------------------
# Setup


@dataclass
class Trainer:
    """Everything one run's steps use, built once by `setup`: the trainer's state."""

    cfg: RunConfig
    rd: RunDir
    dist: Dist
    sink: MetricSink
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: object
    task: object
    pool: list
    suite: dict
    objective: Objective
    compute: Callable  # () -> context manager of the forward passes (autocast in one process)
    state: dict  # step, opt_step, skipped_nonfinite (what a checkpoint restores)
    evaluated: tuple[bool, bool]  # the start's and the end's evaluation already stored (a resumed run)

    def forward_kw(self) -> dict:
        """How this run's forward passes are made (step.frozen_logprobs, step.accumulate_gradients)."""
        return dict(pad_id=self.tokenizer.pad_token_id, temperature=self.cfg.sampler.temperature,
                    compute=self.compute, dist=self.dist)


def load_policy_model(name: str, dist: Dist, compute_dtype: torch.dtype, *, trainable: bool,
                      gradient_checkpointing: bool = False):
    """(model, tokenizer) with float32 master weights on this rank's device, FSDP-sharded when N > 1."""
    model, tok = load_model_and_tokenizer(name, dtype="float32", device="cpu" if dist.sharded else str(dist.device))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist.sharded:
        shard_model(model, compute_dtype)
    if trainable:
        model.train()
    else:
        model.eval().requires_grad_(False)
    return model, tok


def prepare_run_dir(rd: RunDir, dist: Dist, resume: bool) -> Path | None:
    """The checkpoint to resume from, or None: then rank 0 clears the files a previous start wrote."""
    ckpt = find_checkpoint(rd.checkpoint_dir) if resume else None
    if dist.main and ckpt is None:  # a start from step 0 owns the directory's generated files
        for p in (rd.metrics_path, rd.hist_path.parent, rd.path / "eval", rd.path / "checkpoints"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    dist.barrier()
    return ckpt


def build_models(cfg: RunConfig, dist: Dist, dtype: torch.dtype):
    """(policy, frozen reference or None, tokenizer). Master weights in float32; bfloat16/float16 is
    the compute dtype (autocast in one process, FSDP's param dtype when sharded), so small AdamW
    updates are not rounded away."""
    name = resolve_model_name(cfg.model.name)
    model, tok = load_policy_model(name, dist, dtype, trainable=True,
                                   gradient_checkpointing=cfg.model.gradient_checkpointing)
    ref_model = None
    if cfg.train.beta > 0:  # frozen reference: the initial policy
        if dist.sharded:
            ref_model, _ = load_policy_model(name, dist, dtype, trainable=False)
        else:
            ref_model, _ = load_model_and_tokenizer(name, dtype=dtype_name(dtype), device=str(dist.device))
            ref_model.eval().requires_grad_(False)
    return model, ref_model, tok


def build_optimizer(model, tc):
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                                  fused=True)  # one kernel for all tensors: 3x faster than the default on CPU
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc))


def setup(cfg: RunConfig, rd: RunDir, dist: Dist, *, resume: bool, sink: MetricSink) -> Trainer:
    if cfg.train.prompts_per_step % dist.world:  # torchrun's N may differ from launch.nproc_per_node
        raise UserError(f"train.prompts_per_step: {cfg.train.prompts_per_step} prompts cannot be shared by whole "
                        f"groups over {dist.world} processes (make it a multiple)")
    ckpt = prepare_run_dir(rd, dist, resume)
    dtype = compute_dtype(cfg.model.dtype, dist.device)
    model, ref_model, tok = build_models(cfg, dist, dtype)
    optimizer, scheduler = build_optimizer(model, cfg.train)
    state = {"step": 0, "opt_step": 0, "skipped_nonfinite": 0}
    if ckpt is not None:
        state = load_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
    task = build_run_task(cfg)  # the run seed draws the problems, as `clipbench eval <run_dir>` does
    backend = resolve_backend(cfg.sampler.backend)
    sc = cfg.sampler
    # the sampler's log-probs: its old log-probs, or the mismatch (always logged by vLLM; with hf only
    # when a correction asks for it: hf samples from the training model itself)
    want_logp = sc.old_logp == "sampler" or sc.mismatch_is != "none" or backend == "vllm"
    eval_tokens = cfg.eval.max_new_tokens or sc.max_new_tokens  # the engine must hold eval's completions too
    sampler = build_sampler(backend, model, tok, max_new_tokens=sc.max_new_tokens, temperature=sc.temperature,
                            top_p=sc.top_p, seed=cfg.seed, return_logprobs=want_logp,
                            dtype=dtype_name(dtype), gpu_memory_utilization=sc.gpu_memory_utilization,
                            longest_new_tokens=max(eval_tokens, sc.max_new_tokens),
                            sleep_mode=sc.sleep_mode, synced_gpus=dist.sharded,
                            model_path=resolve_model_name(cfg.model.name) if dist.sharded else None)
    suite = eval_suite(cfg, task) if cfg.eval.benchmarks else {}
    first = next(iter(suite), None)  # decided before any rank can write an evaluation, so all agree
    evaluated = (first is not None and rd.eval_path(0, first).exists(),
                 first is not None and rd.eval_path(cfg.train.steps, first).exists())
    if dist.main:
        if ckpt is not None:
            rd.truncate_after(state["step"])
        rd.write_config(to_dict(cfg))
        rd.set_status("running", run_id=run_id(cfg), step=state["step"], steps=cfg.train.steps, backend=backend,
                      world_size=dist.world, started=rd.status().get("started", time.time()))
        sink.log_params(run_params(to_dict(cfg), backend))  # config + effective clip bounds (rule.*)
    dist.barrier()
    autocast = dtype != torch.float32 and not dist.sharded  # sharded: FSDP casts the parameters itself
    compute = functools.partial(torch.autocast, dist.device.type, dtype=dtype) if autocast else contextlib.nullcontext
    return Trainer(cfg=cfg, rd=rd, dist=dist, sink=sink, model=model, ref_model=ref_model, tokenizer=tok,
               optimizer=optimizer, scheduler=scheduler, sampler=sampler, task=task,
               pool=list(task.train_problems()), suite=suite, objective=Objective.from_config(cfg),
               compute=compute, state=state, evaluated=evaluated)


# ----------------------------------------------------------------------------------------------
# Update: every optimizer step of one rollout batch


def update(trainer: Trainer, step: int, batch: RolloutBatch) -> tuple[list[dict], torch.Tensor | None]:
    """Old (and reference) log-probs, then per epoch and mini-batch: accumulate over micro-batches,
    one optimizer step. Returns (per optimizer step: its statistics as device tensors, histogram)."""
    cfg, dist, model = trainer.cfg, trainer.dist, trainer.model
    packed = pack(batch.prompt_ids, batch.completion_ids, trainer.tokenizer.pad_token_id)
    plan = plan_update(packed, mini_batches=cfg.train.mini_batches, epochs=cfg.train.epochs,
                       budget=cfg.train.micro_batch_tokens, perm=generator(cfg.seed, "perm", step), dist=dist)
    inputs, mismatch = rule_inputs(trainer, packed, batch, [s for s in plan if s.epoch == 0])
    done, hist = [], None
    for s in plan:
        if trainer.objective.draws and s.index == 0:  # one draw per (row, position) and epoch
            inputs.uniforms = draw_uniforms(packed.completion_ids.shape, generator(cfg.seed, "nsr", step, s.epoch),
                                            dist.device)
        first = not done  # the first step's forward is the policy before any update
        stats, h = accumulate_gradients(model, packed, s, inputs, trainer.objective, histogram=cfg.train.log_histograms,
                                        mismatch=first and inputs.sampler_logp is not None, **trainer.forward_kw())
        if first and mismatch is not None:
            stats.mismatch.append(mismatch)  # this rank's share: all-reduced with the step's statistics
        grad_norm, stepped = optimizer_step(model, trainer.optimizer, trainer.scheduler, cfg.train.grad_clip)
        trainer.state["opt_step"] += 1
        trainer.state["skipped_nonfinite"] += int(not stepped)
        done.append({"epoch": s.epoch, "mini_batch": s.index, "micro_batches": len(s.micro), "stats": stats,
                     "grad_norm": grad_norm, "opt_step": trainer.state["opt_step"],
                     "lr": trainer.scheduler.get_last_lr()[0], "skipped_nonfinite": trainer.state["skipped_nonfinite"]})
        hist = hist if h is None else add_histograms(hist, h)
    trainer.sampler.sync_weights(model)
    return done, hist


def rule_inputs(trainer: Trainer, packed, batch: RolloutBatch, first_epoch: list) -> tuple[StepInputs, dict | None]:
    """The rule's per-row inputs, fixed for the whole update: advantages, old log-probs (the policy's,
    recomputed; or the sampler's with sampler.old_logp=sampler), the reference's, and the sampler
    correction's weights. Also the sampler/trainer mismatch sums when they are measured here (old
    log-probs recomputed), else None: with old_logp=sampler the first step's forward measures them."""
    cfg, dist, kw = trainer.cfg, trainer.dist, trainer.forward_kw()
    sampled = None if batch.sampler_logp is None else \
        batch.sampler_logp_tensor(packed.completion_ids.shape[1]).to(dist.device)  # (B, T)
    if cfg.sampler.old_logp == "sampler":
        return StepInputs(batch.advantages.to(dist.device), sampled, frozen_ref(trainer, packed, first_epoch),
                          sampler_logp=sampled), None
    old = frozen_logprobs(trainer.model, packed, first_epoch, **kw)
    inputs = StepInputs(batch.advantages.to(dist.device), old, frozen_ref(trainer, packed, first_epoch))
    if sampled is None:
        return inputs, None
    sc, mask = cfg.sampler, packed.completion_mask.to(dist.device)  # (B, T)
    mine = own_rows(first_epoch, len(packed.completion_lens), dist.device)  # (B,): this rank's rows, counted once
    mm = sampler_mismatch(sampled, old, mask, mode=sc.mismatch_is, cap=sc.mismatch_is_cap, counted=mine[:, None] > 0)
    inputs.weights = mm.weights  # every row's (later epochs hand ranks other rows)
    return inputs, mm.sums


def frozen_ref(trainer: Trainer, packed, first_epoch: list) -> torch.Tensor | None:
    """(B, T) the frozen reference's log-probs (train.beta > 0), else None."""
    if trainer.ref_model is None:
        return None
    return frozen_logprobs(trainer.ref_model, packed, first_epoch, **trainer.forward_kw())


# ----------------------------------------------------------------------------------------------
# Logging: statistics all-reduced and transferred once per rollout step; rank 0 writes


def metric_rows(trainer: Trainer, step: int, batch: RolloutBatch, done: list[dict], seconds: float) -> list[dict]:
    """One row per optimizer step: the statistics all-reduced over ranks (one collective per
    reduction kind for every step) and brought to the host in one transfer per kind, finalised."""
    reduced = reduce_sums([d["stats"].sums() for d in done], trainer.dist.all_reduce_, to="cpu")
    norms = torch.stack([d["grad_norm"] for d in done]).cpu().tolist()
    mismatch = {k: v for k, v in StepStats.metrics(reduced[0]).items() if k.startswith("mismatch/")}
    return [{"step": step, "opt_step": d["opt_step"], "epoch": d["epoch"], "mini_batch": d["mini_batch"],
             "micro_batches": d["micro_batches"], **batch.metrics, **StepStats.metrics(r), "grad_norm": norm,
             "lr": d["lr"], "skipped_nonfinite": d["skipped_nonfinite"],
             "old_logp_source": 1 if trainer.cfg.sampler.old_logp == "sampler" else 0,
             **mismatch,  # the rollout batch's sampler/trainer mismatch, on each of its rows
             "time/update": seconds}
            for d, r, norm in zip(done, reduced, norms)]


def sum_histogram(counts: torch.Tensor | None, dist: Dist) -> dict | None:
    """A rollout step's log-ratio counts summed over ranks, as the artifact's row (one transfer)."""
    if counts is None:
        return None
    return histogram_dict(dist.all_reduce_(counts.to(torch.float64)).round().long())


def log_step(trainer: Trainer, step: int, rows: list[dict], hist: dict | None, progress: Callable[[dict], None] | None) -> None:
    """Rank 0: rows to metrics.jsonl and the sink, the histogram, the progress line."""
    if not trainer.dist.main:
        return
    trainer.rd.append_metrics(rows)
    if hist is not None:
        trainer.rd.append_hist([{"step": step, "opt_step": trainer.state["opt_step"], **hist}])
    for row in rows:
        trainer.sink.log_metrics(row["opt_step"], {k: v for k, v in row.items() if isinstance(v, (int, float))})
    if progress:
        progress({"step": step + 1, "steps": trainer.cfg.train.steps, "reward": rows[-1]["reward/mean"],
                  "entropy": rows[-1]["entropy"], "clip_events": sum(r.get("clip_events", 0) for r in rows),
                  "accuracy": rows[-1]["accuracy"], "skipped": trainer.state["skipped_nonfinite"]})


# ----------------------------------------------------------------------------------------------
# After a step: skipped-step budget, evaluation, checkpoint


def check_skipped(trainer: Trainer) -> None:
    """Fail once more than `train.max_skipped_frac` of the run's optimizer steps were skipped."""
    tc, skipped = trainer.cfg.train, trainer.state["skipped_nonfinite"]
    total = planned_optimizer_steps(tc)
    if skipped > tc.max_skipped_frac * total:
        raise RunFailed(f"train.max_skipped_frac: {skipped} of the run's {total} optimizer steps were skipped "
                        f"(non-finite gradient norm), more than {tc.max_skipped_frac:g} of them: the loss overflows; "
                        f"lower train.lr or train.beta (metrics.jsonl shows where it starts)")


def evaluate_run(trainer: Trainer, step: int) -> dict:
    # no sleep after an evaluation: the next rollout samples from these weights (a level-2 sleep
    # drops them, and only sync_weights reloads them)
    dist = trainer.dist
    shard = Shard(dist.rank, dist.world, dist.gather) if dist.sharded else None
    return run_eval(trainer.cfg, trainer.rd, step, trainer.sampler, trainer.suite, trainer.sink, write=dist.main, shard=shard)


def after_step(trainer: Trainer, done: int) -> None:
    cfg = trainer.cfg
    check_skipped(trainer)
    if trainer.suite and cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps:
        evaluate_run(trainer, done)
    if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
        trainer.state["step"] = done
        save_checkpoint(trainer.rd.checkpoint_dir, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                        tokenizer=trainer.tokenizer, state=trainer.state, dist=trainer.dist)
        if trainer.dist.main:
            trainer.rd.set_status("running", step=done, skipped_nonfinite=trainer.state["skipped_nonfinite"])


def finish(trainer: Trainer, last: dict) -> dict:
    cfg, rd = trainer.cfg, trainer.rd
    final = {}
    if trainer.suite and not trainer.evaluated[1]:
        final = evaluate_run(trainer, cfg.train.steps)
    if trainer.dist.main:
        trainer.sink.log_artifact(rd.config_path)
        if rd.hist_path.exists():
            trainer.sink.log_artifact(rd.hist_path, "hist")
        rd.set_status("finished", step=cfg.train.steps, finished=time.time(),
                      skipped_nonfinite=trainer.state["skipped_nonfinite"])
    return {"run_id": run_id(cfg), "run_dir": str(rd.path), "steps": cfg.train.steps, **final,
            "last": {k: v for k, v in last.items() if isinstance(v, (int, float))}}


# ----------------------------------------------------------------------------------------------
# The run


def run_training(cfg: RunConfig, run_dir: Path, *, resume: bool = False, sink: MetricSink | None = None,
                 progress: Callable[[dict], None] | None = None, dist: Dist | None = None) -> dict:
    """Train one run into `run_dir` (resume: from its last checkpoint). Under torchrun every rank
    calls this; `dist` (default: from the environment) says which rank this is. Returns the summary."""
    dist = dist or init_distributed(cfg.model.device)
    trainer = setup(cfg, RunDir(run_dir), dist, resume=resume, sink=sink if sink is not None and dist.main else NullSink())
    try:
        if trainer.suite and trainer.state["step"] == 0 and cfg.eval.at_start and not trainer.evaluated[0]:
            evaluate_run(trainer, 0)
        last: dict = {}
        for step in range(trainer.state["step"], cfg.train.steps):
            batch = collect_rollout(cfg, step, trainer.task, trainer.pool, trainer.sampler, dist)
            trainer.sampler.sleep()  # sampler.sleep_mode: the engine's memory is the trainer's until the sync
            t0 = time.perf_counter()
            done, hist = update(trainer, step, batch)
            rows = metric_rows(trainer, step, batch, done, time.perf_counter() - t0)
            log_step(trainer, step, rows, sum_histogram(hist, dist), progress)
            last = rows[-1]
            after_step(trainer, step + 1)
        return finish(trainer, last)
    finally:
        trainer.sampler.close()
