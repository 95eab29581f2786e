"""Loss aggregation: (B, T) per-token loss -> scalar. Orthogonal to the clip rule.

The normaliser is a count over the whole mini-batch: valid tokens for ``token-mean``; sequences with
at least one valid token for the seq-means; ``max_len`` x sequences for ``seq-mean-token-sum-norm``;
prompt groups and each group's tokens for ``prompt-mean``; none for ``token-sum``. A caller that
splits a mini-batch into micro-batches (or ranks) passes the mini-batch's counts as
``global_tokens`` / ``global_seqs`` (:func:`global_counts` of the whole mini-batch's mask) and, for
``prompt-mean``, ``global_prompts`` / ``group_tokens`` (:func:`group_counts`), so that the
micro-batch losses sum to exactly the mini-batch loss and gradient (no second division by the
number of micro-batches: verl#5625, trl#5619). ``None`` uses this call's own counts. Per-sequence
token means always use each sequence's own count (a sequence is never split).

An all-padding row neither adds a term nor counts as a sequence, so it can never produce 0/0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from clipbench.registry import Registry

Count = int | float | torch.Tensor | None  # a number or a 0-d tensor (no host sync)


@dataclass(frozen=True)
class Norm:
    """The normalisers of one call (0-d float tensors, at least 1; group_tokens (B,) or None)."""

    tokens: torch.Tensor
    seqs: torch.Tensor
    max_len: int
    prompts: torch.Tensor | None = None
    group_tokens: torch.Tensor | None = None  # (B,) each row's prompt group's valid tokens in the mini-batch


# Signature of every aggregation: (token_loss (B, T) masked, maskf (B, T) 0/1, norm) -> 0-d.
Aggregation = Callable[[torch.Tensor, torch.Tensor, Norm], torch.Tensor]


def global_counts(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"global_tokens": valid tokens, "global_seqs": sequences with >= 1 valid token}`` of a
    (B, T) mask, as float 0-d tensors: compute them on the whole mini-batch (all-reduce them across
    ranks) and pass them to every micro-batch's ``policy_loss(..., **counts)``."""
    valid = mask != 0
    return {"global_tokens": valid.sum().to(torch.float32), "global_seqs": valid.any(-1).sum().to(torch.float32)}


