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
    A preemption request (SIGTERM, launch.preempt_signal) stops it at the next safe point with a
    checkpoint, status preempted (train/preempt.py); resuming continues the same run.

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from clipbench.config import RunConfig, run_id
from clipbench.errors import RunFailed, UserError
from clipbench.eval.evaluate import Shard
from clipbench.eval.suite import eval_suite, run_eval
from clipbench.models import compute_dtype
from clipbench.models.routing import RouteReplay, row_routes_table
from clipbench.objectives.corrections import apply_correction
from clipbench.objectives.staleness import staleness_sums
from clipbench.seeds import generator
from clipbench.tasks import build_run_task
from clipbench.tracking.run_entry import run_finished, run_started, run_summary
from clipbench.tracking.sink import MetricSink, NullSink
from clipbench.tracking.store import RunDir, RunState
from clipbench.train.batch import RolloutBatch, collect_rollout
from clipbench.train.build import build_models, build_optimizer, build_run_sampler, planned_optimizer_steps
from clipbench.train.checkpoint import (
    checkpoint_owner,
    checkpoint_step,
    damaged_checkpoint,
    find_checkpoint,
    load_checkpoint,
    load_partial,
    reject_checkpoints,
    restore_logs,
    save_checkpoint,
)
from clipbench.train.distributed import Dist, init_distributed
from clipbench.train.lag import PolicyLag
from clipbench.train.metrics import log_step, metric_rows, rollout_metric, sum_histogram
from clipbench.train.packing import pack
from clipbench.train.preempt import NO_STOP, Partial, StopRequest, cpu_inputs, mark_preempted
from clipbench.train.record import NO_CAPTURE, Recorder
from clipbench.train.shared_eval import read_shared, share, start_eval_key
from clipbench.train.step import (
    Objective,
    StepInputs,
    accumulate_gradients,
    add_histograms,
    draw_uniforms,
    frozen_logprobs,
    optimizer_step,
    own_rows,
    plan_update,
)

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
    recorder: Recorder  # train.record: which rollout steps are recorded (train/record.py)
    lag: PolicyLag  # sampler.lag: the policies a lagged sampler samples from (train/lag.py)
    state: dict  # step, opt_step, skipped_nonfinite (what a checkpoint restores)
    evaluated: tuple[bool, bool]  # the start's and the end's evaluation already stored (a resumed run)
    stop: StopRequest = NO_STOP  # a preemption request (train/preempt.py)
    partial: Partial | None = None  # a rollout step a preemption interrupted, to finish first

    def forward_kw(self) -> dict:
        """How this run's forward passes are made (step.frozen_logprobs, step.accumulate_gradients)."""
        return dict(
            pad_id=self.tokenizer.pad_token_id,
            temperature=self.cfg.sampler.temperature,
            compute=self.compute,
            dist=self.dist,
        )


def prepare_run_dir(rd: RunDir, dist: Dist, resume: bool, cfg: RunConfig) -> tuple[Path | None, list[str]]:
    """(the checkpoint to resume from or None, what was decided about the run's checkpoints: one line
    each, rank 0's). Rank 0 first sets aside every checkpoint that is not this run's own and whole
    (`reject_checkpoints`); with none left it clears the files a previous start wrote."""
    if dist.main:
        rd.remove_temporaries()  # left by a crash mid-write (atomic writes' temp files, a checkpoint's)
    notes = []
    if resume and dist.main:
        notes = reject_checkpoints(rd, run_id=run_id(cfg), seed=cfg.seed, steps=cfg.train.steps)
    dist.barrier()
    ckpt = find_checkpoint(rd.checkpoint_dir) if resume else None
    if dist.main and ckpt is None:  # a start from step 0 owns the directory's generated files
        rd.clear_generated()
    dist.barrier()
    if notes:
        where = (
            f"resumes from its own checkpoint at rollout step {checkpoint_step(ckpt)}"
            if ckpt
            else "restarts from step 0"
        )
        notes.append(f"the run {where}")
    return ckpt, notes


