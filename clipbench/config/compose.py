"""A run config's layers and how they compose: a recipe YAML (or a mapping), then dotted
`key=value` overrides, later wins, into one plain dict (`compose`), not yet validated
(`clipbench.config.load.validate` checks it).

    compose("recipes/quickstart.yaml", ["train.steps=5", "objective.name=dapo"])
    compose({"objective": {"method": "grpo"}}, ["objective.name=dapo"])  # -> {"objective": {"name": "dapo"}}

Every failure is a `ConfigError(file, key, reason)`: one line, exit code 2 at the CLI, nothing written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipbench.config.shipped import recipe_path
from clipbench.config.slots import layer, renamed
from clipbench.errors import ConfigError
from clipbench.yamlio import YamlError, load_yaml_file, load_yaml_text

# Keys whose relative values are paths relative to the recipe file (when they look like paths).
PATH_KEYS = ("model.name", "task.path", "eval.data_dir")


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping (a recipe or a sweep file) with the project's one YAML reader
    (`clipbench.yamlio`: UTF-8 only, duplicate keys refused); every problem is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), None, "file not found" if not path.exists() else "not a regular file")
    try:
        data = load_yaml_file(path)
    except YamlError as e:
        raise ConfigError(str(path), f"line {e.line}" if e.line else None, e.reason) from None
    except OSError as e:
        raise ConfigError(str(path), None, f"cannot read: {e.strerror or e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), None, f"expected a mapping at top level, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class Several:
    """A command-line value in Hydra's multirun form (`seed=0,1`): one value per run (a sweep's axis)."""

    values: tuple
    raw: str


def multirun_values(raw: str) -> list[str] | None:
    """The values of `raw` in Hydra's multirun form (`0,1,2`: commas outside brackets and quotes), or
    None for one value (`[0.9,0.999]` is one list, `'a,b'` one string)."""
    depth, quote, parts, start = 0, "", [], 0
    for i, ch in enumerate(raw):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(raw[start:i])
            start = i + 1
    return [*parts, raw[start:]] if parts else None


def _value(raw: str, source: str | None, key: str) -> Any:
    try:
        return load_yaml_text(raw) if raw.strip() else ""
    except YamlError as e:
        if "duplicate key" in e.reason:
            raise ConfigError(source, key, e.reason) from None
        return raw  # not YAML: the raw string (e.g. a path with a colon)


def parse_overrides(overrides: Iterable[str], source: str | None = "command line", *, multirun: bool = False) -> dict:
    """['a.b=1', 'c=x'] -> nested dict, values parsed as YAML scalars/lists. Hydra's multirun form
    (`seed=0,1`) is a `Several` with `multirun` (a sweep's command line), else refused in one line:
    one run takes one value."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(source, item, "overrides must look like key=value (e.g. train.steps=10)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        if not key:
            raise ConfigError(source, item, "empty key in override")
        several = multirun_values(raw)
        if several is not None and not multirun:
            raise ConfigError(
                source,
                key,
                f"'{raw}' is several values (Hydra's multirun form) and one run takes one: give one value, sweep "
                f"them with `clipbench sweep SWEEP {key}={raw}`, or write a list value as [{raw}]",
            )
        value = Several(tuple(_value(v, source, key) for v in several), raw) if several else _value(raw, source, key)
        set_dotted(out, key, value)
    return out


def set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(None, key, f"'{p}' is not a section")
    d[parts[-1]] = value


def deep_merge(base: Mapping, over: Mapping) -> dict:
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _resolve_paths(d: dict, base_dir: Path) -> dict:
    """Relative paths in a recipe are relative to the recipe file (HF names are left alone)."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        val = d.get(section, {}).get(name) if isinstance(d.get(section), dict) else None
        if isinstance(val, str) and (val.startswith("./") or val.startswith("../")):
            d[section][name] = str((base_dir / val).resolve())
    return _resolve_plugins(d, base_dir)


def _resolve_plugins(d: dict, base_dir: Path) -> dict:
    """`plugins`: .py paths made absolute (relative to base_dir); module names unchanged."""
    from clipbench.objectives.plugins import resolve  # noqa: PLC0415 - objectives.plugins pulls in torch

    if isinstance(d.get("plugins"), list):
        d["plugins"] = [resolve(p, base_dir) if isinstance(p, str) and p.strip() else p for p in d["plugins"]]
    return d


def compose(
    recipe: str | Path | Mapping | None, overrides: Iterable[str] | Mapping = (), *, source: str | None = None
) -> dict:
    """Recipe (file or mapping) + overrides -> a plain dict (not yet validated). Each component is
    kept in the spelling its layer wrote (an error names the key the user wrote); a later layer's
    component name replaces an earlier one's, whichever spelling each uses (`slots.renamed`)."""
    if recipe is None:
        data, base_dir = {}, Path.cwd()
    elif isinstance(recipe, Mapping):
        data, base_dir = dict(recipe), Path.cwd()
    else:
        recipe = recipe_path(recipe)  # a local file, else the shipped recipe of that name
        source = source or str(recipe)
        data, base_dir = read_yaml(recipe), Path(recipe).resolve().parent
    data = _resolve_paths(deep_merge({}, layer(data)), base_dir)
    over = layer(dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides))
    over = _resolve_plugins(over, Path.cwd())  # override paths: relative to the cwd
    return deep_merge(renamed(data, over), over)
