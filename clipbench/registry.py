"""One registry of named things: rules, corrections, aggregations, advantages, engines, tasks,
benchmarks, templates, launchers. Each is a :class:`Registry`::

    TEMPLATES = Registry("template")
    TEMPLATES.register("dapo", DAPO_TEMPLATE)              # origin: where it was registered from
    TEMPLATES.lookup("dpao")   # UserError: unknown template 'dpao' (did you mean 'dapo'?); valid: dapo, plain
    TEMPLATES["dapo"], list(TEMPLATES), "dapo" in TEMPLATES   # a read-only view is a plain mapping

What every registry does the same way:

- names in registration order; ``entry(name)`` holds the value, its origin and its metadata
  (``register(name, value, needs_groups=True)``; ``names(needs_groups=True)`` filters on it);
- a name registered twice: fine from the same place (a plugin imported again); a plugin never
  replaces a built-in (built-in names win) nor another plugin's: one line naming both;
- origin: ``None`` for clipbench's own entries, else :class:`Origin` (the user's file, resolved, and
  its sha256; or an installed module), taken from :func:`import_attributed` while a plugin is
  imported, or from the registering function's file;
- lazy entries: a registry with ``entry_points=GROUP`` imports the modules of that entry-point group
  (``importlib.metadata``) on the first lookup of a name it does not know, once per process;
- an unknown name: ``errors.unknown_choice`` (did-you-mean, the valid names), raised as the
  registry's ``error`` type.

Assigning (``reg[name] = value``) and deleting bypass the checks: that is for tests restoring a
registry, not for registering.

Adding a registry entry: docs/architecture.md, "Adding an engine / a registry entry".
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from clipbench.errors import RuleDefinitionError, UserError, unknown_choice

V = TypeVar("V")


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True)
class Origin:
    """Where a user's entry comes from: its file (resolved) and the sha256 of the file's content, or
    an importable module's name (sha256 '' when it has no file, e.g. a namespace package)."""

    path: str
    sha256: str

    def __str__(self) -> str:
        return self.path

    @classmethod
    def of_file(cls, path: str | Path) -> Origin:
        p = Path(path).resolve()
        return cls(str(p), sha256_file(p))

    @classmethod
    def of_module(cls, name: str) -> Origin:
        """The origin of an importable module: its file and hash (or just its name, for a namespace).
        UserError when it cannot be found."""
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as e:
            raise UserError(f"{name}: plugin module not found ({type(e).__name__}: {e})") from None
        if found is None:
            raise UserError(f"{name}: plugin module not found (not a file path ending in .py and not importable)")
        path = found.origin if found.origin and Path(found.origin).is_file() else None
        return cls.of_file(path) if path else cls(name, "")


def describe_origin(origin: Origin | None) -> str:
    """'built-in' or 'plugin <path>' (for messages)."""
    return "built-in" if origin is None else f"plugin {origin.path}"


@dataclass(frozen=True)
class Entry(Generic[V]):
    """One registered name: its value, where it comes from (None: clipbench's own) and metadata."""

    name: str
    value: V
    origin: Origin | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return describe_origin(self.origin)


# The plugin being imported (import_attributed): the entries it registers record it.
_LOADING: list[Origin] = []
# Every registry, so that a failed plugin import removes what it added to each.
_REGISTRIES: weakref.WeakSet[Registry] = weakref.WeakSet()
# Entry-point groups already imported (once per process) and plugin modules/files imported: spec -> origin.
GROUPS_LOADED: set[str] = set()
IMPORTED: dict[str, Origin] = {}


def loading_origin() -> Origin | None:
    """The origin of the plugin being imported now, or None."""
    return _LOADING[-1] if _LOADING else None


def origin_of(obj: Any) -> Origin | None:
    """Where a registered function or class comes from: the plugin being imported, else None for
    clipbench's own modules, else its source file (and hash), else its module's name."""
    if _LOADING:
        return _LOADING[-1]
    module = getattr(obj, "__module__", "") or ""
    if module == "clipbench" or module.startswith("clipbench."):
        return None
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        path = None
    if path and Path(path).is_file():
        return Origin.of_file(path)
    return Origin(module or "<unknown>", "")


def import_attributed(origin: Origin, do_import: Callable[[], object]) -> None:
    """Run ``do_import`` with the entries it registers (in any registry) attributed to ``origin``; on
    failure, remove what it registered and raise a one-line UserError naming the file (and line)."""
    before = {id(reg): set(reg) for reg in _REGISTRIES}
    _LOADING.append(origin)
    try:
        do_import()
    except BaseException as e:
        for reg in list(_REGISTRIES):
            for name in set(reg) - before.get(id(reg), set()):
                del reg[name]
        if isinstance(e, (UserError, KeyboardInterrupt, SystemExit)):
            raise
        raise _import_error(origin.path, e) from None
    finally:
        _LOADING.pop()


def snapshot() -> dict:
    """Every registry's entries and the plugins imported, as they are now (for `restore`: a test that
    loads a plugin leaves the process's registries as it found them)."""
    return {"entries": {reg: dict(reg._entries) for reg in list(_REGISTRIES)}, "imported": dict(IMPORTED)}


