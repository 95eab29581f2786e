"""Training speed: seconds per GRPO step, clipbench's trainer against TRL's `GRPOTrainer`.

    .venv/bin/python bench/bench_train.py [--steps N] [--block K] [--threads T] [--quick]

Same work on both sides: a tiny built-in model (Qwen3 3x128) on `arith`, 8 prompts x 8 samples = 64
completions per rollout batch. Two workloads: by default `builtin:arith-tiny` on answer-only
completions (3.4 tokens, up to 32: per-step overhead, target <= 1.0x); `--long`:
`builtin:arith-steps` on the quickstart's worked steps with 40 to 48 new tokens on both sides
(`min_new_tokens` 40: HF generate's own option, set in both arms' generation configs, so the length
is the benchmark's choice, not the model's): compute, target <= 0.9x, written to
train_long.json. Both: HF `generate`
(no vLLM), temperature 1.0, top-p 1, top-k off; old log-probs recomputed by the policy once per
rollout batch; then 4 mini-batches of 16 = 4 AdamW steps (same lr, betas, weight decay, grad clip
1.0, constant schedule), clip epsilon 0.2, no KL (beta 0), token-mean aggregation ("dapo" in TRL),
the exact-integer arith reward, float32, CPU, no eval, no checkpoints, no external logging.
One "step" = one rollout batch of 64 completions and its 4 optimizer steps, on both sides.

Measurement: every arm trains in its own thread, and a baton lets exactly one arm run at a time:
each runs `--block` steps (default 1), then hands over (clipbench, TRL, clipbench without
histograms), round-robin, so all arms see the same background load of the shared machine. A step's
wall time runs from the end of the previous step's callback to the end of its own (clipbench: the
`progress` callback of `run_training`; TRL: every 4th `on_step_end` of a `TrainerCallback`), so
set-up and hand-overs are not counted. The first `--warmup` steps (default 2) of each arm are
excluded. Torch intra-op threads are fixed (`--threads`, default 1) for the whole process, so every
arm gets the same.

Reported: the median wall s/step of each arm and their ratio (the headline, target <= 1); the
paired ratio (median over rounds of clipbench's step / TRL's step of the same round, robust to
load swings that last longer than a round) with a 95% bootstrap interval; CPU s/step (CPU time
of the arm's thread, which with 1 torch thread is all of its compute; less sensitive to other
processes); clipbench's own per-step metrics (time/sample + time/score + time/update) and TRL's
matching split (generate + decode, rewards, the rest). Defaults: 100 measured steps per arm,
about a minute on 2 cores; `--quick`: 20 steps, no third arm, about 20 seconds.

Writes results/bench/train.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clipbench.tracking.sink import NullSink  # no torch import: thread settings below still apply

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPTS, GROUP, MINI_BATCHES = 8, 8, 4
EPSILON = 0.2
# The two workloads: answer-only completions (3.4 tokens: measures per-step overhead) and worked
# steps over 4 operands (~34 tokens: measures compute; `--long`, the >= 32-token ratio).
WORKLOADS = {
    "short": {
        "recipe": REPO / "recipes" / "arith_tiny.yaml",
        "model": "builtin:arith-tiny",
        "max_new": 32,
        "task": {},
        "target": 1.0,
    },
    "long": {
        "recipe": REPO / "recipes" / "quickstart.yaml",
        "model": "builtin:arith-steps",
        "max_new": 48,
        "min_new": 40,
        "task": {},
        "target": 0.9,
    },
}
W = dict(WORKLOADS["short"])  # the workload of this process (main sets it)


# ----------------------------------------------------------------------------------------------
# Scheduling: one arm runs at a time, blocks of steps, round-robin


class Baton:
    """Round-robin hand-off between named arms; `wait(name)` blocks until it is that arm's turn."""

    def __init__(self, names: list[str]):
        self.order = list(names)
        self.done: set[str] = set()
        self.turn = 0
        self.cond = threading.Condition()

    def current(self) -> str | None:
        live = [n for n in self.order if n not in self.done]
        return self.order[self.turn] if live else None

    def _advance(self) -> None:
        for _ in range(len(self.order)):
            self.turn = (self.turn + 1) % len(self.order)
            if self.order[self.turn] not in self.done:
                return

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.current() == name)

    def pass_on(self, name: str) -> None:
        with self.cond:
            if self.current() == name:
                self._advance()
            self.cond.notify_all()

    def finish(self, name: str) -> None:
        with self.cond:
            self.done.add(name)
            if self.order[self.turn] == name:
                self._advance()
            self.cond.notify_all()