def load_lag(lag: PolicyLag, ckpt: Path, model: torch.nn.Module, state: dict) -> None:
    """A lagged run's snapshots from its checkpoint (the steps its state.json lists). A lagged run's
    checkpoint without them cannot continue the run (ValueError: it is set aside as damaged)."""
    steps = state.pop("lag_steps", None)
    if not lag.active:
        return
    if steps is None:
        raise ValueError("it holds no snapshots of the lagged sampler's policies (sampler.lag)")
    lag.load(ckpt, model, steps)


def setup(
    cfg: RunConfig, rd: RunDir, dist: Dist, *, resume: bool, sink: MetricSink, stop: StopRequest = NO_STOP
) -> Trainer:
    if cfg.train.prompts_per_step % dist.world:  # torchrun's N may differ from launch.nproc_per_node
        raise UserError(
            f"train.prompts_per_step: {cfg.train.prompts_per_step} prompts cannot be shared by whole "
            f"groups over {dist.world} processes (make it a multiple)"
        )
    ckpt, notes = prepare_run_dir(rd, dist, resume, cfg)
    dtype = compute_dtype(cfg.model.dtype, dist.device)
    model, ref_model, tok = build_models(cfg, dist, dtype)
    optimizer, scheduler = build_optimizer(model, cfg.train)
    state, partial = {"step": 0, "opt_step": 0, "skipped_nonfinite": 0}, None
    lag = PolicyLag(cfg.sampler.lag)
    if ckpt is not None:
        try:
            state = load_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
            partial = load_partial(ckpt)
            load_lag(lag, ckpt, model, state)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if not damaged_checkpoint(e):
                raise
            # a damaged checkpoint its checksums could not catch (an older clipbench's): from step 0
            first = (str(e).strip().splitlines() or [""])[0][:160]
            notes += [
                f"checkpoint {ckpt.relative_to(rd.path)} set aside (removed): it could not be loaded "
                f"({type(e).__name__}: {first})",
                "the run restarts from step 0",
            ]
            ckpt, state, partial = None, {"step": 0, "opt_step": 0, "skipped_nonfinite": 0}, None
            lag = PolicyLag(cfg.sampler.lag)
            if dist.main:
                rd.clear_generated()
            dist.barrier()
            model, ref_model, tok = build_models(cfg, dist, dtype)  # the failed load may have filled some tensors
            optimizer, scheduler = build_optimizer(model, cfg.train)
    task = build_run_task(cfg)  # the run seed draws the problems, as `clipbench eval <run_dir>` does
    backend, sampler = build_run_sampler(cfg, model, tok, dist, dtype)
    suite = eval_suite(cfg, task) if cfg.eval.benchmarks else {}
    first = next(iter(suite), None)  # decided before any rank can write an evaluation, so all agree
    evaluated = (
        first is not None and rd.eval_path(0, first).exists(),
        first is not None and rd.eval_path(cfg.train.steps, first).exists(),
    )
    if dist.main:
        if ckpt is not None:  # a mid-step checkpoint keeps that step's logged optimizer steps
            notes += restore_logs(rd, ckpt)
            rd.truncate_after(state["step"], opt_step=state["opt_step"] if partial else None)
        run_started(  # config, status running, provenance, the sink's params
            cfg,
            rd,
            sink,
            engine="builtin",
            backend=backend,
            world_size=dist.world,
            device=dist.device,
            step=state["step"],
            fresh=ckpt is None,
            drop=() if notes else ("checkpoint_notes",),
            **({"checkpoint_notes": notes, "resumed_from": state["step"] if ckpt else None} if notes else {}),
        )
    dist.barrier()
    autocast = dtype != torch.float32 and not dist.sharded  # sharded: FSDP casts the parameters itself
    compute = functools.partial(torch.autocast, dist.device.type, dtype=dtype) if autocast else contextlib.nullcontext
    return Trainer(
        cfg=cfg,
        rd=rd,
        dist=dist,
        sink=sink,
        model=model,
        ref_model=ref_model,
        tokenizer=tok,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        task=task,
        pool=list(task.train_problems()),
        suite=suite,
        objective=Objective.from_config(cfg),
        compute=compute,
        recorder=Recorder(cfg, rd, dist, model, sink),
        lag=lag,
        state=state,
        evaluated=evaluated,
        stop=stop,
        partial=None if partial is None else Partial(**partial),
    )


