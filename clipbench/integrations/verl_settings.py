"""What a verl launch and clipbench's registered verl losses share: names of settings, no verl import.

The launcher (clipbench.engines.verl) writes these; the losses registered in verl's registry
(clipbench.integrations.verl) read them, inside verl's Ray workers.
"""

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
