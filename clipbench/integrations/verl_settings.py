"""What a verl launch and clipbench's registered verl losses share: names of settings and what verl's
loss call feeds clipbench's loss (`FEEDS`, integrations/feeds.py), no verl import.

The launcher (clipbench.engines.verl) writes these; the losses registered in verl's registry
(clipbench.integrations.verl) read them, inside verl's Ray workers. The engine's preflight refuses
every component of a run config by FEEDS (clipbench.engines.keys), and the launcher sets verl's
aggregation, rollout correction and advantage estimator from it.
"""

from __future__ import annotations

from clipbench.integrations.feeds import Counterpart, Counterparts, Feeds

MODULE = "clipbench.integrations.verl"  # VERL_USE_EXTERNAL_MODULES: verl imports it in every worker
PARAMS_ENV = "CLIPBENCH_RULE_PARAMS"  # the rule's parameters, a JSON object
PLUGINS_ENV = "CLIPBENCH_PLUGINS"  # the run's rule files / modules, separated by os.pathsep
RECORD_DIR_ENV = "CLIPBENCH_RECORD_DIR"  # where the registered losses record their inputs (docs/replay.md)
RECORD_MAX_MB_ENV = "CLIPBENCH_RECORD_MAX_MB"  # ... until the directory holds this many MB

# clipbench parameter <- verl actor field(s) that mean the same for verl's own losses (first one set
# wins; the one owner of this mapping: the registered losses read it, the generated commands set the
# first field of each).
VERL_FIELDS = {
    "eps_low": ("clip_ratio_low", "clip_ratio"),
    "eps_high": ("clip_ratio_high", "clip_ratio"),
    "c": ("clip_ratio_c",),
    "tau_pos": ("tau_pos",),
    "tau_neg": ("tau_neg",),
    "div_low": ("clip_ratio_low", "clip_ratio"),
    "div_high": ("clip_ratio_high", "clip_ratio"),  # dppo_*
    "is_cap": ("clip_ratio_c",),  # dppo_*: the importance-sampling cap
    "eps": ("clip_ratio",),  # cfpo: verl PR #5252 reads the actor's clip_ratio
    "dro_beta": ("policy_loss.dro_beta",),
    "clip_cov_ratio": ("policy_loss.clip_cov_ratio",),
    "clip_cov_lb": ("policy_loss.clip_cov_lb",),
    "clip_cov_ub": ("policy_loss.clip_cov_ub",),
    "kl_cov_ratio": ("policy_loss.kl_cov_ratio",),
    "ppo_kl_coef": ("policy_loss.ppo_kl_coef",),
}

ACTOR = "actor_rollout_ref.actor."  # verl's actor config (main_ppo overrides)
RC = "algorithm.rollout_correction."  # verl's rollout correction (main_ppo overrides)


def _kl_rs(c) -> dict:
    threshold = f"{c['low']!r}_{c['high']!r}" if c["estimator"] == "k1" else c["max_kl"]
    return {RC + "rollout_rs": f"{c['level']}_{c['estimator']}", RC + "rollout_rs_threshold": threshold}


FEEDS = Feeds(
    "verl's policy-loss signature",
    # (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
    # no given rule input, and verl's own agg_loss aggregates
    passes=(),
    aggregations=Counterparts(
        "verl 0.9.1's loss_agg_mode",
        {
            name: Counterpart({ACTOR + "loss_agg_mode": name})
            for name in (
                "token-mean",
                "token-sum",
                "seq-mean-token-mean",
                "seq-mean-token-sum",
                "seq-mean-token-sum-norm",
            )
        },
    ),
    corrections=Counterparts(
        "verl 0.9.1's algorithm.rollout_correction",
        {
            "none": Counterpart(),
            "tis": Counterpart(
                lambda c: {RC + "rollout_is": c["level"], RC + "rollout_is_threshold": c["cap"]},
                only="floor=0",  # verl's truncated IS has no floor
                when=lambda c: c["floor"] == 0.0,
            ),
            "icepop": Counterpart(
                lambda c: {RC + "rollout_is": c["level"], RC + "rollout_is_threshold": f"{c['low']!r}_{c['high']!r}"},
                only="weight=rho and low > 0",
                when=lambda c: c["weight"] == "rho" and c["low"] > 0,
            ),
            "kl_rs": Counterpart(_kl_rs),
        },
        note="verl's sequence masks drop tokens from the denominators, which geo_mask and veto keep "
        "(for verl's Geo-RS: kl_rs with estimator=k1, level=seq_mean)",
    ),
    advantages=Counterparts(
        "verl's algorithm.adv_estimator",
        {
            "group": Counterpart({"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": True}),
            "group_mean": Counterpart({"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False}),
            "rloo": Counterpart({"algorithm.adv_estimator": "rloo", "algorithm.norm_adv_by_std_in_grpo": False}),
        },
    ),
)
