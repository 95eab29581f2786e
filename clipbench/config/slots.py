"""The components of a run (`schema.SLOTS`: the objective, the sampler correction, the aggregation,
the advantage) in their YAML forms: the one form ``{name: <component>, <param>: ...}``, the older
forms that still load, and the stored form (docs/config.md); their registries' names and defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clipbench.config.schema import SLOTS, RunConfig, Slot, SlotDecl, choices, value_at
from clipbench.errors import ConfigError, unknown_choice

# Keys that changed shape: a config written before reads as today's (manifests, run configs, recipes)

LEGACY_CORRECTION = ("mismatch_is", "mismatch_is_cap")  # sampler.* -> sampler.correction (truncated IS)
CORRECTION_KEY = "sampler.correction"


def migrate(data: Mapping, source: str | None = None) -> dict:
    """`data` in today's shape: `sampler.mismatch_is` / `mismatch_is_cap` (truncated IS, before the
    corrections had a registry) become `sampler.correction` ({name: none} or {name: tis, level,
    cap}: the same weights); a bare name (`sampler.correction: icepop`) becomes {name: icepop}."""
    sampler = data.get("sampler") if isinstance(data, Mapping) else None
    if not isinstance(sampler, Mapping):
        return dict(data)
    sampler = dict(sampler)
    old = {k: sampler.pop(k) for k in LEGACY_CORRECTION if k in sampler}
    if old:
        if "correction" in sampler:
            raise ConfigError(source, "sampler.mismatch_is", "replaced by sampler.correction: set only the latter")
        mode, cap = old.get("mismatch_is", "none"), old.get("mismatch_is_cap", 2.0)
        if mode not in ("none", "token", "sequence"):
            raise ConfigError(
                source, "sampler.mismatch_is", unknown_choice("value", mode, ("none", "token", "sequence"))
            )
        sampler["correction"] = (
            {"name": "none"}
            if mode == "none"
            else {
                "name": "tis",
                "level": mode,
                "floor": 0.0,
                "cap": float(cap) if isinstance(cap, int) and not isinstance(cap, bool) else cap,
            }
        )
    return one_form({**data, "sampler": sampler}, source)


def one_form(data: Mapping, source: str | None = None) -> dict:
    """Every component slot (`schema.SLOTS`) of `data` in its stored form: the one YAML form
    ``{name: <component>, <param>: ...}`` and a bare name both become ``{method: ...}`` for the
    objective, ``{name: ...}`` for the correction, the bare name for the aggregation and the
    advantage (whose components take no parameters). A partial layer (overrides) is left partial."""
    out = dict(data)
    for decl in SLOTS.values():
        head, _, rest = decl.key.partition(".")
        section = out if not rest else out.get(head)
        if not isinstance(section, Mapping) or (rest or head) not in section:
            continue
        value = _stored_slot(decl, section[rest or head], source)
        out = {**out, head: value} if not rest else {**out, head: {**section, rest: value}}
    return out


def _stored_slot(decl: SlotDecl, value: Any, source: str | None) -> Any:
    if isinstance(value, str) and not decl.bare:
        return {decl.name_key: value}
    if not isinstance(value, Mapping) or "name" not in value:
        return value
    if decl.bare:
        extra = sorted(k for k in value if k != "name")
        if extra:
            raise ConfigError(
                source, f"{decl.key}.{extra[0]}", f"the {decl.slot} '{value['name']}' takes no parameters"
            )
        return value["name"]
    if decl.name_key == "name":
        return dict(value)
    if decl.name_key in value:
        raise ConfigError(
            source,
            f"{decl.key}.name",
            f"set the name once: {decl.key}.name ({decl.key}.{decl.name_key} is its older form)",
        )
    return {(decl.name_key if k == "name" else k): v for k, v in value.items()}


def slot(cfg: RunConfig, which: str) -> Slot:
    """The component in slot `which` (objective | correction | aggregation | advantage) of a
    validated RunConfig, its parameters resolved."""
    decl = SLOTS[which]
    value = value_at(cfg, decl.key)
    if decl.bare:
        return Slot(value)
    params = dict(value)
    return Slot(params.pop(decl.name_key), params)


def slot_components(which: str) -> dict[str, dict[str, Any]]:
    """{component name: its parameters' defaults} of a slot's registry (read at call time: the run's
    plugins may have added to it)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.objectives import METHODS  # noqa: PLC0415
    from clipbench.objectives.corrections import CORRECTIONS, correction_names  # noqa: PLC0415

    if which == "objective":
        return {m: dict(spec.defaults) for m, spec in METHODS.items()}
    if which == "correction":
        return {n: dict(CORRECTIONS[n].defaults) if n in CORRECTIONS else {} for n in correction_names()}
    return dict.fromkeys(choices()[SLOTS[which].key], {})


def resolve_slot(which: str, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of component `name` in slot `which`: its registry's defaults merged with
    `params` and checked (ValueError naming the problem)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.objectives import validate_params  # noqa: PLC0415
    from clipbench.objectives.corrections import validate_correction  # noqa: PLC0415

    if which == "objective":
        return validate_params(name, dict(params))
    if which == "correction":
        out = validate_correction({"name": name, **params})
        out.pop("name")
        return out
    if params:
        raise ValueError(f"the {which} '{name}' takes no parameters, got {sorted(params)}")
    return {}
