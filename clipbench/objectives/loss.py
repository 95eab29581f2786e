"""The policy loss: a rule bound once per run, called per micro-batch; ``policy_loss`` binds per call.

    bound = bind("grpo", {"eps_high": 0.28}, agg="token-mean", beta=0.0)     # once per run
    out = bound(RuleInputs.of(logp=logp, old_logp=old_logp, advantages=A, mask=mask,
                              counts=Counts(global_tokens=n)))                # per micro-batch: one bundle in
    out = policy_loss("grpo", logp, old_logp, A, mask, eps_high=0.28)         # the same, one call

Design choices:
* :func:`bind` looks the rule up, validates and completes its parameters (a rule's ``warn`` is
  issued here, once), checks the aggregation and the KL weight, and resolves once what every call
  needs: which given inputs the rule reads, whether this setting draws, the ratio level and the
  reference band. A :class:`BoundRule` call then only checks the tensors.
* One bundle in, one output out: a call takes one :class:`RuleInputs` (inputs.py: every tensor of the
  call, the counts (:class:`Counts`) among them) and returns one :class:`PolicyLossOutput`, as verl's
  policy losses share one signature. The rule itself is called with the inputs it names, by
  position, from the bundle prepared with padding neutralised (so padding values of logp/old_logp
  may be anything finite and a rule never needs the mask): its function reads as its formula.
* The ratio's log is value-clamped to [-20, 20] with a straight-through gradient: r = exp(clamp(lr))
  and dr/dlr = r everywhere, so r <= e^20 stays finite and every rule keeps the gradient its formula
  prescribes. GSPO's s is clamped the same way.
* Random draws come from ``uniforms`` (pre-drawn per rollout row and position by the trainer, so
  they never depend on how a mini-batch is split) or else ``torch.rand`` from ``generator``.
* Diagnostics need the per-token gradient g = d(sum l)/d logp of the rule's loss: one
  ``torch.autograd.grad`` on the small rule graph (it stops at logp: the model is never
  backpropagated here); the graph is kept for the caller's ``loss.backward()``.
* A rule with a mini-batch statistic (``rule(batch_stat=...)``: bapo's bounds, m2po's threshold)
  reads it as its input ``stat``: the caller's (``batch_stat=``, computed by
  :meth:`BoundRule.mini_batch_stat` on the whole mini-batch's bundle) or, without one, this call's own.
* A sampler correction enters as ``weights`` (the policy term's multiplier) and ``correction_status``
  (what it did to each token: corrections/registry.py codes); rejected tokens leave this call's own
  counts (a caller passing global counts leaves them out of those too).
* Nothing syncs with the host: stats and sums are 0-d tensors (except prompt-mean without the
  caller's group counts, which counts this call's groups with torch.unique).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from clipbench.errors import RuleError
from clipbench.objectives.aggregation import aggregate, get_aggregation
from clipbench.objectives.corrections.registry import REJECTED
from clipbench.objectives.diagnostics import correction_cell_sums, finalize, split_cell_sums, stat_sums, step_sums
from clipbench.objectives.inputs import CALL_KEYWORDS, GIVEN, NO_COUNTS, RuleInputs, missing_input
from clipbench.objectives.primitives import kl_k3
from clipbench.objectives.registry import MethodSpec, get_method, validate_params
from clipbench.objectives.signature import Band


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # 0-d, differentiable w.r.t. logp
    token_loss: torch.Tensor  # (B, T) per-token loss before aggregation (weights and KL included), 0 at padding
    stats: dict  # str -> detached 0-d tensor: finalize(sums)
    sums: dict  # str -> detached 0-d float64 tensor, combinable over micro-batches and ranks (diagnostics.py)


def _check_beta(beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")


@dataclass(frozen=True)
class BoundRule:
    """A rule bound for a run (:func:`bind`): its spec, its validated parameters (defaults merged), the
    aggregation, the KL weight and the fixed length, and what each call needs, resolved once.
    Call it per micro-batch with the call's bundle: ``bound(RuleInputs.of(...)) -> PolicyLossOutput``."""

    spec: MethodSpec
    params: dict[str, Any]  # validated, every parameter
    reads: tuple[str, ...]  # the given inputs the rule names (RuleInputs fields in GIVEN)
    draws: bool  # does this parameter setting need random draws
    sequence: bool  # the cells use GSPO's s (else the token ratio r)
    band: Band  # the reference band of the out_of_band counts
    agg: str = "token-mean"
    beta: float = 0.0
    max_len: int | None = None  # seq-mean-token-sum-norm's fixed length (default: T)

    @property
    def method(self) -> str:
        return self.spec.name

    def with_loss(self, *, agg: str = "token-mean", beta: float = 0.0, max_len: int | None = None) -> BoundRule:
        """The same bound rule under another aggregation, KL weight and fixed length (checked; the rule
        is not looked up again): for a caller that knows them only after binding (TRL's trainer)."""
        get_aggregation(agg)
        _check_beta(beta)
        return replace(self, agg=agg, beta=beta, max_len=max_len)

    @property
    def has_stat(self) -> bool:
        """Does the rule read a statistic of the whole mini-batch (bapo, m2po)?"""
        return self.spec.batch_stat is not None

    # -- per call -----------------------------------------------------------------------------------

    def __call__(self, inputs: RuleInputs) -> PolicyLossOutput:
        """The policy loss of one call (:func:`policy_loss` documents the tensors): ``inputs`` the call's
        bundle (:meth:`RuleInputs.of`): logp, old_logp, advantages, mask; ``counts``, the mini-batch's
        normalisers when this call is one micro-batch of it; the uniforms or generator of a rule that
        draws; the given inputs the rule reads (inputs.GIVEN); ref_logp, weights, correction_status,
        token_splits, batch_stat."""
        inputs.check()
        if self.beta > 0 and inputs.ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs, (B, T))")
        counts = inputs.counts if inputs.counts is not None else NO_COUNTS
        status, weights = inputs.correction_status, inputs.weights

        # Differentiate w.r.t. the caller's logp when it has a graph; else through a detached leaf copy
        # (and return detached outputs).
        logp, mask = inputs.logp, inputs.mask
        track = torch.is_grad_enabled() and logp.requires_grad
        lp = logp.to(torch.float32) if track else logp.detach().to(torch.float32).requires_grad_(True)
        maskf = mask if mask.dtype == torch.float32 else (mask != 0).to(torch.float32)
        with torch.enable_grad():
            x = inputs.prepared(lp, maskf, self._uniforms(lp.shape, lp.device, inputs.u, inputs.generator))
            # the statistic of a rule that declares one: the caller's (the mini-batch's), else this call's
            x = replace(x, stat=(inputs.stat if inputs.stat is not None else self.stat(x)) if self.has_stat else None)
            rule_loss = self.rule_loss(x)  # (B, T)
            masked = rule_loss * maskf  # 0 at padding
            grad = None
            if masked.requires_grad:  # the rule's per-token gradient, on the rule graph only
                (grad,) = torch.autograd.grad(masked.sum(), lp, retain_graph=True, allow_unused=True)
            grad = torch.zeros_like(lp) if grad is None else grad.detach()

            token_loss = masked if weights is None else masked * weights.detach().to(torch.float32)
            kl = None
            if self.beta > 0:
                kl = kl_k3(x.logp, inputs.ref_logp.detach().to(torch.float32) * maskf) * maskf  # 0 at padding
                token_loss = token_loss + self.beta * kl
            counted = maskf if status is None else maskf * (status != REJECTED)
            loss = aggregate(
                token_loss,
                counted,
                self.agg,
                self.max_len,
                global_tokens=counts.global_tokens,
                global_seqs=counts.global_seqs,
                groups=counts.groups,
                global_prompts=counts.global_prompts,
                group_tokens=counts.group_tokens,
            )

        sums = self._sums(x, rule_loss, grad, kl)
        if not track:
            loss, token_loss = loss.detach(), token_loss.detach()
        return PolicyLossOutput(loss, token_loss, finalize(sums), sums)

    def _uniforms(self, shape, device, uniforms, generator) -> torch.Tensor | None:
        """The rule's ``u``: the caller's uniforms, else torch.rand from the generator; zeros when this
        parameter setting needs no draws (the generator is then not advanced)."""
        if "u" not in self.spec.inputs:
            return None
        if not self.draws:
            return torch.zeros(shape, device=device)
        if uniforms is not None:
            return uniforms.detach().to(device=device, dtype=torch.float32)
        if generator is None:
            raise ValueError(
                f"{self.method} with these parameters draws random numbers: pass uniforms=(B, T) in [0, 1) "
                "or generator=torch.Generator().manual_seed(...)"
            )
        return torch.rand(shape, generator=generator, device=generator.device).to(device)

    def rule_loss(self, inputs: RuleInputs) -> torch.Tensor:
        """The rule's loss broadcast to (B, T), float32; a wrong return is a one-line RuleError."""
        for name in self.reads:
            if getattr(inputs, name) is None:
                raise missing_input(self.method, name)
        out = self.spec.call("rule", *[getattr(inputs, name) for name in self.spec.inputs], **self.params)
        B, T = inputs.mask.shape
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or tuple(out.shape) not in ((B, T), (B, 1)):
            got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise RuleError(
                f"rule '{self.method}' ({self.spec.where}) returned {got}: a rule returns the per-token loss "
                f"(B, T) = ({B}, {T}) or a per-sequence loss (B, 1) as a float tensor"
            )
        if torch.is_grad_enabled() and inputs.logp.requires_grad and not out.requires_grad:
            raise RuleError(
                f"rule '{self.method}' ({self.spec.where}) returned a loss without a gradient: it must depend on "
                "its inputs r, s, logp or log_ratio through differentiable operations (a .detach(), .item(), "
                "torch.no_grad() or a new tensor cuts the gradient)"
            )
        return out.to(torch.float32).expand(B, T)

    def stat(self, inputs: RuleInputs) -> dict:
        """The rule's mini-batch statistic computed on these rows (no gradient)."""
        with torch.no_grad():
            out = self.spec.batch_stat(inputs.r.detach(), inputs.A, inputs.mask, self.params)
        if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values()):
            raise RuleError(f"rule '{self.method}' ({self.spec.where}): batch_stat must return a dict of 0-d tensors")
        return out

    def mini_batch_stat(self, inputs: RuleInputs) -> dict | None:
        """The rule's mini-batch statistic (``rule(batch_stat=...)``) from the whole mini-batch's bundle:
        its (B, T) log-probs (detached: the current policy's, before the step), old log-probs, (B,)
        advantages and mask; pass it to each micro-batch's call as ``batch_stat=``. None for other rules."""
        if not self.has_stat:
            return None
        maskf = (inputs.mask != 0).to(torch.float32)
        return self.stat(inputs.prepared(inputs.logp.detach().to(torch.float32), maskf, None))

    def _sums(self, inputs: RuleInputs, rule_loss, grad, kl) -> dict:
        """The call's diagnostic sums (diagnostics.py), detached."""
        with torch.no_grad():
            valid = inputs.mask != 0
            s = inputs.s.detach() if self.sequence else None
            r = inputs.r.detach()
            x = s.expand_as(r) if self.sequence else r
            sums = step_sums(
                x=x,
                A=inputs.A,
                valid=valid,
                loss=rule_loss.detach(),
                grad=grad,
                band=self.band,
                params=self.params,
                r=r,
                log_ratio=inputs.log_ratio.detach(),
                s=s,
                kl=kl.detach() if kl is not None else None,
            )
            if inputs.correction_status is not None:
                sums.update(correction_cell_sums(x=x, A=inputs.A, valid=valid, status=inputs.correction_status))
            if inputs.token_splits:  # the cells' counts over named subsets of the tokens (diagnostics only)
                sums.update(
                    split_cell_sums(
                        x=x,
                        A=inputs.A,
                        valid=valid,
                        loss=rule_loss.detach(),
                        grad=grad,
                        band=self.band,
                        params=self.params,
                        splits=inputs.token_splits,
                    )
                )
            if inputs.stat is not None:
                sums.update(stat_sums(inputs.stat))
            return {k: v.detach() for k, v in sums.items()}


