"""The one registry of clip rules: names, parameters with their defaults and checks, metadata.

A rule registers itself with :func:`register` (verl ``core_algos`` style)::

    @register("grpo", params=(EPS_LOW(0.2), EPS_HIGH(0.2)), description=..., rule=..., source=...)
    def grpo(ctx, *, eps_low, eps_high): ...

Each parameter is declared once, with its default and its range check; ``METHODS[name].defaults``
is the one place a method's defaults live (the config loader and the CLI read it).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable, Mapping

from clipbench.errors import unknown_choice

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp (value only, straight-through gradient):
# r <= e^20 ~ 4.9e8 stays finite in float32 even for log-ratios of +-50 (see context.py).
LOG_RATIO_CLAMP = 20.0
# Reference band for out_of_band counts when a method has no eps (sapo): [1 - 0.2, 1 + 0.2].
DEFAULT_REF_EPS = 0.2


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One method parameter: its name, default, a one-line help and its range check.

    ``check(value)`` returns None when the value is valid, else the reason ("must be > 0").
    ``choices`` is set for string parameters.
    """

    name: str
    default: Any
    help: str
    check: Callable[[Any], str | None]
    choices: tuple[str, ...] = ()

    def validate(self, method: str, value: Any) -> Any:
        if self.choices:
            if not isinstance(value, str) or value not in self.choices:
                raise ValueError(f"{method}: " + unknown_choice(f"value for '{self.name}'", value, self.choices))
            return value
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
            raise ValueError(f"{method}: '{self.name}' must be a finite number, got {value!r}")
        value = float(value)
        reason = self.check(value)
        if reason:
            raise ValueError(f"{method}: '{self.name}' {reason}, got {value!r}")
        return value


def _nonneg(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def _unit(v: float) -> str | None:
    return None if 0.0 <= v <= 1.0 else "must be in [0, 1]"


def _gt_one(v: float) -> str | None:
    return None if v > 1.0 else "must be > 1"


def _choice(_v: Any) -> str | None:  # choices are checked in Param.validate
    return None


def EPS_LOW(default: float) -> Param:
    return Param("eps_low", default, "lower clip: band starts at 1 - eps_low", _nonneg)


def EPS_HIGH(default: float) -> Param:
    return Param("eps_high", default, "upper clip: band ends at 1 + eps_high", _nonneg)


def ABC_EPS(i: int, default: float = 0.2) -> Param:
    side = {1: "A>0 upper", 2: "A>0 lower", 3: "A<0 upper", 4: "A<0 lower"}[i]
    return Param(f"eps{i}", default, f"ABC band, {side}", _nonneg)


NSR_PARAMS: tuple[Param, ...] = (
    EPS_LOW(0.2),
    EPS_HIGH(0.28),
    Param("delta", 0.1, "width of the rescue band past each bound (ratio units)", _positive),
    Param("p", 0.5, "rescue probability p(d) scale", _unit),
    Param("schedule", "const", "p(d) = p (const) or p * (1 - d / delta) (linear)", _choice, ("const", "linear")),
    Param("sides", "both", "which bound(s) rescue: both, upper (A>0), lower (A<0)", _choice,
          ("both", "upper", "lower")),
    Param("base", "token", "token: grpo rule on r; sequence: gspo rule on s (one draw per sequence)", _choice,
          ("token", "sequence")),
)


# --------------------------------------------------------------------------------------------
# Method specs
# --------------------------------------------------------------------------------------------
Band = tuple[float, float, float, float]  # (lo_pos, hi_pos, lo_neg, hi_neg) in ratio units


def eps_band(params: Mapping[str, Any]) -> Band:
    """Reference band [1 - eps_low, 1 + eps_high] for both signs of A (0.2/0.2 without eps)."""
    lo = 1.0 - params.get("eps_low", DEFAULT_REF_EPS)
    hi = 1.0 + params.get("eps_high", DEFAULT_REF_EPS)
    return lo, hi, lo, hi


@dataclass(frozen=True)
class MethodSpec:
    """A registered clip rule. ``fn(ctx, **params) -> RuleOut`` is the pure tensor rule."""

    name: str
    fn: Callable[..., Any]
    params: tuple[Param, ...]
    description: str  # one line
    rule: str  # the per-token loss as a formula
    source: str  # paper / arXiv id
    level: str = "token"  # "token", "sequence", or "base" (the `base` parameter decides)
    band: Callable[[Mapping[str, Any]], Band] = eps_band
    bounds: Callable[[Mapping[str, Any]], dict] | None = None  # method-specific effective_bounds keys

    @property
    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def ratio_level(self, params: Mapping[str, Any]) -> str:
        """'token' when the rule acts on r, 'sequence' when it acts on GSPO's s."""
        return params["base"] if self.level == "base" else self.level


METHODS: dict[str, MethodSpec] = {}


def register(name: str, *, params: tuple[Param, ...], description: str, rule: str, source: str,
             level: str = "token", band: Callable[[Mapping[str, Any]], Band] = eps_band,
             bounds: Callable[[Mapping[str, Any]], dict] | None = None):
    """Register ``fn`` under ``name``. The rule's keyword-only arguments must be exactly ``params``."""

    def deco(fn):
        if name in METHODS:
            raise ValueError(f"method '{name}' is already registered")
        kwonly = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
        if sorted(kwonly) != sorted(p.name for p in params):
            raise TypeError(f"rule for '{name}' takes {kwonly}, declared params are {[p.name for p in params]}")
        METHODS[name] = MethodSpec(name, fn, tuple(params), description, rule, source, level, band, bounds)
        return fn

    return deco


def get_method(method: str) -> MethodSpec:
    try:
        return METHODS[method]
    except (KeyError, TypeError):
        raise ValueError(unknown_choice("method", method, METHODS)) from None


def validate_params(method: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults merged with ``params``, every value checked. Raises ValueError (did-you-mean) for an
    unknown method or parameter, or a value out of range."""
    spec = get_method(method)
    params = dict(params or {})
    if params.get("method", method) != method:
        raise ValueError(f"params name method '{params['method']}', not '{method}'")
    params.pop("method", None)  # a config's objective mapping may carry its method name
    known = {p.name: p for p in spec.params}
    for key in params:
        if key not in known:
            raise ValueError(f"{method}: " + unknown_choice("parameter", key, known))
    return {name: p.validate(method, params.get(name, p.default)) for name, p in known.items()}


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def interval(lo: float, hi: float, closed: str = "[]") -> str:
    return f"{closed[0]}{_fmt(lo)}, {_fmt(hi)}{closed[1]}"


def effective_bounds(method: str, params: Mapping[str, Any] | None = None) -> dict[str, float | str]:
    """The rule's semantics as flat run params (what was clipped where), e.g. for grpo
    ``{"ratio_level": "token", "clip_low": 0.8, "clip_high": 1.2, "ref_band_pos": "[0.8, 1.2]", ...}``.

    ``ref_band_pos`` / ``ref_band_neg`` are the bands used for the ``out_of_band`` counts (A>0 / A<0;
    A == 0 tokens use the A>0 band); ``log_ratio_clamp`` is the value clamp applied before exp."""
    spec = get_method(method)
    p = validate_params(method, params)
    lo_p, hi_p, lo_n, hi_n = spec.band(p)
    out: dict[str, float | str] = {
        "method": method,
        "ratio_level": spec.ratio_level(p),
        "ref_band_pos": interval(lo_p, hi_p),
        "ref_band_neg": interval(lo_n, hi_n),
        "log_ratio_clamp": LOG_RATIO_CLAMP,
    }
    if spec.bounds is not None:
        out.update(spec.bounds(p))
    return out
