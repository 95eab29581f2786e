"""Policy lag (`sampler.lag`, clipbench/train/lag.py) and the staleness it logs
(clipbench/objectives/staleness.py).

- The swap: the oldest kept policy is in the model inside `behaviour`, the current one after it, bit
  for bit, also when the block raises; a step observed twice is kept once; the lag of the first k
  steps is the step itself.
- The loop: with k = 1, rollout step 1 samples what the base model samples at step 1 (not what the
  updated policy does), and the model trains from the updated weights.
- The staleness sums: golden values, arithmetic in the comments; split over rows (ranks or
  micro-batches), the sums add up to the whole batch's.
- A lagged run stopped inside a rollout step (a preemption: its snapshots go into the checkpoint)
  and resumed equals the uninterrupted run, bit for bit, with the ratio taken against the behaviour
  policy (sampler.old_logp: sampler) and with the decoupled form (recompute + tis).
- Run ids: lag 0 keeps every run id; any other lag is another run.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from clipbench.config import load_run_config, run_id
from clipbench.errors import RunPreempted
from clipbench.objectives.staleness import staleness_stats, staleness_sums
from clipbench.tracking.sink import NullSink
from clipbench.tracking.store import RunDir
from clipbench.train.checkpoint import checkpoint_step, load_policy
from clipbench.train.lag import PolicyLag
from clipbench.train.preempt import StopRequest

REPO = Path(__file__).resolve().parent.parent

RECIPE = str(REPO / "recipes" / "arith_tiny.yaml")
# 4 rollout steps of 4 prompts x 4 samples, 2 mini-batches: 8 optimizer steps; lag 2
RUN = {
    "train.steps": 4,
    "train.prompts_per_step": 4,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.checkpoint_every": 2,
    "train.lr": 1e-3,  # large steps: the behaviour policy is measurably stale after one
    "sampler.lag": 2,
    "sampler.old_logp": "sampler",
    "eval.benchmarks": [],
    "tracking.mlflow": False,
    "launch.preempt_signal": "SIGUSR1",
}


def overrides(**extra) -> list[str]:
    return [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
        for k, v in {**RUN, **extra}.items()
    ]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the swap -------------------------------------------------------------------------------------


class Sampler:
    def __init__(self):
        self.synced = []

    def sync_weights(self, model):
        self.synced.append(model.weight.detach().clone())


def test_behaviour_swaps_the_oldest_kept_policy_in_and_the_current_one_back():
    model = torch.nn.Linear(3, 2)
    lag, sampler = PolicyLag(2), Sampler()
    weights = []
    for step in range(5):
        lag.observe(step, model)
        lag.observe(step, model)  # a rollout step sampled again after a stop: kept once
        weights.append(model.weight.detach().clone())
        with lag.behaviour(step, model, sampler) as k:
            assert k == min(step, 2)  # the first steps sample from the oldest policy there is
            assert torch.equal(model.weight, weights[max(0, step - 2)])
        assert torch.equal(model.weight, weights[step])  # bit for bit
        assert torch.equal(sampler.synced[-1], weights[max(0, step - 2)])  # a vLLM engine gets the behaviour
        with torch.no_grad():
            model.weight.add_(1.0)  # "an update"
    assert lag.steps() == [2, 3, 4]  # k + 1 kept
    current = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sampling failed"), lag.behaviour(5, model, sampler):
        raise RuntimeError("sampling failed")
    assert torch.equal(model.weight, current)


def test_lag_zero_keeps_and_swaps_nothing():
    model, lag = torch.nn.Linear(3, 2), PolicyLag(0)
    lag.observe(0, model)
    with lag.behaviour(0, model, None) as k:
        assert k == 0
    assert lag.steps() == [] and not lag.active


# ---- the loop -------------------------------------------------------------------------------------


def test_lag_one_samples_step_one_with_the_base_model_and_trains_the_updated_one(tmp_path):
    from clipbench.train.batch import collect_rollout
    from clipbench.train.distributed import Dist
    from clipbench.train.loop import rollout, setup, update

    cfg = load_run_config(RECIPE, overrides(**{"sampler.lag": 1}))
    lagged = setup(cfg, RunDir(tmp_path / "lagged"), Dist(), resume=False, sink=NullSink())
    base = setup(cfg, RunDir(tmp_path / "base"), Dist(), resume=False, sink=NullSink())  # never updated
    batch0 = rollout(lagged, 0)
    update(lagged, 0, batch0)
    theta1 = [p.detach().clone() for p in lagged.model.parameters()]
    batch1 = rollout(lagged, 1)
    want = collect_rollout(cfg, 1, base.task, base.pool, base.sampler, base.dist)  # theta_0 at step 1's seeds
    assert batch1.completion_ids == want.completion_ids and batch1.sampler_logp == want.sampler_logp
    assert batch1.metrics["offpolicy/lag"] == 1 and batch0.metrics["offpolicy/lag"] == 0
    assert all(torch.equal(p, q) for p, q in zip(lagged.model.parameters(), theta1))  # theta_1 trains
    # the updated policy itself samples something else at step 1: the lag is visible
    assert (
        collect_rollout(cfg, 1, lagged.task, lagged.pool, lagged.sampler, lagged.dist).sampler_logp != want.sampler_logp
    )


# ---- the staleness sums ---------------------------------------------------------------------------


def test_staleness_golden_values_and_their_sums_split_over_rows():
    # one row of 3 tokens (A = +1) and one of 2 (A = -1, its third position padding)
    # w = exp(logp - behaviour): row 0: 1.5, 1.0, 0.5; row 1: 2.0, 0.9
    w = torch.tensor([[1.5, 1.0, 0.5], [2.0, 0.9, 1.0]], dtype=torch.float64)
    behaviour = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = behaviour + w.log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    A = torch.tensor([1.0, -1.0])
    whole = staleness_sums(logp, behaviour, mask, A, torch.tensor([True, True]))
    stats = staleness_stats(whole)
    valid = [1.5, 1.0, 0.5, 2.0, 0.9]
    # kl: mean of w - 1 - log w = (0.0945 + 0 + 0.1931 + 0.3069 + 0.0054) / 5
    assert stats["offpolicy/kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in valid) / 5, rel=1e-12)
    # ess: (sum w)^2 / (N sum w^2) = 5.9^2 / (5 * 8.31) = 34.81 / 41.55 = 0.83779...
    assert stats["offpolicy/ess"] == pytest.approx(5.9**2 / (5 * 8.31), rel=1e-12)
    # ess_seq: W = (0.75, 1.8): (2.55)^2 / (2 * (0.5625 + 3.24)) = 6.5025 / 7.605 = 0.85503...
    assert stats["offpolicy/ess_seq"] == pytest.approx(2.55**2 / (2 * 3.8025), rel=1e-12)
    # out of [0.8, 1.2]: 1.5 (A>0, w>1: q1), 0.5 (A>0, w<1: q2), 2.0 (A<0, w>1: q4); 0.9 and 1.0 in: 3 of 5
    assert stats["offpolicy/out_of_band"] == pytest.approx(0.6)
    assert [stats[f"offpolicy/{c}"] for c in ("q1", "q2", "q3", "q4", "zero_adv")] == pytest.approx(
        [0.2, 0.2, 0.0, 0.2, 0.0]
    )
    # each row counted by one rank: the two ranks' sums add up to the whole batch's
    parts = [staleness_sums(logp, behaviour, mask, A, torch.tensor(r)) for r in ([True, False], [False, True])]
    assert all(torch.allclose(parts[0][k] + parts[1][k], v, rtol=1e-12) for k, v in whole.items())
    # on-policy: w = 1 everywhere
    same = staleness_stats(staleness_sums(behaviour, behaviour, mask, A, torch.tensor([True, True])))
    assert same["offpolicy/kl"] == 0 and same["offpolicy/ess"] == 1 and same["offpolicy/out_of_band"] == 0


# ---- the run ------------------------------------------------------------------------------------


def test_lag_zero_keeps_every_run_id_and_a_lag_is_another_run():
    plain = load_run_config(RECIPE)
    assert run_id(load_run_config(RECIPE, ["sampler.lag=0"])) == run_id(plain)
    assert run_id(load_run_config(RECIPE, ["sampler.lag=2"])) != run_id(plain)


def strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def signal_at_optimizer_step(monkeypatch, n: int) -> None:
    import clipbench.train.loop as loop

    real, calls = loop.optimizer_step, []

    def step(*a, **kw):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(*a, **kw)

    monkeypatch.setattr(loop, "optimizer_step", step)


@pytest.mark.slow
@pytest.mark.parametrize(
    "form",
    [{}, {"sampler.old_logp": "recompute", "sampler.correction": {"name": "tis", "cap": 2.0}}],
    ids=["behaviour-ratio", "decoupled-tis"],
)
def test_a_lagged_run_stopped_inside_a_step_resumes_to_the_uninterrupted_numbers(form, tmp_path, monkeypatch):
    from clipbench.train.loop import run_training

    cfg = load_run_config(RECIPE, overrides(**form))
    full = RunDir(tmp_path / "full")
    run_training(cfg, full.path)
    rows = full.read_metrics()
    assert [r["offpolicy/lag"] for r in rows[::2]] == [0, 1, 2, 2]
    assert rows[0]["offpolicy/kl"] < 1e-9 < rows[-1]["offpolicy/kl"]  # stale by the last step
    assert rows[-1]["offpolicy/ess"] < 1.0

    cut = RunDir(tmp_path / "cut")
    signal_at_optimizer_step(monkeypatch, 3)  # rollout step 1 (lag 1), its first optimizer step
    stop = StopRequest.install(["SIGUSR1"])
    try:
        with pytest.raises(RunPreempted):
            run_training(cfg, cut.path, stop=stop)
    finally:
        stop.restore()
    assert checkpoint_step(cut.checkpoint_dir) == 1  # and the policies of steps 0 and 1, which steps 2 and 3 sample
    assert sorted(p.name for p in (cut.checkpoint_dir / "lag").iterdir()) == ["0", "1"]
    monkeypatch.undo()
    run_training(cfg, cut.path, resume=True)
    assert strip(cut.read_metrics()) == strip(rows)
    pa, pb = (load_policy(rd.checkpoint_dir)[0].state_dict() for rd in (full, cut))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