# ----------------------------------------------------------------------------------------------
# Rollout and update: every optimizer step of one rollout batch


def rollout(trainer: Trainer, step: int) -> RolloutBatch:
    """Rollout step `step`'s batch, sampled by the behaviour policy (the current one, or with
    sampler.lag the policy of `lag` rollout steps ago: train/lag.py), scored, with its advantages."""
    trainer.lag.observe(step, trainer.model)
    with trainer.lag.behaviour(step, trainer.model, trainer.sampler) as lag:
        batch = collect_rollout(trainer.cfg, step, trainer.task, trainer.pool, trainer.sampler, trainer.dist)
    if trainer.lag.active:
        batch.metrics["offpolicy/lag"] = lag
    return batch


def update(trainer: Trainer, step: int, batch: RolloutBatch) -> tuple[list[dict], torch.Tensor | None, Partial | None]:
    """Old (and reference) log-probs, then per epoch and mini-batch: accumulate over micro-batches,
    one optimizer step. Returns (per optimizer step: its statistics as device tensors, histogram,
    None; or, stopped by a preemption request after a step, what resuming the rest needs)."""
    cfg, dist, model = trainer.cfg, trainer.dist, trainer.model
    packed = pack(batch.prompt_ids, batch.completion_ids, trainer.tokenizer.pad_token_id)
    plan = plan_update(
        packed,
        mini_batches=cfg.train.mini_batches,
        epochs=cfg.train.epochs,
        budget=cfg.train.micro_batch_tokens,
        perm=generator(cfg.seed, "perm", step),
        dist=dist,
    )
    inputs, mismatch, start, hist = update_start(trainer, packed, batch, plan)  # fresh, or a preempted step's rest
    # a rollout step interrupted by a preemption is not recorded: its first optimizer steps ran before the stop
    capture = trainer.recorder.start(step, packed, batch, inputs) if start == 0 else NO_CAPTURE
    done = []
    for i, s in enumerate(plan[start:], start):
        if trainer.objective.draws and (s.index == 0 or i == start):  # one draw per (row, position) and epoch
            inputs.uniforms = draw_uniforms(
                packed.completion_ids.shape, generator(cfg.seed, "nsr", step, s.epoch), dist.device
            )
        first = i == 0  # the first step's forward is the policy before any update
        stats, h = accumulate_gradients(
            model,
            packed,
            s,
            inputs,
            trainer.objective,
            histogram=cfg.train.log_histograms,
            mismatch=first and cfg.sampler.old_logp == "sampler" and inputs.sampler_logp is not None,
            record=capture.forwards(s, inputs),
            **trainer.forward_kw(),
        )
        if first and mismatch is not None:
            stats.add_rollout(mismatch)  # this rank's share: all-reduced with the step's statistics
        capture.before_optimizer_step(s, trainer)
        loss = torch.stack(stats.loss).sum() if stats.loss else None  # a non-finite loss skips the step too
        grad_norm, stepped = optimizer_step(model, trainer.optimizer, trainer.scheduler, cfg.train.grad_clip, loss)
        trainer.state["opt_step"] += 1
        trainer.state["skipped_nonfinite"] += int(not stepped)
        done.append(
            {
                "epoch": s.epoch,
                "mini_batch": s.index,
                "micro_batches": len(s.micro),
                "stats": stats,
                "grad_norm": grad_norm,
                "opt_step": trainer.state["opt_step"],
                "lr": trainer.scheduler.get_last_lr()[0],
                "skipped_nonfinite": trainer.state["skipped_nonfinite"],
            }
        )
        hist = hist if h is None else add_histograms(hist, h)
        if i + 1 < len(plan) and trainer.stop.agreed(dist):  # a preemption, at a safe point: the state is whole
            return done, hist, Partial(vars(batch), cpu_inputs(inputs), i + 1, None, {})
    capture.finish()
    trainer.sampler.sync_weights(model)
    return done, hist, None


