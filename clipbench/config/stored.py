"""The run config as a plain mapping and back, and the readers of stored run configs.

`to_dict` is the stored form (what a run's config.yaml and a sweep's manifest record, and what the
run id hashes); `from_dict` reads it back, from every form a stored config may have been written in.
`setting` and `recorded` read one key of a stored config (a manifest's, a run's config.yaml), perhaps
written before the key existed (docs/config.md, "Reading a run config").
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from clipbench import yamlio
from clipbench.config.schema import RunConfig, leaf_keys
from clipbench.config.slots import migrate


def to_dict(cfg: RunConfig) -> dict:
    """Plain, JSON-able, fully resolved dict (a validated RunConfig holds plain values only)."""
    return dataclasses.asdict(cfg)


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The structured config of RunConfig, built once (OmegaConf.merge copies it)."""
    return OmegaConf.structured(RunConfig)


def from_dict(d: Mapping) -> RunConfig:
    """A RunConfig from a (nested) mapping, typed by OmegaConf's structured-config rules (strings
    converted to numbers where the schema says so, unknown keys refused); values not checked."""
    return OmegaConf.to_object(OmegaConf.merge(_schema(), OmegaConf.create(migrate(d))))  # type: ignore[return-value]


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


def setting(config: RunConfig | Mapping, key: str) -> Any:
    """The value of the dotted run-config `key` (a leaf, or a parameter inside the objective, the
    correction or `trl`) in a run config: a RunConfig, or a stored one (a manifest's, a run's
    run_config.json, perhaps written before the key existed), where a key it lacks reads as the
    schema's default (the one owner of defaults: no reader keeps its own copy). KeyError for a key
    that is not one of the run config's, or a parameter that is neither set nor defaulted.

        setting(manifest_cfg, "launch.nproc_per_node") -> 1 (for a config from before `launch`)"""
    value, default = _lookup(config, key)
    if value is not _UNSET:
        return value
    if default is _UNSET:
        raise KeyError(key)
    return copy.deepcopy(default)


def recorded(config: RunConfig | Mapping, key: str) -> Any:
    """What a run config records at the dotted run-config `key`, None where it records nothing: for
    readers that must not guess (a report of runs whose configs may be partial), where `setting`
    reads the schema's default. KeyError for a key that is not one of the run config's."""
    value, _ = _lookup(config, key)
    return None if value is _UNSET else value


def _lookup(config: RunConfig | Mapping, key: str) -> tuple[Any, Any]:
    """(the value at `key` in `config`, the schema's default there), either _UNSET where absent."""
    leaves, free = _readable()
    if key not in leaves and not any(key.startswith(f + ".") for f in free):
        raise KeyError(key)
    node: Any = config
    default: Any = _defaults()
    for part in key.split("."):
        default = default.get(part, _UNSET) if isinstance(default, Mapping) else _UNSET
        if isinstance(node, Mapping):
            node = node.get(part, _UNSET)
        elif node is not _UNSET:
            node = getattr(node, part, _UNSET)
    return node, default


_UNSET = object()


def dump_yaml(cfg: RunConfig | Mapping) -> str:
    return yamlio.dump_yaml(to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg))
