"""A sweep file, parsed and checked for shape (expansion and the config checks live in expand.py).

    name: nsr_vs_decay                     # optional (default: the file's stem); the results sub-dir
    description: ...                       # optional, free text
    base: ../recipes/quickstart.yaml       # the recipe every run starts from (relative to this file)
    overrides: {train.steps: 40}           # optional, applied to every run (dotted or nested keys)
    grid:                                  # cartesian product over dotted keys of the run config
      objective.name: [dapo, nsr, decay]
      seed: [0, 1, 2]
    zip: {train.lr: [1e-5, 2e-5], train.warmup_steps: [0, 10]}   # optional: axes varying together
    exclude: [{objective.name: nsr, seed: 2}]                    # optional: partial assignments
    plugins: [../rules/lower_only.py]      # optional: your own rule files (relative to this file) or modules
    claims: {benchmark: arith, compare: [[dapo, grpo]]}          # optional: the preregistered claims
                                                                 # (config/claims.py), frozen in the manifest

`zip` may also be a list of such mappings (several independent zip groups). Every problem is a
`ConfigError(file, key, reason)`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clipbench.config import flatten, parse_overrides, read_yaml
from clipbench.config.claims import ClaimFamily, parse_family
from clipbench.config.shipped import shipped_recipe, sweep_path
from clipbench.errors import ConfigError, did_you_mean
from clipbench.objectives.plugins import merge_specs, resolve
from clipbench.sweep.slots import stored_key
from clipbench.tracking.store import NOT_SWEEPS

TOP_KEYS = ("name", "description", "base", "overrides", "grid", "zip", "exclude", "plugins", "claims")
# Sub-directories of a results dir that are not sweeps (`tracking.store.NOT_SWEEPS`, their one
# owner), and `train`, where `clipbench train` puts single runs.
RESERVED_NAMES = ("train", *NOT_SWEEPS)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Axis:
    """One dimension of the product: a grid axis (one key) or a zip group (several keys)."""

    keys: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]  # one tuple (a value per key) per position on the axis
    where: str  # the key prefix for messages: "grid" or "zip" / "zip[1]"; CLI: the command line's (`seed=0,1`)

    def place(self, key: str) -> str:
        """How a message names `key` of this axis: `grid.seed`, or `seed` for the command line's."""
        return key if self.where == CLI else f"{self.where}.{key}"


CLI = "command line"


@dataclass(frozen=True)
class SweepSpec:
    name: str
    file: Path
    base: Path
    overrides: dict[str, Any]  # dotted key -> value, from the sweep file
    cli_overrides: dict[str, Any] = field(default_factory=dict)  # dotted key -> value, command line
    axes: tuple[Axis, ...] = ()
    exclude: tuple[dict[str, Any], ...] = ()
    description: str = ""
    plugins: tuple[str, ...] = ()  # rule files (absolute) or modules, added to every run's `plugins`
    claims: ClaimFamily | None = None  # the preregistered family the report tests (config/claims.py)
    # how `base` was found: "file" (the path the sweep file names), "by_name" (no such file: the shipped
    # recipe of that name), "missing" (neither: `base` is the path named; only a frozen sweep resumes)
    base_found: str = "file"
    base_written: str = ""  # `base:` as the sweep file writes it

    @property
    def source(self) -> str:
        return str(self.file)

    @property
    def axis_keys(self) -> list[str]:
        return [k for ax in self.axes for k in ax.keys]