def update_start(
    trainer: Trainer, packed, batch: RolloutBatch, plan: list
) -> tuple[StepInputs, dict | None, int, torch.Tensor | None]:
    """(the rule's inputs, the rollout batch's sums measured here (mismatch, staleness), the first
    optimizer step to run, the log-ratio counts so far): a fresh update's, or the rest of a rollout
    step a preemption interrupted (its saved inputs; its counts so far on rank 0)."""
    resumed, trainer.partial = trainer.partial, None
    if resumed is None:
        return (*rule_inputs(trainer, packed, batch, [s for s in plan if s.epoch == 0]), 0, None)
    dist = trainer.dist
    hist = resumed.hist.to(dist.device) if dist.main and resumed.hist is not None else None
    return resumed.step_inputs(StepInputs, dist.device), None, resumed.next, hist


def rule_inputs(trainer: Trainer, packed, batch: RolloutBatch, first_epoch: list) -> tuple[StepInputs, dict | None]:
    """The rule's per-row inputs, fixed for the whole update: advantages, old log-probs (the policy's,
    recomputed; or the sampler's with sampler.old_logp=sampler), the reference's, rewards and prompt
    groups, and the sampler correction's weights. Also the rollout batch's sums measured here, or
    None: the sampler/trainer mismatch (old log-probs recomputed; with old_logp=sampler the first
    step's forward measures it) and the batch's staleness, the current policy against the sampler's
    (objectives/staleness.py; with old_logp=sampler from a forward of its own)."""
    cfg, dist, kw = trainer.cfg, trainer.dist, trainer.forward_kw()
    sampled = (
        None
        if batch.sampler_logp is None
        else batch.sampler_logp_tensor(packed.completion_ids.shape[1]).to(dist.device)
    )  # (B, T)
    rows = batch.row_inputs(packed.completion_mask, cfg.sampler.group_size, dist.device)
    if cfg.sampler.old_logp == "sampler":
        inputs = StepInputs(
            batch.advantages.to(dist.device),
            sampled,
            frozen_ref(trainer, packed, first_epoch),
            sampler_logp=sampled,
            **rows,
        )
        if sampled is None:
            return inputs, None
        current = frozen_logprobs(trainer.model, packed, first_epoch, **kw)  # (B, T) the policy before the update
        return inputs, staleness(current, sampled, inputs, first_epoch, len(packed.completion_lens))
    routes, mode = batch_routes(trainer, packed, batch)  # r2: recorded by this forward; r3: the sampler's
    old = frozen_logprobs(trainer.model, packed, first_epoch, **kw, routes=None if routes is None else (mode, routes))
    inputs = StepInputs(
        batch.advantages.to(dist.device), old, frozen_ref(trainer, packed, first_epoch), **rows, routes=routes
    )
    if sampled is None:
        return inputs, None
    if trainer.objective.reads_rollout_logp:  # rollout_is: the rule's ratio is against the sampler
        inputs.sampler_logp = sampled
    mine = own_rows(first_epoch, len(packed.completion_lens), dist.device)  # (B,): this rank's rows, counted once
    corr = apply_correction(
        cfg.sampler.correction.one_form(),
        sampled,
        old,
        inputs.mask,
        counted=mine[:, None] > 0,
        advantages=inputs.advantages,
    )
    inputs.weights, inputs.correction_status = corr.weights, corr.status  # every row's (later epochs: other ranks)
    return inputs, {**corr.sums, **staleness(old, sampled, inputs, first_epoch, len(packed.completion_lens))}