def bind(
    method: str,
    params: dict | None = None,
    *,
    agg: str = "token-mean",
    beta: float = 0.0,
    max_len: int | None = None,
) -> BoundRule:
    """``method`` bound for a run: looked up (the registry's :func:`get_method`), its parameters
    validated and merged with the defaults, the aggregation and KL weight checked, what each call
    needs resolved. ValueError (did-you-mean) for an unknown method, parameter or aggregation."""
    spec = get_method(method)
    p = validate_params(method, params)
    return BoundRule(
        spec,
        p,
        tuple(name for name in spec.inputs if name in GIVEN),
        spec.needs_draws(p),
        spec.ratio_level(p) == "sequence",
        spec.reference_band(p),
    ).with_loss(agg=agg, beta=beta, max_len=max_len)


def mini_batch_stat(
    method: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, **params
) -> dict | None:
    """``bind(method, params).mini_batch_stat(...)`` on these tensors in one call."""
    inputs = RuleInputs.of(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    return bind(method, params).mini_batch_stat(inputs)


def policy_loss(
    method: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    beta: float = 0.0,
    max_len: int | None = None,
    **params_and_inputs,
) -> PolicyLossOutput:
    """The clipped policy loss of ``method`` (docs/objectives.md) and its diagnostics: :func:`bind`
    then one call on ``RuleInputs.of(...)`` (a loop over micro-batches binds once and calls the
    :class:`BoundRule` with each micro-batch's bundle).

    logp, old_logp, mask: (B, T) (mask 1 on real completion tokens, 0 on padding; padding values of
    logp/old_logp may be anything finite); advantages: (B,).
    ``params_and_inputs``: the method's parameters (defaults from ``METHODS[method].defaults``) and the
    call's other inputs by their keywords (inputs.CALL_KEYWORDS; the others are parameters):
    the counts (inputs.Counts: ``global_tokens``, ``global_seqs``, ``global_prompts``, ``group_tokens``,
    ``groups``, or ``counts=``), the inputs some rules read (inputs.GIVEN: ``rewards`` (B,) each
    sequence's reward (topr), ``entropy`` (B, T) the current policy's token entropy (aspo),
    ``sampler_logp`` (B, T) the rollout policy's (rollout_is)),
    ``uniforms`` (B, T) in [0, 1): the draws of stochastic rules (nsr); without them, drawn from
    ``generator``. ``weights`` (B, T): a detached per-token multiplier of the policy term (e.g.
    truncated importance sampling). ``beta * k3(ref_logp)`` is added per token when beta > 0.
    ``max_len`` (default T): the fixed length of ``seq-mean-token-sum-norm``. ``batch_stat``: the
    mini-batch statistic of a rule that declares one (:func:`mini_batch_stat`; default: this call's).
    ``correction_status`` (B, T) int8: what the sampler correction did to each token (per-cell counts;
    rejected tokens leave the counts). ``token_splits`` {name: (B, T) bool}: also count each cell's
    tokens and out-of-band tokens over each named subset (``{name}/{cell}/tokens|out_of_band``; a MoE
    policy's tokens whose experts moved). Computation is in float32 whatever the input dtype.
    """
    keywords = {k: params_and_inputs.pop(k) for k in CALL_KEYWORDS if k in params_and_inputs}
    bound = bind(method, params_and_inputs, agg=agg, beta=beta, max_len=max_len)
    return bound(RuleInputs.of(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, **keywords))
