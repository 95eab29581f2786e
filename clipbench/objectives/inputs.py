"""What a rule reads and what the aggregation divides by, declared once each.

    inputs = RuleInputs.build(logp, old_logp, advantages, maskf, u=u, reward=rewards, entropy=entropy)
    loss = rule_fn(*[getattr(inputs, name) for name in spec.inputs], **params)
    counts = Counts(global_tokens=..., global_seqs=...)          # a micro-batch's normalisers

* :class:`RuleInputs` is the one declaration of the inputs a rule may name in its signature
  (signature.py reads a rule's positional names against its fields): one field each, its meaning in
  the field's ``doc`` (collected in :data:`INPUTS` and in the class docstring). A field is either
  *derived* here from the log-probs (``r``, ``s``, ``log_ratio``), *resolved* by the bound rule
  (``u``, ``stat``, ``generator``: loss.py), or *given* by the caller: ``logp``, ``old_logp``,
  ``A``, ``mask`` always, the others only when a rule reads them (:data:`GIVEN`: the keyword the
  caller passes, the shape, what to pass when it is missing).
* Adding a given input is adding one field with :func:`given` (docs/objectives.md, "Adding a rule
  input"): the shape check, the padding, the missing-input error, the bound loss's keyword, the
  trainer's per-row slicing (of a ``StepInputs`` field of that keyword, which the producer of the
  values fills) and the replay's record lookup all read :data:`GIVEN`.
* Padding is neutralised once, in :meth:`RuleInputs.build`: log-ratio 0 (so r == 1 and s ignores
  padding), logp/old_logp 0, a per-token given input 0; so a rule never needs the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from clipbench.objectives.aggregation import Count, check_count
from clipbench.objectives.primitives import straight_through_exp

TOKEN, SEQUENCE = "(B, T)", "(B,)"  # the shapes a given input may have (B sequences, T completion tokens)


def _input(doc: str, **meta) -> field:
    return field(default=None, metadata={"doc": doc, **meta})


def given(doc: str, shape: str, keyword: str, hint: str) -> field:
    """A rule input the caller passes when a rule reads it: ``keyword`` (the bound loss's and
    ``policy_loss``'s keyword, and the record's tensor name) of ``shape`` (:data:`TOKEN`: detached,
    float32, 0 at padding; :data:`SEQUENCE`: detached float32, as (B, 1)); ``hint`` completes the
    error "reads the input '<name>': pass <keyword>=<shape> (<hint>)"."""
    return _input(doc, shape=shape, keyword=keyword, hint=hint)


@dataclass(frozen=True)
class RuleInputs:
    """The inputs a rule may name in its signature, for one call (B sequences, T completion tokens).

    Fields (each one's meaning is its ``doc``; :data:`INPUTS` collects them):
    """

    r: torch.Tensor = _input(
        "(B, T) token ratio exp(logp - old_logp), with gradient (log-ratio value-clamped to +-20, "
        "straight-through); 1 at padding"
    )
    A: torch.Tensor = _input("(B, 1) advantages, detached float32")
    s: torch.Tensor = _input(
        "(B, 1) GSPO sequence ratio exp(sum_t mask*lr / sum_t mask), with gradient; 1 for an all-padding row"
    )
    logp: torch.Tensor = _input("(B, T) current log-probs, with gradient; 0 at padding")
    old_logp: torch.Tensor = _input("(B, T) behaviour log-probs, detached; 0 at padding")
    log_ratio: torch.Tensor = _input("(B, T) logp - old_logp, with gradient, not clamped; 0 at padding")
    mask: torch.Tensor = _input("(B, T) float 0/1, 1 on real completion tokens")
    u: torch.Tensor | None = _input(
        "(B, T) detached uniforms in [0, 1) for stochastic rules (zeros when the parameters need no draws)"
    )
    generator: torch.Generator | None = _input(
        "torch.Generator or None (prefer u: its draws do not depend on micro-batch splits)"
    )
    reward: torch.Tensor | None = given(
        "(B, 1) the sequence's reward (the task's score, before advantages), detached float32",
        SEQUENCE,
        "rewards",
        "each sequence's reward",
    )
    entropy: torch.Tensor | None = given(
        "(B, T) token entropy of the current policy (the same forward as logp), detached; 0 at padding",
        TOKEN,
        "entropy",
        "the current policy's token entropy, from the same forward as logp",
    )
    rollout_logp: torch.Tensor | None = given(
        "(B, T) the sampler's log-probs of the sampled tokens (the rollout policy, pi_rollout), detached; "
        "0 at padding. Equal to old_logp with sampler.old_logp: sampler",
        TOKEN,
        "sampler_logp",
        "the sampler's log-probs of the sampled tokens, the rollout policy",
    )
    stat: dict | None = _input(
        "dict of 0-d tensors: the rule's mini-batch statistic (rule(batch_stat=...)), computed without "
        "gradient on the whole mini-batch (all micro-batches and ranks) before its loss"
    )

    @classmethod
    def build(
        cls,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        maskf: torch.Tensor,
        *,
        u: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        stat: dict | None = None,
        **values: torch.Tensor | None,
    ) -> RuleInputs:
        """The inputs of one call, padding neutralised: ``logp`` (B, T) float32 (its graph kept),
        ``old_logp`` (B, T), ``advantages`` (B,), ``maskf`` (B, T) float 0/1; ``values``: the given
        inputs by field name (None or absent: not given)."""
        logp = logp * maskf  # (B, T) with grad, 0 at padding
        old_logp = old_logp.detach().to(torch.float32) * maskf  # (B, T), 0 at padding
        log_ratio = logp - old_logp  # (B, T) with grad, 0 at padding
        n_tok = maskf.sum(-1, keepdim=True).clamp(min=1.0)
        return cls(
            r=straight_through_exp(log_ratio),  # (B, T), 1 at padding
            A=advantages.detach().to(torch.float32).reshape(-1, 1),  # (B, 1)
            s=straight_through_exp(log_ratio.sum(-1, keepdim=True) / n_tok),  # (B, 1), 1 for an all-padding row
            logp=logp,
            old_logp=old_logp,
            log_ratio=log_ratio,
            mask=maskf,
            u=u,
            generator=generator,
            stat=stat,
            **{name: _given_value(GIVEN[name], values.get(name), maskf) for name in GIVEN},
        )


def _given_value(spec: dict, t: torch.Tensor | None, maskf: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().to(torch.float32)
    return t * maskf if spec["shape"] == TOKEN else t.reshape(-1, 1)


# The inputs a rule may ask for by name, and their meaning (derived from RuleInputs: not a second list).
INPUTS: dict[str, str] = {f.name: f.metadata["doc"] for f in fields(RuleInputs)}
# The given inputs: field name -> {"shape", "keyword", "hint", "doc"}.
GIVEN: dict[str, dict] = {f.name: dict(f.metadata) for f in fields(RuleInputs) if "keyword" in f.metadata}
# A given input's keyword (the bound call's and policy_loss's, the record's tensor name) -> its field.
KEYWORDS: dict[str, str] = {spec["keyword"]: name for name, spec in GIVEN.items()}
RuleInputs.__doc__ += "".join(f"\n    {name}: {doc}" for name, doc in INPUTS.items())


def check_given(name: str, t: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """ValueError naming the keyword when a given input has the wrong shape for (B, T) = ``shape``."""
    if t is None:
        return
    spec = GIVEN[name]
    if spec["shape"] == TOKEN and tuple(t.shape) != shape:
        raise ValueError(f"{spec['keyword']} must have logp's shape {shape}, got {tuple(t.shape)}")
    if spec["shape"] == SEQUENCE and t.shape not in ((shape[0],), (shape[0], 1)):
        raise ValueError(f"{spec['keyword']} must be (B,) = ({shape[0]},) (one per sequence), got {tuple(t.shape)}")


def missing_input(method: str, name: str) -> ValueError:
    spec = GIVEN[name]
    return ValueError(f"{method} reads the input '{name}': pass {spec['keyword']}={spec['shape']} ({spec['hint']})")


@dataclass(frozen=True)
class Counts:
    """The aggregation's normalisers of one call (aggregation.py): the whole mini-batch's counts when
    the call is one micro-batch of it (None: this call's own).

    global_tokens:  valid completion tokens of the mini-batch (token-mean)
    global_seqs:    sequences with >= 1 valid token (the seq-means)
    global_prompts: distinct prompt groups of the mini-batch (prompt-mean)
    group_tokens:   (B,) each row's prompt group's valid tokens in the mini-batch (prompt-mean)
    groups:         (B,) each row's prompt group (prompt-mean without the global counts)
    Counts are numbers or 0-d tensors (no host sync); rejected tokens of a sampler correction are
    left out of them by the caller (they leave this call's own counts too)."""

    global_tokens: Count = None
    global_seqs: Count = None
    global_prompts: Count = None
    group_tokens: torch.Tensor | None = None
    groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("global_tokens", "global_seqs", "global_prompts"):
            check_count(name, getattr(self, name))

    def check(self, B: int) -> None:
        """ValueError when ``groups`` is not (B,)."""
        t = self.groups
        if t is not None and t.shape not in ((B,), (B, 1)):
            raise ValueError(f"groups must be (B,) = ({B},) (one per sequence), got {tuple(t.shape)}")


NO_COUNTS = Counts()
