"""The registry of sampler/trainer corrections: ``CORRECTIONS``, the ``@correction`` decorator, lookups.

A correction is a plain function whose signature is its schema, like a rule (signature.py)::

    @correction("icepop", source="verl rollout_corr_helper.py ...", level="token")
    def icepop(d, mask, *, low: float = 0.5, high: float = 5.0):
        \"\"\"rho if low <= rho <= high else 0: IcePop token mask\"\"\"
        rho = ratio(d)
        keep = (rho >= low) & (rho <= high)
        return applied(torch.where(keep, rho, 0.0), masked=~keep)

Its positional parameters name its inputs (:data:`CORRECTION_INPUTS`: ``d`` = log rho = trainer's old
log-prob - sampler's log-prob, 0 at padding, ``mask``, and ``A`` the advantages); its keyword-only parameters, with
defaults, are its parameters (validated as a rule's: types, choices, ``checks``, then ``check`` for
rules between parameters). It returns :class:`Applied`: the per-token weights and what it did to
each token (kept, truncated, masked: the numerator only; rejected: out of the aggregation's
denominators too, as verl's rejection sampling does to its response mask) and the raw per-unit
statistic it thresholds (logged before any truncation). ``denominator`` states which of the two its
masked tokens are, following its source.

Plugins register corrections exactly as rules (a file or module named in ``plugins``); the origin
is recorded the same way (registry.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from clipbench.errors import RuleDefinitionError
from clipbench.objectives.registry import _NAME, ENTRY_POINT_GROUP, PluginOrigin, Registered, _origin_of, _where
from clipbench.objectives.signature import Check, Param, formula_and_description, read_signature
from clipbench.registry import Registry

CORRECTION_INPUTS: dict[str, str] = {
    "d": "(B, T) log rho = log pi_old(y_t) - log pi_sampler(y_t) (the trainer's old log-prob minus the "
    "sampler's), float32, not clamped; 0 at padding",
    "mask": "(B, T) bool, True on real completion tokens",
    "A": "(B, 1) the sequences' advantages, float32 (apply_correction(..., advantages=))",
}

# What a correction did to each token (Applied.status): the per-cell counts read these codes.
KEPT, TRUNCATED, MASKED, REJECTED = 0, 1, 2, 3
STATUS = {KEPT: "kept", TRUNCATED: "truncated", MASKED: "masked", REJECTED: "rejected"}


class Applied(NamedTuple):
    """A correction's output: weights (B, T) (or (B, 1), broadcast), status (B, T) int8 codes, raw
    (B, T) or (B, 1): the per-unit statistic it thresholds, before truncation (token or sequence)."""

    weights: torch.Tensor
    status: torch.Tensor
    raw: torch.Tensor


def applied(
    weights: torch.Tensor,
    raw: torch.Tensor,
    *,
    truncated: torch.Tensor | None = None,
    masked: torch.Tensor | None = None,
    rejected: torch.Tensor | None = None,
) -> Applied:
    """An :class:`Applied` from boolean flags (broadcastable to the weights' (B, T)); later flags win."""
    status = torch.zeros(torch.broadcast_shapes(weights.shape, raw.shape), dtype=torch.int8, device=weights.device)
    for code, flag in ((TRUNCATED, truncated), (MASKED, masked), (REJECTED, rejected)):
        if flag is not None:
            status = torch.where(flag, torch.tensor(code, dtype=torch.int8, device=status.device), status)
    return Applied(weights, status, raw)


@dataclass(frozen=True)
class CorrectionSpec(Registered):
    """A registered correction. ``fn(*inputs, **params)`` returns :class:`Applied`."""

    name: str
    fn: Callable[..., Applied]
    inputs: tuple[str, ...]
    params: tuple[Param, ...]
    formula: str
    description: str
    source: str
    level: str | Callable[[Mapping[str, Any]], str]  # "token" | "sequence" (or of the params): its unit
    denominator: str  # "keep": masked tokens stay in every count; "drop": rejected tokens leave them
    check: Callable[[Mapping[str, Any]], str | None] | None = None
    origin: PluginOrigin | None = None

    def unit(self, params: Mapping[str, Any]) -> str:
        """'token' or 'sequence': the unit this setting truncates or masks."""
        return self.level(params) if callable(self.level) else self.level


NONE = "none"  # no correction: the mismatch is measured, nothing is re-weighted
NONE_SUMMARY = "no correction (the mismatch is still measured)"
MASKED_TOKENS = {"keep": "stay in the denominators", "drop": "leave the denominators"}  # by `denominator`
# The corrections, in registration order ('none' is valid and no entry); installed packages' entry
# points of the rules' group load on the first unknown name, as for the rules.
CORRECTIONS: Registry[CorrectionSpec] = Registry(
    "correction", entry_points=ENTRY_POINT_GROUP, error=ValueError, also=(NONE,)
)


def correction(
    name: str,
    *,
    source: str,
    level: str | Callable[[Mapping[str, Any]], str] = "token",
    denominator: str = "keep",
    checks: Mapping[str, Check] | None = None,
    check: Callable[[Mapping[str, Any]], str | None] | None = None,
    description: str | None = None,
):
    """Register a sampler correction under ``name`` (see the module docstring).

    source:      the implementation it follows (repository file and commit); required.
    level:       "token" or "sequence" (or params -> one of them): the unit it truncates or masks.
    denominator: "keep" (masked tokens stay in the aggregation's counts: TRL, SkyRL, slime, OpenRLHF,
                 NeMo-RL, AReaL) or "drop" (its rejected tokens leave them: verl's rollout_rs).
    checks:      {param: value -> reason or None}; check: params -> reason or None (between params).
    """
    if not isinstance(source, str) or not source.strip():
        raise RuleDefinitionError(f"correction {name!r}: source= is required")
    if (level not in ("token", "sequence") and not callable(level)) or denominator not in ("keep", "drop"):
        raise RuleDefinitionError(f"correction {name!r}: level is 'token' or 'sequence', denominator 'keep' or 'drop'")

    def deco(fn):
        where = _where(fn)
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name == NONE:
            raise RuleDefinitionError(
                f"{where}: correction name {name!r} must start with a letter (and is not '{NONE}')"
            )
        inputs, params = read_signature(fn, dict(checks or {}), where, CORRECTION_INPUTS)
        if "name" in {p.name for p in params}:
            raise RuleDefinitionError(f"{where}: 'name' is the correction's key in the config; rename the parameter")
        formula, doc = formula_and_description(fn)
        origin = _origin_of(fn)
        CORRECTIONS.check_free(name, origin, where)
        spec = CorrectionSpec(
            name,
            fn,
            inputs,
            params,
            formula,
            " ".join((description if description is not None else doc).split()),
            source.strip(),
            level,
            denominator,
            check,
            origin,
        )
        CORRECTIONS.register(name, spec, origin=origin, where=where, source=spec.source)
        return fn

    return deco


def get_correction(name: str) -> CorrectionSpec:
    if name == NONE:  # valid, but no entry: nothing to load
        raise ValueError(CORRECTIONS.unknown(name))
    return CORRECTIONS.lookup(name)


def correction_names() -> tuple[str, ...]:
    return (NONE, *CORRECTIONS)


def validate_correction(setting: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """``{"name": ..., **every parameter}`` from a config's mapping (or a bare name): the
    correction's defaults merged and checked. ValueError (did-you-mean) for an unknown name or
    parameter, or a bad value."""
    if setting is None or isinstance(setting, str):
        setting = {"name": setting or NONE}
    if not isinstance(setting, Mapping):
        raise ValueError(f"expected a mapping {{name: ..., <param>: ...}}, got {setting!r}")
    params = dict(setting)
    name = params.pop("name", NONE)
    if name == NONE:
        if params:
            raise ValueError(f"correction '{NONE}' has no parameters, got {sorted(params)}")
        return {"name": NONE}
    return {"name": name, **get_correction(name).validated(params)}


def correction_params(setting: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, parameters) of a validated setting."""
    params = dict(setting)
    return params.pop("name", NONE), params


def describe(setting: Mapping[str, Any]) -> dict[str, Any]:
    """The correction's semantics as flat run params (logged as correction.*)."""
    name, params = correction_params(validate_correction(setting))
    if name == NONE:
        return {"name": NONE}
    spec = CORRECTIONS[name]
    out = {"name": name, "unit": spec.unit(params), "denominator": spec.denominator, **params}
    if spec.origin is not None:
        out.update({"plugin": spec.origin.path, "plugin_sha256": spec.origin.sha256})
    return out
