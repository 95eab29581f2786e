"""The one registry of clip rules: the ``@rule`` decorator, parameters read from signatures, metadata.

A rule is a plain function whose signature is its schema (torchtune style)::

    @rule("lower_only", source="my idea")
    def lower_only(r, A, *, eps_low: float = 0.2):
        \"\"\"-min(r*A, max(r, 1-eps_low)*A): PPO clip with only the lower bound.\"\"\"
        return -torch.minimum(r * A, torch.clamp(r, min=1 - eps_low) * A)

* Positional parameters name the inputs the rule needs, from :data:`INPUTS` (built by
  ``policy_loss``, see loss.py); any other positional name is a registration error.
* Keyword-only parameters with defaults are the rule's parameters. Their type comes from the
  annotation (float, int, bool, str, ``Literal["a", "b"]`` for a str with choices) or else from the
  default. ``METHODS[name].defaults`` is the one place a method's defaults live (the config loader,
  the sweep expander and the CLI read it).
* The docstring's first line is the formula shown by ``clipbench methods``; text after a top-level
  ``": "`` on that line is the one-line description (or pass ``description=``).

Validation of a parameter value: type, finiteness, choices, then the rule's ``checks``
(``{param: check(value) -> reason or None}``); an unknown parameter gets a did-you-mean. Errors in a
rule's definition are :class:`RuleDefinitionError` (a UserError naming the file and line).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import re
import typing
import warnings
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from clipbench.errors import UserError, unknown_choice

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp (value only, straight-through gradient):
# r <= e^20 ~ 4.9e8 stays finite in float32 even for log-ratios of +-50 (see loss.py).
LOG_RATIO_CLAMP = 20.0
# Reference band for out_of_band counts when a method has no eps (sapo): [1 - 0.2, 1 + 0.2].
DEFAULT_REF_EPS = 0.2

# The inputs a rule may ask for by name (shapes: B sequences, T completion tokens):
INPUTS: dict[str, str] = {
    "r": "(B, T) token ratio exp(logp - old_logp), with gradient (log-ratio value-clamped to +-20, "
         "straight-through); 1 at padding",
    "A": "(B, 1) advantages, detached float32",
    "s": "(B, 1) GSPO sequence ratio exp(sum_t mask*lr / sum_t mask), with gradient; 1 for an all-padding row",
    "logp": "(B, T) current log-probs, with gradient; 0 at padding",
    "old_logp": "(B, T) behaviour log-probs, detached; 0 at padding",
    "log_ratio": "(B, T) logp - old_logp, with gradient, not clamped; 0 at padding",
    "mask": "(B, T) float 0/1, 1 on real completion tokens",
    "u": "(B, T) detached uniforms in [0, 1) for stochastic rules (zeros when the parameters need no draws)",
    "generator": "torch.Generator or None (prefer u: its draws do not depend on micro-batch splits)",
}

Band = tuple[float, float, float, float]  # (lo_pos, hi_pos, lo_neg, hi_neg) in ratio units
Check = Callable[[Any], "str | None"]


class RuleDefinitionError(UserError):
    """A rule whose definition is wrong (bad signature, clashing name); names its file and line."""


class RuleError(UserError):
    """A rule that misbehaves at call time (e.g. returns the wrong shape); names the rule and file."""


# --------------------------------------------------------------------------------------------
# Checks for ``rule(..., checks={param: check})``: value -> reason, or None when valid
# --------------------------------------------------------------------------------------------
def nonneg(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def unit_interval(v: float) -> str | None:
    return None if 0.0 <= v <= 1.0 else "must be in [0, 1]"


def greater_than_one(v: float) -> str | None:
    return None if v > 1.0 else "must be > 1"


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One rule parameter, read from a keyword-only argument of the rule's signature."""

    name: str
    default: Any
    type: type  # float, int, bool or str
    choices: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()

    def validate(self, method: str, value: Any) -> Any:
        def bad(reason: str):
            return ValueError(f"{method}: '{self.name}' {reason}, got {value!r}")

        if self.type is bool:
            if not isinstance(value, bool):
                raise bad("must be true or false")
        elif self.type is str:
            if not isinstance(value, str):
                raise bad("must be a string")
            if self.choices and value not in self.choices:
                raise ValueError(f"{method}: " + unknown_choice(f"value for '{self.name}'", value, self.choices))
        else:  # float or int
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
                raise bad("must be a finite number")
            if self.type is int:
                if float(value) != int(value):
                    raise bad("must be an integer")
                value = int(value)
            else:
                value = float(value)
        for check in self.checks:
            reason = check(value)
            if reason:
                raise bad(reason)
        return value