def staleness(current: torch.Tensor, sampled: torch.Tensor, inputs: StepInputs, first_epoch: list, B: int) -> dict:
    """This rank's staleness sums of the rollout batch: `current` (B, T) against the sampler's `sampled`."""
    mine = own_rows(first_epoch, B, current.device) > 0  # (B,) this rank's rows, counted once
    return staleness_sums(current, sampled, inputs.mask, inputs.advantages, mine)


def batch_routes(trainer: Trainer, packed, batch: RolloutBatch) -> tuple[torch.Tensor | None, str]:
    """model.routing_replay's route table of the rollout batch (models/routing.py) and what the old
    forward does with it: r2 an empty table it records into; r3 the sampler's routes, replayed; none
    on a MoE policy: recorded too, and the update's forwards only compare with it (diagnostics)."""
    mode, device = trainer.cfg.model.routing_replay, trainer.dist.device
    if mode == "r2" or (mode == "none" and RouteReplay.of(trainer.model) is not None):  # none: observed only
        return RouteReplay.of(trainer.model).new_table(*packed.input_ids.shape, device=device), "record"
    if mode == "r3":
        prompt_width = packed.input_ids.shape[1] - packed.completion_ids.shape[1]
        table = row_routes_table(batch.routes, packed.prompt_lens, packed.input_ids.shape[1], prompt_width)
        return table.to(device), "replay"
    return None, ""


def frozen_ref(trainer: Trainer, packed, first_epoch: list) -> torch.Tensor | None:
    """(B, T) the frozen reference's log-probs (train.beta > 0), else None."""
    if trainer.ref_model is None:
        return None
    return frozen_logprobs(trainer.ref_model, packed, first_epoch, **trainer.forward_kw())


# ----------------------------------------------------------------------------------------------
# After a step: skipped-step budget, evaluation, checkpoint


def check_skipped(trainer: Trainer) -> None:
    """Fail once more than `train.max_skipped_frac` of the run's optimizer steps were skipped."""
    tc, skipped = trainer.cfg.train, trainer.state["skipped_nonfinite"]
    total = planned_optimizer_steps(tc)
    if skipped > tc.max_skipped_frac * total:
        raise RunFailed(
            f"train.max_skipped_frac: {skipped} of the run's {total} optimizer steps were skipped "
            f"(a non-finite loss or gradient norm), more than {tc.max_skipped_frac:g} of them: the loss overflows; "
            f"lower train.lr or train.beta, or mend a plugin rule that returns inf or NaN (metrics.jsonl shows "
            f"where it starts)"
        )


def evaluate_run(trainer: Trainer, step: int) -> dict:
    # no sleep after an evaluation: the next rollout samples from these weights (a level-2 sleep
    # drops them, and only sync_weights reloads them)
    dist, rd = trainer.dist, trainer.rd
    shard = Shard(dist.rank, dist.world, dist.gather) if dist.sharded else None
    # before the first step, a sweep's runs that would compute the same evaluation share it (train/shared_eval.py)
    key = (
        start_eval_key(trainer.cfg, rd, backend=trainer.sampler.name, device=dist.device, world=dist.world)
        if step == 0
        else None
    )
    shared = read_shared(rd, key, trainer.suite) if key else None
    flat = run_eval(
        trainer.cfg,
        rd,
        step,
        trainer.sampler,
        trainer.suite,
        trainer.sink,
        write=dist.main,
        shard=shard,
        payloads=shared,
    )
    if key and shared is None:
        share(rd, key, trainer.suite)
    return flat


def after_step(trainer: Trainer, done: int) -> None:
    cfg = trainer.cfg
    check_skipped(trainer)
    if trainer.suite and cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps:
        evaluate_run(trainer, done)
    if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
        checkpoint(trainer, done)
        if trainer.dist.main:
            trainer.rd.set_status(RunState.RUNNING, step=done, skipped_nonfinite=trainer.state["skipped_nonfinite"])


