"""The GRPO loop, top to bottom. One rollout step:

    prompts (P) -> sampler: P x G completions -> rewards (P, G) -> advantages (P*G,)
    -> old log-probs (recomputed by the training policy once per rollout batch, or the sampler's)
    -> for epoch in epochs: for each of `mini_batches` slices: policy_loss -> AdamW step
    -> sampler.sync_weights -> metrics rows to the results store (and the sink) -> eval / checkpoint

Every random draw is derived from (seed, step, ...) through explicit generators, so a run resumed
from a checkpoint replays exactly what an uninterrupted run would have done (on CPU).

Metrics, one row per optimizer step (`metrics.jsonl`):
    step, opt_step, epoch, mini_batch      rollout step, global optimizer step, position in the step
    reward/mean, reward/std, accuracy      over the whole rollout batch (accuracy = raw task correctness)
    response_length/mean, truncated_frac   completion tokens; share that hit max_new_tokens
    zero_var_groups_frac                   share of sampled groups with all-equal rewards (A = 0)
    zero_var_groups_frac/kept              the same share in the trained batch (lower with dynamic sampling)
    entropy                                masked mean token entropy of the current policy (mini-batch)
    loss, grad_norm, lr, skipped_nonfinite loss value, pre-clip grad norm, LR, skipped steps so far
    <cell>/<count>, ratio/*, approx_kl, clip_events, kl_ref     from policy_loss (objectives.md)
    time/sample, time/score, time/update   seconds in sampling, scoring and updating this step
    old_logp_source                        0 = recomputed by the policy, 1 = the sampler's
"""

from __future__ import annotations

import hashlib
import math
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from clipbench.config import RunConfig, run_id, to_dict
from clipbench.objectives import log_ratio_histogram, policy_loss
from clipbench.rollout import build_sampler, resolve_backend
from clipbench.tasks import build_run_task
from clipbench.tracking.mlflow_sink import run_params
from clipbench.tracking.sink import MetricSink, NullSink
from clipbench.tracking.store import RunDir
from clipbench.train.advantages import compute_advantages, overlong_shaping, zero_variance_groups
from clipbench.train.base_model import load_model_and_tokenizer, resolve_model_name
from clipbench.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from clipbench.train.policy import Packed, completion_logprobs, pack


