"""Loss aggregation: (B, T) per-token loss -> scalar. Orthogonal to the clip rule.

"Mean over sequences" averages over the sequences that have at least one valid token (an
all-padding row of a padded micro-batch neither adds a term nor counts in the denominator), so an
all-padding row can never produce 0/0.
"""

from __future__ import annotations

from typing import Callable

import torch

from clipbench.errors import unknown_choice

# Signature of every aggregation: (token_loss (B, T) masked, maskf (B, T) 0/1, max_len) -> 0-d.
Aggregation = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def _n_seqs(maskf: torch.Tensor) -> torch.Tensor:
    return (maskf.sum(-1) > 0).sum().clamp(min=1)


def token_mean(token_loss: torch.Tensor, maskf: torch.Tensor, max_len: int) -> torch.Tensor:
    """sum of all valid tokens' losses / number of valid tokens in the batch (DAPO)."""
    return token_loss.sum() / maskf.sum().clamp(min=1.0)


def seq_mean_token_mean(token_loss: torch.Tensor, maskf: torch.Tensor, max_len: int) -> torch.Tensor:
    """mean over sequences of each sequence's token mean (GRPO; ABC-GRPO eq. 6)."""
    per_seq = token_loss.sum(-1) / maskf.sum(-1).clamp(min=1.0)  # (B,)
    return per_seq.sum() / _n_seqs(maskf)


def seq_mean_token_sum(token_loss: torch.Tensor, maskf: torch.Tensor, max_len: int) -> torch.Tensor:
    """mean over sequences of each sequence's token sum."""
    return token_loss.sum() / _n_seqs(maskf)


def seq_mean_token_sum_norm(token_loss: torch.Tensor, maskf: torch.Tensor, max_len: int) -> torch.Tensor:
    """token sum / max_len (a fixed length, default T), mean over sequences (Dr. GRPO)."""
    return token_loss.sum() / (max_len * _n_seqs(maskf))


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def get_aggregation(name: str) -> Aggregation:
    try:
        return AGGREGATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(unknown_choice("aggregation", name, AGGREGATIONS)) from None


def aggregate(token_loss: torch.Tensor, maskf: torch.Tensor, agg: str = "token-mean",
              max_len: int | None = None) -> torch.Tensor:
    """Scalar loss from a masked (B, T) per-token loss. ``max_len`` (default T) is used only by
    ``seq-mean-token-sum-norm``."""
    fn = get_aggregation(agg)
    if max_len is None:
        max_len = token_loss.shape[-1]
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    return fn(token_loss, maskf, max_len)
