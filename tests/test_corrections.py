"""Sampler corrections (clipbench/objectives/corrections): golden values with the arithmetic in
comments, each correction against an independent transcription of the implementation it follows
(tests/oracles: verl, TRL, SkyRL, slime, OpenRLHF, NeMo-RL), the logged diagnostics and their exact
combination across ranks, which tokens stay in the denominators, a Monte Carlo check of the
weights, the config keys and the former `sampler.mismatch_is` keys (same weights, same run ids)."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from oracles import mis_variants, skyrl_off_policy, trl_vllm_is, verl_rollout_corr

from clipbench.objectives import combine, policy_loss
from clipbench.objectives.corrections import (
    CORRECTIONS,
    KEPT,
    REJECTED,
    TRUNCATED,
    apply_correction,
    correction_stats,
    sampler_mismatch,
    validate_correction,
)

LN3 = math.log(3.0)
# row 0: d = trainer - sampler = [0.1, -0.5, ln 3]; row 1: d = [0.2, 0.0, padding]
SAMPLER = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.3, -9.0]])
TRAINER = torch.tensor([[-0.9, -2.5, -0.5 + LN3], [-0.5, -0.3, 4.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_tis_token_weights_by_hand():
    out = apply_correction({"name": "tis"}, SAMPLER, TRAINER, MASK)
    # w = min(exp(d), 2): [e^0.1, e^-0.5, min(3, 2)], [e^0.2, e^0, 0 at padding]
    want = torch.tensor([[math.exp(0.1), math.exp(-0.5), 2.0], [math.exp(0.2), 1.0, 0.0]])
    torch.testing.assert_close(out.weights, want)
    assert out.status.tolist() == [[KEPT, KEPT, TRUNCATED], [KEPT, KEPT, KEPT]]
    stats = correction_stats(out.sums)
    # |d| over the 5 valid tokens: 0.1 + 0.5 + ln 3 + 0.2 + 0 = 1.89861; max ln 3 (padding ignored)
    assert stats["mismatch/abs_mean"] == pytest.approx((0.8 + LN3) / 5, rel=1e-6)
    assert stats["mismatch/abs_max"] == pytest.approx(LN3, rel=1e-6)
    # the raw ratio before truncation (trl#5231): mean (e^0.1 + e^-0.5 + 3 + e^0.2 + 1) / 5, min e^-0.5, max 3
    raw = [math.exp(0.1), math.exp(-0.5), 3.0, math.exp(0.2), 1.0]
    assert stats["mismatch/rho_mean"] == pytest.approx(sum(raw) / 5, rel=1e-6)
    assert (stats["mismatch/rho_min"], stats["mismatch/rho_max"]) == pytest.approx((math.exp(-0.5), 3.0), rel=1e-6)
    # one token of five truncated; mean weight (e^0.1 + e^-0.5 + 2 + e^0.2 + 1) / 5
    assert stats["correction/truncated_frac"] == pytest.approx(0.2)
    assert stats["correction/masked_frac"] == stats["correction/seq_masked_frac"] == 0.0
    assert stats["correction/weight_mean"] == pytest.approx((sum(raw) - 1.0) / 5, rel=1e-6)


def test_tis_sequence_weights_by_hand():
    out = apply_correction({"name": "tis", "level": "sequence"}, SAMPLER, TRAINER, MASK)
    # row 0: exp(0.1 - 0.5 + ln 3) = 3 e^-0.4 = 2.011 -> truncated at 2 on its 3 tokens
    # row 1: exp(0.2 + 0) = 1.2214 on its 2 tokens, 0 at padding
    want = torch.tensor([[2.0, 2.0, 2.0], [math.exp(0.2)] * 2 + [0.0]])
    torch.testing.assert_close(out.weights, want)
    stats = correction_stats(out.sums)
    assert stats["correction/truncated_frac"] == pytest.approx(3 / 5)  # row 0's three tokens
    assert stats["correction/raw_max"] == pytest.approx(3 * math.exp(-0.4), rel=1e-6)  # the sequence ratios
    assert stats["correction/raw_min"] == pytest.approx(math.exp(0.2), rel=1e-6)
    # a row without any valid token gets weight 0 and is not a sequence
    empty = apply_correction(
        {"name": "tis", "level": "sequence"}, SAMPLER, TRAINER, torch.tensor([[1.0, 0, 0], [0, 0, 0]])
    )
    assert empty.weights[1].abs().sum() == 0 and float(empty.sums["mismatch/units"]) == 1


def test_the_former_keys_give_the_same_weights():
    # sampler_mismatch(mode, cap) is tis(level=mode, cap) (the weights of the former sampler.mismatch_is)
    for mode in ("token", "sequence"):
        old = sampler_mismatch(SAMPLER, TRAINER, MASK, mode=mode, cap=2.0)
        new = apply_correction({"name": "tis", "level": mode, "cap": 2.0}, SAMPLER, TRAINER, MASK)
        assert torch.equal(old.weights, new.weights)
    assert sampler_mismatch(SAMPLER, TRAINER, MASK).weights is None
    with pytest.raises(ValueError, match="mode must be one of"):
        sampler_mismatch(SAMPLER, TRAINER, MASK, mode="tokens")


def test_no_correction_still_measures_and_agreement_is_weight_one():
    out = apply_correction(None, SAMPLER, TRAINER, MASK)  # no correction: metrics only
    assert out.weights is None and out.status is None
    assert set(correction_stats(out.sums)) == {
        "mismatch/abs_mean",
        "mismatch/abs_max",
        "mismatch/rho_mean",
        "mismatch/rho_min",
        "mismatch/rho_max",
    }
    for name in CORRECTIONS:  # the sampler agrees with the trainer: every correction keeps every token at 1
        same = apply_correction({"name": name}, SAMPLER, SAMPLER.clone(), MASK, advantages=torch.tensor([1.0, -1.0]))
        assert torch.equal(same.weights, MASK) and not (same.status != KEPT).any(), name


def test_extreme_log_ratios_stay_finite_and_weights_are_detached():
    trainer = torch.tensor([[100.0, -100.0]], requires_grad=True)
    out = apply_correction({"name": "tis", "cap": 3.0}, torch.zeros(1, 2), trainer, torch.ones(1, 2))
    assert out.weights[0, 0] == 3.0 and 0 <= out.weights[0, 1] < 1e-40  # exp clamped at log C (unchanged)
    assert not out.weights.requires_grad
    for name in CORRECTIONS:
        for level in ("token", "sequence"):
            setting = {"name": name, "level": level} if name in ("tis", "icepop") else {"name": name}
            o = apply_correction(setting, torch.zeros(1, 2), trainer, torch.ones(1, 2), advantages=torch.ones(1))
            assert torch.isfinite(o.weights).all() and all(math.isfinite(v) for v in correction_stats(o.sums).values())


def _random(seed=0, B=6, T=7, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(B, T, generator=g) * 3
    sampler = trainer + torch.randn(B, T, generator=g) * spread
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)).float()
    mask[1] = 0.0  # a row without tokens
    return sampler, trainer, mask


SETTINGS = [
    {"name": "tis"},
    {"name": "tis", "level": "sequence", "cap": 3.0, "floor": 0.5},
    {"name": "icepop"},
    {"name": "icepop", "level": "sequence", "low": 0.5, "high": 2.0},
    {"name": "geo_mask", "low": 0.9, "high": 1.1},
    {"name": "veto", "low": 0.5, "high": 2.0},
    {"name": "kl_rs"},
    {"name": "kl_rs", "estimator": "k1", "level": "token", "low": 0.8, "high": 1.25},
    {"name": "vaco", "high": 0.2},
]
A6 = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0])  # the advantages of _random's rows (vaco reads them)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_sums_combine_across_ranks_exactly(setting):
    """Every rank holds the whole batch and counts its own rows (`counted`): the weights stay every
    row's, and `combine` (keys ending in /max, /min by extremum, the others added) gives the batch's sums."""
    s, t, mask = _random()
    full = apply_correction(setting, s, t, mask, advantages=A6)
    own = [
        apply_correction(setting, s, t, mask, counted=(torch.arange(6) // 2 == r)[:, None], advantages=A6)
        for r in range(3)
    ]
    assert all(torch.equal(o.weights, full.weights) and torch.equal(o.status, full.status) for o in own)
    merged = combine([o.sums for o in own])
    assert merged.keys() == full.sums.keys()
    for k, v in merged.items():
        torch.testing.assert_close(v, full.sums[k], msg=k)


def test_weights_turn_sampler_expectations_into_trainer_ones():
    """Monte Carlo, 200,000 tokens drawn from pi_sampler over 5 symbols: the weighted mean of f is
    E_trainer[f] with a cap above every ratio, and E_sampler[min(ratio, C) f] with C = 1.5.
    The weighted values w f lie in [0, 8]; their standard deviation is ~1.9, so the standard error
    is ~0.004 and the tolerance 0.03 is ~7 standard errors."""
    p_s = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    p_t = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])  # ratios 0.75 1 1.33 1 2
    f = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    y = torch.multinomial(p_s, 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    s_lp, t_lp = p_s.log()[y][None], p_t.log()[y][None]  # (1, N)
    w = apply_correction({"name": "tis", "cap": 10.0}, s_lp, t_lp, torch.ones_like(s_lp)).weights[0]
    assert float((w * f[y]).mean()) == pytest.approx(float((p_t * f).sum()), abs=0.03)  # 1.4
    w = apply_correction({"name": "tis", "cap": 1.5}, s_lp, t_lp, torch.ones_like(s_lp)).weights[0]
    truncated = float((p_s * (p_t / p_s).clamp(max=1.5) * f).sum())  # 1.3
    assert float((w * f[y]).mean()) == pytest.approx(truncated, abs=0.03)
    # IcePop [0.8, 1.5]: the ratios 0.75 and 2 are dropped: E_sampler[rho 1{0.8 <= rho <= 1.5} f]
    w = apply_correction({"name": "icepop", "low": 0.8, "high": 1.5}, s_lp, t_lp, torch.ones_like(s_lp)).weights[0]
    kept = (p_t / p_s >= 0.8) & (p_t / p_s <= 1.5)
    assert float((w * f[y]).mean()) == pytest.approx(float((p_t * f * kept).sum()), abs=0.03)  # 1.0


# ---------------------------------------------------------------------------------------------
# Against the implementations they follow (tests/oracles)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 3.0, 5.0, "0.5_5.0", "0.8_1.25"])
def test_tis_and_icepop_equal_verl_rollout_is(level, threshold):
    s, t, mask = _random(1, B=16, T=9)
    want, _ = verl_rollout_corr.verl_rollout_is_weights(t, s, mask, level, threshold)
    if isinstance(threshold, float):
        setting = {"name": "tis", "level": level, "cap": threshold}
    else:
        lo, hi = map(float, threshold.split("_"))
        setting = {"name": "icepop", "level": level, "low": lo, "high": hi}
    got = apply_correction(setting, s, t, mask).weights
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    if threshold == "0.8_1.25":
        assert (got == 0).sum() > (mask == 0).sum()  # IcePop drops some tokens here


@pytest.mark.parametrize("option", verl_rollout_corr.RS_OPTIONS)
def test_kl_rs_equals_verl_rollout_rs(option):
    s, t, mask = _random(2, B=16, T=9, spread=0.2)
    level, estimator = option.rsplit("_", 1)
    thresholds = {
        "k1": "0.95_1.05" if level == "token" else ("0.8_1.25" if "sum" in level else "0.97_1.03"),
        "k2": 0.02 if level != "seq_sum" else 0.1,
        "k3": 0.02 if level != "seq_sum" else 0.1,
    }[estimator]
    want, metrics = verl_rollout_corr.verl_rollout_rejection_mask(t, s, mask, option, thresholds)
    setting = {"name": "kl_rs", "estimator": estimator, "level": level}
    if estimator == "k1":
        setting.update(zip(("low", "high"), map(float, thresholds.split("_"))))
    else:
        setting["max_kl"] = thresholds
    out = apply_correction(setting, s, t, mask)
    assert torch.equal(out.weights, want)  # verl's new response mask: kept tokens 1, rejected 0
    assert torch.equal(out.status == REJECTED, (want == 0) & (mask > 0))
    assert 0 < metrics["rollout_rs_masked_fraction"] < 1  # the thresholds bite here
    stats = correction_stats(out.sums)
    assert stats["correction/rejected_frac"] == pytest.approx(metrics["rollout_rs_masked_fraction"], rel=1e-5)
    assert stats["correction/seq_masked_frac"] * 15 / 16 == pytest.approx(metrics["rollout_rs_seq_masked_fraction"])


@pytest.mark.parametrize(
    "mode, lo, hi",
    [
        ("token_truncate", None, 2.0),
        ("token_truncate", 0.5, 3.0),
        ("sequence_truncate", None, 3.0),
        ("sequence_truncate", 0.5, 2.0),
        ("token_mask", None, 1.2),
        ("token_mask", 0.8, 1.2),
        ("sequence_mask", None, 3.0),
        ("sequence_mask", 0.7, 1.5),
    ],
)
def test_tis_and_icepop_equal_trl_vllm_importance_sampling(mode, lo, hi):
    s, t, mask = _random(3, B=16, T=9, spread=0.2)
    ratio, _ = trl_vllm_is.trl_vllm_is_ratio(t, s, mask, mode, lo, hi)
    level = mode.split("_")[0]
    if mode.endswith("truncate"):
        setting = {"name": "tis", "level": level, "cap": hi, "floor": lo or 0.0}
    else:
        setting = {"name": "icepop", "level": level, "low": lo or 0.0, "high": hi}
    got = apply_correction(setting, s, t, mask).weights
    torch.testing.assert_close(got, (ratio * mask).expand_as(got), rtol=1e-6, atol=0)  # TRL: 1 at padding


def test_geo_mask_veto_and_token_mask_equal_skyrl():
    s, t, mask = _random(4, B=16, T=9, spread=0.05)
    s[3, 1] = t[3, 1] + 12.0  # an outlier token: rho ~ 6e-6 < 1e-4, vetoes row 3
    s[5, 0] = t[5, 0] - 5.0  # rho ~ 148 > 100, vetoes row 5
    for cfg, setting in [
        ({"sequence_mask_metric": "geometric"}, {"name": "geo_mask"}),  # SkyRL's 0.99 / 1.01
        (
            {"sequence_mask_metric": "geometric", "geo_mask_low": 0.995, "geo_mask_high": 1.02},
            {"name": "geo_mask", "low": 0.995, "high": 1.02},
        ),
        ({"outlier_token_is_threshold_low": 1e-4, "outlier_token_is_threshold_high": 100.0}, {"name": "veto"}),
        (
            {"token_mask_is_threshold_low": 0.95, "token_mask_is_threshold_high": 1.05},
            {"name": "icepop", "low": 0.95, "high": 1.05, "weight": "one"},
        ),
    ]:
        _, _, new_mask = skyrl_off_policy.skyrl_off_policy_correction(t, s, mask, **cfg)
        got = apply_correction(setting, s, t, mask).weights
        assert torch.equal(got, new_mask), setting
        assert 0 < (got == 0).sum() - (mask == 0).sum() < mask.sum(), setting  # something dropped, not all


def test_veto_low_side_equals_slime_and_geo_rho_equals_openrlhf():
    s, t, mask = _random(5, B=12, T=8, spread=0.05)
    s[2, 3] = t[2, 3] + 12.0  # catastrophic token (rho < 1e-4): slime vetoes row 2
    s[4, 0] = t[4, 0] - 12.0  # rho > 1e4: slime's veto is low-side only, row 4 stays
    rows = [mask[b] > 0 for b in range(12)]
    _, masks = mis_variants.slime_compute_mis_weights(
        [t[b][r] for b, r in enumerate(rows)],
        [s[b][r] for b, r in enumerate(rows)],
        [mask[b][r] for b, r in enumerate(rows)],
        tis_mode="truncate",
        rs_lower_bound=1e-30,
        rs_upper_bound=1e30,
        rs_veto_threshold=1e-4,
        tis_batch_normalize=False,
    )
    got = apply_correction({"name": "veto", "sides": "low"}, s, t, mask).weights
    for b, r in enumerate(rows):
        assert torch.equal(got[b][r], masks[b]), b
    assert got[2].sum() == 0 and got[4].sum() > 0
    # OpenRLHF seq-mask-tis: the geometric filter, then the raw token rho as the weight
    s, t, mask = _random(6, B=12, T=8, spread=0.03)
    mask[1] = 1.0  # OpenRLHF divides by the row's count without a guard
    want = mis_variants.openrlhf_is_weight(t, s, mask, "seq-mask-tis", (0.99, 1.01)) * mask
    got = apply_correction({"name": "geo_mask", "weight": "rho"}, s, t, mask).weights
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_denominators_icepop_keeps_tokens_kl_rs_drops_them():
    """verl's loss with its IcePop weights (the response mask untouched) equals clipbench's icepop; its
    loss with rejection sampling (the response mask rewritten, batch_num_tokens recounted) equals
    kl_rs, whose rejected tokens leave the token-mean denominator."""
    s, t, mask = _random(7, B=16, T=9, spread=0.2)
    g = torch.Generator().manual_seed(8)
    logp = t + torch.randn(t.shape, generator=g) * 0.2
    A = torch.randn(16, generator=g)
    for setting, weights, rs_mask in [
        (
            {"name": "icepop", "low": 0.8, "high": 1.25},
            verl_rollout_corr.verl_rollout_is_weights(t, s, mask, "token", "0.8_1.25")[0],
            mask,
        ),
        (
            {"name": "kl_rs", "estimator": "k1", "level": "token", "low": 0.8, "high": 1.25},
            None,
            verl_rollout_corr.verl_rollout_rejection_mask(t, s, mask, "token_k1", "0.8_1.25")[0],
        ),
    ]:
        lp = logp.clone().requires_grad_(True)
        want = verl_rollout_corr.verl_vanilla_corrected(lp, t, A[:, None].expand_as(t), rs_mask, weights)
        (want_grad,) = torch.autograd.grad(want, lp)
        corr = apply_correction(setting, s, t, mask)
        lp = logp.clone().requires_grad_(True)
        out = policy_loss("dual_clip", lp, t, A, mask, weights=corr.weights, correction_status=corr.status)
        (grad,) = torch.autograd.grad(out.loss, lp)
        torch.testing.assert_close(out.loss, want.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_per_cell_counts_of_the_correction():
    # ratios r = 1.1 (A>0: q1), 0.9 (A>0: q2), 0.9 (A<0: q3), 1.1 (A<0: q4); the sampler's rho per
    # token 1, 3 (truncated at 2), 1, 1/3 (kept by tis): q2 truncated once, nothing masked
    logp = torch.log(torch.tensor([[1.1, 0.9], [0.9, 1.1]]))
    old = torch.zeros(2, 2)
    sampler = -torch.log(torch.tensor([[1.0, 3.0], [1.0, 1 / 3]]))
    A, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 2)
    corr = apply_correction({"name": "tis"}, sampler, old, mask)
    out = policy_loss("grpo", logp, old, A, mask, weights=corr.weights, correction_status=corr.status)
    assert out.stats["correction/q2/truncated"] == 1 and out.stats["correction/q1/truncated"] == 0
    assert sum(float(v) for k, v in out.stats.items() if k.endswith("/masked")) == 0
    corr = apply_correction({"name": "icepop", "low": 0.5, "high": 2.0}, sampler, old, mask)  # drops 3 and 1/3
    out = policy_loss("grpo", logp, old, A, mask, weights=corr.weights, correction_status=corr.status)
    assert [float(out.stats[f"correction/{c}/masked"]) for c in ("q1", "q2", "q3", "q4")] == [0, 1, 0, 1]


# ---------------------------------------------------------------------------------------------
# The registry and the config


def test_settings_are_validated_with_defaults_filled_in():
    assert validate_correction("icepop") == {
        "name": "icepop",
        "level": "token",
        "low": 0.5,
        "high": 5.0,
        "weight": "rho",
    }
    assert validate_correction(None) == {"name": "none"}
    assert validate_correction({"name": "geo_mask"})["low"] == 0.99  # SkyRL's 0.99 / 1.01
    for setting, match in [
        ({"name": "icepp"}, r"unknown correction 'icepp' \(did you mean 'icepop'\?\)"),
        ({"name": "tis", "cpa": 3}, r"unknown parameter 'cpa' \(did you mean 'cap'\?\)"),
        ({"name": "tis", "cap": 0.5}, r"'cap' must be >= 1"),
        ({"name": "icepop", "low": 2.0, "high": 3.0}, r"needs low <= 1 <= high"),
        ({"name": "kl_rs", "estimator": "k1", "level": "seq_max"}, r"seq_max needs"),
        ({"name": "none", "cap": 2}, r"has no parameters"),
    ]:
        with pytest.raises(ValueError, match=match):
            validate_correction(setting)


def test_config_keys_are_checked_before_anything_runs():
    from clipbench.config import load_run_config
    from clipbench.errors import ConfigError

    cfg = load_run_config("recipes/quickstart.yaml", ["sampler.correction.name=tis", "sampler.correction.cap=3"])
    assert cfg.sampler.correction.one_form() == {"name": "tis", "level": "token", "cap": 3.0, "floor": 0.0}
    assert load_run_config("recipes/quickstart.yaml").sampler.correction.one_form() == {"name": "none"}  # default off
    assert (
        load_run_config("recipes/quickstart.yaml", ["sampler.correction=geo_mask"]).sampler.correction["high"] == 1.01
    )
    for overrides, key in [
        (["sampler.correction.name=icepp"], "sampler.correction.name: unknown correction"),
        (
            ["sampler.correction.name=tis", "sampler.correction.cap=0.5"],
            "sampler.correction.cap: tis: 'cap' must be >= 1",
        ),
        (
            ["sampler.correction.name=tis", "sampler.correction.low=0.5"],
            "sampler.correction.low: tis: unknown parameter 'low'",
        ),
        (
            ["sampler.correction.name=icepop", "sampler.old_logp=sampler"],
            "sampler.correction.name: needs sampler.old_logp=recompute",
        ),
        (["sampler.mismatch_is=tokens"], "sampler.mismatch_is: unknown value 'tokens'"),
    ]:
        with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
            load_run_config("recipes/quickstart.yaml", overrides)


def _without_later_keys(d: dict) -> dict:
    """`d` without the nested keys added after sampler.correction (config/load.py NESTED_ID_DEFAULTS):
    a config of the former shape has none of them."""
    from clipbench.config.identity import NESTED_ID_DEFAULTS

    for section, key in NESTED_ID_DEFAULTS:
        d.get(section, {}).pop(key, None)
    return d


def _former_run_id(d: dict) -> str:
    """The run id as clipbench computed it before sampler.correction (config/load.py at 5ba6cb3: the
    top-level keys `in_id` keeps, with the `train.record` section left out)."""
    from clipbench.config.identity import in_id

    d = {k: ({kk: vv for kk, vv in v.items() if kk != "record"} if k == "train" else v) for k, v in d.items()}
    blob = json.dumps({k: v for k, v in d.items() if in_id(k, v)}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@pytest.mark.parametrize("mode, cap", [("none", 2.0), ("token", 2.0), ("sequence", 3.0)])
def test_a_config_of_the_former_shape_loads_with_its_run_id(mode, cap):
    from clipbench.config import from_dict, load_run_config, run_id, to_dict, validate

    new = to_dict(
        load_run_config("recipes/quickstart.yaml", [f"sampler.mismatch_is={mode}", f"sampler.mismatch_is_cap={cap}"])
    )
    old = _without_later_keys(
        json.loads(json.dumps(new))
    )  # the dict a manifest or config.yaml of the former shape holds
    del old["sampler"]["correction"]
    old["sampler"].update(mismatch_is=mode, mismatch_is_cap=cap)
    rid = _former_run_id(old)
    assert run_id(old) == run_id(from_dict(old)) == run_id(validate(old)) == run_id(new) == rid
    assert to_dict(from_dict(old))["sampler"]["correction"] == new["sampler"]["correction"]
    # any other correction is a run of its own
    assert run_id(load_run_config("recipes/quickstart.yaml", ["sampler.correction=icepop"])) != rid


def test_a_manifest_of_the_former_shape_resumes_its_runs(tmp_path):
    """A sweep frozen before sampler.correction: its runs load from the manifest under their ids."""
    from clipbench.config import load_run_config, run_id, to_dict
    from clipbench.sweep.execute import task_from_manifest

    cfg = _without_later_keys(to_dict(load_run_config("recipes/quickstart.yaml", ["sampler.mismatch_is=token"])))
    del cfg["sampler"]["correction"]
    cfg["sampler"].update(mismatch_is="token", mismatch_is_cap=2.0)
    rid = _former_run_id(cfg)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({"sweep": "old", "runs": {rid: cfg}, "points": {}}))
    task = task_from_manifest(tmp_path / "old" / "manifest.json", rid)
    loaded = task.config  # read once, from the manifest's former shape
    assert run_id(loaded) == rid and loaded.sampler.correction.one_form() == {
        "name": "tis",
        "level": "token",
        "cap": 2.0,
        "floor": 0.0,
    }


SMALL = [
    "train.prompts_per_step=4",
    "sampler.group_size=4",
    "sampler.max_new_tokens=8",
    "train.steps=2",
    "eval.benchmarks=[]",
    "tracking.mlflow=false",
]


@pytest.mark.slow
def test_the_loop_logs_the_mismatch_and_corrects_with_it(tmp_path):
    """The trainer computes the correction once per rollout batch and passes its weights to the loss.
    The hf sampler samples from the training model itself, in float32: its log-probs of the sampled
    tokens equal the trainer's recomputed old log-probs up to kernel round-off (generate's last-token
    logits vs a full forward; measured mean |d| 7e-7, max 8e-6), so every TIS weight is 1 within 1e-4
    and the corrected run logs the same loss as the uncorrected one; an IcePop band of [1, 1] masks
    every token whose rho is not exactly 1 (most of them) and logs it per cell. With old_logp=sampler
    the mismatch is measured inside the first optimizer step's forward, on its rows."""
    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    rows = {}
    for name, over in (
        ("none", []),
        ("token", ["sampler.correction=tis"]),
        ("bypass", ["sampler.old_logp=sampler"]),
        ("mask", ["sampler.correction={name: icepop, low: 1.0, high: 1.0}"]),
    ):
        run_training(load_run_config("recipes/arith_tiny.yaml", SMALL + over), tmp_path / name)
        rows[name] = RunDir(tmp_path / name).read_metrics()
    for r in rows["bypass"]:
        assert 0.0 <= r["mismatch/abs_mean"] <= r["mismatch/abs_max"] < 1e-4 and r["old_logp_source"] == 1
    assert not any("mismatch/abs_mean" in r for r in rows["none"])  # hf without a correction: no sampler log-probs
    for r in rows["token"]:
        assert 0.0 <= r["mismatch/abs_mean"] <= r["mismatch/abs_max"] < 1e-4
        assert r["mismatch/rho_min"] <= r["mismatch/rho_mean"] <= r["mismatch/rho_max"]
        assert r["correction/weight_mean"] == pytest.approx(1.0, abs=1e-4) and r["correction/truncated_frac"] == 0.0
    for a, b in zip(rows["none"], rows["token"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)  # on-policy losses are ~0
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for r in rows["mask"]:
        masked = sum(v for k, v in r.items() if k.startswith("correction/") and k.endswith("/masked"))
        tokens = sum(r[f"{c}/tokens"] for c in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy"))
        assert r["correction/masked_frac"] > 0.5 and 0 < masked <= tokens


def test_a_plugin_registers_a_correction(tmp_path):
    """A user's file registers a correction exactly as a rule: origin recorded, validated, applied,
    listed; a file that fails to import registers nothing."""
    from clipbench.objectives.corrections import describe
    from clipbench.objectives.plugins import load_plugin

    f = tmp_path / "half_weight.py"
    f.write_text(
        "import torch\n"
        "from clipbench.objectives.corrections import applied, correction\n\n"
        "@correction('half_weight', source='a test')\n"
        "def half_weight(d, mask, *, w: float = 0.5):\n"
        "    '''w on every token: a constant weight'''\n"
        "    return applied(torch.full_like(d, w), torch.exp(d))\n"
    )
    origin = load_plugin(str(f))
    assert CORRECTIONS["half_weight"].origin == origin and describe({"name": "half_weight"})["plugin"] == origin.path
    out = apply_correction({"name": "half_weight", "w": 0.25}, SAMPLER, TRAINER, MASK)
    assert torch.equal(out.weights, 0.25 * MASK)
    bad = tmp_path / "broken.py"
    bad.write_text(
        "from clipbench.objectives.corrections import applied, correction\n\n"
        "@correction('broken_one', source='a test')\n"
        "def broken_one(d, mask):\n    '''x'''\n    return d\n\nraise RuntimeError('boom')\n"
    )
    from clipbench.errors import UserError

    with pytest.raises(UserError, match="boom"):
        load_plugin(str(bad))
    assert "broken_one" not in CORRECTIONS


def test_the_report_shows_the_mismatch_and_the_masked_shares():
    """Two rollout steps of two optimizer steps each: the rollout batch's values are read once per
    rollout step (its first row), the extrema over the run, the per-cell masked counts summed over
    every optimizer step."""
    from types import SimpleNamespace

    from clipbench.report.correction import label_correction, run_correction
    from clipbench.report.correction_table import correction_table
    from clipbench.report.render import to_markdown

    def row(step, rho_min, rho_max, masked, q1_masked, q1_tokens):
        return {
            "step": step,
            "mismatch/abs_mean": 0.01 * (step + 1),
            "mismatch/rho_mean": 1.0 + 0.01 * step,
            "mismatch/rho_min": rho_min,
            "mismatch/rho_max": rho_max,
            "correction/weight_mean": 0.9,
            "correction/truncated_frac": 0.0,
            "correction/masked_frac": masked,
            "correction/seq_masked_frac": 0.5,
            "q1/tokens": q1_tokens,
            "correction/q1/masked": q1_masked,
            "q2/tokens": 10.0,
            "correction/q2/masked": 0.0,
        }

    rows = [
        row(0, 0.5, 3.0, 0.1, 2.0, 20.0),
        row(0, 0.5, 3.0, 0.1, 1.0, 20.0),
        row(1, 0.4, 2.0, 0.3, 3.0, 20.0),
        row(1, 0.4, 2.0, 0.3, 0.0, 20.0),
    ]
    c = run_correction(rows)
    assert c["mismatch/abs_mean"] == pytest.approx(0.015)  # (0.01 + 0.02) / 2 rollout steps
    assert c["correction/masked_frac"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2
    assert (c["rho_min"], c["rho_max"]) == (0.4, 3.0)  # over the run
    assert c["q1/masked"] == pytest.approx(100 * 6 / 80)  # (2 + 1 + 3 + 0) / (4 x 20) tokens
    assert c["q2/masked"] == 0.0 and math.isnan(c["q3/masked"])  # q3 never logged
    assert run_correction([{"step": 0, "loss": 1.0}]) is None  # no sampler log-probs: no row
    agg = label_correction([SimpleNamespace(metrics=rows), SimpleNamespace(metrics=rows)])
    assert agg["seeds"] == 2 and agg["correction/masked_frac"]["mean"] == pytest.approx(0.2)
    md = to_markdown(correction_table({"m": {"grpo correction=icepop": agg}}, None))
    assert "grpo correction=icepop" in md and "20.00" in md and "7.50" in md  # masked 20% of tokens, 7.5% of Q1


def test_vaco_golden():
    """open-instruct's own example (test_rho_mask_tv_divergence): rho = [0.25, 1, 4] has TV = mean |rho - 1|
    = (0.75 + 0 + 3)/3 = 1.25 <= 2: kept; rho = [4, 4, 4] has TV 3 > 2 and A = 1 > 0 with d = log 4 > 0
    (the update raises the gap): every token masked. With A = -1 the update lowers it: kept."""
    trainer = torch.log(torch.tensor([[0.25, 1.0, 4.0], [4.0, 4.0, 4.0]]))
    sampler, mask = torch.zeros(2, 3), torch.ones(2, 3)
    out = apply_correction({"name": "vaco", "cap": 10.0}, sampler, trainer, mask, advantages=torch.ones(2))
    torch.testing.assert_close(out.weights, torch.tensor([[0.25, 1.0, 4.0], [0.0, 0.0, 0.0]]))
    assert out.status.tolist() == [[0, 0, 0], [2, 2, 2]]  # masked: numerator only, still in the denominators
    stats = correction_stats(out.sums)
    assert stats["correction/raw_max"] == 3.0 and stats["correction/raw_min"] == 1.25  # the rows' TV
    assert stats["correction/masked_frac"] == 0.5 and stats["correction/seq_masked_frac"] == 0.5
    kept = apply_correction({"name": "vaco", "cap": 10.0}, sampler, trainer, mask, advantages=torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kept.weights, torch.tensor([[0.25, 1.0, 4.0], [4.0, 4.0, 4.0]]))
    # the default cap 2 truncates the kept weights: 4 -> 2
    capped = apply_correction({"name": "vaco"}, sampler, trainer, mask, advantages=torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(capped.weights, torch.tensor([[0.25, 1.0, 2.0], [2.0, 2.0, 2.0]]))
    with pytest.raises(ValueError, match="needs low < high"):
        validate_correction({"name": "vaco", "low": 0.5, "high": 0.4})