@dataclass
class StepClock:
    """Per-step wall times of one arm; a step runs from the previous callback's exit to this one's entry."""

    name: str
    baton: Baton
    block: int
    start: float | None = None
    cpu_start: float | None = None
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # CPU time of the arm's thread (see --threads)
    threads_seen: set[int] = field(default_factory=set)

    def begin(self) -> None:
        self.start, self.cpu_start = time.perf_counter(), time.thread_time()

    def step_done(self) -> None:
        import torch

        t, c = time.perf_counter(), time.thread_time()
        self.times.append(t - self.start)
        self.cpu_times.append(c - self.cpu_start)
        self.threads_seen.add(torch.get_num_threads())
        if len(self.times) % self.block == 0:
            self.baton.pass_on(self.name)
            self.baton.wait(self.name)
        self.start, self.cpu_start = time.perf_counter(), time.thread_time()


# ----------------------------------------------------------------------------------------------
# The arms


def clipbench_config(steps: int, histograms: bool):
    from clipbench.config.load import load_run_config

    task = [f"task.{k}={v}" for k, v in W["task"].items()]
    return load_run_config(
        W["recipe"],
        task
        + [
            "sampler.backend=hf",
            "model.device=cpu",
            "model.dtype=float32",
            f"train.steps={steps}",
            f"train.prompts_per_step={PROMPTS}",
            f"sampler.group_size={GROUP}",
            f"train.mini_batches={MINI_BATCHES}",
            "train.epochs=1",
            f"sampler.max_new_tokens={W['max_new']}",
            "sampler.temperature=1.0",
            "sampler.top_p=1.0",
            "sampler.old_logp=recompute",
            "train.agg=token-mean",
            "train.beta=0.0",
            "train.warmup_steps=0",
            "train.lr_schedule=constant",
            "objective.method=grpo",
            f"objective.eps_low={EPSILON}",
            f"objective.eps_high={EPSILON}",
            "train.checkpoint_every=1000000",
            "eval.benchmarks=[]",
            "eval.at_start=false",
            "tracking.mlflow=false",
            f"train.log_histograms={str(histograms).lower()}",
        ],
    )


class CaptureSink(NullSink):
    """A MetricSink that starts the step clock when training begins and keeps one row per step."""

    def __init__(self, clock: StepClock):
        self.clock, self.rows = clock, {}

    def log_params(self, params: dict) -> None:  # called right before the step loop
        self.clock.begin()

    def log_metrics(self, step: int, metrics: dict) -> None:
        if "time/update" in metrics and metrics["step"] not in self.rows:
            self.rows[metrics["step"]] = {
                k: metrics[k]
                for k in ("time/sample", "time/score", "time/update", "response_length/mean", "reward/mean")
            }


def force_min_new_tokens() -> None:
    """`--long`: clipbench's HF sampler gets `min_new_tokens` in its GenerationConfig, as TRL's does
    through `generation_kwargs` (the benchmark's fixed length; the product has no such option). Only
    `generate` reads that config, so the sampler's own decode loop (rollout/decode.py) is off here:
    the long workload times clipbench on transformers' `generate`, as TRL."""
    from clipbench.rollout.hf import HFSampler

    base = HFSampler._generation_config
    if getattr(base, "forced", False) or not W.get("min_new"):
        return
    HFSampler.own_loop = False

    def with_min(self, *a, **k):
        cfg = base(self, *a, **k)
        cfg.min_new_tokens = W["min_new"]
        return cfg

    with_min.forced = True
    HFSampler._generation_config = with_min


def run_clipbench(clock: StepClock, steps: int, histograms: bool, workdir: Path) -> dict:
    from clipbench.config import to_dict
    from clipbench.train.loop import run_training

    force_min_new_tokens()
    cfg = clipbench_config(steps, histograms)
    sink = CaptureSink(clock)
    run_training(cfg, workdir / clock.name, sink=sink, progress=lambda info: clock.step_done())
    rows = [sink.rows[s] for s in sorted(sink.rows)]
    return {
        "per_step": rows,
        "config": {
            "lr": cfg.train.lr,
            "objective": to_dict(cfg)["objective"],  # the stored form, as the earlier results recorded it
            "histograms": histograms,
            "agg": cfg.train.agg.name,
        },
    }


