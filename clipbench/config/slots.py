"""The components of a run (`schema.SLOTS`: the objective, the sampler correction, the aggregation,
the advantage) in the forms a config gives them, and their registries.

Every form reads to one `Slot` (`read_slot`), whichever layer wrote it:

    objective: {name: dapo, eps_high: 0.3}     the one form (every slot: train.agg: {name: token-mean})
    objective: dapo                            a bare name (the stored form of train.agg, train.advantage)
    objective: {method: dapo, eps_high: 0.3}   the older form (the stored form of the objective)
    sampler: {mismatch_is: token}              the former truncated-IS keys (`migrate`)

An error names a component's name by the key that gave it, as written (`objective.name`, or the
older `objective.method`). `stored` writes a component in its stored form, for
`clipbench.config.stored.to_dict`, and `stored_form` a whole mapping read as it is (a stored
config's run id, the report). `slot_components` and `resolve_slot` read each slot's registry,
`checked` resolves a component against it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

from clipbench.config import dotted
from clipbench.config.schema import SLOTS, RunConfig, Slot, SlotDecl, choices, value_at
from clipbench.errors import ConfigError, unknown_choice

# ---------------------------------------------------------------------------------------------
# Keys that changed shape: a config written before reads as today's (manifests, run configs, recipes)

LEGACY_CORRECTION = ("mismatch_is", "mismatch_is_cap")  # sampler.* -> sampler.correction (truncated IS)


def migrate(data: Mapping, source: str | None = None) -> dict:
    """`data` in today's shape: `sampler.mismatch_is` / `mismatch_is_cap` (truncated IS, before the
    corrections had a registry) become `sampler.correction` ({name: none} or {name: tis, level,
    floor, cap}: the same weights). The components' other forms are left as written."""
    sampler = data.get("sampler") if isinstance(data, Mapping) else None
    if not isinstance(sampler, Mapping):
        return dict(data)
    sampler = dict(sampler)
    old = {k: sampler.pop(k) for k in LEGACY_CORRECTION if k in sampler}
    if not old:
        return dict(data)
    if "correction" in sampler:
        raise ConfigError(source, "sampler.mismatch_is", "replaced by sampler.correction: set only the latter")
    mode, cap = old.get("mismatch_is", "none"), old.get("mismatch_is_cap", 2.0)
    if mode not in ("none", "token", "sequence"):
        raise ConfigError(source, "sampler.mismatch_is", unknown_choice("value", mode, ("none", "token", "sequence")))
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
    return {**data, "sampler": sampler}


# ---------------------------------------------------------------------------------------------
# The layers of a config (a recipe, the overrides) before they are merged


def layer(data: Mapping) -> dict:
    """One layer of a config with each component that takes parameters given as a mapping (a bare
    name becomes ``{name: ...}``), so that a later layer's parameters merge into it; the name stays
    in the spelling the layer wrote (``name`` or the older ``method``)."""
    out = dict(data)
    for decl in SLOTS.values():
        value = _at(out, decl.key)
        if not decl.bare and isinstance(value, str):
            out = dotted.replaced(out, decl.key, {"name": value})
    return out


def renamed(base: Mapping, over: Mapping) -> dict:
    """`base` without the name of each component that the later layer `over` names: merged, the later
    layer's name replaces the earlier one's, whichever spelling each uses."""
    out = dict(base)
    for decl in SLOTS.values():
        earlier, later = _at(out, decl.key), _at(over, decl.key)
        if isinstance(earlier, Mapping) and isinstance(later, Mapping) and any(k in later for k in decl.spellings):
            out = dotted.replaced(out, decl.key, {k: v for k, v in earlier.items() if k not in decl.spellings})
    return out


# ---------------------------------------------------------------------------------------------
# Reading and writing one component


