"""Sweep expansion: a pure function from a `SweepSpec` to fully resolved, validated run configs.

    exp = expand(load_spec("sweeps/nsr_vs_decay.yaml"))
    exp.runs    {run_id: config dict (== to_dict(validate(...)))}, in grid order
    exp.points  {run_id: {axis key: value}}  -- the axes that apply to that run

Layers, later wins: base recipe < sweep `overrides` < command-line overrides < axis values (a
command-line override of an axis key replaces that axis by its one value).

The components (objective, sampler correction, aggregation, advantage) follow one rule
(`clipbench.sweep.slots`): their parameters are conditional, `objective.p` applies only to
methods that declare `p` (`clipbench.objectives.METHODS[m].defaults`). An inapplicable axis or
override value is dropped for that run and the runs are deduplicated by run_id, so `method: [dapo,
nsr, decay] x p: [3 values] x seed: [3]` is 3 + 9 + 9 = 21 runs. A parameter that no component of
the sweep has is an error (a typo), except in the base recipe (it belonged to the recipe's own).
Keys are read in their stored form (`objective.name` as `objective.method`, `train.agg.name` as
`train.agg`); an error names the key as written.

One validator: every run config is the config loader's (`clipbench.config.validate`) and the
engine's check (`clipbench.engines.check`), run once per distinct setting of the non-objective axes
(seeds and objectives share one), with the objective validated once per (method, parameters) by the
registry; an error names the sweep file's key (`grid.train.lr`, `overrides.train.steps`, ...). The
run id is `clipbench.config.run_id`'s.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from clipbench.config import compose, dotted, run_id, to_dict, validate
from clipbench.config.claims import check_rules
from clipbench.config.compose import PATH_KEYS, Several, deep_merge, set_dotted
from clipbench.config.identity import outside_id
from clipbench.config.labels import METHOD_KEY, OBJ, label
from clipbench.config.schema import SLOTS, RunConfig, Slot, leaf_keys, slot_of
from clipbench.config.slots import migrate, read_slot, resolve_slot, stored
from clipbench.config.stored import recorded_slot, setting
from clipbench.engines import check
from clipbench.errors import ConfigError, UserError, did_you_mean, unknown_choice
from clipbench.objectives import METHODS
from clipbench.objectives.plugins import load_plugins, merge_specs
from clipbench.sweep import slots
from clipbench.sweep.spec import CLI, Axis, SweepSpec

TRL = "trl."  # free-form: the trl engine's GRPOConfig fields (checked by the engine)
OBJECTIVE = SLOTS["objective"]


@dataclass(frozen=True)
class Expansion:
    runs: dict[str, dict]  # run_id -> resolved config, in grid order
    points: dict[str, dict]  # run_id -> {axis key: value} (applicable axes only)
    combos: int  # grid points before exclusion, applicability and deduplication
    excluded: int
    warnings: tuple[str, ...] = ()


def expand(spec: SweepSpec) -> Expansion:
    """The sweep's runs (see the module docstring); ConfigError naming the sweep file's key."""
    _load_plugins(spec)
    given = slots.given_keys(spec)
    stored = slots.stored_spec(spec)  # objective.name -> objective.method, train.agg.name -> train.agg
    try:
        exp = _expand(stored)
    except ConfigError as e:  # name the key as it was written
        if e.key not in given:
            raise
        raise ConfigError(e.file, given[e.key], e.reason) from None
    if spec.claims is not None:
        _check_claims(spec, exp)
    return exp


def _check_claims(spec: SweepSpec, exp: Expansion) -> None:
    """The rules the preregistered family compares are the sweep's, each at one setting (its runs differ
    in the seed alone), so that a rule's name is one arm."""
    settings: dict[str, set[str]] = {}
    for rid, cfg in exp.runs.items():
        point = {k: v for k, v in exp.points[rid].items() if k != "seed" and not k.startswith(OBJ)}
        settings.setdefault(recorded_slot(cfg, "objective").name, set()).add(label(point) if point else "")
    check_rules(spec.claims, list(settings), spec.source)
    for i, c in enumerate(spec.claims.comparisons):
        for side, rule in (("a", c.a), ("b", c.b)):
            if len(settings[rule]) > 1:
                raise ConfigError(
                    spec.source,
                    f"claims.compare[{i}].{side}",
                    f"rule {rule!r} has {len(settings[rule])} settings in this sweep "
                    f"({'; '.join(sorted(settings[rule]))}): a compared arm is one setting, its seeds",
                )


