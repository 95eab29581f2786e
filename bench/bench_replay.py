"""Recording's overhead and replay's speed (run by `make bench`).

    .venv/bin/python bench/bench_replay.py [--quick] [--out results/bench/replay.json]

1. Recording at the quickstart shape. The built-in loop's own update (train/step.py: plan_update,
   accumulate_gradients, optimizer_step over 8 mini-batches x 3 epochs = 24 optimizer steps) of one
   rollout batch of the quickstart shape (builtin:arith-steps, 128 rows of ~9 prompt + 15-35
   completion tokens, float32, 1 thread), three arms interleaved in one process (A B C A B C ...):
   not recorded; recorded, token level only (train.record.state=none: the capture in every forward,
   the sum over ranks, the host copy, the safetensors write and its fsync); recorded with the policy
   state before the last optimizer step (state=last, the default: one DCP save of model + AdamW).
   The recording's own calls (the capture hook in each forward, the per-step bookkeeping, the
   final sum, copy and write) are timed in place (process CPU time) and divided by the unrecorded
   update's median CPU time: target <= 2% at token level. The whole-update ratios (recorded /
   unrecorded, CPU and wall) are reported too; on a shared machine their noise is several percent.
   The state save is reported as its own cost and per rollout step at train.record.every=10.
2. Recording at a Qwen3-0.6B shape. One recorded optimizer step of a 512 x 3,072-token mini-batch
   (one epoch slot; the capture's index writes, the host copy, the write) against the training step
   on the same tokens, estimated as bench_objectives.py does (the real Qwen3 0.6B layer shape with 1
   and 3 decoder layers at B=1, T=1024, extrapolated to 28 layers, per token, times the tokens).
   Target <= 2%. The policy state at this shape (0.6B x 12 bytes = 7.2 GB per saved state) is
   stated, not timed.
3. Replay speed. Token level, 27 rules (every registered rule plus grid variants up to 27) on one
   recorded 512 x 3,072-token mini-batch (synthetic record: realistic ratio spread, group
   advantages, 16 micro-batches of 32 rows), on 1 and on 2 threads: process CPU time (robust on a
   shared machine) and wall time. Target: seconds, not minutes.

Writes results/bench/replay.json and prints a small table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402


def quickstart_batch(tok, rows: int = 128, seed: int = 0):
    from clipbench.train.packing import pack

    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    prompts = [torch.randint(3, vocab, (9,), generator=g).tolist() for _ in range(rows)]
    completions = [
        torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(15, 36, (rows,), generator=g)
    ]
    return pack(prompts, completions, tok.pad_token_id), torch.randn(rows, generator=g)


def timed(fn, acc: list):
    """fn, adding its process CPU time to acc[0] at each call."""

    def wrapper(*a, **k):
        t = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.process_time() - t

    return wrapper


def one_update(cfg, trainer, packed, adv, recorder) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, CPU seconds inside the recording's own calls) of the update of one
    rollout batch, recorded or not."""
    from clipbench.seeds import generator
    from clipbench.train.step import (
        Objective,
        StepInputs,
        accumulate_gradients,
        frozen_logprobs,
        optimizer_step,
        plan_update,
    )

    c0, w0 = time.process_time(), time.perf_counter()
    kw = dict(pad_id=trainer.tokenizer.pad_token_id, temperature=1.0, dist=trainer.dist)
    plan = plan_update(packed, mini_batches=8, epochs=3, budget=0, perm=generator(0, "perm", 0), dist=trainer.dist)
    old = frozen_logprobs(trainer.model, packed, [s for s in plan if s.epoch == 0], **kw)
    inputs = StepInputs(advantages=adv, old_logp=old)
    batch = SimpleNamespace(rewards=adv.sign(), correct=(adv > 0).float())
    own = [0.0]
    capture = timed(recorder.start, own)(0, packed, batch, inputs) if recorder else None
    objective = Objective.from_config(cfg)
    for s in plan:
        hook = timed(capture.forwards(s, inputs), own) if capture else None
        accumulate_gradients(trainer.model, packed, s, inputs, objective, record=hook, **kw)
        if capture:
            timed(capture.before_optimizer_step, own)(s, trainer)
        optimizer_step(trainer.model, trainer.optimizer, trainer.scheduler, 1.0)
        trainer.state["opt_step"] += 1
    if capture:
        timed(capture.finish, own)()
    return time.process_time() - c0, time.perf_counter() - w0, own[0]


