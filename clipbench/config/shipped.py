"""The recipes and sweeps shipped inside the package, addressable by name from any directory.

    recipe_path("quickstart")                        # -> <package>/recipes/quickstart.yaml
    recipe_path("abc_grpo_table3/qwen3_4b_grpo")     # -> <package>/recipes/abc_grpo_table3/qwen3_4b_grpo.yaml
    sweep_path("nsr_vs_decay")                       # -> <package>/sweeps/nsr_vs_decay.yaml
    recipe_path("my_recipe.yaml")                    # a local file always wins

They live in `clipbench/recipes/` and `clipbench/sweeps/` (package data; the repository's top-level
`recipes/` and `sweeps/` are links to them), so a sweep's `base: ../recipes/quickstart.yaml` resolves
the same way installed or in a clone. `recipes/NAME.yaml` and `sweeps/NAME.yaml` (the README's
spelling) also find the shipped file when no such local file exists. `catalog()` lists every shipped
file with its entry in `shipped.yaml` beside this module (what it runs, its scale, its expected time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clipbench.errors import ConfigError
from clipbench.yamlio import YamlError, load_yaml_file

PACKAGE = Path(__file__).resolve().parents[1]
RECIPES = PACKAGE / "recipes"
SWEEPS = PACKAGE / "sweeps"
CATALOG = Path(__file__).with_name("shipped.yaml")  # runs / scale / time of each shipped file


def _shipped(ref: str, dirs: tuple[Path, ...]) -> Path | None:
    """The shipped file `ref` names in one of `dirs` (with or without .yaml, with or without a
    leading recipes/ or sweeps/), or None."""
    name = ref.replace("\\", "/")
    for prefix, root in (("recipes/", RECIPES), ("sweeps/", SWEEPS)):
        if name.startswith(prefix):  # the prefix names where to look: `sweeps/quickstart` is never the recipe
            name, dirs = name[len(prefix) :], tuple(d for d in dirs if d == root)
    if not name or name.startswith("/") or ".." in name.split("/"):
        return None
    names = (name,) if name.endswith((".yaml", ".yml")) else (name + ".yaml", name)
    for d in dirs:
        for n in names:
            if (d / n).is_file():
                return d / n
    return None


def _resolve(ref: str | Path, dirs: tuple[Path, ...], kind: str) -> Path:
    path = Path(ref)
    if path.is_file():  # a local file wins
        return path
    found = _shipped(str(ref), dirs)
    if found is None and path.exists():
        return path  # a directory of that name, and no shipped file: read_yaml says what is wrong
    if found is None:
        raise ConfigError(
            str(ref), None, f"file not found, nor a shipped {kind} of that name (`clipbench recipes` lists them)"
        )
    return found


def recipe_path(ref: str | Path) -> Path:
    """A recipe: the local file `ref`, else the shipped recipe of that name (ConfigError if neither)."""
    return _resolve(ref, (RECIPES,), "recipe")


def sweep_path(ref: str | Path) -> Path:
    """A sweep file: the local file `ref`, else the shipped sweep of that name (sweeps/ first, then
    the sweeps that sit beside their recipes, e.g. abc_grpo_table3/sweep_tiny)."""
    return _resolve(ref, (SWEEPS, RECIPES), "sweep")


def shipped_recipe(ref: str) -> Path | None:
    """The shipped recipe `ref` names, or None (a sweep's `base:` falls back to it)."""
    return _shipped(ref, (RECIPES,))


def shipped_sweep(ref: str) -> Path | None:
    """The shipped sweep `ref` names (sweeps/ first, then beside the recipes), or None."""
    return _shipped(ref, (SWEEPS, RECIPES))


@dataclass(frozen=True)
class Shipped:
    key: str  # recipes/NAME or sweeps/NAME (the catalog's key)
    kind: str  # recipe | sweep
    path: Path
    data: dict  # the file's mapping
    summary: str  # what it runs (shipped.yaml)
    scale: str  # where it runs (shipped.yaml)
    time: str  # expected time, as measured or estimated where stated (shipped.yaml)

    @property
    def name(self) -> str:
        """What to type: `clipbench train NAME` / `clipbench sweep NAME`."""
        return self.key.split("/", 1)[1]


def shipped_files() -> list[tuple[str, str, Path]]:
    """(key, kind, path) of every shipped recipe and sweep, key = recipes/NAME or sweeps/NAME; a file
    with a top-level `base:` is a sweep."""
    out = []
    for root in (RECIPES, SWEEPS):
        for path in sorted(root.rglob("*.yaml")):
            name = path.relative_to(PACKAGE).with_suffix("").as_posix()
            try:
                data = load_yaml_file(path)
            except YamlError as e:
                raise ConfigError(str(path), None, e.reason) from None
            out.append((name, "sweep" if isinstance(data, dict) and "base" in data else "recipe", path))
    return out


def catalog() -> list[Shipped]:
    """Every shipped recipe and sweep with its catalog entry (ConfigError: a file without an entry,
    or an entry without a file)."""
    entries = load_yaml_file(CATALOG) or {}
    files = shipped_files()
    names = {n for n, _, _ in files}
    for name in entries:
        if name not in names:
            raise ConfigError(str(CATALOG), name, "no shipped recipe or sweep of that name")
    out = []
    for key, kind, path in files:
        entry = entries.get(key)
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("runs", "scale", "time")):
            raise ConfigError(str(CATALOG), key, "missing or incomplete entry (runs, scale, time)")
        out.append(Shipped(key, kind, path, load_yaml_file(path) or {}, entry["runs"], entry["scale"], entry["time"]))
    return out
