"""What engine trl (clipbench.engines.trl) and ClipbenchGRPOTrainer (clipbench.integrations.trl) share,
no trl import: what TRL's loss call feeds clipbench's loss (`FEEDS`, integrations/feeds.py).

ClipbenchGRPOTrainer refuses a rule or an aggregation by it; the engine's preflight refuses every
component of a run config by it (clipbench.engines.keys); `grpo_args` sets the GRPOConfig fields of
the sampler correction and the advantage from it.
"""

from __future__ import annotations

from clipbench.integrations.feeds import Counterpart, Counterparts, Feeds


def _importance_sampling(mode: str, low: float, high: float) -> dict:
    """GRPOConfig's vllm_importance_sampling_* fields (TRL's clip_min None: no floor)."""
    return {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": mode,
        "vllm_importance_sampling_clip_min": low if low > 0 else None,
        "vllm_importance_sampling_clip_max": high,
    }


FEEDS = Feeds(
    "TRL's loss call",
    # the entropy of TRL's own forward; TRL's loss inputs carry no per-sequence reward and no sampler
    # log-probs, and its shuffled generation batch no prompt groups
    passes=("entropy",),
    corrections=Counterparts(
        "TRL 1.16's vllm_importance_sampling_mode",
        {
            "none": Counterpart({"vllm_importance_sampling_correction": False}),
            "tis": Counterpart(lambda c: _importance_sampling(f"{c['level']}_truncate", c["floor"], c["cap"])),
            "icepop": Counterpart(
                lambda c: _importance_sampling(f"{c['level']}_mask", c["low"], c["high"]),
                only="weight=rho",
                when=lambda c: c["weight"] == "rho",
            ),
        },
        note="TRL corrects with truncated or masked importance sampling only",
    ),
    advantages=Counterparts(
        "TRL's scale_rewards",
        {"group": Counterpart({"scale_rewards": "group"}), "group_mean": Counterpart({"scale_rewards": "none"})},
    ),
)