def derive_seed(*parts) -> int:
    """A 63-bit seed from (seed, step, ...) — independent streams without global RNG state."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def compute_dtype_for(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype of `model.dtype` (auto: bfloat16 on a GPU that supports it, else float32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def lr_lambda(tc):
    """LR multiplier per optimizer step: linear warmup, then constant or cosine to 0."""
    total = max(1, tc.steps * tc.mini_batches * tc.epochs)

    def f(s: int) -> float:
        if tc.warmup_steps and s < tc.warmup_steps:
            return (s + 1) / tc.warmup_steps
        if tc.lr_schedule == "cosine":
            progress = min(1.0, (s - tc.warmup_steps) / max(1, total - tc.warmup_steps))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return f


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ----------------------------------------------------------------------------------------------
# Rollout: sample, score, advantages (with DAPO dynamic sampling when enabled)


def collect_rollout(cfg: RunConfig, step: int, task, pool, sampler) -> dict:
    """Sample P prompts x G completions, score them, compute advantages.

    Returns a dict of lists/tensors over the B = P*G rows (grouped by prompt)."""
    P, G = cfg.train.prompts_per_step, cfg.sampler.group_size
    rng = np.random.default_rng(derive_seed(cfg.seed, "prompts", step))
    order = rng.permutation(len(pool))
    rounds = 1 + (cfg.train.max_resample_rounds if cfg.train.dynamic_sampling else 0)
    kept: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "texts": [], "truncated": [],
                             "sampler_logp": [], "rewards": [], "correct": []}
    t_sample = t_score = 0.0
    n_groups = n_zero_var = 0
    raw_acc: list[float] = []
    for rnd in range(rounds):
        need = P - len(kept["rewards"]) // G
        if need <= 0:
            break
        idx = order[(rnd * P) % len(pool):][:P] if rnd else order[:P]
        problems = [pool[int(i)] for i in idx]
        t0 = time.perf_counter()
        ro = sampler.generate([p.prompt for p in problems], G, seed=derive_seed(cfg.seed, "sample", step, rnd))
        t1 = time.perf_counter()
        correct = [task.is_correct(text, problems[i // G]) for i, text in enumerate(ro.texts)]
        rewards = torch.tensor([task.reward(text, problems[i // G]) for i, text in enumerate(ro.texts)],
                               dtype=torch.float32)
        if cfg.train.overlong.enabled:
            rewards = overlong_shaping(
                rewards, torch.tensor([len(c) for c in ro.completion_ids]), torch.tensor(ro.truncated),
                max_new_tokens=cfg.sampler.max_new_tokens, buffer=cfg.train.overlong.buffer,
                penalty=cfg.train.overlong.penalty)
        t_sample += t1 - t0
        t_score += time.perf_counter() - t1
        raw_acc.extend(float(c) for c in correct)
        zero = zero_variance_groups(rewards.view(-1, G))  # (P,)
        n_groups += len(problems)
        n_zero_var += int(zero.sum())
        for g in range(len(problems)):
            if cfg.train.dynamic_sampling and bool(zero[g]) and rnd < rounds - 1:
                continue  # DAPO: drop all-equal groups while more draws are allowed
            if len(kept["rewards"]) // G >= P:
                break
            rows = range(g * G, (g + 1) * G)
            kept["prompt_ids"] += [ro.prompt_ids[i] for i in rows]
            kept["completion_ids"] += [ro.completion_ids[i] for i in rows]
            kept["texts"] += [ro.texts[i] for i in rows]
            kept["truncated"] += [ro.truncated[i] for i in rows]
            kept["sampler_logp"] += [ro.sampler_logp[i] for i in rows] if ro.sampler_logp else [None] * G
            kept["rewards"] += [float(rewards[i]) for i in rows]
            kept["correct"] += [float(correct[i]) for i in rows]
        if not cfg.train.dynamic_sampling:
            break
    rewards = torch.tensor(kept["rewards"]).view(-1, G)  # (P', G)
    adv = compute_advantages(rewards, cfg.train.advantage).reshape(-1)  # (B,)
    lengths = [len(c) for c in kept["completion_ids"]]
    kept.update(
        advantages=adv,
        metrics={
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "accuracy": float(np.mean(kept["correct"])) if kept["correct"] else 0.0,
            "accuracy/sampled": float(np.mean(raw_acc)) if raw_acc else 0.0,
            "response_length/mean": float(np.mean(lengths)) if lengths else 0.0,
            "truncated_frac": float(np.mean(kept["truncated"])) if kept["truncated"] else 0.0,
            "zero_var_groups_frac": n_zero_var / max(n_groups, 1),
            "zero_var_groups_frac/kept": float(zero_variance_groups(rewards).float().mean()) if rewards.numel() else 0.0,
            "groups_kept": rewards.shape[0],
            "time/sample": t_sample, "time/score": t_score,
        },
    )
    return kept


# ----------------------------------------------------------------------------------------------
# Evaluation (Avg@n / Pass@k) at the start, every `eval.every` steps and at the end


def eval_suite(cfg: RunConfig, task) -> dict[str, tuple[list, Callable]]:
    """{benchmark: (problems, grade(completion, problem) -> bool)} for the run's eval config."""
    from clipbench.tasks.benchmarks import benchmark_grader, load_benchmark

    suite = {}
    for name in cfg.eval.benchmarks:
        if name == "arith" and cfg.task.name == "arith":  # the run's own held-out split and knobs
            problems = list(task.test_problems())[: cfg.eval.limit or None]
            suite[name] = (problems, task.is_correct)
        else:
            problems = load_benchmark(name, data_dir=cfg.eval.data_dir, limit=cfg.eval.limit)
            suite[name] = (problems, benchmark_grader(name))
    return suite


def run_eval(cfg: RunConfig, rd: RunDir, step: int, sampler, suite, sink: MetricSink) -> dict:
    """Avg@n / Pass@k of every benchmark in `suite`, stored in the run dir and mirrored to the sink."""
    from clipbench.eval.runner import evaluate_and_store

    payloads = evaluate_and_store(
        rd, step, sampler, {name: problems for name, (problems, _) in suite.items()},
        grade={name: grade_fn for name, (_, grade_fn) in suite.items()}, n=cfg.eval.n,
        seed=derive_seed(cfg.seed, "eval", step), temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.sampler.max_new_tokens)
    flat = {f"eval/{name}/{k}": float(v) for name, payload in payloads.items()
            for k, v in payload["summary"].items() if isinstance(v, (int, float))}
    for name in payloads:
        sink.log_artifact(rd.eval_path(step, name), f"eval/step_{step:06d}")
    sink.log_metrics(step, flat)
    return flat


# ----------------------------------------------------------------------------------------------
# The run


def preflight(cfg: RunConfig) -> None:
    """Fail before anything is written: the model resolves and its config loads, the task builds,
    the eval benchmarks load. Raises UserError (one line, exit 2 at the CLI)."""
    from transformers import AutoConfig

    from clipbench.errors import UserError

    name = resolve_model_name(cfg.model.name)
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"model.name: cannot load '{cfg.model.name}': {reason}") from None
    eval_suite(cfg, build_run_task(cfg))