def checkpoint(trainer: Trainer, step: int, partial: Partial | None = None) -> None:
    """Every rank: the run's state at rollout step `step` (`partial`: inside it, by a preemption)."""
    trainer.state["step"] = step
    if trainer.lag.active:
        trainer.state["lag_steps"] = trainer.lag.steps()
    save_checkpoint(
        trainer.rd.checkpoint_dir,
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        tokenizer=trainer.tokenizer,
        state=trainer.state,
        dist=trainer.dist,
        partial=None if partial is None else vars(partial),
        owner=checkpoint_owner(trainer.cfg),
        logs={"metrics.jsonl": trainer.rd.metrics_path, "log_ratio.jsonl": trainer.rd.hist_path},
        also=functools.partial(trainer.lag.save, model=trainer.model) if trainer.lag.active else None,
    )


def stop_at_boundary(trainer: Trainer, step: int) -> None:
    """A safe point before rollout step `step` trains: on a preemption request, checkpoint (unless the
    last one is this step's) and stop."""
    if trainer.stop.agreed(trainer.dist):
        if checkpoint_step(find_checkpoint(trainer.rd.checkpoint_dir) or trainer.rd.checkpoint_dir) != step:
            checkpoint(trainer, step)
        mark_preempted(trainer, step, trainer.stop)


def stop_inside(trainer: Trainer, step: int, partial: Partial, rows: list[dict], hist) -> None:
    """Stopped after an optimizer step of rollout step `step`: log its steps so far, checkpoint the
    rest's inputs with them (the histogram so far, summed over ranks), stop."""
    log_step(trainer, step, rows, None, None)
    partial.hist = None if hist is None else trainer.dist.all_reduce_(hist.to(torch.float64)).cpu()
    partial.mismatch = {k: v for k, v in rows[0].items() if rollout_metric(k)}
    checkpoint(trainer, step, partial)
    mark_preempted(trainer, step, trainer.stop)


def finish(trainer: Trainer, last: dict) -> dict:
    cfg, rd = trainer.cfg, trainer.rd
    final = {}
    if trainer.suite and not trainer.evaluated[1]:
        final = evaluate_run(trainer, cfg.train.steps)
    if trainer.dist.main:
        run_finished(cfg, rd, trainer.sink, skipped_nonfinite=trainer.state["skipped_nonfinite"])
    return run_summary(cfg, rd, final, last)


# ----------------------------------------------------------------------------------------------
# The run


def run_training(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    sink: MetricSink | None = None,
    progress: Callable[[dict], None] | None = None,
    dist: Dist | None = None,
    stop: StopRequest = NO_STOP,
) -> dict:
    """Train one run into `run_dir` (resume: from its last checkpoint). Under torchrun every rank
    calls this; `dist` (default: from the environment) says which rank this is; `stop`: the
    preemption request its safe points check (RunPreempted once checkpointed). Returns the summary."""
    dist = dist or init_distributed(cfg.model.device)
    trainer = setup(
        cfg,
        RunDir(run_dir),
        dist,
        resume=resume,
        sink=sink if sink is not None and dist.main else NullSink(),
        stop=stop,
    )
    try:
        if trainer.suite and trainer.state["step"] == 0 and cfg.eval.at_start and not trainer.evaluated[0]:
            evaluate_run(trainer, 0)
        last: dict = {}
        for step in range(trainer.state["step"], cfg.train.steps):
            resumed = trainer.partial
            if resumed is None:
                stop_at_boundary(trainer, step)
                batch = rollout(trainer, step)
                stop_at_boundary(trainer, step)  # nothing trained yet: a resumed run samples the same again
            else:
                batch = RolloutBatch(**resumed.batch)
            trainer.sampler.sleep()  # sampler.sleep_mode: the engine's memory is the trainer's until the sync
            t0 = time.perf_counter()
            done, hist, stopped = update(trainer, step, batch)
            rows = metric_rows(trainer, step, batch, done, time.perf_counter() - t0, resumed and resumed.mismatch)
            if stopped is not None:
                stop_inside(trainer, step, stopped, rows, hist)
            log_step(trainer, step, rows, sum_histogram(hist, dist), progress)
            last = rows[-1]
            after_step(trainer, step + 1)
        return finish(trainer, last)
    finally:
        trainer.sampler.close()