def load_spec(
    path: str | Path,
    cli_overrides: list[str] | tuple[str, ...] = (),
    plugins: list[str] | tuple[str, ...] = (),
    *,
    missing_base_ok: bool = False,
) -> SweepSpec:
    """Read and shape-check a sweep file. Nothing is written. ``plugins``: the CLI's --plugin
    entries (relative to the working directory), after the file's own. ``missing_base_ok``: a base
    recipe that is not found is `base_found == "missing"`, not an error (a frozen sweep resumes
    without it)."""
    path = sweep_path(path)  # a local file, else the shipped sweep of that name
    src = str(path)
    data = read_yaml(path)
    for k in data:
        if k not in TOP_KEYS:
            raise ConfigError(
                src, str(k), "unknown key" + did_you_mean(str(k), TOP_KEYS) + f"; valid keys: {', '.join(TOP_KEYS)}"
            )
    name = _name(data.get("name", path.stem), src)
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(src, "description", f"expected a string, got {type(description).__name__}")
    overrides = _dotted_mapping(data.get("overrides", {}), src, "overrides")
    axes = _grid_axes(data.get("grid"), src) + _zip_axes(data.get("zip"), src)
    seen = _axis_places(axes, overrides, src)

    file_plugins = data.get("plugins") or []
    if not isinstance(file_plugins, list) or not all(isinstance(p, str) and p.strip() for p in file_plugins):
        raise ConfigError(src, "plugins", f"expected a list of .py paths or module names, got {file_plugins!r}")
    plugin_list = merge_specs([resolve(p, path.resolve().parent) for p in file_plugins], [resolve(p) for p in plugins])
    base, found = _base(data.get("base"), path, src, missing_base_ok)
    return SweepSpec(
        name=name,
        file=path,
        base=base,
        base_found=found,
        base_written=str(data.get("base")),
        overrides=overrides,
        cli_overrides=flatten(parse_overrides(cli_overrides, "command line", multirun=True)) if cli_overrides else {},
        axes=tuple(axes),
        exclude=_excludes(data.get("exclude"), seen, src),
        description=description,
        plugins=tuple(plugin_list),
        claims=parse_family(data["claims"], src) if "claims" in data else None,
    )


NAME_MAX = 128  # characters: the sweep's directory, its MLflow parent run and lock paths are named by it


def _name(name: Any, src: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            src, "name", f"expected a directory-safe name (ASCII letters, digits, '_', '-', '.'), got {name!r}"
        )
    if len(name) > NAME_MAX:
        raise ConfigError(
            src, "name", f"{len(name)} characters, at most {NAME_MAX} (it names the sweep's directory): shorten it"
        )
    if name in RESERVED_NAMES:
        raise ConfigError(src, "name", f"'{name}' is reserved; reserved names: {', '.join(RESERVED_NAMES)}")
    return name


def _base(base: Any, path: Path, src: str, missing_ok: bool = False) -> tuple[Path, str]:
    """(the recipe every run starts from, how it was found: `SweepSpec.base_found`): relative to the
    sweep file; else the shipped recipe of that name (`base: quickstart` works from any directory)."""
    if base is None:
        raise ConfigError(
            src, "base", "missing: the recipe every run starts from, e.g. base: ../recipes/quickstart.yaml"
        )
    if not isinstance(base, str):
        raise ConfigError(src, "base", f"expected a path to a recipe, got {base!r}")
    base_path = (path.resolve().parent / base).resolve()
    if base_path.is_file():
        return base_path, "file"
    shipped = shipped_recipe(base)
    if shipped is not None:
        return shipped, "by_name"
    if missing_ok:
        return base_path, "missing"
    raise ConfigError(src, "base", base_not_found(base_path, base))


def base_not_found(base_path: Path, base: str) -> str:
    return f"recipe not found: {base_path} (nor a shipped recipe '{base}'; `clipbench recipes` lists them)"


def _grid_axes(grid: Any, src: str) -> list[Axis]:
    """One axis per key of `grid` (the cartesian product)."""
    if grid is None:
        return []
    if not isinstance(grid, Mapping):
        raise ConfigError(src, "grid", f"expected a mapping of dotted keys to lists, got {type(grid).__name__}")
    axes = []
    for key, values in grid.items():
        key = _key(key, src, "grid")
        axes.append(Axis((key,), tuple((v,) for v in _values(values, src, f"grid.{key}")), "grid"))
    return axes


def _zip_axes(zips: Any, src: str) -> list[Axis]:
    """One axis per zip group: its keys vary together (lists of one length)."""
    if zips is None:
        return []
    groups = [zips] if isinstance(zips, Mapping) else zips
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise ConfigError(src, "zip", "expected a mapping of dotted keys to equal-length lists (or a list of them)")
    axes = []
    for i, group in enumerate(groups):
        where = "zip" if isinstance(zips, Mapping) else f"zip[{i}]"
        if not group:
            raise ConfigError(src, where, "empty: give at least one key")
        keys = [_key(k, src, where) for k in group]
        # a column may repeat a value (two rows with the same lr); the rows must differ
        cols = [_values(group[k0], src, f"{where}.{k}", unique=len(keys) == 1) for k0, k in zip(group, keys)]
        lengths = {k: len(c) for k, c in zip(keys, cols)}
        if len(set(lengths.values())) > 1:
            raise ConfigError(
                src,
                where,
                "zipped lists must have the same length, got " + ", ".join(f"{k}: {n}" for k, n in lengths.items()),
            )
        rows = list(zip(*cols))
        for j, row in enumerate(rows):
            if any(all(_same(a, b) for a, b in zip(row, other)) for other in rows[:j]):
                raise ConfigError(src, where, f"row {j} repeats an earlier row: {dict(zip(keys, row))}")
        axes.append(Axis(tuple(keys), tuple(rows), where))
    return axes