def _expand(spec: SweepSpec) -> Expansion:
    axes, cli, warnings = _pin_axes(spec)
    _check_keys(spec, axes, cli)
    base = _Base(spec, cli)
    rules = {
        which: slots.build_rule(
            decl, base.names[which], base.settings[which], axes, spec.axes, str(spec.base), spec.source
        )
        for which, decl in SLOTS.items()
    }
    plain = _PlainPart(spec, axes, base)
    runs: dict[str, dict] = {}
    points: dict[str, dict] = {}
    combos = excluded = 0
    matched = [False] * len(spec.exclude)
    for idx in itertools.product(*[range(len(ax.values)) for ax in axes]):
        combos += 1
        assign = {k: v for ax, i in zip(axes, idx) for k, v in zip(ax.keys, ax.values[i])}
        assign, objective, applies = _components(rules, assign)
        point = {
            k: v
            for ax, i in zip(axes, idx)
            for k, v in zip(ax.keys, ax.values[i])
            if slot_of(k) is None or k in applies
        }
        hits = [i for i, e in enumerate(spec.exclude) if all(k in point and point[k] == v for k, v in e.items())]
        if hits:
            excluded += 1
            for i in hits:
                matched[i] = True
            continue
        cfg = {**plain.config(idx, assign), "objective": objective}
        cfg = {k: cfg[k] for k in _TOP_KEYS}  # the schema's key order (== to_dict(...))
        rid = run_id(cfg)
        if rid in runs:
            if points[rid] != point:
                warnings.append(
                    f"the runs {label(points[rid])} and {label(point)} have the same config "
                    f"(run {rid}); keeping the first"
                )
            continue  # else only inapplicable component values differed: the same run again
        runs[rid] = cfg
        points[rid] = {k: (v if slot_of(k) else dotted.value(cfg, k)) for k, v in point.items()}
    _check_excludes(spec, matched, combos)
    if not runs:
        raise ConfigError(spec.source, "exclude", f"excludes every one of the {combos} grid points")
    return Expansion(runs, points, combos, excluded, tuple(warnings))


def _check_excludes(spec: SweepSpec, matched: list[bool], combos: int) -> None:
    """Every exclude entry leaves out a grid point: one that matches none (a value its axis does not
    hold, a number written as text) is a typo, and the run it meant to leave out would train. An
    entry on an axis the command line pinned is not judged (it may match another pin's points)."""
    axes = {k: ax for ax in spec.axes for k in ax.keys}
    for i, (entry, hit) in enumerate(zip(spec.exclude, matched)):
        if hit or any(k in spec.cli_overrides for k in entry):
            continue
        for k, v in entry.items():
            ax = axes[k]
            held = [vals[ax.keys.index(k)] for vals in ax.values]
            if not any(_same_value(v, h) for h in held):
                like = [h for h in held if str(h) == str(v)]
                hint = f"; write {like[0]!r} ({type(like[0]).__name__}), not {v!r} ({type(v).__name__})" if like else ""
                raise ConfigError(
                    spec.source,
                    f"exclude[{i}].{k}",
                    f"{v!r} is not a value of the axis {ax.where}.{k} ({', '.join(map(repr, held))}): the entry "
                    f"leaves nothing out{hint}",
                )
        raise ConfigError(
            spec.source,
            f"exclude[{i}]",
            f"matches none of the sweep's {combos} grid points (a component's parameter applies only to "
            "the components that have it): the entry leaves nothing out",
        )


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of one kind (a bool is not the number 1, text is not a number)."""
    kind = lambda x: "bool" if isinstance(x, bool) else ("num" if isinstance(x, (int, float)) else type(x).__name__)  # noqa: E731
    return kind(a) == kind(b) and a == b


def _components(rules: Mapping[str, slots.SlotRule], assign: dict) -> tuple[dict, dict, set[str]]:
    """(the point's assignments with each component it sets in place of its dotted keys, its
    objective, the component keys that apply to it). The objective is validated here by its
    registry (cached per method and parameters); the other components with the rest of the config."""
    applies: set[str] = set()
    objective: dict = {}
    for which, rule in rules.items():
        name, params, keys = rule.component(assign)
        applies |= keys
        key = rule.decl.key
        if which == "objective":
            objective = _objective(name, tuple(sorted(params.items())))
        elif not rule.decl.bare and any(k.startswith(key + ".") for k in assign):
            assign = {k: v for k, v in assign.items() if not k.startswith(key + ".")}
            assign[key] = stored(rule.decl, Slot(name, params))  # replaces the base's component
    return assign, objective, applies


# ---------------------------------------------------------------------------------------------
# The layers


def _load_plugins(spec: SweepSpec) -> None:
    """The sweep's own rule files, before any method is checked."""
    if spec.plugins:
        try:
            load_plugins(spec.plugins)
        except UserError as e:
            raise ConfigError(spec.source, "plugins", str(e)) from None