def recording_at_quickstart(reps: int) -> dict:
    from clipbench.config import load_run_config
    from clipbench.models import load_model_and_tokenizer, resolve_model_name
    from clipbench.tracking.store import RunDir
    from clipbench.train.distributed import Dist
    from clipbench.train.loop import build_optimizer
    from clipbench.train.record import Recorder

    model, tok = load_model_and_tokenizer(resolve_model_name("builtin:arith-steps"))
    model.train()
    packed, adv = quickstart_batch(tok)
    arms = {"off": None, "tokens": "none", "state": "last"}
    times = {a: {"cpu": [], "wall": [], "own_cpu": []} for a in arms}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(reps + 1):
            for arm, state in arms.items():
                cfg = load_run_config(
                    REPO / "recipes" / "quickstart.yaml",
                    [
                        f"train.record.every={1 if state else 0}",
                        f"train.record.state={state or 'auto'}",
                        "train.record.max_mb=100000",
                    ],
                )
                optimizer, scheduler = build_optimizer(model, cfg.train)
                trainer = SimpleNamespace(
                    model=model,
                    tokenizer=tok,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    dist=Dist(),
                    state={"opt_step": 0},
                )
                rd = RunDir(Path(d) / f"{arm}{rep}")
                rd.path.mkdir()
                rec = Recorder(cfg, rd, trainer.dist, model) if state else None
                cpu, wall, own = one_update(cfg, trainer, packed, adv, rec)
                if rep:  # the first round warms up
                    times[arm]["cpu"].append(cpu)
                    times[arm]["wall"].append(wall)
                    times[arm]["own_cpu"].append(own)
        size = sum(p.stat().st_size for p in (Path(d) / f"tokens{reps}").rglob("*") if p.is_file())
    med = {a: {k: statistics.median(v) for k, v in t.items()} for a, t in times.items()}
    off = med["off"]
    return {
        "shape": {"rows": 128, "prompt": 9, "completion": "15-35", "optimizer_steps": 24},
        "median_s": med,
        "reps": reps,
        "record_bytes_token_level": size,
        "share_tokens_own": med["tokens"]["own_cpu"] / off["cpu"],
        "share_state_own": med["state"]["own_cpu"] / off["cpu"],
        "ratio_tokens_cpu": med["tokens"]["cpu"] / off["cpu"],
        "ratio_tokens_wall": med["tokens"]["wall"] / off["wall"],
        "ratio_state_cpu": med["state"]["cpu"] / off["cpu"],
        "ratio_state_wall": med["state"]["wall"] / off["wall"],
        "target": 1.02,
    }


def recording_at_qwen3_06b(model_reps: int) -> dict:
    from bench_objectives import QWEN3_06B, QWEN3_06B_LAYERS, time_model_step

    from clipbench.tracking.records import install_record, staging_dir

    B, T = 512, 3072
    g = torch.Generator().manual_seed(0)
    packed_like = {
        "completion_ids": torch.randint(0, QWEN3_06B["vocab_size"], (B, T), generator=g, dtype=torch.int32),
        "mask": torch.ones(B, T, dtype=torch.uint8),
        "advantages": torch.randn(B, generator=g),
        "old_logp": -torch.rand(B, T, generator=g),
    }
    logp = -torch.rand(B, T, generator=g)
    with tempfile.TemporaryDirectory() as d:
        c0, w0 = time.process_time(), time.perf_counter()
        slots = torch.zeros(2, 1, B, T)
        for i in range(0, B, 32):  # the capture: one index write per micro-batch of 32 rows
            idx = torch.arange(i, i + 32)
            slots[0, 0, idx] = logp[idx]
            slots[1, 0, idx] = logp[idx]
        install_record(
            staging_dir(Path(d), "step_000000"),
            {"opt_steps": []},
            {
                "logp": slots[0],
                "entropy": slots[1],
                **packed_like,
                "prompt_ids": torch.zeros(B, 512, dtype=torch.int32),
            },
        )
        rec_cpu, rec_wall = time.process_time() - c0, time.perf_counter() - w0
    t1 = time_model_step(1, 1024, model_reps)
    t3 = time_model_step(3, 1024, model_reps)
    step_ms_per_1024 = t1 + (QWEN3_06B_LAYERS - 1) * (t3 - t1) / 2
    step_s = step_ms_per_1024 / 1e3 * (B * T / 1024)
    params = 596_049_920
    return {
        "tokens": B * T,
        "record_cpu_s": rec_cpu,
        "record_wall_s": rec_wall,
        "model_step_ms_per_1024_tokens": step_ms_per_1024,
        "model_step_s_estimate": step_s,
        "ratio_cpu": rec_cpu / step_s,
        "target": 0.02,
        "state_bytes": params * 12,
    }