def trl_config(steps: int, lr: float, workdir: Path):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        gradient_checkpointing=False,  # TRL's default is True; clipbench's is off
        max_steps=MINI_BATCHES * steps,  # global_step counts optimizer steps
        per_device_train_batch_size=PROMPTS * GROUP // MINI_BATCHES,
        gradient_accumulation_steps=1,
        generation_batch_size=PROMPTS * GROUP,  # -> steps_per_generation = 4
        num_generations=GROUP,
        num_iterations=1,
        max_completion_length=W["max_new"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        epsilon=EPSILON,
        scale_rewards="group",
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        generation_kwargs={"min_new_tokens": W["min_new"]} if W.get("min_new") else None,
    )


def timed_method(obj, name: str, sink: list) -> None:
    """Wrap `obj.name` to append its wall time to `sink` (a breakdown of TRL's rollout)."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def run_trl(clock: StepClock, steps: int, lr: float, workdir: Path) -> dict:
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from clipbench.models import load_model_and_tokenizer, resolve_model_name
    from clipbench.tasks.arith import ArithTask

    knobs = {k: v for k, v in clipbench_config(1, False).task.__dict__.items() if k in ArithTask.__dataclass_fields__}
    task = ArithTask(seed=0, **knobs)  # the recipe's arith task, as clipbench's arm builds it
    pool = list(task.train_problems())
    data = Dataset.from_dict({"prompt": [p.prompt for p in pool], "pid": list(range(len(pool)))})

    def arith_reward(completions, pid, **kwargs) -> list[float]:
        return [task.reward(c, pool[i]) for c, i in zip(completions, pid)]

    model, tok = load_model_and_tokenizer(resolve_model_name(W["model"]))
    gen_logs: list[dict] = []  # one per rollout batch: completion length and reward

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % MINI_BATCHES == 0:
                clock.step_done()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                gen_logs.append(
                    {"completions/mean_length": logs["completions/mean_length"], "reward": logs.get("reward")}
                )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arith_reward,
        args=trl_config(steps, lr, workdir),
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    trainer.remove_callback(PrinterCallback)  # no console printing of every log (clipbench's arm prints nothing)
    t_gen, t_score, t_rollout = [], [], []
    timed_method(trainer, "_generate", t_gen)  # tokenize + generate + decode, as clipbench's time/sample
    timed_method(trainer, "_calculate_rewards", t_score)
    timed_method(trainer, "_generate_and_score_completions", t_rollout)
    trainer.train()
    rows = [
        {
            "time/sample": g,
            "time/score": s,
            "time/rollout": r,
            "response_length/mean": lg["completions/mean_length"],
            "reward/mean": lg["reward"],
        }
        for g, s, r, lg in zip(t_gen, t_score, t_rollout, gen_logs)
    ]
    a = trainer.args
    return {
        "per_step": rows,
        "config": {
            "lr": a.learning_rate,
            "generation_batch_size": a.generation_batch_size,
            "steps_per_generation": a.steps_per_generation,
            "per_device_train_batch_size": a.per_device_train_batch_size,
            "num_iterations": a.num_iterations,
            "loss_type": a.loss_type,
            "beta": a.beta,
            "epsilon": a.epsilon,
            "gradient_checkpointing": a.gradient_checkpointing,
            "max_completion_length": a.max_completion_length,
            "optim": str(a.optim),
            "lr_scheduler_type": str(a.lr_scheduler_type),
            "max_grad_norm": a.max_grad_norm,
        },
    }


# ----------------------------------------------------------------------------------------------
# Running the arms interleaved


def run_interleaved(arms: dict[str, Callable[[StepClock], dict]], block: int) -> tuple[dict, dict]:
    baton = Baton(list(arms))
    clocks = {name: StepClock(name, baton, block) for name in arms}
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}

    def target(name: str) -> None:
        baton.wait(name)
        try:
            results[name] = arms[name](clocks[name])
        except BaseException:  # noqa: BLE001 - reported by the main thread
            errors[name] = traceback.format_exc()
        finally:
            baton.finish(name)

    threads = [threading.Thread(target=target, args=(n,), name=n, daemon=True) for n in arms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("\n".join(f"[{n}]\n{e}" for n, e in errors.items()))
    return results, clocks


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": xs[0], "max": xs[-1], "n": len(xs)}


def bootstrap_ci(xs: list[float], n: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the median of xs (fixed seed: the same data give the same CI)."""
    import numpy as np

    a = np.asarray(xs)
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n, len(a)))
    meds = np.median(a[idx], axis=1)
    return [float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))]


def mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def median_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(name: str, clock: StepClock, out: dict, warmup: int, block: int) -> dict:
    wall = clock.times[warmup:]
    rows = out["per_step"][warmup:]
    keys = ("time/sample", "time/score", "time/update", "time/rollout")
    s = {
        "wall": quantiles(wall),
        "cpu": quantiles(clock.cpu_times[warmup:]),
        "per_step_wall": wall,
        "per_step_cpu": clock.cpu_times[warmup:],
        "threads_seen": sorted(clock.threads_seen),
        "completion_tokens_mean": mean_of(rows, "response_length/mean"),
        "reward_mean": mean_of(rows, "reward/mean"),
        "config": out["config"],
        "breakdown_median": {k: median_of(rows, k) for k in keys if median_of(rows, k) is not None},
    }
    b = s["breakdown_median"]
    # comparable on both sides: old log-probs, advantages, the 4 optimizer steps and all bookkeeping
    b["rest (wall - sample - score)"] = statistics.median(
        w - r["time/sample"] - r["time/score"] for w, r in zip(wall, rows)
    )
    if name.startswith("clipbench"):
        parts = [r["time/sample"] + r["time/score"] + r["time/update"] for r in rows]
        s["metrics_sum"] = quantiles(parts)  # sample + score + update, from the trainer's own metrics
        b["other (wall - sample - score - update)"] = statistics.median(w - p for w, p in zip(wall, parts))
    else:  # TRL: rollout = generate + rewards + old log-probs + advantages; then the 4 optimizer steps
        b["rollout rest (old log-probs, advantages)"] = statistics.median(
            r["time/rollout"] - r["time/sample"] - r["time/score"] for r in rows
        )
        b["update (wall - rollout)"] = statistics.median(w - r["time/rollout"] for w, r in zip(wall, rows))
    # per-round medians: steps [warmup + k*block, ...) of each arm ran back to back in round k
    starts = range(0, len(clock.times), block)
    s["round_medians"] = [statistics.median(clock.times[i : i + block]) for i in starts]
    s["round_cpu_medians"] = [statistics.median(clock.cpu_times[i : i + block]) for i in starts]
    return s


