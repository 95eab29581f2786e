"""The run config as a plain mapping and back, and the readers of stored run configs.

`to_dict` writes the stored form (what a run's config.yaml and a sweep's manifest record, and what
the run id hashes): each component slot in its older form (`slots.stored`: ``objective: {method:
...}``, a bare name for train.agg and train.advantage), so that every run id and results store
stays valid. `from_dict` reads a mapping in the stored form or any other form a config may give
(`slots.read_slot`) back into a RunConfig. These two are the only translation between the typed
slots and the stored form (and `slots.stored_form`, theirs for a mapping read as it is: the run id
of a stored config, the report). `setting`, `recorded` and `recorded_slot` read one key of a stored config (a manifest's, a
run's config.yaml), perhaps written before the key existed (docs/config.md, "Reading a run config").
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from clipbench import yamlio
from clipbench.config.schema import SLOTS, RunConfig, Slot, leaf_keys, value_at
from clipbench.config.slots import migrate, read_slot, read_slots, stored


def to_dict(cfg: RunConfig) -> dict:
    """The stored form of a RunConfig: plain, JSON-able, fully resolved (a validated RunConfig holds
    plain values only), each component in its stored form."""
    out = dataclasses.asdict(cfg)
    for decl in SLOTS.values():
        head, _, rest = decl.key.partition(".")
        value = stored(decl, value_at(cfg, decl.key))
        if rest:
            out[head][rest] = value
        else:
            out[head] = value
    return out


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The structured config of RunConfig, built once (OmegaConf.merge copies it)."""
    return OmegaConf.structured(RunConfig)


def from_dict(d: Mapping) -> RunConfig:
    """A RunConfig from a (nested) mapping in the stored form or any form a config may give, typed
    by OmegaConf's structured-config rules (strings converted to numbers where the schema says so,
    unknown keys refused); values not checked."""
    return typed(d)[0]


def typed(d: Mapping, source: str | None = None) -> tuple[RunConfig, dict[str, str]]:
    """(`from_dict(d)`, {slot: the dotted key that named its component, as written}): the validator's
    reading, whose errors name the keys a user wrote."""
    rest, components, named = read_slots(migrate(d, source), source)
    cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(_schema(), OmegaConf.create(rest)))  # type: ignore[assignment]
    for which, slot in components.items():
        set_slot(cfg, which, slot)
    return cfg, named


def set_slot(cfg: RunConfig, which: str, slot: Slot) -> None:
    """Put `slot` in the slot `which` of `cfg` (a validated component replacing its unresolved one)."""
    section, _, name = SLOTS[which].key.rpartition(".")
    setattr(value_at(cfg, section) if section else cfg, name, slot)


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    return to_dict(RunConfig())


@functools.lru_cache(maxsize=1)
def _readable() -> tuple[frozenset[str], tuple[str, ...]]:
    """(the leaf keys of the run config, the free-form mappings among them: objective, trl,
    sampler.correction, whose own keys are their components' parameters)."""

    leaves = leaf_keys()
    flat = yamlio.flatten(_defaults())
    return frozenset(leaves), tuple(k for k in leaves if k not in flat or isinstance(flat[k], dict))


def setting(config: Mapping, key: str) -> Any:
    """The value of the dotted run-config `key` in its stored form (a leaf, or a parameter inside the
    objective, the correction or `trl`) in a stored run config (a manifest's, a run's config.yaml,
    perhaps written before the key existed), where a key it lacks reads as the
    schema's default (the one owner of defaults: no reader keeps its own copy). KeyError for a key
    that is not one of the run config's, or a parameter that is neither set nor defaulted.

        setting(manifest_cfg, "launch.nproc_per_node") -> 1 (for a config from before `launch`)"""
    value, default = _lookup(config, key)
    if value is not _UNSET:
        return value
    if default is _UNSET:
        raise KeyError(key)
    return copy.deepcopy(default)


def recorded(config: Mapping, key: str) -> Any:
    """What a stored run config records at the dotted run-config `key`, None where it records nothing: for
    readers that must not guess (a report of runs whose configs may be partial), where `setting`
    reads the schema's default. KeyError for a key that is not one of the run config's."""
    value, _ = _lookup(config, key)
    return None if value is _UNSET else value


def recorded_slot(config: Mapping, which: str) -> Slot | None:
    """The component a stored run config records in slot `which` (objective | correction |
    aggregation | advantage), None where it records none (no such slot, or one without a name)."""
    decl = SLOTS[which]
    value = recorded(config, decl.key)
    if value is None or (isinstance(value, Mapping) and not any(k in value for k in decl.spellings)):
        return None
    return read_slot(decl, value)[0]


def _lookup(config: Mapping, key: str) -> tuple[Any, Any]:
    """(the value at `key` in `config`, the schema's default there), either _UNSET where absent."""
    leaves, free = _readable()
    if key not in leaves and not any(key.startswith(f + ".") for f in free):
        raise KeyError(key)
    node: Any = config
    default: Any = _defaults()
    for part in key.split("."):
        default = default.get(part, _UNSET) if isinstance(default, Mapping) else _UNSET
        node = node.get(part, _UNSET) if isinstance(node, Mapping) else _UNSET
    return node, default


_UNSET = object()


def dump_yaml(cfg: RunConfig) -> str:
    """The stored form of `cfg` as YAML."""
    return yamlio.dump_yaml(to_dict(cfg))
