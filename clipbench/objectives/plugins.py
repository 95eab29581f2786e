"""Plugins: a user's rules in their own file (or module, or installed package), loaded by name.

    from clipbench.objectives.plugins import load_plugins, ensure_plugins
    load_plugins(["lower_only.py", "mypkg.rules"])   # a .py path or an importable module name
    ensure_plugins(cfg)                              # a run config's `plugins` list (and entry points)

* A path (ends in ``.py`` or names an existing file) is imported as a fresh module whose name is
  derived from its resolved path; a module name is imported with importlib. Every rule the import
  registers records its origin: the resolved file and the sha256 of its content
  (``METHODS[name].origin``). Loading the same file twice is a no-op.
* Installed packages expose rules through the entry-point group ``clipbench.rules`` (value: a module,
  imported for its ``@rule`` decorators); the registry loads them on first need (registry.py).
* Every failure is one line naming the file (a ``UserError``): a missing file, an import error (with
  the plugin's line), a bad rule signature, a name clash (built-in names win). A failed import
  registers nothing.
* A sweep's manifest records each plugin's path and hash (:func:`plugin_records`); a resumed sweep
  whose plugin changed stops with :func:`check_plugin_records`'s one-line error.

The import runs the user's code: load only plugins you trust, as with any Python file you run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from clipbench.errors import RuleDefinitionError, UserError
from clipbench.objectives.corrections import CORRECTIONS
from clipbench.objectives.registry import (
    LOADED,
    METHODS,
    PluginOrigin,
    import_rules,
    load_entry_points,
    module_origin,
    sha256_file,
)


def is_path(spec: str) -> bool:
    """A plugin given as a file path (else: an importable module name)."""
    return spec.endswith(".py") or "/" in spec or "\\" in spec or Path(spec).is_file()


def resolve(spec: str, base_dir: str | Path | None = None) -> str:
    """A path made absolute (relative to ``base_dir``, default the working directory); module names
    unchanged."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"plugin {spec!r}: expected a .py path or a module name")
    spec = spec.strip()
    if not is_path(spec):
        return spec
    p = Path(spec).expanduser()
    if not p.is_absolute():
        p = Path(base_dir or Path.cwd()) / p
    return str(p.resolve())


def load_plugin(spec: str, base_dir: str | Path | None = None) -> PluginOrigin:
    """Import one plugin (a .py path, relative to ``base_dir``, or a module name); idempotent."""
    key = resolve(spec, base_dir)
    if key in LOADED:
        return LOADED[key]
    if is_path(key):
        path = Path(key)
        if not path.is_file():
            raise UserError(f"{key}: plugin file not found")
        origin = PluginOrigin(str(path), sha256_file(path))
        name = f"clipbench_plugin_{path.stem}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise UserError(f"{key}: cannot import plugin: not a Python file")
        module = importlib.util.module_from_spec(module_spec)

        def do_import():
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise

        import_rules(origin, do_import)
    else:
        origin = module_origin(key)
        import_rules(origin, lambda: importlib.import_module(key))
    LOADED[key] = origin
    return origin


def load_plugins(specs: Iterable[str] = (), base_dir: str | Path | None = None) -> list[PluginOrigin]:
    """Entry-point rules, then each plugin of ``specs`` (paths relative to ``base_dir``)."""
    load_entry_points()
    return [load_plugin(s, base_dir) for s in specs or ()]


def plugin_specs(cfg: Any) -> list[str]:
    """The ``plugins`` list of a RunConfig, a config dict, or a list of specs."""
    if cfg is None:
        return []
    if isinstance(cfg, (list, tuple)):
        return list(cfg)
    if isinstance(cfg, Mapping):
        return list(cfg.get("plugins") or [])
    return list(getattr(cfg, "plugins", None) or [])


def ensure_plugins(cfg: Any) -> list[PluginOrigin]:
    """Import the plugins a run needs (its config's ``plugins`` list, whose paths are absolute once
    the config is composed, and the entry-point rules): call it wherever a run config becomes a run."""
    return load_plugins(plugin_specs(cfg))


def merge_specs(*lists: Iterable[str]) -> list[str]:
    """Concatenate plugin lists, first occurrence wins."""
    return list(dict.fromkeys(s for lst in lists for s in (lst or ())))


# --------------------------------------------------------------------------------------------
# Manifest records
# --------------------------------------------------------------------------------------------
def plugin_records(configs: Iterable[Mapping]) -> list[dict]:
    """[{"path", "sha256"}] of the plugin files the run configs list and of the non-built-in rules
    they use (e.g. entry-point rules), for a sweep's manifest. The plugins must be loaded."""
    out: dict[str, str] = {}
    for cfg in configs:
        for spec in plugin_specs(cfg):
            origin = load_plugin(spec)
            out.setdefault(origin.path, origin.sha256)
        method = (cfg.get("objective") or {}).get("method")
        correction = ((cfg.get("sampler") or {}).get("correction") or {}).get("name")
        for spec in (METHODS.get(method), CORRECTIONS.get(correction)):
            if spec is not None and spec.origin is not None:
                out.setdefault(spec.origin.path, spec.origin.sha256)
    return [{"path": p, "sha256": h} for p, h in out.items()]


def check_plugin_records(records: Iterable[Mapping], source: str) -> None:
    """Raise a one-line UserError when a recorded plugin file is gone or its content changed."""
    for rec in records or ():
        path, want = rec.get("path"), rec.get("sha256")
        if not path or not want or not Path(path).is_absolute():
            continue  # a module without a file: nothing to compare
        if not Path(path).is_file():
            raise UserError(f"{path}: plugin file of {source} is missing; restore it or use a new sweep name")
        have = sha256_file(path)
        if have != want:
            raise UserError(
                f"{path}: plugin changed since {source} was planned (sha256 {want[:12]} -> {have[:12]}): "
                "the frozen runs would no longer be what was planned; restore the file or use a new "
                "sweep name"
            )


__all__ = [
    "RuleDefinitionError",
    "check_plugin_records",
    "ensure_plugins",
    "is_path",
    "load_entry_points",
    "load_plugin",
    "load_plugins",
    "merge_specs",
    "plugin_records",
    "plugin_specs",
    "resolve",
    "sha256_file",
]