def _pin_axes(spec: SweepSpec) -> tuple[list[Axis], dict[str, Any], list[str]]:
    """(axes, the command line's other overrides, warnings): a command-line value of an axis key
    replaces that axis by its one value (a key of a zip group cannot be pinned alone)."""
    cli, axes, warnings = dict(spec.cli_overrides), [], []
    for ax in spec.axes:
        hit = [k for k in ax.keys if k in cli]
        if hit and len(ax.keys) == 1:
            k = ax.keys[0]
            v = cli.pop(k)
            shown = v.raw if isinstance(v, Several) else repr(v)
            warnings.append(f"command-line override {k}={shown} replaces the axis {ax.where}.{k}")
            axes.append(Axis(ax.keys, tuple((x,) for x in _several(v, k)), ax.where))
        elif hit:
            raise ConfigError(
                "command line",
                hit[0],
                f"'{hit[0]}' is part of the zip group {ax.where}; edit the sweep file to change it",
            )
        else:
            axes.append(ax)
    for k in [k for k, v in cli.items() if isinstance(v, Several)]:  # Hydra's multirun form: an axis of its own
        axes.append(Axis((k,), tuple((x,) for x in _several(cli.pop(k), k)), CLI))
    for ax in axes:
        if all(outside_id(k) for k in ax.keys):  # e.g. grid launch.nproc_per_node: [1, 8]
            raise ConfigError(
                CLI if ax.where == CLI else spec.source,
                ax.place(ax.keys[0]),
                "not part of a run's identity (how a run "
                "is launched or tracked, not what it computes), so its values alone would be one "
                "run; set it in overrides, or zip it with a key that differs",
            )
    return axes, cli, warnings


def _several(value: Any, key: str) -> tuple:
    """The values a command-line override gives an axis: each of `seed=0,1`, or the one value."""
    if not isinstance(value, Several):
        return (value,)
    for i, v in enumerate(value.values):
        if any(v == w and type(v) is type(w) for w in value.values[:i]):
            raise ConfigError(CLI, key, f"'{value.raw}' repeats the value {v!r}")
    return value.values


def _check_keys(spec: SweepSpec, axes: list[Axis], cli: Mapping[str, Any]) -> None:
    """Every key of the sweep file and the command line names a leaf of the run config."""
    leaves = set(leaf_keys()) - {"objective", "trl"}
    places = (
        [(k, spec.source, f"overrides.{k}") for k in spec.overrides]
        + [(k, "command line", k) for k in cli]
        + [(k, CLI if ax.where == CLI else spec.source, ax.place(k)) for ax in axes for k in ax.keys]
    )
    for key, src, where in places:
        if key.startswith(TRL) or slot_of(key) is not None or key in leaves:
            continue  # a component's parameters: checked against the sweep's components (sweep/slots.py)
        if key in slots.LEGACY:  # fine in overrides (`slots.former_keys`), not as an axis
            if not where.startswith(("overrides.", key)):
                raise ConfigError(
                    src,
                    where,
                    f"'{key}' is now {slots.LEGACY[key]} (sampler.correction.name: "
                    "tis with sampler.correction.level: token | sequence and sampler.correction.cap)",
                )
            continue
        sub = sorted(leaf for leaf in leaves if leaf.startswith(key + "."))
        if sub:
            raise ConfigError(src, where, f"'{key}' is a section; use one of its keys: {', '.join(sub)}")
        raise ConfigError(src, where, f"unknown key '{key}'" + did_you_mean(key, sorted(leaves)))


class _Base:
    """The recipe, then the sweep's overrides, then the command line's (each layer validated on its
    own, so an error names its layer). Per component slot: `names` (the base's component) and
    `settings` (its explicit parameter settings, recipe first: (param, value, source, where))."""

    def __init__(self, spec: SweepSpec, cli: Mapping[str, Any]):
        raw = migrate(compose(spec.base), str(spec.base))
        cfg = to_dict(validate(raw, str(spec.base)))
        if spec.plugins:  # every run lists the sweep's plugins after the recipe's (workers import them)
            cfg["plugins"] = merge_specs(cfg["plugins"], spec.plugins)
        self.objective_defaults = dict(cfg.pop("objective"))
        sweep_dir = spec.file.resolve().parent
        for layer, src, prefix, base_dir in (
            (slots.former_keys(spec.overrides), spec.source, "overrides.", sweep_dir),
            (slots.former_keys(cli), "command line", "", Path.cwd()),
        ):
            plain = {k: _resolve_path(k, v, base_dir) for k, v in layer.items() if not k.startswith(OBJ)}
            if plain:
                cfg = self.validated(cfg, plain, src, lambda key: f"{prefix}{key}" if key in plain else key)
        self.config = cfg
        self.names = {
            which: recorded_slot({**cfg, "objective": self.objective_defaults}, which).name for which in SLOTS
        }
        self.settings = {which: _settings(decl, raw, spec, cli) for which, decl in SLOTS.items()}
        method = cli.get(METHOD_KEY, spec.overrides.get(METHOD_KEY, self.names["objective"]))
        if not isinstance(method, str) or method not in METHODS:
            src, where = ("command line", METHOD_KEY) if METHOD_KEY in cli else (spec.source, f"overrides.{METHOD_KEY}")
            raise ConfigError(src, where, unknown_choice(OBJECTIVE.noun, method, METHODS))
        self.names["objective"] = method

    def validated(
        self, cfg: dict, assign: Mapping[str, Any], src: str, where, suffix: str = "", engine_check: bool = False
    ) -> dict:
        """`cfg` with the dotted `assign`ments, validated by the config loader (and with `engine_check`
        the engine's check), the base's objective standing in (it is checked on its own); the result
        without objective. An error names `where(key)`."""

        nested: dict = {}
        for k, v in assign.items():
            set_dotted(nested, k, v)
        merged = {**deep_merge(cfg, nested), "objective": self.objective_defaults}
        for decl in SLOTS.values():  # a component's parameters are its own: it replaces the base's
            if not decl.bare and decl.key in assign:
                merged = dotted.replaced(merged, decl.key, assign[decl.key])
        try:
            run = validate(merged, src)
            if engine_check:
                check(run, src)
        except ConfigError as e:
            raise ConfigError(src, where(e.key), e.reason + suffix) from None
        out = to_dict(run)
        out.pop("objective")
        return out


