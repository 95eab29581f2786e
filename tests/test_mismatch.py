"""Sampler/trainer mismatch: truncated importance-sampling weights and the logged mismatch
(clipbench/rollout/mismatch.py). Golden values with the arithmetic in comments, and a Monte Carlo
check that the weights turn sampler expectations into trainer expectations."""

from __future__ import annotations

import math

import pytest
import torch

from clipbench.objectives import combine
from clipbench.objectives.corrections import sampler_mismatch, mismatch_stats

LN3 = math.log(3.0)
# row 0: d = trainer - sampler = [0.1, -0.5, ln 3]; row 1: d = [0.2, 0.0, padding]
SAMPLER = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.3, -9.0]])
TRAINER = torch.tensor([[-0.9, -2.5, -0.5 + LN3], [-0.5, -0.3, 4.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_weights_by_hand():
    out = sampler_mismatch(SAMPLER, TRAINER, MASK, mode="token", cap=2.0)
    # w = min(exp(d), 2): [e^0.1, e^-0.5, min(3, 2)], [e^0.2, e^0, 0 at padding]
    want = torch.tensor([[math.exp(0.1), math.exp(-0.5), 2.0], [math.exp(0.2), 1.0, 0.0]])
    torch.testing.assert_close(out.weights, want)
    stats = mismatch_stats(out.sums)
    # |d| over the 5 valid tokens: 0.1 + 0.5 + ln 3 + 0.2 + 0 = 1.89861; max ln 3 (padding ignored)
    assert stats["mismatch/abs_mean"] == pytest.approx((0.8 + LN3) / 5, rel=1e-6)
    assert stats["mismatch/abs_max"] == pytest.approx(LN3, rel=1e-6)
    # one token of five at the cap; mean weight (e^0.1 + e^-0.5 + 2 + e^0.2 + 1) / 5
    assert stats["mismatch/is_capped_frac"] == pytest.approx(0.2)
    assert stats["mismatch/is_weight_mean"] == pytest.approx(
        (math.exp(0.1) + math.exp(-0.5) + 2 + math.exp(0.2) + 1) / 5, rel=1e-6)


def test_sequence_weights_by_hand():
    out = sampler_mismatch(SAMPLER, TRAINER, MASK, mode="sequence", cap=2.0)
    # row 0: exp(0.1 - 0.5 + ln 3) = 3 e^-0.4 = 2.011 -> capped at 2 on its 3 tokens
    # row 1: exp(0.2 + 0) = 1.2214 on its 2 tokens, 0 at padding
    want = torch.tensor([[2.0, 2.0, 2.0], [math.exp(0.2)] * 2 + [0.0]])
    torch.testing.assert_close(out.weights, want)
    stats = mismatch_stats(out.sums)
    assert stats["mismatch/is_capped_frac"] == pytest.approx(0.5)          # one sequence of two
    assert stats["mismatch/is_weight_mean"] == pytest.approx((2 + math.exp(0.2)) / 2, rel=1e-6)
    # a row without any valid token gets weight 0 and is not a sequence
    empty = sampler_mismatch(SAMPLER, TRAINER, torch.tensor([[1.0, 0, 0], [0, 0, 0]]), mode="sequence")
    assert empty.weights[1].abs().sum() == 0 and float(empty.sums["mismatch/is_units"]) == 1


def test_no_correction_still_measures_and_agreement_is_weight_one():
    out = sampler_mismatch(SAMPLER, TRAINER, MASK)                        # mode none: metrics only
    assert out.weights is None and set(mismatch_stats(out.sums)) == {"mismatch/abs_mean", "mismatch/abs_max"}
    same = sampler_mismatch(SAMPLER, SAMPLER.clone(), MASK, mode="token")
    assert torch.equal(same.weights, MASK) and float(same.sums["mismatch/abs/max"]) == 0.0


def test_extreme_log_ratios_stay_finite_and_weights_are_detached():
    trainer = torch.tensor([[100.0, -100.0]], requires_grad=True)
    out = sampler_mismatch(torch.zeros(1, 2), trainer, torch.ones(1, 2), mode="token", cap=3.0)
    assert out.weights[0, 0] == 3.0 and 0 <= out.weights[0, 1] < 1e-40   # exp clamped at log C
    assert not out.weights.requires_grad
    seq = sampler_mismatch(torch.zeros(1, 2), torch.full((1, 2), 500.0), torch.ones(1, 2), mode="sequence", cap=3.0)
    assert torch.equal(seq.weights, torch.full((1, 2), 3.0))


def test_sums_combine_across_ranks_exactly():
    """Rows split over two ranks (or micro-batches): `combine` (the objectives' rule: keys ending in
    /max by max, the others added) gives the whole batch's sums."""
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    whole = sampler_mismatch(s, t, mask, mode="sequence").sums
    a, b = (sampler_mismatch(s[i], t[i], mask[i], mode="sequence").sums for i in (slice(0, 2), slice(2, 6)))
    reduced = combine([a, b])
    assert set(reduced) == set(whole) and {k for k in whole if k.endswith("/max")} == {"mismatch/abs/max"}
    for k in whole:
        torch.testing.assert_close(reduced[k], whole[k])
    # the trainer's way: every rank holds the whole batch and counts its own rows (`counted`);
    # the weights stay every row's, the sums add up to the batch's once
    for mode in ("token", "sequence"):
        full = sampler_mismatch(s, t, mask, mode=mode)
        own = [sampler_mismatch(s, t, mask, mode=mode, counted=(torch.arange(6) // 2 == r)[:, None] if r < 2 else
                                (torch.arange(6) >= 4)[:, None]) for r in range(3)]  # rows 0-1, 2-3, 4-5
        assert all(torch.equal(o.weights, full.weights) for o in own)
        for k, v in combine([o.sums for o in own]).items():
            torch.testing.assert_close(v, full.sums[k])


def test_weights_turn_sampler_expectations_into_trainer_ones():
    """Monte Carlo, 200,000 tokens drawn from pi_sampler over 5 symbols: the weighted mean of f is
    E_trainer[f] with a cap above every ratio, and E_sampler[min(ratio, C) f] with C = 1.5.
    The weighted values w f lie in [0, 8]; their standard deviation is ~1.9, so the standard error
    is ~0.004 and the tolerance 0.03 is ~7 standard errors."""
    p_s = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    p_t = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])           # ratios 0.75 1 1.33 1 2
    f = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    y = torch.multinomial(p_s, 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    s_lp, t_lp = p_s.log()[y][None], p_t.log()[y][None]     # (1, N)
    w = sampler_mismatch(s_lp, t_lp, torch.ones_like(s_lp), mode="token", cap=10.0).weights[0]
    assert float((w * f[y]).mean()) == pytest.approx(float((p_t * f).sum()), abs=0.03)   # 1.4
    w = sampler_mismatch(s_lp, t_lp, torch.ones_like(s_lp), mode="token", cap=1.5).weights[0]
    truncated = float((p_s * (p_t / p_s).clamp(max=1.5) * f).sum())                      # 1.3
    assert float((w * f[y]).mean()) == pytest.approx(truncated, abs=0.03)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be one of"):
        sampler_mismatch(SAMPLER, TRAINER, MASK, mode="tokens")
    with pytest.raises(ValueError, match="cap must be a finite number >= 1"):
        sampler_mismatch(SAMPLER, TRAINER, MASK, mode="token", cap=0.5)
    with pytest.raises(ValueError, match="same"):
        sampler_mismatch(SAMPLER[:, :2], TRAINER, MASK)


def test_config_keys_are_checked_before_anything_runs():
    from clipbench.config import load_run_config
    from clipbench.errors import ConfigError

    cfg = load_run_config("recipes/quickstart.yaml", ["sampler.mismatch_is=sequence", "sampler.mismatch_is_cap=3"])
    assert (cfg.sampler.mismatch_is, cfg.sampler.mismatch_is_cap) == ("sequence", 3.0)
    assert load_run_config("recipes/quickstart.yaml").sampler.mismatch_is == "none"       # default off
    for overrides, key in [(["sampler.mismatch_is=tokens"], "sampler.mismatch_is: unknown value 'tokens'"),
                           (["sampler.mismatch_is_cap=0.5"], "sampler.mismatch_is_cap: must be >= 1 (a cap below 1"),
                           (["sampler.mismatch_is_cap=.inf"], "sampler.mismatch_is_cap: must be a finite number >= 1"),
                           (["sampler.mismatch_is=token", "sampler.old_logp=sampler"],
                            "sampler.mismatch_is: needs sampler.old_logp=recompute"),
                           (["sampler.sleep_mode=true", "sampler.backend=hf"],
                            "sampler.sleep_mode: applies to the vllm backend")]:
        with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
            load_run_config("recipes/quickstart.yaml", overrides)


SMALL = ["train.prompts_per_step=4", "sampler.group_size=4", "sampler.max_new_tokens=8", "train.steps=2",
         "eval.benchmarks=[]", "tracking.mlflow=false"]


@pytest.mark.slow
def test_the_loop_logs_the_mismatch_and_corrects_with_it(tmp_path):
    """The trainer computes the mismatch once per rollout batch and passes the TIS weights to the loss.
    The hf sampler samples from the training model itself, in float32: its log-probs of the sampled
    tokens equal the trainer's recomputed old log-probs up to kernel round-off (generate's last-token
    logits vs a full forward; measured mean |d| 7e-7, max 8e-6), so every weight is 1 within 1e-4 and
    the corrected run logs the same loss as the uncorrected one. With old_logp=sampler the mismatch is
    measured inside the first optimizer step's forward, on its rows (the policy before its step)."""
    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    rows = {}
    for name, over in (("none", []), ("token", ["sampler.mismatch_is=token"]), ("bypass", ["sampler.old_logp=sampler"])):
        run_training(load_run_config("recipes/arith_tiny.yaml", SMALL + over), tmp_path / name)
        rows[name] = RunDir(tmp_path / name).read_metrics()
    for r in rows["bypass"]:
        assert 0.0 <= r["mismatch/abs_mean"] <= r["mismatch/abs_max"] < 1e-4 and r["old_logp_source"] == 1
    assert not any("mismatch/abs_mean" in r for r in rows["none"])  # hf without a correction: no sampler log-probs
    for r in rows["token"]:
        assert 0.0 <= r["mismatch/abs_mean"] <= r["mismatch/abs_max"] < 1e-4
        assert r["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and r["mismatch/is_capped_frac"] == 0.0
    for a, b in zip(rows["none"], rows["token"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)  # on-policy losses are ~0
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