def restore(state: dict) -> None:
    """The registries and the imported plugins as `snapshot` found them (a registry made since is left)."""
    for reg, entries in state["entries"].items():
        reg._entries.clear()
        reg._entries.update(entries)
    IMPORTED.clear()
    IMPORTED.update(state["imported"])


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
    return UserError(
        f"{where}{f':{line}' if line else ''}: cannot import plugin: {type(e).__name__}" + (f": {msg}" if msg else "")
    )


def load_entry_points(group: str) -> None:
    """Import every module registered under the entry-point ``group`` (once per process; a module
    already imported as a plugin is not imported again)."""
    if group in GROUPS_LOADED:
        return
    GROUPS_LOADED.add(group)
    for ep in importlib.metadata.entry_points(group=group):
        module = ep.value.split(":")[0].strip()
        if module in IMPORTED:
            continue
        try:
            origin = Origin.of_module(module)
        except UserError as e:
            raise UserError(f"entry point {ep.name} = {ep.value} ({group}): {e}") from None
        import_attributed(origin, ep.load)
        IMPORTED[module] = origin


_FROM_VALUE = object()  # register()'s default origin: origin_of the value (or the plugin being imported)


class Registry(MutableMapping[str, V]):
    """Named entries of one kind (see the module docstring).

    kind:         the word in messages ("rule", "engine", ...).
    entry_points: an entry-point group loaded on the first lookup of an unknown name (None: none).
    error:        the exception type of an unknown name (UserError, or ValueError where a caller
                  adds its own context to the message).
    also:         names that are valid but not entries (e.g. a template's 'auto'): listed as valid.
    asked_as:     the word for an unknown name when the user's key says it otherwise (a rule is
                  asked for as a 'method'); default: kind."""

    def __init__(
        self,
        kind: str,
        *,
        entry_points: str | None = None,
        error: type[Exception] = UserError,
        also: Iterable[str] = (),
        asked_as: str | None = None,
    ):
        self.kind, self.entry_points, self.error, self.also = kind, entry_points, error, tuple(also)
        self.asked_as = asked_as or kind
        self._entries: dict[str, Entry[V]] = {}
        _REGISTRIES.add(self)

    # --- the mapping: name -> value, in registration order -------------------------------------
    __hash__ = object.__hash__  # one object per kind (kept in a WeakSet); equal only to itself
    __eq__ = object.__eq__

    def __getitem__(self, name: str) -> V:
        return self._entries[name].value

    def __setitem__(self, name: str, value: V) -> None:
        """Unchecked (tests restoring a registry): the origin is the value's own ``origin`` when it
        carries one (rule and correction specs do), else the replaced entry's."""
        old = self._entries.get(name)
        origin = getattr(value, "origin", None)
        if not isinstance(origin, Origin):
            origin = old.origin if old else None
        self._entries[name] = Entry(name, value, origin, old.meta if old else {})

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"

    # --- registering ------------------------------------------------------------------------------
    def register(self, name: str, value: V, *, origin: Any = _FROM_VALUE, where: str | None = None, **meta: Any) -> V:
        """Add ``name``; returns ``value``. ``origin`` defaults to :func:`origin_of` the value (the
        plugin being imported, else the value's module); ``where`` (file:line) starts a collision's
        message. Metadata: keyword arguments, kept on the entry."""
        if origin is _FROM_VALUE:
            origin = origin_of(value) if (inspect.isfunction(value) or inspect.isclass(value)) else loading_origin()
        self.check_free(name, origin, where or (origin.path if origin else name))
        self._entries[name] = Entry(name, value, origin, dict(meta))
        return value

    def check_free(self, name: str, origin: Origin | None, where: str) -> None:
        """A name registered again: fine from the same place (a plugin imported again); a plugin never
        replaces a built-in (built-in names win) nor another plugin's. RuleDefinitionError-like
        UserError naming both origins."""
        old = self._entries.get(name)
        if old is None:
            return
        if old.origin is None and origin is not None:
            raise RuleDefinitionError(f"{where}: '{name}' is a built-in {self.kind} (built-in names win): rename yours")
        same = (old.origin is None and origin is None) or (
            old.origin is not None and origin is not None and old.origin.path == origin.path
        )
        if not same:
            raise RuleDefinitionError(f"{where}: {self.kind} '{name}' is already registered by {old.where}")

    # --- lookups ---------------------------------------------------------------------------------
    def entry(self, name: str) -> Entry[V]:
        """The entry of ``name``; an unknown name first loads the entry points, then raises
        ``self.error`` with a did-you-mean."""
        if isinstance(name, str) and name not in self._entries and self.entry_points:
            load_entry_points(self.entry_points)
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise self.error(self.unknown(name)) from None

    def lookup(self, name: str) -> V:
        """The value of ``name`` (see :meth:`entry`)."""
        return self.entry(name).value

    def unknown(self, name: Any) -> str:
        """The message for an unknown name: did-you-mean and every valid name."""
        return unknown_choice(self.asked_as, name, self.choices())

    def choices(self) -> tuple[str, ...]:
        """Every valid name: the entries, then ``also``."""
        return (*self._entries, *self.also)

    def names(self, **meta: Any) -> tuple[str, ...]:
        """The names in registration order; with keyword arguments, those whose metadata matches."""
        return tuple(n for n, e in self._entries.items() if all(e.meta.get(k) == v for k, v in meta.items()))

    def origin(self, name: str) -> Origin | None:
        return self._entries[name].origin