def _settings(decl, raw: Mapping, spec: SweepSpec, cli: Mapping[str, Any]) -> list[tuple[str, Any, str, str]]:
    """A slot's explicit parameter settings (param, value, source, where): the recipe's, then the
    sweep's overrides, then the command line's."""
    head = decl.key + "."
    out = []
    recipe = dotted.value(raw, decl.key)
    if not decl.bare and recipe is not None:
        out += [(k, v, str(spec.base), head + k) for k, v in read_slot(decl, recipe)[0].params.items()]
    for layer, src, where in (
        (slots.former_keys(spec.overrides), spec.source, "overrides."),
        (slots.former_keys(cli), "command line", ""),
    ):
        out += [
            (k[len(head) :], v, src, where + k) for k, v in layer.items() if k.startswith(head) and k != decl.name_path
        ]
    return out


def _resolve_path(key: str, value: Any, base_dir: Path) -> Any:
    if key in PATH_KEYS and isinstance(value, str) and (value.startswith("./") or value.startswith("../")):
        return str((base_dir / value).resolve())
    return value


# ---------------------------------------------------------------------------------------------
# The objective


@functools.lru_cache(maxsize=4096)
def _objective(method: str, params: tuple) -> dict:
    """The objective in its stored form, every parameter resolved (the registry's defaults merged and
    checked)."""
    return stored(OBJECTIVE, Slot(method, resolve_slot("objective", method, dict(params))))


# ---------------------------------------------------------------------------------------------
# The rest of a run's config: one validation per distinct setting of the non-objective axes


class _PlainPart:
    def __init__(self, spec: SweepSpec, axes: list[Axis], base: _Base):
        self.spec, self.axes, self.base = spec, axes, base
        self.sweep_dir = spec.file.resolve().parent
        self.plain_axes = [i for i, ax in enumerate(axes) if any(not k.startswith(OBJ) for k in ax.keys)]
        self.where = {k: ax.place(k) for ax in axes for k in ax.keys}
        self.cache: dict[tuple, dict] = {}

    def config(self, idx: tuple, assign: Mapping[str, Any]) -> dict:
        """The validated config (without objective) of the point `idx`; cached per plain sub-point."""
        sub = tuple(idx[i] for i in self.plain_axes)
        if sub not in self.cache:
            plain = {k: _resolve_path(k, v, self.sweep_dir) for k, v in assign.items() if not k.startswith(OBJ)}
            shown = f" (in the run {label(plain)})" if plain else ""
            self.cache[sub] = self.base.validated(
                self.base.config,
                plain,
                self.spec.source,
                lambda key: self.where.get(key, key),
                shown,
                engine_check=True,
            )
        return {k: v for k, v in self.cache[sub].items()}


def _top_keys() -> tuple[str, ...]:

    return tuple(f.name for f in fields(RunConfig))


_TOP_KEYS = _top_keys()


def iter_summary(runs: Mapping[str, dict], points: Mapping[str, dict]) -> Iterable[dict]:
    """One row per run for tables: run_id, method, parameters, seed, steps, other axes."""
    for rid, cfg in runs.items():
        obj = recorded_slot(cfg, "objective") or Slot("?")
        pt = points.get(rid, {})
        other = {k: v for k, v in pt.items() if not k.startswith(OBJ) and k != "seed"}
        yield {
            "run_id": rid,
            "method": obj.name,
            "params": obj.params,
            "seed": setting(cfg, "seed"),
            "steps": setting(cfg, "train.steps"),
            "other": other,
        }