def replay_speed(threads: int) -> dict:
    from clipbench.objectives import METHODS
    from clipbench.replay.rules import parse_rules
    from clipbench.replay.tokens import OptStepView, replay_rule
    from clipbench.tracking.records import Record

    torch.set_num_threads(threads)
    B, T, G = 512, 3072, 8
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lens[:, None]).to(torch.uint8)
    old = -torch.rand(B, T, generator=g) * 2 * mask
    logp = (old + 0.15 * torch.randn(B, T, generator=g)) * mask  # ~5-10% of tokens past a 0.2 band
    rewards = (torch.rand(B, generator=g) < 0.4).float()
    grp = rewards.view(-1, G)
    adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-6)).reshape(-1)
    tensors = {
        "logp": logp[None],
        "entropy": (torch.rand(B, T, generator=g) * 2 * mask)[None],  # per slot, as training records it (aspo reads it)
        "old_logp": old,
        "mask": mask,
        "advantages": adv,
        "uniforms": torch.rand(1, B, T, generator=g),
    }
    micro = [{"rows": list(range(i, i + 32)), "width": int(lens[i : i + 32].max())} for i in range(0, B, 32)]
    opt = {
        "opt_step": 1,
        "epoch": 0,
        "rows": list(range(B)),
        "ranks": [micro],
        "global_tokens": int(mask.sum()),
        "global_seqs": B,
    }
    rec = Record(
        Path("."),
        {
            "objective": {"method": "grpo", "params": {}, "agg": "token-mean", "beta": 0.0, "max_len": T},
            "opt_steps": [opt],
            "seed": 0,
            "step": 0,
        },
        tensors,
    )
    extra = ["dapo(eps_high=0.24,0.32,0.4)", "nsr(p=0.25)", "abc(eps4=0.3)", "decay(p=0.25)", "dual_clip(c=2)"]
    rules = parse_rules("all," + ",".join(extra))[:27]
    step = OptStepView(rec, opt)
    replay_rule(step, rules[0])  # warm-up
    per_rule = {}
    c0, t0 = time.process_time(), time.perf_counter()
    for r in rules:
        t = time.process_time()
        replay_rule(step, r)
        per_rule[r.label] = time.process_time() - t
    return {
        "rows": B,
        "tokens_per_row": T,
        "valid_tokens": int(mask.sum()),
        "micro_batches": len(micro),
        "rules": len(rules),
        "registered": len(METHODS),
        "threads": threads,
        "cpu_s": time.process_time() - c0,
        "wall_s": time.perf_counter() - t0,
        "per_rule_cpu_s": per_rule,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "replay.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = {
        "benchmark": "recording overhead and replay speed",
        "quickstart": recording_at_quickstart(3 if args.quick else 7),
        "qwen3_06b": recording_at_qwen3_06b(1 if args.quick else 3),
        "replay": {"1_thread": replay_speed(1), "2_threads": replay_speed(2)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    q, b, r = report["quickstart"], report["qwen3_06b"], report["replay"]
    ok = lambda x, t: "ok" if x <= t else "MISSED"  # noqa: E731
    print(
        f"recording at the quickstart shape (update of one rollout batch, 24 optimizer steps, "
        f"{q['median_s']['off']['cpu']:.2f} s CPU unrecorded): the recording's own calls cost "
        f"{q['share_tokens_own']:.2%} of it at token level (target <= 2%) {ok(q['share_tokens_own'], 0.02)} and "
        f"{q['share_state_own']:.2%} with the policy state (state=last; {q['share_state_own'] / 10:.2%} per rollout "
        f"step at every=10); whole-update ratios, recorded / not: token level {q['ratio_tokens_cpu']:.3f}x CPU, "
        f"{q['ratio_tokens_wall']:.3f}x wall; state {q['ratio_state_cpu']:.3f}x CPU, {q['ratio_state_wall']:.3f}x wall; "
        f"{q['record_bytes_token_level'] / 1024:.0f} KiB per token-level record"
    )
    print(
        f"recording at a Qwen3-0.6B shape ({b['tokens']:,} tokens): {b['record_cpu_s']:.2f} s CPU vs a training step of "
        f"~{b['model_step_s_estimate']:.0f} s CPU = {b['ratio_cpu']:.4%} (target <= 2%) {ok(b['ratio_cpu'], 0.02)}; "
        f"a saved policy state would be {b['state_bytes'] / 1e9:.1f} GB"
    )
    r1, r2 = r["1_thread"], r["2_threads"]
    print(
        f"replay of {r1['rules']} rules on one {r1['rows']} x {r1['tokens_per_row']} mini-batch ({r1['valid_tokens']:,} "
        f"tokens, {r1['micro_batches']} micro-batches), token level: 1 thread {r1['cpu_s']:.1f} s CPU / "
        f"{r1['wall_s']:.1f} s wall; 2 threads {r2['cpu_s']:.1f} s CPU / {r2['wall_s']:.1f} s wall"
    )
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
