"""Plugins: a user's rules in their own file (or module, or installed package), loaded by name.

    from clipbench.objectives.plugins import load_plugins, ensure_plugins
    load_plugins(["lower_only.py", "mypkg.rules"])   # a .py path or an importable module name
    ensure_plugins(cfg)                              # a run config's `plugins` list (and entry points)

* A path (ends in ``.py`` or names an existing file) is imported as a fresh module whose name is
  derived from its resolved path; a module name is imported with importlib. Every rule the import
  registers records its origin: the resolved file and the sha256 of its content
  (``METHODS[name].origin``). Loading the same file twice is a no-op.
* Installed packages expose rules through the entry-point group ``clipbench.rules`` (value: a module,
  imported for its ``@rule`` decorators); they are loaded on first need and are always available.
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
import importlib.metadata
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any, Iterable, Mapping

from clipbench.errors import UserError
from clipbench.objectives.registry import METHODS, PluginOrigin, RuleDefinitionError, loading_plugin

ENTRY_POINT_GROUP = "clipbench.rules"

_LOADED: dict[str, PluginOrigin] = {}  # plugin spec (resolved path or module name) -> origin
_ENTRY_POINTS_LOADED = False


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


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


def _import_error(where: str, e: BaseException) -> UserError:
    """One line: the plugin's file and line of the error, the error itself."""
    line = None
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve() == Path(where).resolve():
        line = e.lineno
    else:
        for frame in reversed(traceback.extract_tb(e.__traceback__)):
            if frame.filename and Path(frame.filename).resolve() == Path(where).resolve():
                line = frame.lineno
                break
    msg = str(e).splitlines()[0] if str(e) else ""
    return UserError(f"{where}{f':{line}' if line else ''}: cannot import plugin: {type(e).__name__}"
                     + (f": {msg}" if msg else ""))


def _import(origin: PluginOrigin, do_import) -> None:
    """Run ``do_import`` with the rules it registers attributed to ``origin``; on failure, unregister
    what it registered and raise a one-line UserError naming the file."""
    before = set(METHODS)
    try:
        with loading_plugin(origin):
            do_import()
    except BaseException as e:
        for name in set(METHODS) - before:
            del METHODS[name]
        if isinstance(e, UserError):
            raise
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _import_error(origin.path, e) from None


def load_plugin(spec: str, base_dir: str | Path | None = None) -> PluginOrigin:
    """Import one plugin (a .py path, relative to ``base_dir``, or a module name); idempotent."""
    key = resolve(spec, base_dir)
    if key in _LOADED:
        return _LOADED[key]
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

        _import(origin, do_import)
    else:
        origin = _module_origin(key)
        _import(origin, lambda: importlib.import_module(key))
    _LOADED[key] = origin
    return origin


def _module_origin(name: str) -> PluginOrigin:
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        raise UserError(f"{name}: plugin module not found ({type(e).__name__}: {e})") from None
    if found is None:
        raise UserError(f"{name}: plugin module not found (not a file path ending in .py and not importable)")
    path = found.origin if found.origin and Path(found.origin).is_file() else None
    return PluginOrigin(str(Path(path).resolve()), sha256_file(path)) if path else PluginOrigin(name, "")


def load_entry_points() -> None:
    """Import every module registered under the ``clipbench.rules`` entry-point group (once)."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        module = ep.value.split(":")[0].strip()
        if module in _LOADED:
            continue
        try:
            origin = _module_origin(module)
        except UserError as e:
            raise UserError(f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}): {e}") from None
        _import(origin, ep.load)
        _LOADED[module] = origin


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
        spec = METHODS.get(method)
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
            raise UserError(f"{path}: plugin changed since {source} was planned (sha256 {want[:12]} -> {have[:12]}): "
                            "the frozen runs would no longer be what was planned; restore the file or use a new "
                            "sweep name")


__all__ = ["ENTRY_POINT_GROUP", "RuleDefinitionError", "check_plugin_records", "ensure_plugins", "is_path",
           "load_entry_points", "load_plugin", "load_plugins", "merge_specs", "plugin_records", "plugin_specs",
           "resolve", "sha256_file"]
