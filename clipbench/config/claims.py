"""A preregistered family of claims: the comparisons a sweep's report tests, declared in the sweep file
before its first run and frozen with its manifest (docs/reports.md, "Preregistered claims").

    claims:                               # in a sweep file
      benchmark: arith                    # the split every accuracy verdict is read on (the test split)
      endpoints: [avg, pass, entropy]     # each comparison on each, unless the comparison names its own
      equivalence: [avg]                  # the endpoints whose "no difference" is also tested (TOST)
      margins: {avg: 3.0}                 # the equivalence margins, in the endpoint's unit
      compare:                            # a - b, paired by seed; the claim: a is higher than b
        - [dapo, grpo]
        - {a: nsr, b: dapo, endpoints: [avg], source: "NSR, abstract"}   # source: whose claim it is

An arm is a rule (`objective.name`): each rule of the comparison must have one setting in the sweep
(its own tuned learning rate, say), so that "dapo" names one arm. The report (report/claims/family.py) tests
exactly this family: per comparison and endpoint a difference claim (two-sided paired t over seeds, the
claimed sign +), and per comparison and equivalence endpoint an equivalence claim (two one-sided tests
against +-margin), Holm over all of them. Nothing here reads runs: this is the family's shape, checked
where it is read (the sweep file, one line naming the key) and stored as `to_dict` gives it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clipbench.errors import ConfigError, did_you_mean

# the endpoints a comparison may name: Avg@n and Pass@n at the last evaluation, the last fifth's
# entropy (what each measures, its value, unit, figure and claim: report/claims/endpoints.py, whose
# family endpoints tests/test_prereg_claims.py holds equal to these)
ENDPOINTS = ("avg", "pass", "entropy")
KEYS = ("benchmark", "endpoints", "equivalence", "margins", "compare")
COMPARE_KEYS = ("a", "b", "endpoints", "source")


@dataclass(frozen=True)
class Comparison:
    a: str  # a rule (objective.name)
    b: str
    endpoints: tuple[str, ...]
    source: str = ""  # whose claim it is (a paper), when it tests one


@dataclass(frozen=True)
class ClaimFamily:
    benchmark: str
    comparisons: tuple[Comparison, ...]
    equivalence: tuple[str, ...] = ()
    margins: Mapping[str, float] = field(default_factory=dict)

    def size(self) -> int:
        """The hypotheses the family holds (Holm's denominator): a difference per comparison and
        endpoint, an equivalence per comparison and equivalence endpoint it has."""
        return sum(len(c.endpoints) + sum(e in c.endpoints for e in self.equivalence) for c in self.comparisons)

    def rules(self) -> list[str]:
        return list(dict.fromkeys(r for c in self.comparisons for r in (c.a, c.b)))

    def to_dict(self) -> dict:
        return {
            "benchmark": self.benchmark,
            "equivalence": list(self.equivalence),
            "margins": dict(self.margins),
            "compare": [
                {"a": c.a, "b": c.b, "endpoints": list(c.endpoints)} | ({"source": c.source} if c.source else {})
                for c in self.comparisons
            ],
        }


def _endpoints(value: Any, src: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(src, key, f"expected a non-empty list of endpoints ({', '.join(ENDPOINTS)}), got {value!r}")
    for e in value:
        if e not in ENDPOINTS:
            raise ConfigError(
                src, key, f"unknown endpoint {e!r}{did_you_mean(str(e), ENDPOINTS)}; endpoints: {', '.join(ENDPOINTS)}"
            )
    if len(set(value)) != len(value):
        raise ConfigError(src, key, f"an endpoint is listed twice: {value!r}")
    return tuple(value)


def _text(value: Any, src: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(src, key, f"expected a non-empty string, got {value!r}")
    return value


def _comparison(item: Any, default: tuple[str, ...], src: str, key: str) -> Comparison:
    if isinstance(item, list):
        if len(item) != 2:
            raise ConfigError(src, key, f"expected [a, b] (two rules), got {item!r}")
        item = {"a": item[0], "b": item[1]}
    if not isinstance(item, Mapping):
        raise ConfigError(src, key, f"expected [a, b] or a mapping with a and b, got {type(item).__name__}")
    for k in item:
        if k not in COMPARE_KEYS:
            raise ConfigError(src, f"{key}.{k}", "unknown key" + did_you_mean(str(k), COMPARE_KEYS))
    for k in ("a", "b"):
        if k not in item:
            raise ConfigError(src, f"{key}.{k}", "missing: the comparison is a - b of two rules")
    a, b = _text(item["a"], src, f"{key}.a"), _text(item["b"], src, f"{key}.b")
    if a == b:
        raise ConfigError(src, key, f"compares {a!r} with itself")
    endpoints = _endpoints(item["endpoints"], src, f"{key}.endpoints") if "endpoints" in item else default
    source = _text(item["source"], src, f"{key}.source") if "source" in item else ""
    return Comparison(a, b, endpoints, source)


def parse_family(data: Any, src: str, key: str = "claims") -> ClaimFamily:
    """The family a sweep file's `claims` declares; ConfigError (file, key, reason) on any problem."""
    if not isinstance(data, Mapping):
        raise ConfigError(src, key, f"expected a mapping ({', '.join(KEYS)}), got {type(data).__name__}")
    for k in data:
        if k not in KEYS:
            raise ConfigError(
                src, f"{key}.{k}", "unknown key" + did_you_mean(str(k), KEYS) + f"; valid keys: {', '.join(KEYS)}"
            )
    if "benchmark" not in data:
        raise ConfigError(src, f"{key}.benchmark", "missing: the benchmark every accuracy verdict is read on")
    bench = _text(data["benchmark"], src, f"{key}.benchmark")
    default = _endpoints(data.get("endpoints", ["avg"]), src, f"{key}.endpoints")
    equivalence = _endpoints(data["equivalence"], src, f"{key}.equivalence") if "equivalence" in data else ()
    margins = data.get("margins", {})
    if not isinstance(margins, Mapping):
        raise ConfigError(src, f"{key}.margins", f"expected a mapping endpoint -> margin, got {margins!r}")
    for e, m in margins.items():
        if e not in ENDPOINTS:
            raise ConfigError(src, f"{key}.margins.{e}", "unknown endpoint" + did_you_mean(str(e), ENDPOINTS))
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0:
            raise ConfigError(src, f"{key}.margins.{e}", f"expected a number > 0, got {m!r}")
    for e in equivalence:
        if e not in margins:
            raise ConfigError(src, f"{key}.margins.{e}", f"missing: equivalence on {e!r} needs its margin, declared")
    items = data.get("compare")
    if not isinstance(items, list) or not items:
        raise ConfigError(src, f"{key}.compare", f"expected a non-empty list of comparisons, got {items!r}")
    comparisons = tuple(_comparison(it, default, src, f"{key}.compare[{i}]") for i, it in enumerate(items))
    seen: set[tuple[str, str]] = set()
    for i, c in enumerate(comparisons):
        if (c.a, c.b) in seen or (c.b, c.a) in seen:
            raise ConfigError(src, f"{key}.compare[{i}]", f"{c.a} - {c.b} is compared twice")
        seen.add((c.a, c.b))
    return ClaimFamily(bench, comparisons, equivalence, {e: float(m) for e, m in margins.items()})


def check_rules(family: ClaimFamily, rules: Sequence[str], src: str, key: str = "claims") -> None:
    """Every rule the family compares is a rule of the sweep's runs."""
    for i, c in enumerate(family.comparisons):
        for side, rule in (("a", c.a), ("b", c.b)):
            if rule not in rules:
                raise ConfigError(
                    src,
                    f"{key}.compare[{i}].{side}",
                    f"no run of this sweep has objective.name {rule!r}{did_you_mean(rule, rules)}; "
                    f"its rules: {', '.join(rules)}",
                )
