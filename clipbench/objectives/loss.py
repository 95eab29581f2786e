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
* A rule with a mini-batch statistic (``rule(batch_stat=...)``: bapo's bounds, m2po's threshold)
  reads it as its input ``stat``: the caller's (``batch_stat=``, computed by :func:`mini_batch_stat`
  on the whole mini-batch) or, without one, this call's own.
* A sampler correction enters as ``weights`` (the policy term's multiplier) and ``correction_status``
  (what it did to each token: corrections/registry.py codes); rejected tokens leave this call's own
  counts (a caller passing global counts leaves them out of those too).
* Nothing syncs with the host: stats and sums are 0-d tensors (except prompt-mean without the
  caller's group counts, which counts this call's groups with torch.unique).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from clipbench.errors import RuleError
from clipbench.objectives.aggregation import Count, aggregate, check_count, get_aggregation
from clipbench.objectives.corrections.registry import REJECTED
from clipbench.objectives.diagnostics import correction_cell_sums, finalize, split_cell_sums, stat_sums, step_sums
from clipbench.objectives.primitives import kl_k3, straight_through_exp
from clipbench.objectives.registry import MethodSpec, get_method, validate_params


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # 0-d, differentiable w.r.t. logp
    token_loss: torch.Tensor  # (B, T) per-token loss before aggregation (weights and KL included), 0 at padding
    stats: dict  # str -> detached 0-d tensor: finalize(sums)
    sums: dict  # str -> detached 0-d float64 tensor, combinable over micro-batches and ranks (diagnostics.py)


def _check_inputs(
    logp,
    old_logp,
    advantages,
    mask,
    ref_logp,
    weights,
    uniforms,
    generator,
    beta,
    entropy=None,
    status=None,
    rewards=None,
    groups=None,
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    for name, t in (
        ("old_logp", old_logp),
        ("mask", mask),
        ("ref_logp", ref_logp),
        ("weights", weights),
        ("uniforms", uniforms),
        ("entropy", entropy),
        ("correction_status", status),
    ):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have logp's shape {shape}, got {tuple(t.shape)}")
    for name, t in (("advantages", advantages), ("rewards", rewards), ("groups", groups)):
        if t is not None and t.shape not in ((shape[0],), (shape[0], 1)):
            raise ValueError(f"{name} must be (B,) = ({shape[0]},) (one per sequence), got {tuple(t.shape)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs, (B, T))")


class _Inputs:
    """The named inputs of the rules (registry.INPUTS); r and s are built on first use."""

    def __init__(self, logp, old_logp, advantages, maskf, u, generator, rewards=None, entropy=None):
        self.mask = maskf  # (B, T) float 0/1
        self.reward = None if rewards is None else rewards.detach().to(torch.float32).reshape(-1, 1)  # (B, 1)
        self.entropy = None if entropy is None else entropy.detach().to(torch.float32) * maskf  # (B, T)
        self.stat = None  # the rule's mini-batch statistic (set by policy_loss)
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
        raise ValueError(
            f"{spec.name} with these parameters draws random numbers: pass uniforms=(B, T) in [0, 1) "
            "or generator=torch.Generator().manual_seed(...)"
        )
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


NEEDED = {
    "reward": "rewards=(B,) (each sequence's reward)",
    "entropy": "entropy=(B, T) (the current policy's token entropy, from the same forward as logp)",
}


def _call_rule(spec: MethodSpec, inputs: _Inputs, p: dict) -> torch.Tensor:
    """The rule's loss broadcast to (B, T), float32; a wrong return is a one-line RuleError."""
    for name in spec.inputs:
        if name in NEEDED and getattr(inputs, name) is None:
            raise ValueError(f"{spec.name} reads the input '{name}': pass {NEEDED[name]}")
    out = spec.call("rule", *[getattr(inputs, name) for name in spec.inputs], **p)
    B, T = inputs.mask.shape
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or tuple(out.shape) not in ((B, T), (B, 1)):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise RuleError(
            f"rule '{spec.name}' ({spec.where}) returned {got}: a rule returns the per-token loss "
            f"(B, T) = ({B}, {T}) or a per-sequence loss (B, 1) as a float tensor"
        )
    return out.to(torch.float32).expand(B, T)


def _rule_stat(spec: MethodSpec, p: dict, r: torch.Tensor, A: torch.Tensor, maskf: torch.Tensor) -> dict:
    """The rule's mini-batch statistic computed on these rows (no gradient)."""
    with torch.no_grad():
        out = spec.batch_stat(r.detach(), A, maskf, p)
    if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values()):
        raise RuleError(f"rule '{spec.name}' ({spec.where}): batch_stat must return a dict of 0-d tensors")
    return out


def mini_batch_stat(
    method: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, **params
) -> dict | None:
    """A rule's mini-batch statistic (``rule(batch_stat=...)``) from the whole mini-batch's (B, T)
    log-probs (detached: the current policy's, before the step), old log-probs, (B,) advantages and
    mask; pass it to each micro-batch's ``policy_loss(..., batch_stat=)``. None for other rules."""
    spec = get_method(method)
    if spec.batch_stat is None:
        return None
    p = validate_params(method, params)
    maskf = (mask != 0).to(torch.float32)
    inputs = _Inputs(logp.detach().to(torch.float32), old_logp, advantages, maskf, None, None)
    return _rule_stat(spec, p, inputs.r, inputs.A, maskf)


def policy_loss(
    method: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    max_len: int | None = None,
    global_tokens: Count = None,
    global_seqs: Count = None,
    weights: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    global_prompts: Count = None,
    group_tokens: torch.Tensor | None = None,
    batch_stat: dict | None = None,
    correction_status: torch.Tensor | None = None,
    token_splits: dict | None = None,
    **params,
) -> PolicyLossOutput:
    """The clipped policy loss of ``method`` (docs/objectives.md) and its diagnostics.

    logp, old_logp, mask: (B, T) (mask 1 on real completion tokens, 0 on padding; padding values of
    logp/old_logp may be anything finite); advantages: (B,).
    ``params``: the method's parameters (defaults from ``METHODS[method].defaults``).
    ``uniforms`` (B, T) in [0, 1): the draws of stochastic rules (nsr); without them, drawn from
    ``generator``. ``weights`` (B, T): a detached per-token multiplier of the policy term (e.g.
    truncated importance sampling). ``beta * k3(ref_logp)`` is added per token when beta > 0.
    ``max_len`` (default T): the fixed length of ``seq-mean-token-sum-norm``. ``global_tokens`` /
    ``global_seqs`` (and for ``prompt-mean`` ``global_prompts`` / ``group_tokens`` (B,)): the whole
    mini-batch's counts when this call is one micro-batch of it (aggregation.py); ``groups`` (B,):
    each row's prompt group (prompt-mean counts this call's groups without the global counts).
    Inputs some rules read: ``rewards`` (B,) each sequence's reward (topr); ``entropy`` (B, T) the
    current policy's token entropy (aspo); ``batch_stat``: the mini-batch statistic of a rule that
    declares one (:func:`mini_batch_stat`; default: this call's). ``correction_status`` (B, T) int8:
    what the sampler correction did to each token (per-cell counts; rejected tokens leave the
    counts). ``token_splits`` {name: (B, T) bool}: also count each cell's tokens and out-of-band
    tokens over each named subset (``{name}/{cell}/tokens|out_of_band``; a MoE policy's tokens whose
    experts moved). Computation is in float32 whatever the input dtype.
    """
    spec = get_method(method)
    p = validate_params(method, params)
    get_aggregation(agg)
    _check_inputs(
        logp,
        old_logp,
        advantages,
        mask,
        ref_logp,
        weights,
        uniforms,
        generator,
        beta,
        entropy,
        correction_status,
        rewards,
        groups,
    )
    for name, value in (
        ("global_tokens", global_tokens),
        ("global_seqs", global_seqs),
        ("global_prompts", global_prompts),
    ):
        check_count(name, value)

    # Differentiate w.r.t. the caller's logp when it has a graph; else through a detached leaf copy
    # (and return detached outputs).
    track = torch.is_grad_enabled() and logp.requires_grad
    lp = logp.to(torch.float32) if track else logp.detach().to(torch.float32).requires_grad_(True)
    maskf = mask if mask.dtype == torch.float32 else (mask != 0).to(torch.float32)
    valid = maskf != 0
    with torch.enable_grad():
        u = _uniforms(spec, p, lp.shape, lp.device, uniforms, generator)
        inputs = _Inputs(lp, old_logp, advantages, maskf, u, generator, rewards, entropy)
        if spec.batch_stat is not None:
            inputs.stat = batch_stat if batch_stat is not None else _rule_stat(spec, p, inputs.r, inputs.A, maskf)
        rule_loss = _call_rule(spec, inputs, p)  # (B, T)
        masked = rule_loss * maskf  # 0 at padding
        grad = None
        if masked.requires_grad:  # the rule's per-token gradient, on the rule graph only
            (grad,) = torch.autograd.grad(masked.sum(), lp, retain_graph=True, allow_unused=True)
        grad = torch.zeros_like(lp) if grad is None else grad.detach()

        token_loss = masked if weights is None else masked * weights.detach().to(torch.float32)
        kl = None
        if beta > 0:
            kl = kl_k3(inputs.logp, ref_logp.detach().to(torch.float32) * maskf) * maskf  # 0 at padding
            token_loss = token_loss + beta * kl
        counted = maskf if correction_status is None else maskf * (correction_status != REJECTED)  # the denominators'
        loss = aggregate(
            token_loss,
            counted,
            agg,
            max_len,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            groups=groups,
            global_prompts=global_prompts,
            group_tokens=group_tokens,
        )

    with torch.no_grad():
        sequence = spec.ratio_level(p) == "sequence"
        s = inputs.s.detach() if sequence else None
        r = inputs.r.detach()
        x = s.expand_as(r) if sequence else r
        sums = step_sums(
            x=x,
            A=inputs.A,
            valid=valid,
            loss=rule_loss.detach(),
            grad=grad,
            band=spec.reference_band(p),
            params=p,
            r=r,
            log_ratio=inputs.log_ratio.detach(),
            s=s,
            kl=kl.detach() if kl is not None else None,
        )
        if correction_status is not None:
            sums.update(correction_cell_sums(x=x, A=inputs.A, valid=valid, status=correction_status))
        if token_splits:  # the cells' counts over named subsets of the tokens (diagnostics only)
            sums.update(
                split_cell_sums(
                    x=x,
                    A=inputs.A,
                    valid=valid,
                    loss=rule_loss.detach(),
                    grad=grad,
                    band=spec.reference_band(p),
                    params=p,
                    splits=token_splits,
                )
            )
        if inputs.stat is not None:
            sums.update(stat_sums(inputs.stat))
        sums = {k: v.detach() for k, v in sums.items()}
    if not track:
        loss, token_loss = loss.detach(), token_loss.detach()
    return PolicyLossOutput(loss, token_loss, finalize(sums), sums)
