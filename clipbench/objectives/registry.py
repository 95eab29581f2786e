"""The one registry of clip rules: ``METHODS``, the ``@rule`` decorator, lookups, rules' origins.

A rule is a plain function whose signature is its schema (signature.py)::

    @rule("lower_only", source="my idea")
    def lower_only(r, A, *, eps_low: float = 0.2):
        \"\"\"-min(r*A, max(r, 1-eps_low)*A): PPO clip with only the lower bound.\"\"\"
        return -torch.minimum(r * A, torch.clamp(r, min=1 - eps_low) * A)

``METHODS[name].defaults`` is the one place a method's defaults live (the config loader, the sweep
expander and the CLI read it). An unknown parameter gets a did-you-mean; errors in a rule's
definition are ``RuleDefinitionError`` (a UserError naming the file and line).

Where rules come from: the built-in ones (objectives/rules/, registered when the package is
imported), a user's files and modules (plugins.py imports them through :func:`import_rules`, so the
rules they register record their file and its sha256), and installed packages' ``clipbench.rules``
entry points, which this registry loads itself on the first lookup of a name it does not know.
``METHODS`` is a :class:`clipbench.registry.Registry` (the storage, origins, collisions, entry points
and did-you-mean every registry of clipbench shares); this module adds what a rule is.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from clipbench import registry as _registry
from clipbench.errors import RuleDefinitionError, RuleError, unknown_choice
from clipbench.objectives.primitives import LOG_RATIO_CLAMP
from clipbench.objectives.signature import Band, Check, Param, formula_and_description, read_signature
from clipbench.registry import IMPORTED, Origin, Registry, describe_origin, import_attributed
from clipbench.registry import sha256_file as sha256_file  # re-exported: plugins.py

# Reference band for out_of_band counts when a method has no eps (sapo): [1 - 0.2, 1 + 0.2].
DEFAULT_REF_EPS = 0.2
ENTRY_POINT_GROUP = "clipbench.rules"


PluginOrigin = Origin  # where a user's rule comes from: its file (resolved) and its sha256 (clipbench.registry)


class Registered:
    """What a registered rule and a registered correction share (both read from a function's
    signature, signature.py): parameters with defaults, a check between parameters, an origin."""

    @property
    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    @property
    def parameters(self) -> str:
        """The parameters in one line: `name=default` each, a choice's alternatives after it
        (`level=token (token/sequence)`); '-' for none (`clipbench methods`, docs/objectives.md)."""
        text = ", ".join(
            f"{p.name}={p.default}" + (f" ({'/'.join(p.choices)})" if p.choices else "") for p in self.params
        )
        return text or "-"

    @property
    def where(self) -> str:
        """'built-in' or 'plugin <path>' (for messages)."""
        return describe_origin(self.origin)

    def call(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        """The function itself; a plugin's exception becomes one RuleError line naming the kind, the
        name and the file (a built-in's propagates as it is: that is a bug of clipbench's)."""
        if self.origin is None:
            return self.fn(*args, **kwargs)
        try:
            return self.fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the user's code: one line that names it
            raise RuleError(f"{kind} '{self.name}' ({self.where}) raised {type(e).__name__}: {e}") from e

    def validated(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter: the defaults merged with `given`, each value checked, then the check between
        parameters. ValueError (did-you-mean) for an unknown parameter or a bad value."""
        known = {p.name: p for p in self.params}
        for key in given:
            if key not in known:
                raise ValueError(f"{self.name}: " + unknown_choice("parameter", key, known))
        out = {name: p.validate(self.name, given.get(name, p.default)) for name, p in known.items()}
        reason = self.check(out) if self.check is not None else None
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        return out


