"""A rule's signature is its schema: inputs and parameters read from the function (torchtune style).

    inputs, params = read_signature(fn, checks, where)     # positional names -> INPUTS; keyword-only -> Params
    formula, description = formula_and_description(fn)      # the docstring's first line

* Positional parameters name the inputs the rule needs: the fields of ``inputs.RuleInputs``
  (:data:`INPUTS`: name -> meaning); any other positional name is a definition error.
* Keyword-only parameters with defaults are the rule's parameters. Their type comes from the
  annotation (float, int, bool, str, ``Literal["a", "b"]`` for a str with choices) or else from the
  default. Validation of a value: type, finiteness, choices, then the rule's ``checks``
  (``{param: check(value) -> reason or None}``, e.g. :func:`nonneg`).
* The docstring's first line is the formula shown by ``clipbench methods``; text after a top-level
  ``": "`` on that line is the one-line description.
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any, Literal

from clipbench.errors import RuleDefinitionError, unknown_choice
from clipbench.objectives.inputs import INPUTS  # the rule inputs: RuleInputs' fields

Band = tuple[float, float, float, float]  # (lo_pos, hi_pos, lo_neg, hi_neg) in ratio units
Check = Callable[[Any], "str | None"]


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


def param_type(name: str, annotation: Any, default: Any, where: str) -> tuple[type, tuple[str, ...]]:
    if annotation is inspect.Parameter.empty:
        t = type(default)
        if t not in (float, int, bool, str):
            raise RuleDefinitionError(
                f"{where}: parameter '{name}' has default {default!r}: parameters are "
                "float, int, bool or str (annotate Literal[...] for choices)"
            )
        return t, ()
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise RuleDefinitionError(f"{where}: parameter '{name}': Literal[...] choices must be strings")
        if default not in choices:
            raise RuleDefinitionError(f"{where}: parameter '{name}': default {default!r} is not one of {choices}")
        return str, tuple(choices)
    if annotation not in (float, int, bool, str):
        raise RuleDefinitionError(
            f"{where}: parameter '{name}': annotation {annotation!r} is not float, int, bool, str or Literal[...]"
        )
    ok = (
        isinstance(default, bool)
        if annotation is bool
        else isinstance(default, str)
        if annotation is str
        else isinstance(default, int) and not isinstance(default, bool)
        if annotation is int
        else isinstance(default, Real) and not isinstance(default, bool)
    )
    if not ok:
        raise RuleDefinitionError(f"{where}: parameter '{name}': default {default!r} is not a {annotation.__name__}")
    return annotation, ()


def read_signature(
    fn: Callable, checks: Mapping[str, Check], where: str, inputs_allowed: Mapping[str, str] | None = None
) -> tuple[tuple[str, ...], tuple[Param, ...]]:
    """(inputs, params) from the rule's signature (``inputs_allowed``: the input names, default the
    rules' :data:`INPUTS`; the sampler corrections name theirs)."""
    allowed = INPUTS if inputs_allowed is None else inputs_allowed
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: fall back to the defaults' types
        hints = {}
    inputs, params = [], []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise RuleDefinitionError(f"{where}: *args/**kwargs are not allowed: name the inputs and parameters")
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if p.name not in allowed:
                raise RuleDefinitionError(
                    f"{where}: '{p.name}' is not an input ({', '.join(allowed)}); parameters are keyword-only "
                    f"with defaults, after '*': def {fn.__name__}(r, A, *, {p.name}=...)"
                )
            inputs.append(p.name)
            continue
        if p.default is inspect.Parameter.empty:
            raise RuleDefinitionError(f"{where}: parameter '{p.name}' needs a default (the signature is the schema)")
        t, choices = param_type(p.name, hints.get(p.name, p.annotation), p.default, where)
        check = checks.get(p.name)
        default = float(p.default) if t is float else p.default
        params.append(Param(p.name, default, t, choices, (check,) if check else ()))
    unknown = set(checks) - {p.name for p in params}
    if unknown:
        raise RuleDefinitionError(f"{where}: checks for unknown parameter(s) {sorted(unknown)}")
    return tuple(inputs), tuple(params)


def top_level_colon(line: str) -> int:
    """Index of the first ': ' outside parentheses/brackets, or -1."""
    depth = 0
    for i, ch in enumerate(line):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ":" and depth == 0 and line[i + 1 : i + 2] == " ":
            return i
    return -1


def formula_and_description(fn: Callable) -> tuple[str, str]:
    doc = inspect.cleandoc(fn.__doc__ or "")
    if not doc:
        return "", ""
    paragraphs = doc.split("\n\n")
    first = paragraphs[0].splitlines()[0].strip()
    i = top_level_colon(first)
    if i >= 0:
        return first[:i].strip(), first[i + 2 :].strip()
    rest = " ".join(" ".join(paragraphs[1].split()).split(". ")[:1]) if len(paragraphs) > 1 else ""
    return first, rest.rstrip(".")
