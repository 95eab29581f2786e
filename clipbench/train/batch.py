"""One rollout step: P prompts x G completions, rewards, advantages (DAPO dynamic sampling optional).

    batch = collect_rollout(cfg, step, task, pool, sampler, dist)

Design choices
- Prompts: a seeded permutation of the training pool per step (seed, "prompts", step); round r of
  dynamic sampling takes the next P prompts of it.
- Sampling is split by whole groups: each rank samples a contiguous block of the round's prompts
  (`Dist.block`), in calls of `sampler.prompts_per_call` prompts (0: the whole block). Each prompt's
  randomness is its own, seeded from (seed, "sample", step, round, the prompt's global index in the
  round): the samplers draw a prompt's samples from its seed alone (`Sampler.generate`). So the
  completions depend on the seed, never on how many processes share the work or how they batch it
  (up to float round-off between batch shapes).
- Each rank scores its own completions; then every rank gathers the whole round (token ids, rewards:
  small), so dynamic sampling keeps the same groups on every rank and every rank knows the batch.
- Advantages are per group (a group's G samples stay together), computed on the kept groups.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from clipbench.objectives.advantages import compute_advantages, overlong_shaping, zero_variance_groups
from clipbench.seeds import derive_seed
from clipbench.train.distributed import Dist


@dataclass
class Group:
    """One prompt's G samples."""

    prompt_ids: list[int]
    completion_ids: list[list[int]]  # (G) ragged, EOS included when generated
    truncated: list[bool]
    sampler_logp: list[list[float]] | None
    rewards: list[float]
    correct: list[float]
    routes: list | None = None  # (G) the sampler's routes of each sample (Rollout.routes; r3)


@dataclass
class RolloutBatch:
    """The trained batch: B = P' x G rows grouped by prompt (prompt i owns rows i*G .. i*G+G-1)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logp: list[list[float]] | None
    advantages: torch.Tensor  # (B,)
    metrics: dict = field(default_factory=dict)
    rewards: torch.Tensor | None = None  # (B,) each row's reward (after overlong shaping): rules may read it
    correct: torch.Tensor | None = None  # (B,) 1.0 where the task grades the completion correct
    routes: list | None = None  # (B) the sampler's routes of each row (r3: models/routing.py)

    def row_inputs(self, mask: torch.Tensor, group_size: int, device) -> dict:
        """Per-row inputs some rules and aggregations read (`step.StepInputs`): rewards (topr), prompt
        groups (prompt-mean: prompt i owns rows i*G .. i*G+G-1), the (B, T) completion mask on the device."""
        return {
            "rewards": None if self.rewards is None else self.rewards.to(device),
            "groups": tuple(i // group_size for i in range(len(self.completion_ids))),
            "mask": mask.to(device),
        }

    def sampler_logp_tensor(self, T: int) -> torch.Tensor:
        """(B, T) the sampler's log-probs, 0 at padding."""
        out = torch.zeros(len(self.completion_ids), T)
        for i, lp in enumerate(self.sampler_logp or ()):
            out[i, : len(lp)] = torch.tensor(lp)
        return out


def round_prompts(order: np.ndarray, rnd: int, P: int) -> list[int]:
    """Pool indices of round `rnd`: the next P prompts of the step's permutation (wrapping around)."""
    return [int(order[(rnd * P + j) % len(order)]) for j in range(P)]


