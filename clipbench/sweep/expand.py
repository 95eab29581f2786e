"""Sweep expansion: a pure function from a `SweepSpec` to fully resolved, validated run configs.

    exp = expand(load_sweep("sweeps/nsr_vs_decay.yaml"))
    exp.runs    {run_id: config dict (== to_dict(validate(...)))}, in grid order
    exp.points  {run_id: {axis key: value}}  -- the axes that apply to that run

Layers, later wins: base recipe < sweep `overrides` < command-line overrides < axis values (a
command-line override of an axis key replaces that axis by its one value).

Objective parameters are conditional: `objective.p` applies only to methods that declare `p`
(`clipbench.objectives.METHODS[m].defaults`). An inapplicable axis or override value is dropped
for that run and the runs are deduplicated by run_id, so `method: [dapo, nsr, decay] x p: [3
values] x seed: [3]` is 3 + 9 + 9 = 21 runs. A parameter that no method of the sweep has is an
error (a typo), except in the base recipe (it belonged to the recipe's own method).

Speed (10,000 runs in well under a second): the base is validated once with the full loader;
each distinct axis value is type-checked once (OmegaConf, per key); each run is then a dict copy,
the cross-field value checks of `clipbench.config.load` on a directly built `RunConfig`, a cached
`validate_params`, and a run_id hashed from cached per-section JSON. tests/test_sweep_expand.py
checks the result against the full loader run by run.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from clipbench.config import compose, run_id, to_dict, validate
from clipbench.config.load import ID_DEFAULTS, NOT_IN_ID, PATH_KEYS, deep_merge, set_dotted
from clipbench.config.schema import RunConfig
from clipbench.errors import ConfigError, did_you_mean, unknown_choice
from clipbench.sweep.spec import Axis, SweepSpec

OBJ = "objective."
TRL = "trl."  # free-form: the trl engine's GRPOConfig fields
METHOD_KEY = "objective.method"


@dataclass(frozen=True)
class Expansion:
    runs: dict[str, dict]  # run_id -> resolved config, in grid order
    points: dict[str, dict]  # run_id -> {axis key: value} (applicable axes only)
    combos: int  # grid points before exclusion, applicability and deduplication
    excluded: int
    warnings: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Schema helpers


@functools.lru_cache(maxsize=None)
def _dc_children(cls) -> dict[str, Any]:
    """{field name: nested dataclass type or None} for a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name] if is_dataclass(hints[f.name]) else None) for f in fields(cls)}


@functools.lru_cache(maxsize=None)
def schema_leaves() -> tuple[str, ...]:
    """Every dotted leaf key of RunConfig (objective's free-form parameters excluded)."""
    out: list[str] = []

    def walk(cls, prefix: str) -> None:
        for name, sub in _dc_children(cls).items():
            if sub is not None:
                walk(sub, f"{prefix}{name}.")
            elif prefix + name != "objective":
                out.append(prefix + name)

    walk(RunConfig, "")
    return tuple(out) + (METHOD_KEY,)


def build_config(d: Mapping, cls=RunConfig):
    """A plain, already type-checked dict -> the dataclass, without OmegaConf (microseconds)."""
    kids = _dc_children(cls)
    return cls(**{k: (build_config(v, kids[k]) if kids.get(k) is not None else v) for k, v in d.items()})


def _copy_tree(d: Mapping) -> dict:
    return {k: (_copy_tree(v) if isinstance(v, dict) else (list(v) if isinstance(v, list) else v)) for k, v in d.items()}


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"), default=str)


# ---------------------------------------------------------------------------------------------
# Checks of keys and values


