"""policy_loss: inputs -> rule -> per-token loss (+ weights, KL) -> aggregation, plus diagnostics.

Design choices:
* The rule is called with the inputs it names (registry.INPUTS), built here once: padding is
  neutralised up front (log-ratio 0, so r == 1 and s ignores padding; logp/old_logp 0), so padding
  values of logp/old_logp may be anything finite and a rule never needs the mask.
* The ratio's log is value-clamped to [-20, 20] with a straight-through gradient: r = exp(clamp(lr))
  and dr/dlr = r everywhere, so r <= e^20 stays finite and every rule keeps the gradient its formula
  prescribes. GSPO's s is clamped the same way.
* Random draws come from ``uniforms`` (pre-drawn per rollout row and position by the trainer, so
  they never depend on how a mini-batch is split) or else ``torch.rand`` from ``generator``.
* Diagnostics need the per-token gradient g = d(sum l)/d logp of the rule's loss: one
  ``torch.autograd.grad`` on the small rule graph (it stops at logp: the model is never
  backpropagated here); the graph is kept for the caller's ``loss.backward()``.
* Nothing syncs with the host: stats and sums are 0-d tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from clipbench.objectives.aggregation import Count, aggregate, check_count, get_aggregation
from clipbench.objectives.diagnostics import finalize, step_sums
from clipbench.errors import RuleError
from clipbench.objectives.primitives import kl_k3, straight_through_exp
from clipbench.objectives.registry import MethodSpec, get_method, validate_params


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # 0-d, differentiable w.r.t. logp
    token_loss: torch.Tensor  # (B, T) per-token loss before aggregation (weights and KL included), 0 at padding
    stats: dict  # str -> detached 0-d tensor: finalize(sums)
    sums: dict  # str -> detached 0-d float64 tensor, combinable over micro-batches and ranks (diagnostics.py)


def _check_inputs(logp, old_logp, advantages, mask, ref_logp, weights, uniforms, generator, beta) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("weights", weights),
                    ("uniforms", uniforms)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have logp's shape {shape}, got {tuple(t.shape)}")
    if advantages.shape not in ((shape[0],), (shape[0], 1)):
        raise ValueError(f"advantages must be (B,) = ({shape[0]},) (one per sequence), "
                         f"got {tuple(advantages.shape)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs, (B, T))")


class _Inputs:
    """The named inputs of the rules (registry.INPUTS); r and s are built on first use."""

    def __init__(self, logp, old_logp, advantages, maskf, u, generator):
        self.mask = maskf  # (B, T) float 0/1
        self.A = advantages.detach().to(torch.float32).reshape(-1, 1)  # (B, 1)
        self.logp = logp * maskf  # (B, T) with grad, 0 at padding
        self.old_logp = old_logp.detach().to(torch.float32) * maskf  # (B, T), 0 at padding
        self.log_ratio = self.logp - self.old_logp  # (B, T) with grad, 0 at padding
        self.u = u  # (B, T) or None
        self.generator = generator

    @cached_property
    def r(self) -> torch.Tensor:  # (B, T) with grad, 1 at padding
        return straight_through_exp(self.log_ratio)

    @cached_property
    def s(self) -> torch.Tensor:  # (B, 1) with grad, 1 for an all-padding row
        n_tok = self.mask.sum(-1, keepdim=True).clamp(min=1.0)
        return straight_through_exp(self.log_ratio.sum(-1, keepdim=True) / n_tok)


def _uniforms(spec: MethodSpec, p: dict, shape, device, uniforms, generator) -> torch.Tensor | None:
    """The rule's ``u``: the caller's uniforms, else torch.rand from the generator; zeros when this
    parameter setting needs no draws (the generator is then not advanced)."""
    if "u" not in spec.inputs:
        return None
    if not spec.needs_draws(p):
        return torch.zeros(shape, device=device)
    if uniforms is not None:
        return uniforms.detach().to(device=device, dtype=torch.float32)
    if generator is None:
        raise ValueError(f"{spec.name} with these parameters draws random numbers: pass uniforms=(B, T) in [0, 1) "
                         "or generator=torch.Generator().manual_seed(...)")
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def _call_rule(spec: MethodSpec, inputs: _Inputs, p: dict) -> torch.Tensor:
    """The rule's loss broadcast to (B, T), float32; a wrong return is a one-line RuleError."""
    out = spec.fn(*[getattr(inputs, name) for name in spec.inputs], **p)
    B, T = inputs.mask.shape
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or tuple(out.shape) not in ((B, T), (B, 1)):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise RuleError(f"rule '{spec.name}' ({spec.where}) returned {got}: a rule returns the per-token loss "
                        f"(B, T) = ({B}, {T}) or a per-sequence loss (B, 1) as a float tensor")
    return out.to(torch.float32).expand(B, T)


