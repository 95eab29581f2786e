"""Which rules a replay runs: `--rules all|a,b,c`, with parameters and grids as in `clipbench methods`.

    parse_rules("grpo,dapo(eps_high=0.28,0.4),nsr(p=0.5)")   # -> grpo, dapo(eps_high=0.28), dapo(eps_high=0.4), nsr(p=0.5)
    parse_rules("all")                                        # every registered rule at its defaults

A spec is a rule name with optional `(key=value, ...)`; a key followed by several values
(`eps_high=0.28,0.4`) is a grid, and several grids multiply. Values are YAML scalars (numbers,
true/false, strings). Every parameter set is checked by the registry (`validate_params`): a bad one
is a one-line UserError naming the spec.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from clipbench.errors import UserError, unknown_choice
from clipbench.objectives import METHODS, validate_params
from clipbench.yamlio import YamlError, load_yaml_text


@dataclass(frozen=True)
class RuleSpec:
    """One rule to replay: a registered method with all its parameters (defaults filled in)."""

    method: str
    params: tuple[tuple[str, object], ...]  # sorted (name, value), every parameter of the method

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    @property
    def label(self) -> str:
        """`method` at its defaults, else `method(k=v, ...)` with the parameters that differ."""
        defaults = METHODS[self.method].defaults
        changed = [f"{k}={_fmt(v)}" for k, v in self.params if defaults.get(k) != v]
        return f"{self.method}({','.join(changed)})" if changed else self.method

    @classmethod
    def of(cls, method: str, params: dict) -> RuleSpec:
        try:
            full = validate_params(method, dict(params))
        except ValueError as e:
            raise UserError(f"--rules: {e}") from None
        return cls(method, tuple(sorted(full.items())))


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v).lower() if isinstance(v, bool) else str(v)


def _split_top(text: str) -> list[str]:
    """`text` split at commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise UserError(f"--rules: unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise UserError(f"--rules: unbalanced '(' in {text!r}")
    return [p.strip() for p in parts + [cur] if p.strip()]


def _value(raw: str, spec: str):
    try:
        return load_yaml_text(raw.strip())
    except YamlError as e:
        raise UserError(f"--rules: {spec}: value {raw!r} is not a number, boolean or string ({e.reason})") from None


def _grid(spec: str) -> list[RuleSpec]:
    name, _, rest = spec.partition("(")
    name = name.strip()
    if name not in METHODS:
        raise UserError("--rules: " + unknown_choice("rule", name, sorted(METHODS)))
    if not rest:
        return [RuleSpec.of(name, {})]
    if not rest.endswith(")"):
        raise UserError(f"--rules: {spec!r}: parameters go in parentheses, e.g. dapo(eps_high=0.28,0.4)")
    axes: dict[str, list] = {}
    key = None
    for item in rest[:-1].split(","):
        if "=" in item:
            key, raw = item.split("=", 1)
            key = key.strip()
            axes[key] = [_value(raw, spec)]
        elif key is None:
            raise UserError(f"--rules: {spec!r}: {item.strip()!r} has no parameter name (write key=value)")
        else:
            axes[key].append(_value(item, spec))
    return [RuleSpec.of(name, dict(zip(axes, combo))) for combo in itertools.product(*axes.values())]


def parse_rules(text: str | None) -> list[RuleSpec]:
    """The rules of `--rules` in the order given, duplicates dropped; `all` (or None): every registered
    rule at its defaults (plugins included once imported)."""
    if text is None or text.strip() == "all":
        return [RuleSpec.of(m, {}) for m in sorted(METHODS)]
    out: list[RuleSpec] = []
    for spec in _split_top(text):
        for r in [RuleSpec.of(m, {}) for m in sorted(METHODS)] if spec == "all" else _grid(spec):
            if r not in out:
                out.append(r)
    if not out:
        raise UserError("--rules: no rule given (e.g. --rules all, or --rules grpo,dapo(eps_high=0.28,0.4))")
    return out