def _check_key(key: str, src: str, where: str) -> None:
    if key.startswith(OBJ):
        return  # objective parameters are checked against the sweep's methods
    if key.startswith(TRL):
        return  # GRPOConfig fields: checked by the trl engine (clipbench.integrations.check_run)
    leaves = schema_leaves()
    if key in leaves:
        return
    if any(leaf.startswith(key + ".") for leaf in leaves):
        sub = [leaf for leaf in leaves if leaf.startswith(key + ".")]
        raise ConfigError(src, where, f"'{key}' is a section; use one of its keys: {', '.join(sub)}")
    raise ConfigError(src, where, f"unknown key '{key}'" + did_you_mean(key, leaves))


@functools.lru_cache(maxsize=None)
def _section_struct(path: tuple[str, ...]):
    """The structured config of the dataclass at `path` (() = RunConfig), built once."""
    cls = RunConfig
    for part in path:
        cls = _dc_children(cls)[part]
    return OmegaConf.structured(cls)


def _coerce(key: str, value: Any, src: str, where: str) -> Any:
    """A value for a (non-objective) leaf key, type-checked and converted exactly as the loader does
    (OmegaConf's structured-config rules), against the leaf's own section only (fast)."""
    if key.startswith(TRL):
        return value
    *section, leaf = key.split(".")
    try:
        conf = OmegaConf.merge(_section_struct(tuple(section)), OmegaConf.create({leaf: value}))
        out = conf[leaf]
        if OmegaConf.is_config(out):
            out = OmegaConf.to_container(out, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(src, where, str(e).splitlines()[0].replace(f"'{leaf}'", f"'{key}'", 1)) from None
    return out


def _resolve_path(key: str, value: Any, base_dir: Path) -> Any:
    if key in PATH_KEYS and isinstance(value, str) and (value.startswith("./") or value.startswith("../")):
        return str((base_dir / value).resolve())
    return value


@functools.lru_cache(maxsize=4096)
def _resolved_params(method: str, items: tuple) -> tuple:
    from clipbench.objectives import validate_params

    return tuple(validate_params(method, dict(items)).items())


def _params_frozen(params: Mapping) -> tuple:
    return tuple(sorted(params.items()))


# ---------------------------------------------------------------------------------------------
# Expansion


def expand(spec: SweepSpec) -> Expansion:
    from clipbench.config.load import check_values
    from clipbench.integrations import check_run
    from clipbench.objectives import METHODS

    src = spec.source
    sweep_dir = spec.file.resolve().parent
    warnings: list[str] = []
    if spec.plugins:  # the sweep's own rule files, before any method is checked
        from clipbench.objectives.plugins import load_plugins
        from clipbench.errors import UserError

        try:
            load_plugins(spec.plugins)
        except UserError as e:
            raise ConfigError(src, "plugins", str(e)) from None

    # --- command-line overrides of axis keys replace the axis by their one value
    cli = dict(spec.cli_overrides)
    axes: list[Axis] = []
    for ax in spec.axes:
        hit = [k for k in ax.keys if k in cli]
        if hit and len(ax.keys) == 1:
            k = ax.keys[0]
            warnings.append(f"command-line override {k}={cli[k]!r} replaces the axis {ax.where}.{k}")
            axes.append(Axis(ax.keys, ((cli.pop(k),),), ax.where))
        elif hit:
            raise ConfigError("command line", hit[0], f"'{hit[0]}' is part of the zip group {ax.where}; "
                              "edit the sweep file to change it")
        else:
            axes.append(ax)

    # --- keys
    for k in spec.overrides:
        _check_key(k, src, f"overrides.{k}")
    for k in cli:
        _check_key(k, "command line", k)
    for ax in axes:
        for k in ax.keys:
            _check_key(k, src, f"{ax.where}.{k}")

    # --- the base: the recipe validates on its own (errors name the recipe)
    raw = compose(spec.base)
    base_cfg = validate(raw, str(spec.base))
    base_dict = to_dict(base_cfg)
    if spec.plugins:  # every run lists the sweep's plugins after the recipe's (workers import them)
        from clipbench.objectives.plugins import merge_specs

        base_dict["plugins"] = merge_specs(base_dict.get("plugins") or [], spec.plugins)
    base_obj = dict(base_dict.pop("objective"))
    base_method = base_obj.pop("method")
    raw_base_params = {k: v for k, v in (raw.get("objective") or {}).items() if k != "method"}

    # layered objective settings: key -> (value, source, where)
    file_obj = {k[len(OBJ):]: v for k, v in spec.overrides.items() if k.startswith(OBJ)}
    cli_obj = {k[len(OBJ):]: v for k, v in cli.items() if k.startswith(OBJ)}
    method = cli_obj.pop("method", file_obj.pop("method", base_method))
    if not isinstance(method, str) or method not in METHODS:
        where = (("command line", METHOD_KEY) if METHOD_KEY in cli else (src, f"overrides.{METHOD_KEY}"))
        raise ConfigError(where[0], where[1], unknown_choice("method", method, METHODS))
    explicit: dict[str, tuple[Any, str, str]] = {}
    for k, v in raw_base_params.items():
        explicit[k] = (v, str(spec.base), f"objective.{k}")
    for k, v in file_obj.items():
        explicit[k] = (v, src, f"overrides.objective.{k}")
    for k, v in cli_obj.items():
        explicit[k] = (v, "command line", f"objective.{k}")

    # non-objective layers: sweep overrides, then the command line (each validated with the base)
    layered = base_dict
    for layer, lsrc, prefix in ((spec.overrides, src, "overrides."), (cli, "command line", "")):
        plain = {k: _resolve_path(k, v, sweep_dir if lsrc == src else Path.cwd())
                 for k, v in layer.items() if not k.startswith(OBJ)}
        if not plain:
            continue
        nested: dict = {}
        for k, v in plain.items():
            set_dotted(nested, k, v)
        merged = deep_merge(layered, nested)
        try:
            cfg = validate({**merged, "objective": {"method": base_method, **base_obj}}, lsrc)
        except ConfigError as e:
            key = f"{prefix}{e.key}" if e.key in plain else e.key
            raise ConfigError(lsrc, key, e.reason) from None
        layered = to_dict(cfg)
        layered.pop("objective")

    # --- the methods of this sweep, and which parameters exist among them
    method_axis = next((ax for ax in axes if METHOD_KEY in ax.keys), None)
    if method_axis is not None:
        j = method_axis.keys.index(METHOD_KEY)
        methods = []
        for vals in method_axis.values:
            m = vals[j]
            if not isinstance(m, str) or m not in METHODS:
                raise ConfigError(src, f"{method_axis.where}.{METHOD_KEY}", unknown_choice("method", m, METHODS))
            methods.append(m)
    else:
        methods = [method]
    # Parameters are checked against the sweep file's methods too: a command line that pins the
    # method (objective.method=dapo) makes the file's `p` axis inapplicable, not wrong.
    file_methods = [v for ax in spec.axes for k, col in zip(ax.keys, zip(*ax.values)) if k == METHOD_KEY
                    for v in col if isinstance(v, str) and v in METHODS]
    known_params = {p for m in set(methods) | set(file_methods) for p in METHODS[m].defaults}

    def check_param(name: str, value: Any, psrc: str, where: str, *, drop_unknown: bool = False) -> bool:
        """False when the parameter belongs to no method of the sweep (and may be dropped)."""
        if name not in known_params:
            if drop_unknown:
                return False
            all_params = sorted({p for m in METHODS for p in METHODS[m].defaults})
            owners = sorted(m for m in METHODS if name in METHODS[m].defaults)
            hint = (f"; only {', '.join(owners)} {'has' if len(owners) == 1 else 'have'} it" if owners
                    else did_you_mean(name, all_params))
            raise ConfigError(psrc, where, f"no method in this sweep ({', '.join(sorted(set(methods)))}) "
                              f"has parameter '{name}'{hint}; their parameters: {', '.join(sorted(known_params))}")
        for m in dict.fromkeys(methods):
            if name in METHODS[m].defaults:
                try:
                    _resolved_params(m, ((name, value),))
                except (ValueError, TypeError) as e:
                    raise ConfigError(psrc, where, str(e)) from None
        return True

    for k in list(explicit):
        v, psrc, where = explicit[k]
        if not check_param(k, v, psrc, where, drop_unknown=psrc == str(spec.base)):
            del explicit[k]
    for ax in axes:
        if all(k.split(".")[0] in NOT_IN_ID for k in ax.keys):  # e.g. grid launch.nproc_per_node: [1, 8]
            raise ConfigError(src, f"{ax.where}.{ax.keys[0]}", "not part of a run's identity (how a run is launched "
                              "or tracked, not what it computes), so its values alone would be one run; set it in "
                              "overrides, or zip it with a key that differs")
        for j, k in enumerate(ax.keys):
            if k.startswith(OBJ) and k != METHOD_KEY:
                for vals in ax.values:
                    check_param(k[len(OBJ):], vals[j], src, f"{ax.where}.{k}")

    # --- coerce every distinct non-objective axis value once
    coerced: list[list[tuple]] = []
    for ax in axes:
        col = []
        for vals in ax.values:
            col.append(tuple(v if k.startswith(OBJ) else _coerce(k, _resolve_path(k, v, sweep_dir), src, f"{ax.where}.{k}")
                             for k, v in zip(ax.keys, vals)))
        coerced.append(col)
    excludes = [{k: (v if k.startswith(OBJ) else _coerce(k, v, src, f"exclude[{i}].{k}")) for k, v in e.items()}
                for i, e in enumerate(spec.exclude)]

    # --- per-section canonical JSON of the parts no axis touches (for fast run ids)
    touched = {k.split(".")[0] for k in spec.axis_keys}
    id_keys = sorted(k for k in list(layered) + ["objective"] if k not in NOT_IN_ID)
    static_json = {k: _canon(layered[k]) for k in id_keys if k not in touched and k != "objective"}
    # Axes holding a non-objective key: the run's non-objective part depends on these indices only.
    plain_axes = [i for i, ax in enumerate(axes) if any(not k.startswith(OBJ) for k in ax.keys)]
    base_objective = {"method": base_method, **base_obj}

    plain_cache: dict[tuple, tuple[dict, dict]] = {}  # sub-point -> (config minus objective, section JSON)

    def plain_part(idx: tuple, assign: dict) -> tuple[dict, dict]:
        sub = tuple(idx[i] for i in plain_axes)
        hit = plain_cache.get(sub)
        if hit is None:
            cfg = _copy_tree(layered)
            for k, v in assign.items():
                if not k.startswith(OBJ):
                    node, parts = cfg, k.split(".")
                    for part in parts[:-1]:
                        node = node[part]
                    node[parts[-1]] = _copy_tree({"v": v})["v"] if isinstance(v, (list, dict)) else v
            try:  # the cross-field and engine checks, with the base objective standing in (checked on its own)
                built = build_config(_with_objective(cfg, base_objective))
                check_values(built, src)
                check_run(built, src)
            except ConfigError as e:
                shown = {k: v for k, v in assign.items() if not k.startswith(OBJ)}
                raise ConfigError(src, e.key, f"{e.reason} (in the run {label(shown)})") from None
            hit = plain_cache[sub] = (cfg, {k: _canon(cfg[k]) for k in touched if k in cfg and k not in NOT_IN_ID})
        return hit

    obj_cache: dict[tuple, tuple[dict, str]] = {}  # (method, params) -> (objective dict, its JSON)

    def objective_part(m: str, params: dict) -> tuple[dict, str]:
        key = (m, _params_frozen(params))
        hit = obj_cache.get(key)
        if hit is None:
            obj = {"method": m, **dict(_resolved_params(*key))}
            hit = obj_cache[key] = (obj, _canon(obj))
        return hit

    runs: dict[str, dict] = {}
    points: dict[str, dict] = {}
    combos = excluded = 0
    explicit_items = {k: v[0] for k, v in explicit.items()}
    for idx in itertools.product(*[range(len(col)) for col in coerced]):
        combos += 1
        assign = {k: v for ax, col, i in zip(axes, coerced, idx) for k, v in zip(ax.keys, col[i])}
        m = assign.get(METHOD_KEY, method)
        spec_params = METHODS[m].defaults
        point = {k: v for k, v in assign.items() if not k.startswith(OBJ) or k == METHOD_KEY or k[len(OBJ):] in spec_params}
        if excludes and any(all(k in point and point[k] == v for k, v in e.items()) for e in excludes):
            excluded += 1
            continue
        params = {k: v for k, v in explicit_items.items() if k in spec_params}
        params.update({k[len(OBJ):]: v for k, v in point.items() if k.startswith(OBJ) and k != METHOD_KEY})
        objective, obj_json = objective_part(m, params)
        plain, plain_json = plain_part(idx, assign)
        cfg = _with_objective(plain, objective)
        parts = ((k, obj_json if k == "objective" else static_json.get(k) or plain_json[k]) for k in id_keys)
        body = ",".join(_KEY_JSON[k] + ":" + js for k, js in parts if _ID_DEFAULT_JSON.get(k) != js)
        rid = hashlib.sha256(("{" + body + "}").encode()).hexdigest()[:12]
        if rid in runs:
            if points[rid] == point:
                continue  # only inapplicable objective values differed: the same run again
            warnings.append(f"the runs {label(points[rid])} and {label(point)} have the same config "
                            f"(run {rid}); keeping the first")
            continue
        runs[rid] = cfg
        points[rid] = point
    if not runs:
        raise ConfigError(src, "exclude", f"excludes every one of the {combos} grid points")
    first = next(iter(runs))  # one cross-check per expansion keeps the fast path honest
    if run_id(runs[first]) != first:  # pragma: no cover - a bug in the fast path
        raise RuntimeError("fast run id disagrees with clipbench.config.run_id")
    return Expansion(runs, points, combos, excluded, tuple(warnings))


class _KeyJson(dict):
    def __missing__(self, k: str) -> str:
        self[k] = json.dumps(k)
        return self[k]


_KEY_JSON = _KeyJson()
_ID_DEFAULT_JSON = {k: _canon(v) for k, v in ID_DEFAULTS.items()}  # keys left out of the run id at these values


def _with_objective(cfg: dict, objective: dict) -> dict:
    """Insert `objective` where the schema puts it (so the dict equals to_dict(...) key for key)."""
    return {k: (objective if k == "objective" else cfg[k]) for k in _TOP_FIELDS if k == "objective" or k in cfg}


_TOP_FIELDS = tuple(f.name for f in fields(RunConfig))


# ---------------------------------------------------------------------------------------------
# Labels


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
        if k != METHOD_KEY:
            parts.append(f"{k.rsplit('.', 1)[-1] if k.startswith(OBJ) or k == 'seed' else k}={format_value(v)}")
    return " ".join(parts) if parts else "(base)"


def run_label(config: Mapping, point: Mapping | None = None) -> str:
    point = dict(point or {})
    if METHOD_KEY not in point:
        point = {METHOD_KEY: config.get("objective", {}).get("method", "?"), **point}
    return label(point)


def iter_summary(runs: Mapping[str, dict], points: Mapping[str, dict]) -> Iterable[dict]:
    """One row per run for tables: run_id, method, parameters, seed, steps, other axes."""
    for rid, cfg in runs.items():
        obj = dict(cfg.get("objective", {}))
        m = obj.pop("method", "?")
        pt = points.get(rid, {})
        other = {k: v for k, v in pt.items() if not k.startswith(OBJ) and k != "seed"}
        yield {"run_id": rid, "method": m, "params": obj, "seed": cfg.get("seed"),
               "steps": cfg.get("train", {}).get("steps"), "other": other}