@dataclass(frozen=True)
class PluginOrigin:
    """Where a user's rule comes from: its file (resolved) and the sha256 of the file's content."""

    path: str
    sha256: str

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True)
class MethodSpec:
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
    warn: Callable[[Mapping[str, Any]], "str | None"] | None = None  # a one-line warning for a setting
    origin: PluginOrigin | None = None  # None for a built-in rule
    per_call: bool = False  # a token's loss depends on other rows of the same call (clip_cov, kl_cov)

    @property
    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def where(self) -> str:
        """'built-in' or 'plugin <path>' (for messages)."""
        return "built-in" if self.origin is None else f"plugin {self.origin.path}"

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


METHODS: dict[str, MethodSpec] = {}

# The plugin being imported (set by plugins.py while it imports a user's file), so that the rules
# it registers record their origin.
_LOADING: list[PluginOrigin] = []


@contextlib.contextmanager
def loading_plugin(origin: PluginOrigin):
    _LOADING.append(origin)
    try:
        yield
    finally:
        _LOADING.pop()


def _where(fn: Callable) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}"
    except (TypeError, AttributeError):
        return getattr(fn, "__module__", "?")


def _origin_of(fn: Callable) -> PluginOrigin | None:
    if _LOADING:
        return _LOADING[-1]
    module = getattr(fn, "__module__", "") or ""
    if module.startswith("clipbench.objectives"):
        return None  # built-in
    path = inspect.getsourcefile(fn) if hasattr(fn, "__code__") else None
    if path and Path(path).is_file():
        p = Path(path).resolve()
        return PluginOrigin(str(p), hashlib.sha256(p.read_bytes()).hexdigest())
    return PluginOrigin(module or "<unknown>", "")


def _param_type(name: str, annotation: Any, default: Any, where: str) -> tuple[type, tuple[str, ...]]:
    if annotation is inspect.Parameter.empty:
        t = type(default)
        if t not in (float, int, bool, str):
            raise RuleDefinitionError(f"{where}: parameter '{name}' has default {default!r}: parameters are "
                                      "float, int, bool or str (annotate Literal[...] for choices)")
        return t, ()
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise RuleDefinitionError(f"{where}: parameter '{name}': Literal[...] choices must be strings")
        if default not in choices:
            raise RuleDefinitionError(f"{where}: parameter '{name}': default {default!r} is not one of {choices}")
        return str, tuple(choices)
    if annotation not in (float, int, bool, str):
        raise RuleDefinitionError(f"{where}: parameter '{name}': annotation {annotation!r} is not float, int, "
                                  "bool, str or Literal[...]")
    ok = (isinstance(default, bool) if annotation is bool
          else isinstance(default, str) if annotation is str
          else isinstance(default, int) and not isinstance(default, bool) if annotation is int
          else isinstance(default, Real) and not isinstance(default, bool))
    if not ok:
        raise RuleDefinitionError(f"{where}: parameter '{name}': default {default!r} is not a {annotation.__name__}")
    return annotation, ()