def read_slot(decl: SlotDecl, value: Any, source: str | None = None) -> tuple[Slot, str]:
    """(the component, the dotted key that named it, as written) of a slot's value in any of its
    forms; a mapping without a name takes the schema's. Its parameters are not checked (`checked`);
    ConfigError naming the key for a value that is not one component: a name that is not one string,
    a name set twice (``name`` and its older spelling), parameters for a component that takes none."""
    if isinstance(value, Mapping):
        params = copy.deepcopy(dict(value))
        spelled = [k for k in decl.spellings if k in params]
        if len(spelled) > 1:
            raise ConfigError(
                source,
                f"{decl.key}.name",
                f"set the name once: {decl.key}.name ({decl.key}.{decl.name_key} is its older form)",
            )
        key = f"{decl.key}.{spelled[0] if spelled else 'name'}"
        name = params.pop(spelled[0]) if spelled else _default(decl.slot).name
    else:
        params, key, name = {}, decl.key, value
    if not isinstance(name, str):
        several = f"; to compare several, make it a sweep axis (grid: {key}: [...])" if isinstance(name, list) else ""
        raise ConfigError(source, key, f"must be one {decl.noun} name, got {type(name).__name__} {name!r}{several}")
    if decl.bare and params:
        raise ConfigError(source, f"{decl.key}.{sorted(params)[0]}", f"the {decl.slot} '{name}' takes no parameters")
    return Slot(name, params), key


def read_slots(data: Mapping, source: str | None = None) -> tuple[dict, dict[str, Slot], dict[str, str]]:
    """(`data` without its component slots, {slot: its component} (the schema's default where `data`
    gives none), {slot: the dotted key that named it, as written})."""
    rest, components, named = dict(data), {}, {}
    for which, decl in SLOTS.items():
        value = _at(rest, decl.key)
        if value is _ABSENT:
            components[which], named[which] = _default(which), f"{decl.key}.name"
            continue
        rest = dotted.without(rest, decl.key)
        components[which], named[which] = read_slot(decl, value, source)
    return rest, components, named


def stored(decl: SlotDecl, slot: Slot) -> Any:
    """A component in its stored form (docs/config.md): the bare name where the slot's components take
    no parameters, else ``{<name_key>: name, <param>: value, ...}`` (``method`` for the objective)."""
    return slot.name if decl.bare else {decl.name_key: slot.name, **copy.deepcopy(slot.params)}


def stored_form(d: Mapping) -> dict:
    """A mapping read as it is (nothing filled in, nothing checked but each component's form) in the
    stored form: the former correction keys as `sampler.correction`, each component as `stored`
    writes it (a stored config's run id, the report's reading of a run's config.yaml)."""
    out = migrate(d)
    for decl in SLOTS.values():
        value = _at(out, decl.key)
        if value is not _ABSENT:
            out = dotted.replaced(out, decl.key, stored(decl, read_slot(decl, value)[0]))
    return out


@functools.cache
def _default(which: str) -> Slot:
    return value_at(RunConfig(), SLOTS[which].key)


# ---------------------------------------------------------------------------------------------
# The slots' registries


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


def checked(decl: SlotDecl, slot: Slot, key: str, source: str | None = None) -> Slot:
    """`slot` with every parameter resolved by its registry (read now: after the run's plugins).
    ConfigError naming `key` (the name's key, as written) for an unknown name, the parameter's key
    for a bad parameter."""
    components = slot_components(decl.slot)
    if slot.name not in components:
        raise ConfigError(source, key, unknown_choice(decl.noun, slot.name, components))
    try:
        return Slot(slot.name, resolve_slot(decl.slot, slot.name, slot.params))
    except (ValueError, TypeError) as e:
        own = components[slot.name]
        bad = next((k for k in slot.params if k not in own), None)
        if bad is None:  # a value error: the offending parameter from the message, when it names one
            bad = next((k for k in slot.params if f"'{k}'" in str(e) or str(k) in str(e)), None)
        raise ConfigError(source, f"{decl.key}.{bad}" if bad else decl.key, str(e)) from None


_ABSENT = object()


def _at(d: Mapping, key: str) -> Any:
    return dotted.value(d, key, _ABSENT)
