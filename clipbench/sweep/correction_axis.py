"""The sampler correction as a sweep axis: `sampler.correction.name` and its parameters as dotted keys.

    grid:
      sampler.correction.name: [none, tis, icepop, geo_mask]
      sampler.correction.cap: [2.0, 3.0]        # applies to tis only: dropped for the other names

Like the objective's parameters, a correction parameter applies only to the corrections that declare
it (`clipbench.objectives.corrections.CORRECTIONS[name].defaults`): an inapplicable value is dropped
for that run (and the runs deduplicated by id), a parameter no correction of the sweep has is an
error. A point whose name differs from the base config's starts from that correction's defaults (the
base's parameters belong to the base's correction); a point with the base's name keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clipbench.config.load import migrate
from clipbench.errors import ConfigError, did_you_mean, unknown_choice
from clipbench.objectives.corrections import CORRECTIONS, NONE, correction_names

KEY = "sampler.correction"
PREFIX = KEY + "."
NAME = PREFIX + "name"
LEGACY = {"sampler.mismatch_is": NAME, "sampler.mismatch_is_cap": PREFIX + "cap"}


def former_keys(layer: Mapping[str, Any]) -> dict:
    """An overrides layer with the former `sampler.mismatch_is` / `mismatch_is_cap` as the
    `sampler.correction` they meant (the same weights; as the config loader's `migrate`)."""
    if not any(k in LEGACY for k in layer):
        return dict(layer)
    former = {k.split(".", 1)[1]: layer[k] for k in LEGACY if k in layer}
    out = {k: v for k, v in layer.items() if k not in LEGACY}
    out[KEY] = migrate({"sampler": former})["sampler"]["correction"]
    return out


def _params(name: str) -> dict:
    return {} if name == NONE or name not in CORRECTIONS else CORRECTIONS[name].defaults


def check_keys(places: list[tuple[str, str, str]], names: list[str]) -> None:
    """Every `sampler.correction.<param>` of the sweep file or command line names a parameter of a
    correction of the sweep (`names`); places: (key, source, where)."""
    known = {p for n in names for p in _params(n)}
    for key, src, where in places:
        if not key.startswith(PREFIX) or key == NAME:
            continue
        param = key[len(PREFIX) :]
        if param not in known:
            owners = sorted(n for n in CORRECTIONS if param in CORRECTIONS[n].defaults)
            hint = (
                f"; only {', '.join(owners)} {'has' if len(owners) == 1 else 'have'} it"
                if owners
                else did_you_mean(param, sorted({p for n in CORRECTIONS for p in _params(n)}))
            )
            raise ConfigError(
                src,
                where,
                f"no correction in this sweep ({', '.join(sorted(set(names)))}) has parameter '{param}'{hint}",
            )


def sweep_names(axes, base_name: str, source: str) -> list[str]:
    """The correction names of the sweep's runs (the name axis, else the base's); unknown ones refused."""
    names = [base_name]
    for ax in axes:
        if NAME in ax.keys:
            j = ax.keys.index(NAME)
            for vals in ax.values:
                if vals[j] not in correction_names():
                    raise ConfigError(
                        source, f"{ax.where}.{NAME}", unknown_choice("correction", vals[j], correction_names())
                    )
            names = [vals[j] for vals in ax.values]
    return names


def point(assign: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[dict, set[str]]:
    """(the assignments with this point's `sampler.correction` mapping in place of its dotted keys,
    the dotted keys that apply to it). `base`: the base config's resolved correction."""
    dotted = {k: v for k, v in assign.items() if k.startswith(PREFIX)}
    if not dotted:
        return dict(assign), set()
    name = dotted.get(NAME, base["name"])
    own = _params(name)
    applies = {k for k in dotted if k == NAME or k[len(PREFIX) :] in own}
    start = {k: v for k, v in base.items() if k != "name"} if name == base["name"] else {}
    setting = {"name": name, **start, **{k[len(PREFIX) :]: v for k, v in dotted.items() if k in applies and k != NAME}}
    out = {k: v for k, v in assign.items() if not k.startswith(PREFIX)}
    out[KEY] = setting
    return out, applies