def policy_loss(method: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, agg: str = "token-mean", generator: torch.Generator | None = None,
                uniforms: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                max_len: int | None = None, global_tokens: Count = None, global_seqs: Count = None,
                weights: torch.Tensor | None = None, **params) -> PolicyLossOutput:
    """The clipped policy loss of ``method`` (docs/objectives.md) and its diagnostics.

    logp, old_logp, mask: (B, T) (mask 1 on real completion tokens, 0 on padding; padding values of
    logp/old_logp may be anything finite); advantages: (B,).
    ``params``: the method's parameters (defaults from ``METHODS[method].defaults``).
    ``uniforms`` (B, T) in [0, 1): the draws of stochastic rules (nsr); without them, drawn from
    ``generator``. ``weights`` (B, T): a detached per-token multiplier of the policy term (e.g.
    truncated importance sampling). ``beta * k3(ref_logp)`` is added per token when beta > 0.
    ``max_len`` (default T): the fixed length of ``seq-mean-token-sum-norm``. ``global_tokens`` /
    ``global_seqs``: the whole mini-batch's counts when this call is one micro-batch of it
    (aggregation.py). Computation is in float32 whatever the input dtype.
    """
    spec = get_method(method)
    p = validate_params(method, params)
    get_aggregation(agg)
    _check_inputs(logp, old_logp, advantages, mask, ref_logp, weights, uniforms, generator, beta)
    check_count("global_tokens", global_tokens)
    check_count("global_seqs", global_seqs)

    # Differentiate w.r.t. the caller's logp when it has a graph; else through a detached leaf copy
    # (and return detached outputs).
    track = torch.is_grad_enabled() and logp.requires_grad
    lp = logp.to(torch.float32) if track else logp.detach().to(torch.float32).requires_grad_(True)
    maskf = mask if mask.dtype == torch.float32 else (mask != 0).to(torch.float32)
    valid = maskf != 0
    with torch.enable_grad():
        u = _uniforms(spec, p, lp.shape, lp.device, uniforms, generator)
        inputs = _Inputs(lp, old_logp, advantages, maskf, u, generator)
        rule_loss = _call_rule(spec, inputs, p)  # (B, T)
        l = rule_loss * maskf  # 0 at padding
        grad = None
        if l.requires_grad:  # the rule's per-token gradient, on the rule graph only
            (grad,) = torch.autograd.grad(l.sum(), lp, retain_graph=True, allow_unused=True)
        grad = torch.zeros_like(lp) if grad is None else grad.detach()

        token_loss = l if weights is None else l * weights.detach().to(torch.float32)
        kl = None
        if beta > 0:
            kl = kl_k3(inputs.logp, ref_logp.detach().to(torch.float32) * maskf) * maskf  # 0 at padding
            token_loss = token_loss + beta * kl
        loss = aggregate(token_loss, maskf, agg, max_len, global_tokens=global_tokens, global_seqs=global_seqs)

    with torch.no_grad():
        sequence = spec.ratio_level(p) == "sequence"
        s = inputs.s.detach() if sequence else None
        r = inputs.r.detach()
        x = s.expand_as(r) if sequence else r
        sums = step_sums(x=x, A=inputs.A, valid=valid, loss=rule_loss.detach(), grad=grad,
                         band=spec.reference_band(p), params=p, r=r, log_ratio=inputs.log_ratio.detach(), s=s,
                         kl=kl.detach() if kl is not None else None)
        sums = {k: v.detach() for k, v in sums.items()}
    if not track:
        loss, token_loss = loss.detach(), token_loss.detach()
    return PolicyLossOutput(loss, token_loss, finalize(sums), sums)
