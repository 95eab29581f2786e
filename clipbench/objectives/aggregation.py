"""Loss aggregation: (B, T) per-token loss -> scalar. Orthogonal to the clip rule.

The normaliser is a count over the whole mini-batch: valid tokens for ``token-mean``; sequences with
at least one valid token for the seq-means; ``max_len`` x sequences for ``seq-mean-token-sum-norm``.
A caller that splits a mini-batch into micro-batches (or ranks) passes the mini-batch's counts as
``global_tokens`` / ``global_seqs`` (:func:`global_counts` of the whole mini-batch's mask), so that
the micro-batch losses sum to exactly the mini-batch loss and gradient (no second division by the
number of micro-batches: verl#5625, trl#5619). ``None`` uses this call's own counts. Per-sequence
token means always use each sequence's own count (a sequence is never split).

An all-padding row neither adds a term nor counts as a sequence, so it can never produce 0/0.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from clipbench.errors import unknown_choice

Count = Union[int, float, torch.Tensor, None]  # a number or a 0-d tensor (no host sync)
# Signature of every aggregation: (token_loss (B, T) masked, maskf (B, T) 0/1, max_len, tokens, seqs) -> 0-d.
Aggregation = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]


def global_counts(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"global_tokens": valid tokens, "global_seqs": sequences with >= 1 valid token}`` of a
    (B, T) mask, as float 0-d tensors: compute them on the whole mini-batch (all-reduce them across
    ranks) and pass them to every micro-batch's ``policy_loss(..., **counts)``."""
    valid = mask != 0
    return {"global_tokens": valid.sum().to(torch.float32),
            "global_seqs": valid.any(-1).sum().to(torch.float32)}


def token_mean(token_loss, maskf, max_len, tokens, seqs):
    """sum of all valid tokens' losses / number of valid tokens in the mini-batch (DAPO)."""
    return token_loss.sum() / tokens


def seq_mean_token_mean(token_loss, maskf, max_len, tokens, seqs):
    """mean over sequences of each sequence's token mean (GRPO; ABC-GRPO eq. 6)."""
    per_seq = token_loss.sum(-1) / maskf.sum(-1).clamp(min=1.0)  # (B,)
    return per_seq.sum() / seqs


def seq_mean_token_sum(token_loss, maskf, max_len, tokens, seqs):
    """mean over sequences of each sequence's token sum."""
    return token_loss.sum() / seqs


def seq_mean_token_sum_norm(token_loss, maskf, max_len, tokens, seqs):
    """token sum / max_len (a fixed length, default T), mean over sequences (Dr. GRPO)."""
    return token_loss.sum() / (max_len * seqs)


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


def check_count(name: str, value: Count) -> None:
    """A global count is None, a number >= 0 or a 0-d tensor (not inspected: no host sync)."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a number or a 0-d tensor, got shape {tuple(value.shape)}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0 or a 0-d tensor, got {value!r}")


def _normaliser(given: Count, own: torch.Tensor) -> torch.Tensor:
    """The count to divide by (at least 1): the caller's global count, else this call's own."""
    if given is None:
        return own.clamp(min=1.0)
    if isinstance(given, torch.Tensor):
        return given.to(device=own.device, dtype=torch.float32).clamp(min=1.0)
    return own.new_tensor(max(float(given), 1.0))


def aggregate(token_loss: torch.Tensor, maskf: torch.Tensor, agg: str = "token-mean", max_len: int | None = None,
              *, global_tokens: Count = None, global_seqs: Count = None) -> torch.Tensor:
    """Scalar loss from a masked (B, T) per-token loss. ``max_len`` (default T) is used only by
    ``seq-mean-token-sum-norm``; ``global_tokens`` / ``global_seqs``: see the module docstring."""
    fn = get_aggregation(agg)
    if max_len is None:
        max_len = token_loss.shape[-1]
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    check_count("global_tokens", global_tokens)
    check_count("global_seqs", global_seqs)
    own = global_counts(maskf)
    tokens = _normaliser(global_tokens, own["global_tokens"])
    seqs = _normaliser(global_seqs, own["global_seqs"])
    return fn(token_loss, maskf, max_len, tokens, seqs)
