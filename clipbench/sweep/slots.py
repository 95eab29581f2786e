"""The components of a run as sweep axes: one rule for every slot of `clipbench.config.schema.SLOTS`
(the objective, the sampler correction, the aggregation, the advantage).

    grid:
      objective.name: [grpo, dapo, nsr]        # (objective.method: the older form of the same axis)
      objective.p: [0.25, 0.5]                 # applies to the methods that declare p only
      sampler.correction.name: [none, tis, icepop]
      sampler.correction.cap: [2.0, 3.0]       # applies to tis only
      train.agg.name: [token-mean, seq-mean-token-mean]   # (train.agg: the older form)

The rule: a point's component is the slot's name axis value (else the base's name) with the
parameters that component declares (its registry's defaults,
`clipbench.config.slots.slot_components`) taken from the base's explicit settings (recipe <
overrides < command line) and then the point's axis values; a value the component does not declare
is dropped for that run (and the runs deduplicated by id). A parameter that no component of the
sweep has is an error (a typo), except in the base recipe (it belonged to the recipe's component).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from clipbench.config.schema import SLOTS, SlotDecl, slot_of
from clipbench.config.slots import migrate, resolve_slot, slot_components
from clipbench.errors import ConfigError, did_you_mean, unknown_choice

CORRECTION = SLOTS["correction"]
# The former truncated-IS keys: fine in overrides (read as the sampler.correction they meant), not as axes.
LEGACY = {"sampler.mismatch_is": CORRECTION.name_path, "sampler.mismatch_is_cap": CORRECTION.key + ".cap"}


def stored_key(key: str) -> str:
    """A sweep key in the stored form (a point's key): `objective.name` -> `objective.method`,
    `train.agg.name` -> `train.agg`; every other key unchanged."""
    hit = slot_of(key)
    return hit[0].name_path if hit and hit[1] is None else key


def stored_keys(layer: Mapping[str, Any], source: str, where: str = "") -> dict:
    """A layer of dotted keys in the stored form; a layer that names one component twice (its one
    form and its older form) is refused."""
    out: dict = {}
    for k, v in layer.items():
        key = stored_key(k)
        if key in out:
            raise ConfigError(source, f"{where}{k}", f"names the same setting as {key}: set one of them")
        out[key] = v
    return out


def given_keys(spec) -> dict[str, str]:
    """{the place of a key in its stored form: the place as the sweep file or command line gave it}
    for the keys `stored_spec` renames, so that an error names the key the user wrote."""
    places = [(f"{ax.where}.", k) for ax in spec.axes for k in ax.keys]
    places += [("overrides.", k) for k in spec.overrides] + [("", k) for k in spec.cli_overrides]
    places += [("exclude.", k) for e in spec.exclude for k in e]
    return {where + stored_key(k): where + k for where, k in places if stored_key(k) != k}


def stored_spec(spec):
    """The sweep spec with every key in the stored form (its axes, overrides, command line, excludes)."""
    axes, seen = [], set()
    for ax in spec.axes:
        keys = tuple(stored_keys(dict.fromkeys(ax.keys), spec.source, f"{ax.where}."))
        for k, given in zip(keys, ax.keys):
            if k in seen:
                raise ConfigError(spec.source, f"{ax.where}.{given}", f"names the same setting as {k}: set one of them")
            seen.add(k)
        axes.append(replace(ax, keys=keys))
    return replace(
        spec,
        overrides=stored_keys(spec.overrides, spec.source, "overrides."),
        cli_overrides=stored_keys(spec.cli_overrides, "command line"),
        axes=tuple(axes),
        exclude=tuple(stored_keys(e, spec.source, "exclude.") for e in spec.exclude),
    )


def former_keys(layer: Mapping[str, Any]) -> dict:
    """An overrides layer with the former `sampler.mismatch_is` / `mismatch_is_cap` as the
    `sampler.correction` they meant (the same weights; as the config loader's `migrate`)."""
    if not any(k in LEGACY for k in layer):
        return dict(layer)
    former = {k.split(".", 1)[1]: layer[k] for k in LEGACY if k in layer}
    out = {k: v for k, v in layer.items() if k not in LEGACY}
    out[CORRECTION.key] = migrate({"sampler": former})["sampler"]["correction"]
    return out


def is_slot_param(key: str) -> bool:
    """Whether a dotted key is a parameter of a slot's component (checked by the slot's rule)."""
    hit = slot_of(key)
    return hit is not None and hit[1] is not None


@dataclass
class SlotRule:
    """One slot's part of a sweep: the names of its runs, the explicit parameter settings, and the
    component of each grid point."""

    decl: SlotDecl
    base_name: str
    explicit: dict[str, Any]  # param -> value (recipe < overrides < command line), checked
    components: dict[str, dict[str, Any]]  # name -> its parameters' defaults

    def param(self, key: str) -> str | None:
        return key[len(self.decl.key) + 1 :] if key.startswith(self.decl.key + ".") and key != self.name_key else None

    @property
    def name_key(self) -> str:
        return self.decl.name_path

    def component(self, assign: Mapping[str, Any]) -> tuple[str, dict[str, Any], set[str]]:
        """(name, parameters, the keys of `assign` that apply) of the point `assign`."""
        name = assign.get(self.name_key, self.base_name)
        own = self.components[name]
        params = {k: v for k, v in self.explicit.items() if k in own}
        applies = {self.name_key} & set(assign)
        for k, v in assign.items():
            p = self.param(k)
            if p is not None and p in own:
                params[p] = v
                applies.add(k)
        return name, params, applies


def build_rule(
    decl: SlotDecl,
    base_name: str,
    settings: list[tuple[str, Any, str, str]],
    axes,
    file_axes,
    recipe: str,
    source: str,
) -> SlotRule:
    """The slot's rule for a sweep. `settings`: the base's explicit parameter settings (param, value,
    source, where), recipe first; `axes`: the sweep's (command-line pins applied); `file_axes`: the
    sweep file's own (a command line that pins the name makes the file's parameter axes
    inapplicable, not wrong). Unknown names and parameters are refused, naming the sweep key."""
    components = slot_components(decl.slot)
    noun = decl.noun
    names = _names(decl, base_name, axes, components, noun, source)
    file_names = [n for n in _axis_names(decl, file_axes) if isinstance(n, str) and n in components]
    known = {p for n in set(names) | set(file_names) for p in components[n]}

    def check(name: str, value: Any, src: str, where: str) -> None:
        if name not in known:
            owners = sorted(n for n in components if name in components[n])
            hint = (
                f"; only {', '.join(owners)} {'has' if len(owners) == 1 else 'have'} it"
                if owners
                else did_you_mean(name, sorted({p for n in components for p in components[n]}))
            )
            raise ConfigError(
                src,
                where,
                f"no {noun} in this sweep ({', '.join(sorted(set(names)))}) has parameter '{name}'{hint}"
                + (f"; their parameters: {', '.join(sorted(known))}" if known else ""),
            )
        for n in dict.fromkeys(names):
            if name in components[n]:
                try:
                    resolve_slot(decl.slot, n, {name: value})
                except (ValueError, TypeError) as e:
                    raise ConfigError(src, where, str(e)) from None

    explicit = {}
    for name, value, src, where in settings:
        if src == recipe and name not in known:
            continue  # the recipe's own component's parameter
        check(name, value, src, where)
        explicit[name] = value
    rule = SlotRule(decl, base_name, explicit, components)
    for ax in axes:
        for j, k in enumerate(ax.keys):
            p = rule.param(k)
            if p is not None:
                for vals in ax.values:
                    check(p, vals[j], source, f"{ax.where}.{k}")
    return rule


def _axis_names(decl: SlotDecl, axes) -> list:
    return [v for ax in axes for k, col in zip(ax.keys, zip(*ax.values)) if k == decl.name_path for v in col]


def _names(decl: SlotDecl, base_name: str, axes, components: Mapping, noun: str, source: str) -> list[str]:
    """The component names of the sweep's runs (the name axis, else the base's); unknown ones refused."""
    for ax in axes:
        if decl.name_path in ax.keys:
            j = ax.keys.index(decl.name_path)
            for vals in ax.values:
                if not isinstance(vals[j], str) or vals[j] not in components:
                    raise ConfigError(source, f"{ax.where}.{decl.name_path}", unknown_choice(noun, vals[j], components))
            return [vals[j] for vals in ax.values]
    return [base_name]
