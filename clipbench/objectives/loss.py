"""policy_loss: rule -> per-token loss (+ optional KL) -> aggregation, plus diagnostics."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clipbench.objectives.aggregation import aggregate, get_aggregation
from clipbench.objectives.context import RatioContext
from clipbench.objectives.diagnostics import step_stats
from clipbench.objectives.registry import LOG_RATIO_CLAMP, get_method, validate_params


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # 0-d, differentiable w.r.t. logp
    token_loss: torch.Tensor  # (B, T) per-token loss before aggregation, 0 at padding
    stats: dict  # str -> detached 0-d tensor


def _check_shapes(logp, old_logp, advantages, mask) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    if advantages.shape not in ((logp.shape[0],), (logp.shape[0], 1)):
        raise ValueError(f"advantages must be (B,) = ({logp.shape[0]},) (one per sequence), "
                         f"got {tuple(advantages.shape)}")


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """(B, T) k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, with ref - logp value-clamped to +-20."""
    d = ref_logp.detach().to(torch.float32) - logp
    d = d - (d.detach() - d.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # straight-through clamp
    return torch.exp(d) - d - 1.0


def policy_loss(method: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, agg: str = "token-mean", generator: torch.Generator | None = None,
                ref_logp: torch.Tensor | None = None, beta: float = 0.0, max_len: int | None = None,
                **params) -> PolicyLossOutput:
    """The clipped policy loss of ``method`` (see ../shared/docs/objectives.md).

    logp, old_logp, mask: (B, T) (mask 1 on real completion tokens, 0 on padding; padding values
    of logp/old_logp may be anything finite); advantages: (B,).
    ``params`` are the method's parameters (defaults from ``METHODS[method].defaults``);
    ``generator`` feeds nsr's draws; ``beta * k3(ref_logp)`` is added per token when beta > 0;
    ``max_len`` (default T) is the fixed length of ``seq-mean-token-sum-norm``.
    Computation is in float32 whatever the input dtype.
    """
    spec = get_method(method)
    p = validate_params(method, params)
    get_aggregation(agg)
    _check_shapes(logp, old_logp, advantages, mask)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs, (B, T))")
    if ref_logp is not None and ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp must have logp's shape {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")

    ctx = RatioContext(logp, old_logp, advantages, mask, generator)
    out = spec.fn(ctx, **p)
    token_loss = out.surrogate * ctx.weight  # l = -A * surrogate, 0 at padding; (B, T)
    kl = None
    if beta > 0:
        kl = kl_k3(ctx.logp, ref_logp.detach().to(torch.float32) * ctx.maskf) * ctx.maskf  # 0 at padding
        token_loss = token_loss + beta * kl
    loss = aggregate(token_loss, ctx.maskf, agg, max_len)

    with torch.no_grad():
        stats = step_stats(ctx, out, spec.band(p), spec.ratio_level(p))
        if kl is not None:
            stats["kl_ref"] = kl.detach().sum() / ctx.maskf.sum().clamp(min=1.0)
    return PolicyLossOutput(loss, token_loss, stats)