def sample_groups(cfg, step: int, rnd: int, problems: list, task, sampler, dist: Dist) -> tuple[list[Group], dict]:
    """Every group of a round, in prompt order, on every rank; this rank sampled and scored its block."""
    G = cfg.sampler.group_size
    mine = dist.block(len(problems))
    per_call = cfg.sampler.prompts_per_call or max(len(mine), 1)
    groups: list[Group] = []
    t_sample = t_score = 0.0
    for start in range(mine.start, mine.stop, per_call):
        chunk = problems[start : min(start + per_call, mine.stop)]
        t0 = time.perf_counter()
        seeds = [derive_seed(cfg.seed, "sample", step, rnd, i) for i in range(start, start + len(chunk))]
        ro = sampler.generate([p.prompt for p in chunk], G, seed=seeds)  # one seed per prompt group
        t1 = time.perf_counter()
        rewards = torch.tensor(
            [task.reward(text, chunk[i // G]) for i, text in enumerate(ro.texts)], dtype=torch.float32
        )
        if cfg.train.overlong.enabled:
            rewards = overlong_shaping(
                rewards,
                torch.tensor([len(c) for c in ro.completion_ids]),
                torch.tensor(ro.truncated),
                max_new_tokens=cfg.sampler.max_new_tokens,
                buffer=cfg.train.overlong.buffer,
                penalty=cfg.train.overlong.penalty,
            )
        correct = [float(task.is_correct(text, chunk[i // G])) for i, text in enumerate(ro.texts)]
        for g in range(len(chunk)):
            rows = slice(g * G, (g + 1) * G)
            groups.append(
                Group(
                    ro.prompt_ids[g * G],
                    ro.completion_ids[rows],
                    ro.truncated[rows],
                    ro.sampler_logp[rows] if ro.sampler_logp else None,
                    rewards[rows].tolist(),
                    correct[rows],
                    ro.routes[rows] if ro.routes else None,
                )
            )
        t_sample += t1 - t0
        t_score += time.perf_counter() - t1
    return [g for part in dist.gather(groups) for g in part], {"time/sample": t_sample, "time/score": t_score}


def collect_rollout(cfg, step: int, task, pool: list, sampler, dist: Dist) -> RolloutBatch:
    """Sample, score and keep P groups (DAPO: all-equal groups dropped while more rounds are allowed)."""
    P, G = cfg.train.prompts_per_step, cfg.sampler.group_size
    order = np.random.default_rng(derive_seed(cfg.seed, "prompts", step)).permutation(len(pool))
    rounds = 1 + (cfg.train.max_resample_rounds if cfg.train.dynamic_sampling else 0)
    kept: list[Group] = []
    sampled: list[Group] = []
    times = {"time/sample": 0.0, "time/score": 0.0}
    for rnd in range(rounds):
        if len(kept) >= P:
            break
        problems = [pool[i] for i in round_prompts(order, rnd, P)]
        groups, t = sample_groups(cfg, step, rnd, problems, task, sampler, dist)
        times = {k: times[k] + t[k] for k in times}
        sampled += groups
        last = rnd == rounds - 1
        for grp in groups:
            if len(kept) >= P:
                break
            if cfg.train.dynamic_sampling and not last and len(set(grp.rewards)) == 1:
                continue  # DAPO: drop an all-equal group while more draws are allowed
            kept.append(grp)
    return _batch(kept, sampled, G, cfg.train.advantage.name, times)


def _batch(kept: list[Group], sampled: list[Group], G: int, advantage: str, times: dict) -> RolloutBatch:
    rewards = torch.tensor([g.rewards for g in kept], dtype=torch.float32)  # (P', G)
    lengths = [len(c) for g in kept for c in g.completion_ids]
    truncated = [t for g in kept for t in g.truncated]
    correct = [c for g in kept for c in g.correct]
    raw = [c for g in sampled for c in g.correct]
    all_equal = zero_variance_groups(torch.tensor([g.rewards for g in sampled]))
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "accuracy": float(np.mean(correct)) if correct else 0.0,
        "accuracy/sampled": float(np.mean(raw)) if raw else 0.0,
        "response_length/mean": float(np.mean(lengths)) if lengths else 0.0,
        "truncated_frac": float(np.mean(truncated)) if truncated else 0.0,
        "zero_var_groups_frac": float(all_equal.float().mean()),
        "zero_var_groups_frac/kept": float(zero_variance_groups(rewards).float().mean()) if rewards.numel() else 0.0,
        "groups_kept": rewards.shape[0],
        **times,
    }
    has_logp = all(g.sampler_logp is not None for g in kept)
    has_routes = bool(kept) and all(g.routes is not None for g in kept)
    return RolloutBatch(
        prompt_ids=[g.prompt_ids for g in kept for _ in range(G)],
        completion_ids=[c for g in kept for c in g.completion_ids],
        sampler_logp=[lp for g in kept for lp in g.sampler_logp] if has_logp else None,
        advantages=compute_advantages(rewards, advantage).reshape(-1),  # (B,)
        metrics=metrics,
        rewards=rewards.reshape(-1),
        correct=torch.tensor(correct, dtype=torch.float32),
        routes=[r for g in kept for r in g.routes] if has_routes else None,
    )