def _axis_places(axes: list[Axis], overrides: Mapping[str, Any], src: str) -> dict[str, tuple[str, str]]:
    """{axis key as stored: (where it is, the key as the sweep file writes it)}; a key on two axes, or
    both an axis and an override, is refused (a component's name in its one form and its older form,
    `objective.name` and `objective.method`, is one key: `sweep.slots.stored_key`)."""

    if not axes:
        raise ConfigError(src, "grid", "empty: give at least one axis, e.g. grid: {seed: [0, 1, 2]}")
    seen: dict[str, tuple[str, str]] = {}
    for ax in axes:
        for k in ax.keys:
            if stored_key(k) in seen:
                raise ConfigError(src, f"{ax.where}.{k}", f"'{k}' is already an axis in {seen[stored_key(k)][0]}")
            seen[stored_key(k)] = (ax.where, k)
    for k in overrides:
        if stored_key(k) in seen:
            raise ConfigError(
                src, f"overrides.{k}", f"'{k}' is also an axis in {seen[stored_key(k)][0]}; remove one of them"
            )
    return seen


def _excludes(exclude: Any, seen: Mapping[str, tuple[str, str]], src: str) -> tuple[dict, ...]:
    """Partial assignments of axis keys: the grid points they match are left out. A key is stored in
    a point's form (`objective.name` as `objective.method`: `sweep.slots.stored_key`), so either form
    of a component's name matches the axis in either form."""
    if exclude is None:
        return ()
    if not isinstance(exclude, list):
        raise ConfigError(src, "exclude", f"expected a list of partial assignments, got {type(exclude).__name__}")
    out = []
    axes = [w for _, w in seen.values()]  # as the sweep file writes them
    for i, item in enumerate(exclude):
        if not isinstance(item, Mapping) or not item:
            raise ConfigError(
                src, f"exclude[{i}]", f"expected a non-empty mapping of axis keys to values, got {item!r}"
            )
        entry, written = {}, {}
        for k, v in item.items():
            k = _key(k, src, f"exclude[{i}]")
            key = stored_key(k)
            if key not in seen:
                raise ConfigError(
                    src,
                    f"exclude[{i}].{k}",
                    "not an axis of this sweep" + did_you_mean(k, axes) + f"; axes: {', '.join(axes)}",
                )
            if key in entry:
                raise ConfigError(src, f"exclude[{i}].{k}", f"names the same axis as {written[key]}: give one of them")
            entry[key], written[key] = v, k
        out.append(entry)
    return tuple(out)


def _key(k: Any, src: str, where: str) -> str:
    if not isinstance(k, str) or not k or k.startswith(".") or k.endswith(".") or ".." in k:
        raise ConfigError(src, f"{where}.{k}", "expected a dotted key of the run config, e.g. train.lr")
    return k


def _values(values: Any, src: str, where: str, unique: bool = True) -> list:
    if not isinstance(values, list):
        raise ConfigError(src, where, f"expected a list of values, got {values!r}")
    if not values:
        raise ConfigError(src, where, "empty list: give at least one value")
    for i, v in enumerate(values):
        if isinstance(v, Mapping):
            raise ConfigError(src, where, f"value {i} is a mapping; sweep leaf keys (e.g. model.name), not sections")
        if unique and any(_same(v, w) for w in values[:i]):
            raise ConfigError(src, where, f"duplicate value {v!r}")
    return values


def _same(a: Any, b: Any) -> bool:
    return (
        type(a) is type(b)
        and a == b
        or (
            isinstance(a, (int, float))
            and isinstance(b, (int, float))
            and not isinstance(a, bool)
            and not isinstance(b, bool)
            and a == b
        )
    )


def _dotted_mapping(d: Any, src: str, where: str) -> dict[str, Any]:
    """A mapping with dotted and/or nested keys -> {dotted leaf key: value}."""
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise ConfigError(src, where, f"expected a mapping of dotted keys to values, got {type(d).__name__}")
    out: dict[str, Any] = {}
    for k, v in d.items():
        k = _key(k, src, where)
        if isinstance(v, Mapping) and v:
            for sub, val in _dotted_mapping(v, src, f"{where}.{k}").items():
                out[f"{k}.{sub}"] = val
        else:
            out[k] = v
    return out