def run_training(cfg: RunConfig, run_dir: Path, *, resume: bool = False, sink: MetricSink | None = None,
                 progress: Callable[[dict], None] | None = None) -> dict:
    sink = sink or NullSink()
    rd = RunDir(run_dir)
    device = resolve_device(cfg.model.device)
    tc, sc = cfg.train, cfg.sampler
    obj = dict(cfg.objective)
    method = obj.pop("method")

    ckpt = find_checkpoint(rd.checkpoint_dir) if resume else None
    if not resume:  # a fresh start owns the directory's generated files
        for p in (rd.metrics_path, rd.hist_path.parent, rd.path / "eval", rd.path / "checkpoints"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    model_name = resolve_model_name(cfg.model.name)
    # Master weights and optimizer state in float32; bfloat16/float16 is the compute dtype (autocast),
    # so small AdamW updates are not rounded away as they would be in bf16 weights.
    compute_dtype = compute_dtype_for(cfg.model.dtype, device)
    autocast = torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32)
    model, tok = load_model_and_tokenizer(str(ckpt / "model") if ckpt else model_name,
                                          dtype="float32", device=str(device))
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ref_model = None
    if tc.beta > 0:  # frozen reference: the initial policy
        ref_model, _ = load_model_and_tokenizer(model_name, dtype=cfg.model.dtype, device=str(device))
        ref_model.eval().requires_grad_(False)

    task = build_run_task(cfg)  # the run seed draws the problems, as `clipbench eval <run_dir>` does
    pool = list(task.train_problems())
    backend = resolve_backend(sc.backend)
    sampler = build_sampler(backend, model, tok, max_new_tokens=sc.max_new_tokens, temperature=sc.temperature, top_p=sc.top_p,
                            seed=cfg.seed, return_logprobs=sc.old_logp == "sampler", dtype=str(compute_dtype).split(".")[-1],
                            gpu_memory_utilization=sc.gpu_memory_utilization)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                            fused=True)  # one kernel for all tensors: 3x faster than the default on CPU
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc))

    state = {"step": 0, "opt_step": 0, "skipped_nonfinite": 0}
    if ckpt:
        state = load_checkpoint(ckpt, optimizer=opt, scheduler=sched)
        rd.truncate_after(state["step"])
    rd.write_config(to_dict(cfg))
    rd.set_status("running", run_id=run_id(cfg), step=state["step"], steps=tc.steps, backend=backend,
                  started=rd.status().get("started", time.time()))
    sink.log_params(run_params(to_dict(cfg), backend))  # config + effective clip bounds (rule.*)

    suite = eval_suite(cfg, task) if cfg.eval.benchmarks else {}
    if suite and state["step"] == 0 and cfg.eval.at_start and not rd.eval_path(0, next(iter(suite))).exists():
        run_eval(cfg, rd, 0, sampler, suite, sink)

    last_summary: dict = {}
    for step in range(state["step"], tc.steps):
        ro = collect_rollout(cfg, step, task, pool, sampler)
        B = len(ro["completion_ids"])
        batch = pack(ro["prompt_ids"], ro["completion_ids"], tok.pad_token_id)
        adv = ro["advantages"]  # (B,)
        t_up = time.perf_counter()

        # Mini-batch slices: a seeded permutation per epoch, split into `mini_batches` parts.
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "perm", step))
        n_mb = min(tc.mini_batches, B)
        perms = [torch.randperm(B, generator=gen) for _ in range(tc.epochs)]
        slices = [[p[i::n_mb] for i in range(n_mb)] for p in perms]

        # Old log-probs: the policy before this update, on exactly the mini-batch tensors it will train on.
        def frozen_logprobs(m) -> torch.Tensor:  # (B, T) under no_grad, mini-batch by mini-batch
            out = torch.zeros(B, batch.completion_ids.shape[1])
            with torch.no_grad(), autocast:
                for idx in slices[0]:
                    lp, _ = completion_logprobs(m, _rows(batch, idx).to(device), temperature=sc.temperature,
                                                with_entropy=False)
                    out[idx, :lp.shape[1]] = lp.float().cpu()
            return out

        if sc.old_logp == "sampler" and ro["sampler_logp"][0] is not None:
            old_logp = torch.zeros(B, batch.completion_ids.shape[1])
            for i, lp in enumerate(ro["sampler_logp"]):
                old_logp[i, :len(lp)] = torch.tensor(lp)
        else:
            old_logp = frozen_logprobs(model)
        ref_logp = frozen_logprobs(ref_model) if ref_model is not None else None

        rows, hist = [], None  # hist: log-ratio counts summed over this rollout step's optimizer steps
        for epoch in range(tc.epochs):
            for mb, idx in enumerate(slices[epoch]):
                mbatch = _rows(batch, idx).to(device)
                with autocast:
                    logp, ent = completion_logprobs(model, mbatch, temperature=sc.temperature)
                logp = logp.float()  # (b, T_mb)
                mask = mbatch.completion_mask
                T_mb = logp.shape[1]
                old_mb = old_logp[idx, :T_mb].to(device)
                nsr_gen = torch.Generator(device=device).manual_seed(derive_seed(cfg.seed, "nsr", step, epoch, mb))
                out = policy_loss(method, logp, old_mb, adv[idx].to(device), mask,
                                  agg=tc.agg, generator=nsr_gen,
                                  ref_logp=ref_logp[idx, :T_mb].to(device) if ref_logp is not None else None,
                                  beta=tc.beta, max_len=sc.max_new_tokens, **obj)
                opt.zero_grad(set_to_none=True)
                finite = bool(torch.isfinite(out.loss))
                grad_norm = float("nan")
                if finite:
                    out.loss.backward()
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
                    if math.isfinite(grad_norm):
                        opt.step()
                        sched.step()
                    else:
                        finite = False
                if not finite:  # a non-finite loss or gradient skips the step; counted, the run goes on
                    opt.zero_grad(set_to_none=True)
                    state["skipped_nonfinite"] += 1
                state["opt_step"] += 1
                tok_count = mask.sum().clamp(min=1)
                row = {"step": step, "opt_step": state["opt_step"], "epoch": epoch, "mini_batch": mb,
                       **ro["metrics"],
                       "entropy": float((ent * mask).sum() / tok_count),
                       "loss": float(out.loss.detach()), "grad_norm": grad_norm,
                       "lr": sched.get_last_lr()[0], "skipped_nonfinite": state["skipped_nonfinite"],
                       "old_logp_source": 1 if sc.old_logp == "sampler" else 0,
                       **{k: float(v) for k, v in out.stats.items()}}
                rows.append(row)
                if tc.log_histograms:
                    h = log_ratio_histogram(logp.detach(), old_mb, adv[idx].to(device), mask)
                    hist = h if hist is None else {**hist, "pos": [a + b for a, b in zip(hist["pos"], h["pos"])],
                                                   "neg": [a + b for a, b in zip(hist["neg"], h["neg"])]}
        sampler.sync_weights(model)
        t_update = time.perf_counter() - t_up
        for row in rows:
            row["time/update"] = t_update
        rd.append_metrics(rows)
        if hist is not None:
            rd.append_hist([{"step": step, "opt_step": state["opt_step"], **hist}])
        for row in rows:
            sink.log_metrics(row["opt_step"], {k: v for k, v in row.items() if isinstance(v, (int, float))})
        last_summary = rows[-1]
        if progress:
            progress({"step": step + 1, "steps": tc.steps, "reward": rows[-1]["reward/mean"],
                      "entropy": rows[-1]["entropy"], "clip_events": sum(r.get("clip_events", 0) for r in rows),
                      "accuracy": rows[-1]["accuracy"]})

        done = step + 1
        if suite and cfg.eval.every and done % cfg.eval.every == 0 and done < tc.steps:
            run_eval(cfg, rd, done, sampler, suite, sink)
        if done % tc.checkpoint_every == 0 or done == tc.steps:
            state["step"] = done
            save_checkpoint(rd.checkpoint_dir, model=model, tokenizer=tok, optimizer=opt, scheduler=sched,
                            state=state)
            rd.set_status("running", step=done)

    final = {}
    if suite and not rd.eval_path(tc.steps, next(iter(suite))).exists():
        final = run_eval(cfg, rd, tc.steps, sampler, suite, sink)
    sink.log_artifact(rd.config_path)
    if rd.hist_path.exists():
        sink.log_artifact(rd.hist_path, "hist")
    sampler.close()
    rd.set_status("finished", step=tc.steps, finished=time.time(),
                  skipped_nonfinite=state["skipped_nonfinite"])
    return {"run_id": run_id(cfg), "run_dir": str(rd.path), "steps": tc.steps, **final,
            "last": {k: v for k, v in last_summary.items() if isinstance(v, (int, float))}}


def _rows(batch, idx: torch.Tensor):
    """The rows `idx` of a packed batch, trimmed to the longest completion among them."""
    cm = batch.completion_mask[idx]
    T = int(cm.sum(-1).max().clamp(min=1))
    Lp = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    return Packed(batch.input_ids[idx, :Lp + T], batch.attention_mask[idx, :Lp + T],
                  batch.position_ids[idx, :Lp + T], batch.completion_ids[idx, :T], cm[:, :T])
