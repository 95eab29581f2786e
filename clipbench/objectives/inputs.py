"""One call of a rule, as one bundle: what a rule reads and what the loss around it needs.

    inputs = RuleInputs.of(logp=lp, old_logp=old, advantages=A, mask=mask, uniforms=u, rewards=rw,
                           counts=Counts(global_tokens=n), weights=w)    # the caller's keywords
    out = bound(inputs)                                                 # objectives/loss.py: one output
    loss = rule_fn(*[getattr(prepared, name) for name in spec.inputs], **params)   # inside the call

* :class:`RuleInputs` is the one bundle a bound rule is called with (loss.py), and the one
  declaration of the inputs a rule may name in its signature (signature.py reads a rule's
  positional names against :data:`INPUTS`): one field each, its meaning in the field's ``doc``
  (collected in :data:`INPUTS` and in the class docstring). A rule input is either *derived* by the
  call from the log-probs (``r``, ``s``, ``log_ratio``), *resolved* by it (``u``, ``stat``: from the
  caller's or drawn / computed), or *given* by the caller: ``logp``, ``old_logp``, ``A``, ``mask``
  always, the others only when a rule reads them (:data:`GIVEN`: the keyword the caller passes, the
  shape, what to pass when it is missing). The remaining fields are the loss's, not a rule's
  (:data:`LOSS`: ``counts``, ``ref_logp``, ``weights``, ``correction_status``, ``token_splits``).
* Callers pass their tensors by *keyword* (:meth:`RuleInputs.of`: each field's keyword, e.g.
  ``advantages`` for ``A``, ``uniforms`` for ``u``, ``rewards`` for ``reward``): the vocabulary of
  ``policy_loss``, of a record's tensors and of the trainer's ``StepInputs``; a rule names the
  fields. :data:`CALL_KEYWORDS` lists them.
* Adding a given input is adding one field with :func:`given` (docs/objectives.md, "Adding a rule
  input"): the shape check, the padding, the missing-input error, the keyword of ``of`` and
  ``policy_loss``, the trainer's per-row slicing (of a ``StepInputs`` field of that keyword, which
  the producer of the values fills) and the replay's record lookup all read :data:`GIVEN`.
* Padding is neutralised once, in :meth:`RuleInputs.prepared` (the bound call's): log-ratio 0 (so
  r == 1 and s ignores padding), logp/old_logp 0, a per-token given input 0; so a rule never needs
  the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from clipbench.objectives.aggregation import Count, check_count
from clipbench.objectives.primitives import straight_through_exp

TOKEN, SEQUENCE = "(B, T)", "(B,)"  # the shapes a given input may have (B sequences, T completion tokens)
RULE, LOSS_INPUT = "rule", "loss"  # a field a rule may name, or one the loss reads around the rule


def _input(doc: str, keyword: str | None = None, kind: str = RULE, **meta) -> field:
    """A field: its meaning, the callers' keyword (None: derived by the call, no caller passes it)."""
    return field(default=None, metadata={"doc": doc, "keyword": keyword, "kind": kind, **meta})


def given(doc: str, shape: str, keyword: str, hint: str) -> field:
    """A rule input the caller passes when a rule reads it: ``keyword`` (the callers' keyword:
    :meth:`RuleInputs.of`'s and ``policy_loss``'s, and the record's tensor name) of ``shape``
    (:data:`TOKEN`: detached, float32, 0 at padding; :data:`SEQUENCE`: detached float32, as (B, 1));
    ``hint`` completes the error "reads the input '<name>': pass <keyword>=<shape> (<hint>)"."""
    return _input(doc, keyword, shape=shape, hint=hint)


def _loss(doc: str, keyword: str) -> field:
    """A field the loss reads around the rule (not a rule input)."""
    return _input(doc, keyword, LOSS_INPUT)


