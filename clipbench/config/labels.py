"""How a run is named in tables, progress lines and MLflow: the method, then the settings that make it
differ. The one owner of the format (the sweep's run labels, the report's group labels).

    format_value(0.25) -> "0.25"; format_value([0.9, 0.999]) -> "[0.9,0.999]"
    label({"objective.method": "nsr", "objective.p": 0.25, "seed": 1}) -> "nsr p=0.25 seed=1"
    label({"sampler.correction.name": "tis", "sampler.correction.cap": 3.0}) -> "correction=tis cap=3"
    group_label("nsr", [("p", 0.25)]) -> "nsr(p=0.25)"     # the runs of one setting, seeds pooled
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from clipbench.config.schema import SLOTS
from clipbench.config.stored import recorded_slot

OBJ = SLOTS["objective"].key + "."
METHOD_KEY = SLOTS["objective"].name_path  # a point's key of the method (the stored form: objective.method)
CORRECTION = SLOTS["correction"].key + "."  # its name labels as correction=<name>, its parameters by their own names


def format_value(v: Any) -> str:
    """A config value as in a run label: floats %g, lists [a,b]."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    return str(v)


def label(point: Mapping[str, Any]) -> str:
    """'nsr p=0.25 seed=1': the method, then the other axis values by their last key part."""
    parts = []
    if METHOD_KEY in point:
        parts.append(str(point[METHOD_KEY]))
    for k, v in point.items():
        if k == CORRECTION + "name":
            parts.append(f"correction={format_value(v)}")
        elif k != METHOD_KEY:
            short = k.startswith((OBJ, CORRECTION)) or k == "seed"
            parts.append(f"{k.rsplit('.', 1)[-1] if short else k}={format_value(v)}")
    return " ".join(parts) if parts else "(base)"


def run_label(config: Mapping, point: Mapping | None = None) -> str:
    """The label of a stored run config (a manifest's) at its sweep point: its method first."""
    point = dict(point or {})
    if METHOD_KEY not in point:
        objective = recorded_slot(config, "objective")
        point = {METHOD_KEY: objective.name if objective else "?", **point}
    return label(point)


def group_label(method: str, settings: Iterable[tuple[str, Any]]) -> str:
    """'nsr(p=0.25, delta=0.1)': a method and the settings that set its runs apart (report groups)."""
    parts = [f"{k}={format_value(v)}" for k, v in settings]
    return method + (f"({', '.join(parts)})" if parts else "")
