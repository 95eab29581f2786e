"""Apply a correction to one rollout batch: its weights, what it did to each token, and its sums.

    out = apply_correction({"name": "icepop"}, sampler_logp, trainer_logp, mask, counted=mine)
    policy_loss(..., weights=out.weights[rows], correction_status=out.status[rows])
    metrics = correction_stats(reduced_sums)    # after micro-batches and ranks combined (objectives.combine)

The sums are additive counts and sums, or extrema (keys ending in /max, /min), so that ranks
combine exactly by the objectives' rule (`clipbench.objectives.reduction`); nothing syncs the host.
Every key starts with `mismatch/` (the rule's own per-cell counts are `correction/<cell>/...`).
They always hold the mismatch (|d| and the raw token ratio rho before any truncation: trl#5231) and,
with a correction, what it did: the mean weight, the tokens it truncated, masked, rejected (out of
the denominators), the sequences it touched, and the raw per-unit statistic it thresholds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from clipbench.objectives.corrections.builtin import SAFETY
from clipbench.objectives.corrections.registry import (
    MASKED,
    NONE,
    REJECTED,
    TRUNCATED,
    correction_params,
    get_correction,
    validate_correction,
)
from clipbench.objectives.primitives import masked_extreme


@dataclass
class Corrected:
    weights: torch.Tensor | None  # (B, T) detached float32, 0 at padding; None without a correction
    status: torch.Tensor | None  # (B, T) int8 codes (registry.KEPT ... REJECTED); None without a correction
    sums: dict[str, torch.Tensor]  # 0-d float64 tensors (keys ending /max, /min by extremum, others add)


def mismatch_sums(d: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """|d| and the raw token ratio rho = exp(d) (d clamped to +-20) over the counted valid tokens."""
    a, rho = d.abs().to(torch.float64), torch.exp(d.clamp(-SAFETY, SAFETY)).to(torch.float64)
    return {
        "mismatch/abs_sum": torch.where(count, a, 0.0).sum(),
        "mismatch/tokens": count.sum().to(torch.float64),
        "mismatch/abs/max": torch.where(count, a, 0.0).amax() if a.numel() else a.new_zeros(()),
        "mismatch/rho_sum": torch.where(count, rho, 0.0).sum(),
        "mismatch/rho/max": masked_extreme(rho, count, "max"),
        "mismatch/rho/min": masked_extreme(rho, count, "min"),
    }


def _correction_sums(w, status, raw, valid, count) -> dict[str, torch.Tensor]:
    f64 = torch.float64
    rows = count.any(-1, keepdim=True)  # (B, 1) counted sequences with a valid token
    units = count if raw.shape == count.shape else rows  # the raw statistic's unit: token or sequence
    touched = (status >= MASKED) & count
    raw_v = raw.to(f64).expand_as(units)
    return {
        "mismatch/correction_tokens": count.sum().to(f64),
        "mismatch/weight_sum": torch.where(count, w, 0.0).to(f64).sum(),
        "mismatch/truncated": ((status == TRUNCATED) & count).sum().to(f64),
        "mismatch/masked": touched.sum().to(f64),
        "mismatch/rejected": ((status == REJECTED) & count).sum().to(f64),
        "mismatch/seqs": rows.sum().to(f64),
        "mismatch/seq_masked": (touched.any(-1) & rows[:, 0]).sum().to(f64),
        "mismatch/units": units.sum().to(f64),
        "mismatch/raw_sum": torch.where(units, raw_v, 0.0).sum(),
        "mismatch/raw/max": masked_extreme(raw_v, units, "max"),
        "mismatch/raw/min": masked_extreme(raw_v, units, "min"),
    }


def apply_correction(
    setting: Mapping[str, Any] | str | None,
    sampler_logp: torch.Tensor,
    trainer_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    counted: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
) -> Corrected:
    """The correction `setting` ({name, params...}, validated here) of one batch.

    sampler_logp, trainer_logp: (B, T) log-probs of the sampled tokens under the sampler and under
    the trainer's rollout policy; mask: (B, T) 1 on completion tokens; counted: bool, broadcastable
    to (B, T): the tokens the sums count (default all: a rank counts its own rows, so that the sums of
    all ranks cover the batch once; the weights are every row's); advantages: (B,) the sequences'
    advantages, for a correction that reads them (vaco)."""
    if not sampler_logp.shape == trainer_logp.shape == mask.shape:
        raise ValueError(
            f"sampler_logp {tuple(sampler_logp.shape)}, trainer_logp {tuple(trainer_logp.shape)} "
            f"and mask {tuple(mask.shape)} must have the same (B, T) shape"
        )
    name, params = correction_params(validate_correction(setting))
    valid = mask > 0
    count = valid if counted is None else valid & counted
    d = torch.where(valid, trainer_logp.detach().float() - sampler_logp.detach().float(), 0.0)  # (B, T)
    sums = mismatch_sums(d, count)
    if name == NONE:
        return Corrected(None, None, sums)
    spec = get_correction(name)
    if "A" in spec.inputs and advantages is None:
        raise ValueError(f"correction '{name}' reads the advantages: pass advantages=(B,)")
    A = None if advantages is None else advantages.detach().float().reshape(-1, 1)  # (B, 1)
    out = spec.call("correction", *[{"d": d, "mask": valid, "A": A}[i] for i in spec.inputs], **params)
    w = torch.where(valid, out.weights.detach().float().expand_as(d), 0.0)
    status = torch.where(valid, out.status.expand_as(d), 0).to(torch.int8)
    sums.update(_correction_sums(w, status, out.raw.detach(), valid, count))
    return Corrected(w, status, sums)


def correction_stats(sums: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Logged metrics from (combined) sums: mismatch/abs_mean, abs_max, rho_mean, rho_min, rho_max,
    and with a correction correction/weight_mean, truncated_frac, masked_frac, rejected_frac,
    seq_masked_frac, raw_mean, raw_min, raw_max (an empty batch reads 1 for ratios, 0 for shares)."""
    f = {k: float(v) for k, v in sums.items()}
    n = f["mismatch/tokens"]
    out = {
        "mismatch/abs_mean": f["mismatch/abs_sum"] / max(n, 1.0),
        "mismatch/abs_max": f["mismatch/abs/max"],
        "mismatch/rho_mean": f["mismatch/rho_sum"] / n if n else 1.0,
        "mismatch/rho_min": f["mismatch/rho/min"] if n else 1.0,
        "mismatch/rho_max": f["mismatch/rho/max"] if n else 1.0,
    }
    if "mismatch/correction_tokens" in f:
        t, s, u = max(f["mismatch/correction_tokens"], 1.0), max(f["mismatch/seqs"], 1.0), f["mismatch/units"]
        out.update(
            {
                "correction/weight_mean": f["mismatch/weight_sum"] / t,
                "correction/truncated_frac": f["mismatch/truncated"] / t,
                "correction/masked_frac": f["mismatch/masked"] / t,
                "correction/rejected_frac": f["mismatch/rejected"] / t,
                "correction/seq_masked_frac": f["mismatch/seq_masked"] / s,
                "correction/raw_mean": f["mismatch/raw_sum"] / u if u else 1.0,
                "correction/raw_min": f["mismatch/raw/min"] if u else 1.0,
                "correction/raw_max": f["mismatch/raw/max"] if u else 1.0,
            }
        )
    return out


def is_batch_metric(key: str) -> bool:
    """A logged metric of the rollout batch's correction (`mismatch/*`, `correction/<name>`), as
    opposed to an optimizer step's per-cell counts (`correction/<cell>/<count>`)."""
    return key.startswith("mismatch/") or (key.startswith("correction/") and key.count("/") == 1)
