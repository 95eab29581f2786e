"""The house reads one way: every import in clipbench/ goes down the floors docs/architecture.md states,
and no module imports itself back, lazily or not.

The floors are read from docs/architecture.md (its ```floors block: one line per floor, top first),
so the document and the code cannot drift apart: a new package must be given a floor there, and an
import that runs back up (or sideways, between two packages of one floor) fails here with the file,
the line and the two floors.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "clipbench"
DOC = REPO / "docs" / "architecture.md"


def floors() -> dict[str, int]:
    """{unit: floor number, 0 = the top} from the ```floors block of docs/architecture.md."""
    text = DOC.read_text()
    m = re.search(r"```floors\n(.*?)```", text, re.S)
    assert m, f"{DOC} has no ```floors block"
    out: dict[str, int] = {}
    for i, line in enumerate(ln for ln in m.group(1).splitlines() if ln.strip()):
        names = line.split("#", 1)[0].replace(",", " ").split()
        for name in names:
            assert name not in out, f"{name} is on two floors of {DOC}"
            out[name] = i
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The floor unit of a module: the package under clipbench (clipbench.sweep.expand -> sweep), or
    the top-level module itself (clipbench.errors -> errors)."""
    return module.split(".")[1] if module.count(".") >= 1 else "clipbench"


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported clipbench module, line) for every import of the file, at any depth (lazy ones too).
    `from clipbench.x import y` counts as clipbench.x.y when that is a module, else clipbench.x."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("clipbench")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = here.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("clipbench"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if _is_module(sub) else mod, node.lineno))
    return out


def _is_module(name: str) -> bool:
    p = REPO.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_floor():
    declared = floors()
    units = {unit(module_name(p)) for p in SOURCES} - {"clipbench"}
    missing = sorted(units - set(declared))
    assert not missing, f"give these a floor in {DOC}: {missing}"
    assert not sorted(set(declared) - units), f"{DOC} names floors for what does not exist"


def test_imports_go_down_only():
    declared = floors()
    wrong = []
    for path in SOURCES:
        here = unit(module_name(path))
        for target, line in imports(path):
            there = unit(target)
            if there == here or there == "clipbench":
                continue
            if declared[there] <= declared[here]:
                wrong.append(
                    f"{path.relative_to(REPO)}:{line}: {here} (floor {declared[here]}) imports "
                    f"{target} ({there}, floor {declared[there]})"
                )
    assert not wrong, "imports that do not go down:\n" + "\n".join(wrong)


def test_no_module_imports_itself_back():
    """No cycle in the module graph (the floors rule out cycles between packages; this one catches
    them inside a package too, e.g. a registry and its plugin loader)."""
    graph = {module_name(p): {t for t, _ in imports(p)} for p in SOURCES}
    for mod, targets in graph.items():  # a module depends on the packages it lives in (their __init__)
        targets.discard(mod)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                # a package's __init__ importing its own submodules is how packages export: not a cycle
                # unless a submodule imports the package back
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The reader itself: imports inside functions count, `from a import module` names the module."""
    src = PACKAGE / "engines" / "launch.py"
    found = {t for t, _ in imports(src)}
    assert "clipbench.engines" in found  # `from clipbench.engines import train_run`, inside run_as_rank
    assert "clipbench.tracking.store" in found
