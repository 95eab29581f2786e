"""The policy loss: a rule bound once per run, called per micro-batch; ``policy_loss`` binds per call.

    bound = bind("grpo", {"eps_high": 0.28}, agg="token-mean", beta=0.0)     # once per run
    out = bound(logp, old_logp, advantages, mask, Counts(global_tokens=n))   # per micro-batch
    out = policy_loss("grpo", logp, old_logp, advantages, mask, eps_high=0.28)   # the same, one call

Design choices:
* :func:`bind` looks the rule up, validates and completes its parameters (a rule's ``warn`` is
  issued here, once), checks the aggregation and the KL weight, and resolves once what every call
  needs: which given inputs the rule reads, whether this setting draws, the ratio level and the
  reference band. A :class:`BoundRule` call then only checks the tensors.
* The rule is called with the inputs it names (inputs.py: :class:`RuleInputs`, built once per call
  with padding neutralised, so padding values of logp/old_logp may be anything finite and a rule
  never needs the mask). Counts travel as one bundle (:class:`Counts`).
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
  :meth:`BoundRule.mini_batch_stat` on the whole mini-batch) or, without one, this call's own.
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
from clipbench.objectives.inputs import GIVEN, KEYWORDS, NO_COUNTS, Counts, RuleInputs, check_given, missing_input
from clipbench.objectives.primitives import kl_k3
from clipbench.objectives.registry import MethodSpec, get_method, validate_params
from clipbench.objectives.signature import Band

COUNT_KEYWORDS = ("global_tokens", "global_seqs", "global_prompts", "group_tokens", "groups")


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # 0-d, differentiable w.r.t. logp
    token_loss: torch.Tensor  # (B, T) per-token loss before aggregation (weights and KL included), 0 at padding
    stats: dict  # str -> detached 0-d tensor: finalize(sums)
    sums: dict  # str -> detached 0-d float64 tensor, combinable over micro-batches and ranks (diagnostics.py)


def _check_tensors(logp, old_logp, advantages, mask, ref_logp, weights, uniforms, generator, status) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    for name, t in (
        ("old_logp", old_logp),
        ("mask", mask),
        ("ref_logp", ref_logp),
        ("weights", weights),
        ("uniforms", uniforms),
        ("correction_status", status),
    ):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have logp's shape {shape}, got {tuple(t.shape)}")
    if advantages.shape not in ((shape[0],), (shape[0], 1)):
        raise ValueError(f"advantages must be (B,) = ({shape[0]},) (one per sequence), got {tuple(advantages.shape)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def _check_beta(beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")


@dataclass(frozen=True)
class BoundRule:
    """A rule bound for a run (:func:`bind`): its spec, its validated parameters (defaults merged), the
    aggregation, the KL weight and the fixed length, and what each call needs, resolved once.
    Call it per micro-batch: ``bound(logp, old_logp, advantages, mask, counts, **tensors)``."""

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

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        counts: Counts = NO_COUNTS,
        *,
        uniforms: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        batch_stat: dict | None = None,
        ref_logp: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        correction_status: torch.Tensor | None = None,
        token_splits: dict | None = None,
        **given: torch.Tensor | None,
    ) -> PolicyLossOutput:
        """The policy loss of one call (:func:`policy_loss` documents the tensors); ``counts``: the
        mini-batch's normalisers when this call is one micro-batch of it; ``given``: the inputs some
        rules read, by keyword (inputs.GIVEN: ``rewards`` (B,), ``entropy`` (B, T))."""
        _check_tensors(logp, old_logp, advantages, mask, ref_logp, weights, uniforms, generator, correction_status)
        values = self._given(given, tuple(logp.shape))
        counts.check(logp.shape[0])
        if self.beta > 0 and ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs, (B, T))")

        # Differentiate w.r.t. the caller's logp when it has a graph; else through a detached leaf copy
        # (and return detached outputs).
        track = torch.is_grad_enabled() and logp.requires_grad
        lp = logp.to(torch.float32) if track else logp.detach().to(torch.float32).requires_grad_(True)
        maskf = mask if mask.dtype == torch.float32 else (mask != 0).to(torch.float32)
        with torch.enable_grad():
            u = self._uniforms(lp.shape, lp.device, uniforms, generator)
            inputs = RuleInputs.build(lp, old_logp, advantages, maskf, u=u, generator=generator, **values)
            if self.has_stat:
                inputs = replace(inputs, stat=batch_stat if batch_stat is not None else self.stat(inputs))
            rule_loss = self.rule_loss(inputs)  # (B, T)
            masked = rule_loss * maskf  # 0 at padding
            grad = None
            if masked.requires_grad:  # the rule's per-token gradient, on the rule graph only
                (grad,) = torch.autograd.grad(masked.sum(), lp, retain_graph=True, allow_unused=True)
            grad = torch.zeros_like(lp) if grad is None else grad.detach()

            token_loss = masked if weights is None else masked * weights.detach().to(torch.float32)
            kl = None
            if self.beta > 0:
                kl = kl_k3(inputs.logp, ref_logp.detach().to(torch.float32) * maskf) * maskf  # 0 at padding
                token_loss = token_loss + self.beta * kl
            counted = maskf if correction_status is None else maskf * (correction_status != REJECTED)
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

        sums = self._sums(inputs, rule_loss, grad, kl, correction_status, token_splits)
        if not track:
            loss, token_loss = loss.detach(), token_loss.detach()
        return PolicyLossOutput(loss, token_loss, finalize(sums), sums)

    @staticmethod
    def _given(given: dict, shape: tuple[int, int]) -> dict[str, torch.Tensor | None]:
        """The given inputs by field name, shapes checked (a keyword that names none is a TypeError)."""
        unknown = set(given) - set(KEYWORDS)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}: rule inputs are {sorted(KEYWORDS)}")
        values = {KEYWORDS[k]: t for k, t in given.items()}
        for name, t in values.items():
            check_given(name, t, shape)
        return values

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
        return out.to(torch.float32).expand(B, T)

    def stat(self, inputs: RuleInputs) -> dict:
        """The rule's mini-batch statistic computed on these rows (no gradient)."""
        with torch.no_grad():
            out = self.spec.batch_stat(inputs.r.detach(), inputs.A, inputs.mask, self.params)
        if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values()):
            raise RuleError(f"rule '{self.method}' ({self.spec.where}): batch_stat must return a dict of 0-d tensors")
        return out

    def mini_batch_stat(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> dict | None:
        """The rule's mini-batch statistic (``rule(batch_stat=...)``) from the whole mini-batch's (B, T)
        log-probs (detached: the current policy's, before the step), old log-probs, (B,) advantages and
        mask; pass it to each micro-batch's call as ``batch_stat=``. None for other rules."""
        if not self.has_stat:
            return None
        maskf = (mask != 0).to(torch.float32)
        return self.stat(RuleInputs.build(logp.detach().to(torch.float32), old_logp, advantages, maskf))

    def _sums(self, inputs: RuleInputs, rule_loss, grad, kl, status, token_splits) -> dict:
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
            if status is not None:
                sums.update(correction_cell_sums(x=x, A=inputs.A, valid=valid, status=status))
            if token_splits:  # the cells' counts over named subsets of the tokens (diagnostics only)
                sums.update(
                    split_cell_sums(
                        x=x,
                        A=inputs.A,
                        valid=valid,
                        loss=rule_loss.detach(),
                        grad=grad,
                        band=self.band,
                        params=self.params,
                        splits=token_splits,
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
    """``bind(method, params).mini_batch_stat(logp, old_logp, advantages, mask)`` in one call."""
    return bind(method, params).mini_batch_stat(logp, old_logp, advantages, mask)


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
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    batch_stat: dict | None = None,
    correction_status: torch.Tensor | None = None,
    token_splits: dict | None = None,
    **params_and_inputs,
) -> PolicyLossOutput:
    """The clipped policy loss of ``method`` (docs/objectives.md) and its diagnostics: :func:`bind`
    then one call (a loop over micro-batches binds once and calls the :class:`BoundRule`).

    logp, old_logp, mask: (B, T) (mask 1 on real completion tokens, 0 on padding; padding values of
    logp/old_logp may be anything finite); advantages: (B,).
    ``params_and_inputs``: the method's parameters (defaults from ``METHODS[method].defaults``), the
    counts (inputs.Counts: ``global_tokens``, ``global_seqs``, ``global_prompts``, ``group_tokens``,
    ``groups``) and the inputs some rules read (inputs.GIVEN: ``rewards`` (B,) each sequence's reward
    (topr), ``entropy`` (B, T) the current policy's token entropy (aspo)).
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
    counts = {k: params_and_inputs.pop(k) for k in COUNT_KEYWORDS if k in params_and_inputs}
    given = {k: params_and_inputs.pop(k) for k in KEYWORDS if k in params_and_inputs}
    bound = bind(method, params_and_inputs, agg=agg, beta=beta, max_len=max_len)
    return bound(
        logp,
        old_logp,
        advantages,
        mask,
        Counts(**counts),
        uniforms=uniforms,
        generator=generator,
        batch_stat=batch_stat,
        ref_logp=ref_logp,
        weights=weights,
        correction_status=correction_status,
        token_splits=token_splits,
        **given,
    )
