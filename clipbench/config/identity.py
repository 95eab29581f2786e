"""A run's identity: its run id, a hash of the stored form of its resolved config (`to_dict`), minus
what does not change what the run computes and the keys added after run ids were first handed out
(at their values from before they existed), so that every run id stays valid
(tests/test_run_ids_pinned.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from clipbench.config.schema import SLOTS, RunConfig
from clipbench.config.slots import stored_form
from clipbench.config.stored import to_dict

# Sections that do not change what a run computes, so they stay out of its identity.
# plugins: where a rule is found (the manifest records its hash); launch: how many processes train the run.
NOT_IN_ID = ("name", "tracking", "plugins", "launch", "train.record")  # top-level keys or dotted sections
# Top-level keys added after run ids were first handed out: at these values they stay out of the
# hash, so every run id from before they existed is unchanged.
ID_DEFAULTS = {"engine": "builtin", "trl": {}}
# Nested keys added later, the same way: (section, key) -> the value that keeps them out of the hash.
NESTED_ID_DEFAULTS = {
    ("train", "router_aux_loss_coef"): 0.0,
    ("model", "routing_replay"): "none",
    ("eval", "n_ends"): None,
    ("sampler", "lag"): 0,
}
# Rule parameters added to a rule after its runs had ids: (method, parameter) -> the value that keeps
# it out of the hash, so every run id of that rule from before the parameter existed is unchanged.
OBJECTIVE_ID_DEFAULTS = {("cispo", "unified_mask"): False}


def in_id(key: str, value: Any) -> bool:
    """Whether a top-level key of a resolved config counts in its run id."""
    return key not in NOT_IN_ID and not (key in ID_DEFAULTS and value == ID_DEFAULTS[key])


def outside_id(key: str) -> bool:
    """Whether a dotted key lies in a part of the config that never counts in the run id (NOT_IN_ID)."""
    return any(key == k or key.startswith(k + ".") for k in NOT_IN_ID)


def _without_nested(d: dict) -> dict:
    """`d` without the dotted sections of NOT_IN_ID (e.g. train.record)."""
    out = dict(d)
    for dotted in (k for k in NOT_IN_ID if "." in k):
        head, *rest = dotted.split(".")
        if isinstance(out.get(head), dict):
            out[head] = _without_nested_path(out[head], rest)
    return out


def _without_nested_path(d: dict, path: list[str]) -> dict:
    out = dict(d)
    if len(path) == 1:
        out.pop(path[0], None)
    elif isinstance(out.get(path[0]), dict):
        out[path[0]] = _without_nested_path(out[path[0]], path[1:])
    return out


def _id_sampler(sampler: Mapping) -> dict:
    """The sampler section as the run id hashes it: a correction the former keys could express is
    hashed as those keys (`mismatch_is`, `mismatch_is_cap`), so every run id from before
    `sampler.correction` existed is unchanged; any other correction is hashed as itself. (A former
    config with mismatch_is none and a cap other than 2, a cap nothing read, hashes as cap 2.)"""
    out = dict(sampler)
    corr = out.pop("correction", None)
    if corr is None:
        return out
    corr = dict(corr)
    if corr.get("name") == "none" and len(corr) == 1:
        return {**out, "mismatch_is": "none", "mismatch_is_cap": 2.0}
    if corr.get("name") == "tis" and set(corr) <= {"name", "level", "cap", "floor"} and corr.get("floor", 0.0) == 0.0:
        return {**out, "mismatch_is": corr.get("level", "token"), "mismatch_is_cap": corr.get("cap", 2.0)}
    return {**out, "correction": corr}


def _id_objective(objective: Mapping) -> dict:
    """The objective as the run id hashes it: without the OBJECTIVE_ID_DEFAULTS parameters of its
    method at their id values."""
    method = objective.get(SLOTS["objective"].name_key)
    return {
        k: v
        for k, v in objective.items()
        if not ((method, k) in OBJECTIVE_ID_DEFAULTS and OBJECTIVE_ID_DEFAULTS[(method, k)] == v)
    }


def run_id(cfg: RunConfig | Mapping) -> str:
    """12 hex chars of sha256 over the canonical JSON of the resolved config in its stored form (minus
    tracking/name, the ID_DEFAULTS keys and OBJECTIVE_ID_DEFAULTS rule parameters at their defaults;
    the sampler correction as `_id_sampler` states). `cfg`: a RunConfig, or a resolved config as a
    mapping (a manifest's, a run's config.yaml, the sweep expander's), hashed as it is."""
    d = to_dict(cfg) if isinstance(cfg, RunConfig) else stored_form(cfg)
    d = {k: v for k, v in _without_nested(d).items() if in_id(k, v)}
    for (section, key), default in NESTED_ID_DEFAULTS.items():
        if isinstance(d.get(section), Mapping) and d[section].get(key, default) == default:
            d[section] = {k: v for k, v in d[section].items() if k != key}
    if isinstance(d.get("sampler"), Mapping):
        d["sampler"] = _id_sampler(d["sampler"])
    if isinstance(d.get("objective"), Mapping):
        d["objective"] = _id_objective(d["objective"])
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