@dataclass(frozen=True)
class MethodSpec(Registered):
    """A registered clip rule. ``fn(*inputs, **params)`` returns the per-token loss."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]  # positional inputs, from INPUTS
    params: tuple[Param, ...]
    formula: str  # the docstring's first line
    description: str  # one line
    source: str  # paper / arXiv id / repository file
    level: str | Callable[[Mapping[str, Any]], str] = "token"  # which ratio the cells use
    band: Callable[[Mapping[str, Any]], Band] | None = None  # reference band for out_of_band
    draws: Callable[[Mapping[str, Any]], bool] | None = None  # does this setting need random draws
    bounds: Callable[[Mapping[str, Any]], dict] | None = None  # extra effective_bounds keys
    warn: Callable[[Mapping[str, Any]], str | None] | None = None  # a one-line warning for a setting
    origin: PluginOrigin | None = None  # None for a built-in rule
    per_call: bool = False  # a token's loss depends on other rows of the same call (clip_cov, kl_cov)
    batch_stat: Callable[..., dict] | None = None  # (r, A, mask, params) -> the mini-batch statistic `stat`
    check: Callable[[Mapping[str, Any]], str | None] | None = None  # a rule between parameters: reason or None

    def ratio_level(self, params: Mapping[str, Any]) -> str:
        """'token' when the rule's cells use the token ratio r, 'sequence' when GSPO's s."""
        return self.level(params) if callable(self.level) else self.level

    def reference_band(self, params: Mapping[str, Any]) -> Band:
        return (self.band or eps_band)(params)

    def needs_draws(self, params: Mapping[str, Any]) -> bool:
        """True when this parameter setting needs random draws (the rule reads ``u``)."""
        if self.draws is not None:
            return bool(self.draws(params))
        return "u" in self.inputs


def eps_band(params: Mapping[str, Any]) -> Band:
    """Reference band [1 - eps_low, 1 + eps_high] for both signs of A (0.2/0.2 without eps)."""
    lo = 1.0 - params.get("eps_low", DEFAULT_REF_EPS)
    hi = 1.0 + params.get("eps_high", DEFAULT_REF_EPS)
    return lo, hi, lo, hi


# The rules, in registration order; an unknown name first imports the installed packages'
# `clipbench.rules` entry points (their rules and corrections), then fails with a did-you-mean.
METHODS: Registry[MethodSpec] = Registry("rule", entry_points=ENTRY_POINT_GROUP, error=ValueError, asked_as="method")
LOADED = IMPORTED  # plugin spec (resolved path or module name) -> origin: each imported once
module_origin = Origin.of_module
import_rules = import_attributed  # run an import with the rules it registers attributed to an origin


def load_entry_points() -> None:
    """Import every module registered under the ``clipbench.rules`` entry-point group (once)."""
    _registry.load_entry_points(ENTRY_POINT_GROUP)


def _where(fn: Callable) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}"
    except (TypeError, AttributeError):
        return getattr(fn, "__module__", "?")


_origin_of = _registry.origin_of


_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def rule(
    name: str,
    *,
    source: str,
    level: str | Callable[[Mapping[str, Any]], str] = "token",
    band: Callable[[Mapping[str, Any]], Band] | None = None,
    draws: Callable[[Mapping[str, Any]], bool] | None = None,
    description: str | None = None,
    bounds: Callable[[Mapping[str, Any]], dict] | None = None,
    checks: Mapping[str, Check] | None = None,
    warn: Callable[[Mapping[str, Any]], str | None] | None = None,
    per_call: bool = False,
    batch_stat: Callable[..., dict] | None = None,
    check: Callable[[Mapping[str, Any]], str | None] | None = None,
):
    """Register a clip rule under ``name`` (see the module docstring; docs/plugins.md).

    source:      where the rule comes from (paper, arXiv id, repository file); required.
    level:       "token" (cells on r), "sequence" (cells on GSPO's s), or params -> one of them.
    band:        params -> (lo_pos, hi_pos, lo_neg, hi_neg), the reference band of out_of_band
                 (default [1-eps_low, 1+eps_high] when the rule has those parameters, else 0.2/0.2).
    draws:       params -> bool, whether this setting needs random draws (default: 'u' is an input).
    description: one line (default: the docstring's text after the formula).
    bounds:      params -> dict of extra effective-bound run params (logged as rule.*).
    checks:      {param: value -> reason or None}, e.g. nonneg, positive, unit_interval.
    warn:        params -> a one-line warning for a legal but suspicious setting, or None.
    check:       params -> the reason a setting is invalid (a rule between parameters), or None.
    per_call:    True when a token's loss depends on the other rows of the call (batch statistics,
                 e.g. clip_cov's covariance): such a rule is exact over micro-batch splits only
                 when the trainer does not split; say what the statistics range over in its docstring.
    batch_stat:  (r, A, mask, params) -> {name: 0-d tensor}: a statistic of the whole mini-batch the
                 rule reads as its input ``stat`` (no gradient; r (B, T) detached, 1 at padding; A
                 (B, 1); mask (B, T) float). ``policy_loss`` computes it on its own call unless the
                 caller passes the mini-batch's (``batch_stat=``: the trainer computes it over every
                 micro-batch and rank before the step's first backward), so the rule is exact under
                 micro-batching; its values are logged as ``stat/<name>``.
    """
    if not isinstance(source, str) or not source.strip():
        raise RuleDefinitionError(f"rule {name!r}: source= is required (the paper or repository it comes from)")
    if level not in ("token", "sequence") and not callable(level):
        raise RuleDefinitionError(f"rule {name!r}: level must be 'token', 'sequence' or a function of the params")

    def deco(fn):
        where = _where(fn)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RuleDefinitionError(
                f"{where}: rule name {name!r} must start with a letter and use letters, digits, '_', '-' or '.'"
            )
        inputs, params = read_signature(fn, dict(checks or {}), where)
        if ("stat" in inputs) != (batch_stat is not None):
            raise RuleDefinitionError(
                f"{where}: a rule reads the input 'stat' exactly when it declares "
                "batch_stat= (the function that computes it)"
            )
        formula, doc_description = formula_and_description(fn)
        desc = " ".join((description if description is not None else doc_description).split())
        origin = _origin_of(fn)
        METHODS.check_free(name, origin, where)
        spec = MethodSpec(
            name,
            fn,
            inputs,
            params,
            formula,
            desc,
            source.strip(),
            level,
            band,
            draws,
            bounds,
            warn,
            origin,
            bool(per_call),
            batch_stat,
            check,
        )
        METHODS.register(name, spec, origin=origin, where=where, source=spec.source)
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------------------------
def get_method(method: str) -> MethodSpec:
    """The spec of a registered method; rules of installed packages (entry points) load on first need."""
    return METHODS.lookup(method)


def reads_rollout_logp(method: str) -> bool:
    """Does the rule read the sampler's log-probs (the input rollout_logp: rollout_is)? Its run must
    have them: the sampler returns them, and engines that cannot pass them refuse it."""
    return "rollout_logp" in get_method(method).inputs


def validate_params(method: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults merged with ``params``, every value checked. Raises ValueError (did-you-mean) for an
    unknown method or parameter, or a bad value. A rule's ``warn`` is issued as a UserWarning."""
    spec = get_method(method)
    params = dict(params or {})
    if params.get("method", method) != method:
        raise ValueError(f"params name method '{params['method']}', not '{method}'")
    params.pop("method", None)  # a config's objective mapping may carry its method name
    out = spec.validated(params)
    if spec.warn is not None:
        message = spec.warn(out)
        if message:
            warnings.warn(f"{method}: {message}", UserWarning, stacklevel=2)
    return out


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def interval(lo: float, hi: float, closed: str = "[]") -> str:
    return f"{closed[0]}{_fmt(lo)}, {_fmt(hi)}{closed[1]}"


def effective_bounds(method: str, params: Mapping[str, Any] | None = None) -> dict[str, float | str]:
    """The rule's semantics as flat run params (what was clipped where), e.g. for grpo
    ``{"ratio_level": "token", "clip_low": 0.8, "clip_high": 1.2, "ref_band_pos": "[0.8, 1.2]", ...}``.

    ``ref_band_pos`` / ``ref_band_neg`` are the bands used for the ``out_of_band`` counts (A>0 / A<0;
    A == 0 tokens use the A>0 band); ``log_ratio_clamp`` is the value clamp applied before exp;
    ``plugin`` / ``plugin_sha256`` name a user's rule file."""
    spec = get_method(method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = validate_params(method, params)
    lo_p, hi_p, lo_n, hi_n = spec.reference_band(p)
    out: dict[str, float | str] = {
        "method": method,
        "ratio_level": spec.ratio_level(p),
        "ref_band_pos": interval(lo_p, hi_p),
        "ref_band_neg": interval(lo_n, hi_n),
        "log_ratio_clamp": LOG_RATIO_CLAMP,
    }
    if spec.origin is not None:
        out.update({"plugin": spec.origin.path, "plugin_sha256": spec.origin.sha256})
    if spec.bounds is not None:
        out.update(
            {
                k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
                for k, v in spec.bounds(p).items()
            }
        )
    return out