def _signature(fn: Callable, checks: Mapping[str, Check], where: str) -> tuple[tuple[str, ...], tuple[Param, ...]]:
    """(inputs, params) from the rule's signature."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: fall back to the defaults' types
        hints = {}
    inputs, params = [], []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise RuleDefinitionError(f"{where}: *args/**kwargs are not allowed: name the inputs and parameters")
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if p.name not in INPUTS:
                raise RuleDefinitionError(
                    f"{where}: '{p.name}' is not an input ({', '.join(INPUTS)}); parameters are keyword-only "
                    f"with defaults, after '*': def {fn.__name__}(r, A, *, {p.name}=...)")
            inputs.append(p.name)
            continue
        if p.default is inspect.Parameter.empty:
            raise RuleDefinitionError(f"{where}: parameter '{p.name}' needs a default (the signature is the schema)")
        t, choices = _param_type(p.name, hints.get(p.name, p.annotation), p.default, where)
        check = checks.get(p.name)
        default = float(p.default) if t is float else p.default
        params.append(Param(p.name, default, t, choices, (check,) if check else ()))
    unknown = set(checks) - {p.name for p in params}
    if unknown:
        raise RuleDefinitionError(f"{where}: checks for unknown parameter(s) {sorted(unknown)}")
    return tuple(inputs), tuple(params)


def _top_level_colon(line: str) -> int:
    """Index of the first ': ' outside parentheses/brackets, or -1."""
    depth = 0
    for i, ch in enumerate(line):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ":" and depth == 0 and line[i + 1:i + 2] == " ":
            return i
    return -1


def _formula_and_description(fn: Callable) -> tuple[str, str]:
    doc = inspect.cleandoc(fn.__doc__ or "")
    if not doc:
        return "", ""
    paragraphs = doc.split("\n\n")
    first = paragraphs[0].splitlines()[0].strip()
    i = _top_level_colon(first)
    if i >= 0:
        return first[:i].strip(), first[i + 2:].strip()
    rest = " ".join(" ".join(paragraphs[1].split()).split(". ")[:1]) if len(paragraphs) > 1 else ""
    return first, rest.rstrip(".")


_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def rule(name: str, *, source: str, level: str | Callable[[Mapping[str, Any]], str] = "token",
         band: Callable[[Mapping[str, Any]], Band] | None = None,
         draws: Callable[[Mapping[str, Any]], bool] | None = None, description: str | None = None,
         bounds: Callable[[Mapping[str, Any]], dict] | None = None, checks: Mapping[str, Check] | None = None,
         warn: Callable[[Mapping[str, Any]], "str | None"] | None = None, per_call: bool = False):
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
    per_call:    True when a token's loss depends on the other rows of the call (batch statistics,
                 e.g. clip_cov's covariance): such a rule is exact over micro-batch splits only
                 when the trainer does not split; say what the statistics range over in its docstring.
    """
    if not isinstance(source, str) or not source.strip():
        raise RuleDefinitionError(f"rule {name!r}: source= is required (the paper or repository it comes from)")
    if level not in ("token", "sequence") and not callable(level):
        raise RuleDefinitionError(f"rule {name!r}: level must be 'token', 'sequence' or a function of the params")

    def deco(fn):
        where = _where(fn)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RuleDefinitionError(f"{where}: rule name {name!r} must start with a letter and use letters, "
                                      "digits, '_', '-' or '.'")
        inputs, params = _signature(fn, dict(checks or {}), where)
        formula, doc_description = _formula_and_description(fn)
        desc = " ".join((description if description is not None else doc_description).split())
        origin = _origin_of(fn)
        old = METHODS.get(name)
        if old is not None:
            if old.origin is None and origin is not None:
                raise RuleDefinitionError(f"{where}: '{name}' is a built-in rule (built-in names win): rename yours")
            same = (old.origin is None and origin is None) or (
                old.origin is not None and origin is not None and old.origin.path == origin.path)
            if not same:
                raise RuleDefinitionError(f"{where}: rule '{name}' is already registered by {old.where}")
        METHODS[name] = MethodSpec(name, fn, inputs, params, formula, desc, source.strip(), level, band, draws,
                                   bounds, warn, origin, bool(per_call))
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------------------------
def get_method(method: str) -> MethodSpec:
    """The spec of a registered method; rules of installed packages (entry points) load on first need."""
    if isinstance(method, str) and method not in METHODS:
        from clipbench.objectives.plugins import load_entry_points

        load_entry_points()
    try:
        return METHODS[method]
    except (KeyError, TypeError):
        raise ValueError(unknown_choice("method", method, METHODS)) from None


def validate_params(method: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults merged with ``params``, every value checked. Raises ValueError (did-you-mean) for an
    unknown method or parameter, or a bad value. A rule's ``warn`` is issued as a UserWarning."""
    spec = get_method(method)
    params = dict(params or {})
    if params.get("method", method) != method:
        raise ValueError(f"params name method '{params['method']}', not '{method}'")
    params.pop("method", None)  # a config's objective mapping may carry its method name
    known = {p.name: p for p in spec.params}
    for key in params:
        if key not in known:
            raise ValueError(f"{method}: " + unknown_choice("parameter", key, known))
    out = {name: p.validate(method, params.get(name, p.default)) for name, p in known.items()}
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
        out.update({k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
                    for k, v in spec.bounds(p).items()})
    return out