def git_revision() -> str:
    import subprocess

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "clipbench"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict:
    import datasets
    import torch
    import transformers
    import trl

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "datasets": datasets.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "clipbench_git": git_revision(),
    }


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    arms = report["arms"]
    t = Table(
        title=f"GRPO step (64 completions, 4 optimizer steps): median of {report['measured_steps']} "
        f"steps after {report['warmup_steps']} warm-up, torch threads = {report['threads']}"
    )
    for col in ("arm", "wall s/step", "IQR", "CPU s/step", "sample", "score", "rest", "tokens", "reward"):
        t.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for name, a in arms.items():
        b = a["breakdown_median"]
        t.add_row(
            name,
            f"{a['wall']['median']:.3f}",
            f"{a['wall']['p25']:.3f}-{a['wall']['p75']:.3f}",
            f"{a['cpu']['median']:.3f}",
            f"{b['time/sample']:.3f}",
            f"{b['time/score']:.4f}",
            f"{b['rest (wall - sample - score)']:.3f}",
            f"{a['completion_tokens_mean']:.2f}",
            f"{a['reward_mean']:.3f}",
        )
    Console(width=130).print(t)
    print(
        "wall s/step: wall clock per rollout step; CPU s/step: CPU time of the arm's thread; sample: generate + "
        "decode; score: rewards; rest: wall - sample - score (old log-probs, advantages, 4 optimizer steps, "
        "bookkeeping); tokens: mean completion length. Breakdown columns are medians of per-step wall times."
    )
    r, rc = report["ratio"], report["ratio_cpu"]
    lo, hi = r["paired_median_ci95"]
    print(
        f"clipbench / TRL: wall {r['value']:.3f} (target <= {r['target']}); paired (median of per-round ratios) "
        f"{r['paired_median']:.3f}, 95% CI {lo:.3f}..{hi:.3f}; CPU {rc:.3f} (paired "
        f"{report['ratio_cpu_paired']:.3f}); "
        f"clipbench sample+score+update metrics {arms['clipbench']['metrics_sum']['median']:.3f} s/step; "
        f"load average {report['loadavg'][0]:.1f} -> {report['loadavg'][1]:.1f} on {os.cpu_count()} cores"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="measured steps per arm (default 100; quick 20)")
    ap.add_argument("--warmup", type=int, default=None, help="excluded steps per arm (default 2)")
    ap.add_argument("--block", type=int, default=None, help="steps per arm before handing over (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both (default 1)")
    ap.add_argument(
        "--no-histogram-arm", action="store_true", help="skip the third arm (clipbench with train.log_histograms=false)"
    )
    ap.add_argument("--quick", action="store_true", help="20 steps, two arms: about 20 seconds")
    ap.add_argument(
        "--long",
        action="store_true",
        help="worked-steps completions (~34 tokens, builtin:arith-steps): compute, not overhead; "
        "target <= 0.9x (writes train_long.json)",
    )
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "train.json"))
    args = ap.parse_args(argv)
    W.clear()
    W.update(WORKLOADS["long" if args.long else "short"])
    if args.long and args.out == str(REPO / "results" / "bench" / "train.json"):
        args.out = str(REPO / "results" / "bench" / "train_long.json")
    steps = args.steps or (20 if args.quick else 100)
    block = args.block or 1
    warmup = args.warmup if args.warmup is not None else 2
    if warmup % block:
        ap.error(f"--warmup ({warmup}) must be a multiple of --block ({block}) so rounds line up")
    hist_arm = not (args.no_histogram_arm or args.quick)

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars
    for module in ("trl", "transformers", "accelerate", "torch"):
        warnings.filterwarnings("ignore", module=module)  # TRL/transformers set-up chatter
    from clipbench.models import resolve_model_name

    resolve_model_name(W["model"])  # built once, outside any timing
    lr = clipbench_config(1, True).train.lr
    total = warmup + steps
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        work = Path(tmp)
        arms: dict[str, Callable[[StepClock], dict]] = {
            "clipbench": lambda c: run_clipbench(c, total, True, work),
            "trl": lambda c: run_trl(c, total, lr, work),
        }
        if hist_arm:
            arms["clipbench (no histograms)"] = lambda c: run_clipbench(c, total, False, work)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        out, clocks = run_interleaved(arms, block)
        elapsed = time.perf_counter() - t0
    summary = {n: summarize(n, clocks[n], out[n], warmup, block) for n in arms}
    cb, trl = summary["clipbench"], summary["trl"]
    per_round = [c / t for c, t in zip(cb["round_medians"], trl["round_medians"])][warmup // block :]
    paired, paired_ci = statistics.median(per_round), bootstrap_ci(per_round)
    per_round_cpu = [c / t for c, t in zip(cb["round_cpu_medians"], trl["round_cpu_medians"])][warmup // block :]
    report = {
        "benchmark": "train step: clipbench run_training vs TRL GRPOTrainer",
        "workload": {
            "model": W["model"],
            "task": {"name": "arith", **W["task"]},
            "prompts": PROMPTS,
            "group_size": GROUP,
            "completions_per_step": PROMPTS * GROUP,
            "optimizer_steps_per_step": MINI_BATCHES,
            "max_new_tokens": W["max_new"],
            "temperature": 1.0,
            "generation": "HF generate, CPU, float32",
            "lr": lr,
            "epsilon": EPSILON,
            "beta": 0.0,
            "aggregation": "token-mean (TRL: dapo)",
        },
        "threads": args.threads,
        "warmup_steps": warmup,
        "measured_steps": steps,
        "block": block,
        "clipbench_s_per_step": cb["wall"]["median"],
        "trl_s_per_step": trl["wall"]["median"],
        "ratio": {
            "value": cb["wall"]["median"] / trl["wall"]["median"],
            "target": W["target"],
            "per_round": per_round,
            "paired_median": paired,
            "paired_median_ci95": paired_ci,
        },
        "ratio_cpu": cb["cpu"]["median"] / trl["cpu"]["median"],
        "ratio_cpu_paired": statistics.median(per_round_cpu),
        "clipbench_cpu_s_per_step": cb["cpu"]["median"],
        "trl_cpu_s_per_step": trl["cpu"]["median"],
        "clipbench_breakdown_s": cb["breakdown_median"],
        "arms": summary,
        "elapsed_s": elapsed,
        "loadavg": [load0, os.getloadavg()[0]],
        "versions": versions(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {args.out} ({elapsed:.0f} s)")
    return report


if __name__ == "__main__":
    main()