def group_counts(mask: torch.Tensor, groups: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"global_prompts": distinct prompt groups among the rows, "group_tokens": (B,) the valid
    tokens of each row's group over these rows}`` for ``prompt-mean``: compute them on the whole
    mini-batch and pass each micro-batch its rows' ``group_tokens``. Every group with a row counts,
    also one whose rows have no valid token or whose advantages are all 0 (SkyRL's P)."""
    ids, inverse = torch.unique(groups.reshape(-1), return_inverse=True)
    per_group = torch.zeros(len(ids), device=mask.device).index_add_(
        0, inverse.to(mask.device), (mask != 0).sum(-1).to(torch.float32)
    )
    return {"global_prompts": torch.tensor(float(len(ids)), device=mask.device), "group_tokens": per_group[inverse]}


def token_mean(token_loss, maskf, n: Norm):
    """sum of all valid tokens' losses / number of valid tokens in the mini-batch (DAPO).

    The default (`train.agg`).
    """
    return token_loss.sum() / n.tokens


def token_sum(token_loss, maskf, n: Norm):
    """sum of all valid tokens' losses, no normaliser (verl `token-sum`, verl#7197).

    The gradient grows with the mini-batch's tokens, so the learning rate must be tuned for it.
    """
    return token_loss.sum()


def seq_mean_token_mean(token_loss, maskf, n: Norm):
    """mean over sequences of each sequence's token mean (the original GRPO; ABC-GRPO eq. 6)."""
    per_seq = token_loss.sum(-1) / maskf.sum(-1).clamp(min=1.0)  # (B,)
    return per_seq.sum() / n.seqs


def seq_mean_token_sum(token_loss, maskf, n: Norm):
    """mean over sequences of each sequence's token sum."""
    return token_loss.sum() / n.seqs


def seq_mean_token_sum_norm(token_loss, maskf, n: Norm):
    """token sum / max_len (a fixed length, default T), mean over sequences (Dr. GRPO)."""
    return token_loss.sum() / (n.max_len * n.seqs)


def prompt_mean(token_loss, maskf, n: Norm):
    """mean over the mini-batch's prompt groups of each group's pooled token mean, every group
    weighing the same (SkyRL `prompt_mean`).

    SkyRL pre-scales each group's advantages by 1 / (P x its tokens): the same loss for every rule
    linear in A at a fixed sign (tested). P counts every group with a row in the mini-batch, also
    one without valid tokens or with all-equal rewards (SkyRL's). clipbench's mini-batches are
    strided row slices of the rollout batch, so a group's rows may lie in several mini-batches;
    each mini-batch pools the rows it has (SkyRL's mini-batches are whole prompts).
    """
    return (token_loss.sum(-1) / (n.prompts * n.group_tokens.clamp(min=1.0))).sum()


# `train.agg`: each aggregation with `needs_groups` (it reads each row's prompt group).
AGGREGATIONS: Registry[Aggregation] = Registry("aggregation", error=ValueError)
AGGREGATIONS.register("token-mean", token_mean, needs_groups=False)
AGGREGATIONS.register("token-sum", token_sum, needs_groups=False)
AGGREGATIONS.register("seq-mean-token-mean", seq_mean_token_mean, needs_groups=False)
AGGREGATIONS.register("seq-mean-token-sum", seq_mean_token_sum, needs_groups=False)
AGGREGATIONS.register("seq-mean-token-sum-norm", seq_mean_token_sum_norm, needs_groups=False)
AGGREGATIONS.register("prompt-mean", prompt_mean, needs_groups=True)


def needs_groups(name: str) -> bool:
    """Whether aggregation `name` reads each row's prompt group (its `needs_groups`), read from the
    registry at each call: an aggregation registered after import (a plugin's) counts too."""
    return bool(AGGREGATIONS.entry(name).meta.get("needs_groups"))


def get_aggregation(name: str) -> Aggregation:
    return AGGREGATIONS.lookup(name)


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


def _group_norm(maskf: torch.Tensor, groups, group_tokens, global_prompts) -> tuple:
    """(prompts, group_tokens (B,)) for prompt-mean: the caller's mini-batch counts, else this call's."""
    if group_tokens is None:
        if groups is None:
            raise ValueError(
                "aggregation 'prompt-mean' needs each row's prompt group: pass groups=(B,) "
                "(and, for one micro-batch of a mini-batch, global_prompts and group_tokens)"
            )
        own = group_counts(maskf, groups)
        group_tokens = own["group_tokens"]
        global_prompts = own["global_prompts"] if global_prompts is None else global_prompts
    elif global_prompts is None:
        raise ValueError("group_tokens= needs global_prompts= (the mini-batch's prompt groups)")
    if tuple(group_tokens.shape) != (maskf.shape[0],):
        raise ValueError(f"group_tokens must be (B,) = ({maskf.shape[0]},), got {tuple(group_tokens.shape)}")
    prompts = _normaliser(global_prompts, maskf.new_zeros(()))
    return prompts, group_tokens.to(device=maskf.device, dtype=torch.float32)


def aggregate(
    token_loss: torch.Tensor,
    maskf: torch.Tensor,
    agg: str = "token-mean",
    max_len: int | None = None,
    *,
    global_tokens: Count = None,
    global_seqs: Count = None,
    groups: torch.Tensor | None = None,
    global_prompts: Count = None,
    group_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar loss from a masked (B, T) per-token loss. ``max_len`` (default T) is used only by
    ``seq-mean-token-sum-norm``; the counts: see the module docstring (``groups`` (B,) prompt ids,
    ``global_prompts``, ``group_tokens`` (B,): ``prompt-mean`` only)."""
    fn = get_aggregation(agg)
    if max_len is None:
        max_len = token_loss.shape[-1]
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    for name, value in (
        ("global_tokens", global_tokens),
        ("global_seqs", global_seqs),
        ("global_prompts", global_prompts),
    ):
        check_count(name, value)
    own = global_counts(maskf)
    prompts = per_group = None
    if needs_groups(agg):
        prompts, per_group = _group_norm(maskf, groups, group_tokens, global_prompts)
    norm = Norm(
        _normaliser(global_tokens, own["global_tokens"]),
        _normaliser(global_seqs, own["global_seqs"]),
        max_len,
        prompts,
        per_group,
    )
    return fn(token_loss, maskf, norm)
