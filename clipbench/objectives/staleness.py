"""How stale a rollout batch is: the policy about to be updated against the behaviour policy that
sampled the batch (a lagged sampler, `sampler.lag`; or a sampler with numerics of its own, vLLM).

Per valid completion token, w = pi_current(y_t) / pi_behaviour(y_t) = exp(logp - behaviour_logp), with
logp the current policy's log-probs before the update and behaviour_logp the sampler's; per sequence
b, W_b = prod_t w_t. Logged once per rollout step, on each of its rows (`offpolicy/*`):

    offpolicy/kl            mean_t (w - 1 - log w): the k3 estimate of KL(behaviour || current), >= 0
    offpolicy/ess           (sum_t w)^2 / (N sum_t w^2): the token importance weights' effective
                            sample size as a share of the N tokens (1: on-policy; -> 1/N: one token
                            carries the batch)
    offpolicy/ess_seq       the same over the sequences' weights W_b
    offpolicy/out_of_band   the share of the tokens whose w lies outside GRPO's band [1 - 0.2, 1 + 0.2]
                            (`BAND`): what a PPO clip at its defaults would see if its ratio were taken
                            against the behaviour policy
    offpolicy/{q1..q4}      the same share, split by the clip's quadrants (objectives.diagnostics
                            CELLS: q1 A>0 w>1, q2 A>0 w<1, q3 A<0 w<1, q4 A<0 w>1), and
    offpolicy/zero_adv      the share of A == 0 tokens out of the band (GRPO's all-equal groups): the
                            five sum to out_of_band

The sums combine exactly over micro-batches and ranks (objectives.diagnostics.reduce_sums: every key
here is a sum). A sequence's log-weight is clamped to +-300 before exp (float64 holds exp(600)).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from clipbench.objectives.diagnostics import CELLS, cell_sums

PREFIX = "offpolicy/"
TOKENS = PREFIX + "tokens"  # the key a rollout batch's staleness sums always hold
BAND = (0.8, 1.2)  # GRPO's default band, the same for both signs of A
SHARES = CELLS[:5]  # q1..q4 and zero_adv (an on_policy token, w == 1 exactly, is never out of the band)
LOG_W_CLAMP = 300.0


def staleness_sums(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, rows: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Combinable float64 sums of one rank's share of a rollout batch. logp, behaviour_logp, mask:
    (B, T); advantages: (B,); rows: (B,) bool, the rows this rank counts (each row counted by one rank)."""
    valid = (mask > 0) & rows[:, None]
    log_w = torch.where(valid, logp.to(torch.float64) - behaviour_logp.to(torch.float64), 0.0)
    w = log_w.exp()
    seqs = valid.any(-1)
    seq_w = log_w.sum(-1).clamp(-LOG_W_CLAMP, LOG_W_CLAMP).exp()
    zeros = torch.zeros_like(w)
    lo, hi = BAND
    cells = cell_sums(
        x=w, A=advantages.reshape(-1, 1), valid=valid, loss=zeros, grad=zeros, band=(lo, hi, lo, hi), params={}
    )  # (cells, features): features[1] is out_of_band
    out = {
        TOKENS: valid.sum().to(torch.float64),
        PREFIX + "w_sum": torch.where(valid, w, 0.0).sum(),
        PREFIX + "w_sq_sum": torch.where(valid, w * w, 0.0).sum(),
        PREFIX + "k3_sum": torch.where(valid, w - 1 - log_w, 0.0).sum(),
        PREFIX + "seqs": seqs.sum().to(torch.float64),
        PREFIX + "seq_w_sum": torch.where(seqs, seq_w, 0.0).sum(),
        PREFIX + "seq_w_sq_sum": torch.where(seqs, seq_w * seq_w, 0.0).sum(),
    }
    for i, cell in enumerate(SHARES):
        out[PREFIX + f"{cell}/out_of_band"] = cells[i, 1]
    return out


def staleness_stats(sums: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """The logged `offpolicy/*` values from (combined) sums; an empty batch reads as on-policy."""
    f = {k: float(v) for k, v in sums.items() if k.startswith(PREFIX)}
    n, s = f[TOKENS], f[PREFIX + "seqs"]
    out = {
        PREFIX + "kl": f[PREFIX + "k3_sum"] / n if n else 0.0,
        PREFIX + "ess": f[PREFIX + "w_sum"] ** 2 / (n * f[PREFIX + "w_sq_sum"]) if n else 1.0,
        PREFIX + "ess_seq": f[PREFIX + "seq_w_sum"] ** 2 / (s * f[PREFIX + "seq_w_sq_sum"]) if s else 1.0,
    }
    shares = {PREFIX + c: f[PREFIX + f"{c}/out_of_band"] / n if n else 0.0 for c in SHARES}
    return {**out, PREFIX + "out_of_band": sum(shares.values()), **shares}


def is_staleness_sum(key: str) -> bool:
    """A key of `staleness_sums` (a rollout batch's, as opposed to an optimizer step's)."""
    return key.startswith(PREFIX)