@dataclass(frozen=True)
class RuleInputs:
    """One call of a bound rule (B sequences, T completion tokens): the inputs a rule may name in its
    signature and what the loss around it reads. Build it with :meth:`of` (the callers' keywords).

    Fields (each one's meaning is its ``doc``; :data:`INPUTS` collects the rule inputs, :data:`LOSS`
    the loss's):
    """

    r: torch.Tensor = _input(
        "(B, T) token ratio exp(logp - old_logp), with gradient (log-ratio value-clamped to +-20, "
        "straight-through); 1 at padding"
    )
    A: torch.Tensor = _input("(B, 1) advantages, detached float32", "advantages")
    s: torch.Tensor = _input(
        "(B, 1) GSPO sequence ratio exp(sum_t mask*lr / sum_t mask), with gradient; 1 for an all-padding row"
    )
    logp: torch.Tensor = _input("(B, T) current log-probs, with gradient; 0 at padding", "logp")
    old_logp: torch.Tensor = _input("(B, T) behaviour log-probs, detached; 0 at padding", "old_logp")
    log_ratio: torch.Tensor = _input("(B, T) logp - old_logp, with gradient, not clamped; 0 at padding")
    mask: torch.Tensor = _input("(B, T) float 0/1, 1 on real completion tokens", "mask")
    u: torch.Tensor | None = _input(
        "(B, T) detached uniforms in [0, 1) for stochastic rules (zeros when the parameters need no draws)",
        "uniforms",
    )
    generator: torch.Generator | None = _input(
        "torch.Generator or None (prefer u: its draws do not depend on micro-batch splits)", "generator"
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
        "gradient on the whole mini-batch (all micro-batches and ranks) before its loss",
        "batch_stat",
    )
    counts: Counts | None = _loss(
        "Counts: the aggregation's normalisers, the whole mini-batch's when the call is one micro-batch "
        "of it (None: this call's own)",
        "counts",
    )
    ref_logp: torch.Tensor | None = _loss(
        "(B, T) the reference policy's log-probs: beta * k3 is added per token when beta > 0", "ref_logp"
    )
    weights: torch.Tensor | None = _loss(
        "(B, T) a detached per-token multiplier of the policy term (a sampler correction, e.g. truncated IS)",
        "weights",
    )
    correction_status: torch.Tensor | None = _loss(
        "(B, T) int8: what the sampler correction did to each token (per-cell counts; rejected tokens "
        "leave the counts)",
        "correction_status",
    )
    token_splits: dict | None = _loss(
        "{name: (B, T) bool}: each cell's tokens and out-of-band tokens also counted over each named subset "
        "(a MoE policy's tokens whose experts moved)",
        "token_splits",
    )

    @classmethod
    def of(cls, **keywords) -> RuleInputs:
        """The bundle of one call from the callers' keywords (:data:`CALL_KEYWORDS`: each field's, e.g.
        ``advantages``, ``uniforms``, ``rewards``, and the counts' own names, ``global_tokens`` ...,
        bundled into ``counts``). TypeError naming any other keyword."""
        unknown = keywords.keys() - _CALL_KEYWORDS
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {sorted(unknown)}: the call's inputs are {sorted(FIELD_OF)}, "
                f"rule inputs {sorted(KEYWORDS)}, counts {sorted(COUNT_KEYWORDS)}"
            )
        counted = {k: keywords.pop(k) for k in COUNT_KEYWORDS if k in keywords}
        if counted:
            if keywords.get("counts") is not None:
                raise TypeError(f"pass counts= or {sorted(counted)}, not both")
            keywords["counts"] = Counts(**counted)
        return cls(**{FIELD_OF[k]: v for k, v in keywords.items()})

    def check(self) -> None:
        """ValueError naming the keyword when a tensor has the wrong shape for logp's (B, T)."""
        if self.logp is None or self.logp.dim() != 2:
            got = "none" if self.logp is None else f"shape {tuple(self.logp.shape)}"
            raise ValueError(f"logp must be (B, T), got {got}")
        shape = tuple(self.logp.shape)
        for name in ("old_logp", "mask", "ref_logp", "weights", "u", "correction_status"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{KEYWORD[name]} must have logp's shape {shape}, got {tuple(t.shape)}")
        for name in ("old_logp", "mask"):
            if getattr(self, name) is None:
                raise ValueError(f"{name} is missing: pass {name}=(B, T)")
        if self.A is None or self.A.shape not in ((shape[0],), (shape[0], 1)):
            got = "none" if self.A is None else tuple(self.A.shape)
            raise ValueError(f"advantages must be (B,) = ({shape[0]},) (one per sequence), got {got}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(self.generator).__name__}")
        for name in GIVEN:
            check_given(name, getattr(self, name), shape)
        if self.counts is not None:
            self.counts.check(shape[0])

    def prepared(self, logp: torch.Tensor, maskf: torch.Tensor, u: torch.Tensor | None) -> RuleInputs:
        """The call's inputs as its rule sees them, padding neutralised: ``logp`` (B, T) float32, the
        log-probs the gradient is taken against (its graph kept), ``maskf`` (B, T) float 0/1, ``u`` the
        resolved uniforms; r, s and log_ratio derived; A as (B, 1); the given inputs detached float32."""
        logp = logp * maskf  # (B, T) with grad, 0 at padding
        old_logp = self.old_logp.detach().to(torch.float32) * maskf  # (B, T), 0 at padding
        log_ratio = logp - old_logp  # (B, T) with grad, 0 at padding
        n_tok = maskf.sum(-1, keepdim=True).clamp(min=1.0)
        return replace(
            self,
            r=straight_through_exp(log_ratio),  # (B, T), 1 at padding
            A=self.A.detach().to(torch.float32).reshape(-1, 1),  # (B, 1)
            s=straight_through_exp(log_ratio.sum(-1, keepdim=True) / n_tok),  # (B, 1), 1 for an all-padding row
            logp=logp,
            old_logp=old_logp,
            log_ratio=log_ratio,
            mask=maskf,
            u=u,
            **{name: _given_value(GIVEN[name], getattr(self, name), maskf) for name in GIVEN},
        )


def _given_value(spec: dict, t: torch.Tensor | None, maskf: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().to(torch.float32)
    return t * maskf if spec["shape"] == TOKEN else t.reshape(-1, 1)


_FIELDS = fields(RuleInputs)
# The inputs a rule may ask for by name, and their meaning (derived from RuleInputs: not a second list).
INPUTS: dict[str, str] = {f.name: f.metadata["doc"] for f in _FIELDS if f.metadata["kind"] == RULE}
# The fields the loss reads around the rule (no rule names them), and their meaning.
LOSS: dict[str, str] = {f.name: f.metadata["doc"] for f in _FIELDS if f.metadata["kind"] == LOSS_INPUT}
# The given inputs: field name -> {"shape", "keyword", "hint", "doc", "kind"}.
GIVEN: dict[str, dict] = {f.name: dict(f.metadata) for f in _FIELDS if "hint" in f.metadata}
# A given input's keyword (policy_loss's, RuleInputs.of's, the record's tensor name) -> its field.
KEYWORDS: dict[str, str] = {spec["keyword"]: name for name, spec in GIVEN.items()}
# Every field a caller passes -> its keyword, and back.
KEYWORD: dict[str, str] = {f.name: f.metadata["keyword"] for f in _FIELDS if f.metadata["keyword"]}
FIELD_OF: dict[str, str] = {kw: name for name, kw in KEYWORD.items()}
RuleInputs.__doc__ += "".join(f"\n    {name}: {doc}" for name, doc in INPUTS.items())
RuleInputs.__doc__ += "\n\n    The loss's (no rule names them):" + "".join(
    f"\n    {name}: {doc}" for name, doc in LOSS.items()
)


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
COUNT_KEYWORDS = tuple(f.name for f in fields(Counts))  # the counts by their own names (policy_loss's)
CALL_KEYWORDS = (*FIELD_OF, *COUNT_KEYWORDS)  # every keyword RuleInputs.of (and policy_loss) takes
_CALL_KEYWORDS = frozenset(CALL_KEYWORDS)
