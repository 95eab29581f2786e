"""The one generic Registry (clipbench/registry.py): names in order, did-you-mean, collisions naming
both origins, origins with the file's sha256, metadata, a real entry-point group loaded lazily, and
a failed plugin import removing what it registered in every registry."""

from __future__ import annotations

import hashlib
import sys
import textwrap
import types

import pytest

from clipbench import registry as generic
from clipbench.errors import RuleDefinitionError, UserError
from clipbench.registry import Origin, Registry, import_attributed


def test_names_in_order_lookup_and_did_you_mean():
    reg = Registry("colour", also=("auto",))
    reg.register("red", 1)
    reg.register("green", 2, warm=False)
    reg.register("orange", 3, warm=True)
    assert list(reg) == ["red", "green", "orange"] and reg.choices() == ("red", "green", "orange", "auto")
    assert reg.lookup("green") == 2 and reg["orange"] == 3 and dict(reg) == {"red": 1, "green": 2, "orange": 3}
    assert reg.names(warm=True) == ("orange",) and reg.entry("green").meta == {"warm": False}
    with pytest.raises(UserError) as e:
        reg.lookup("gren")
    # valid names sorted (errors.unknown_choice), 'auto' among them
    assert str(e.value) == "unknown colour 'gren' (did you mean 'green'?); valid: auto, green, orange, red"
    asked = Registry("rule", error=ValueError, asked_as="method")
    with pytest.raises(ValueError, match=r"^unknown method 'x'; valid: $"):
        asked.lookup("x")


def test_collisions_name_both_origins(tmp_path):
    reg = Registry("widget")
    reg.register("a", object())  # clipbench's own (no plugin being imported): origin None
    assert reg.origin("a") is None and reg.entry("a").where == "built-in"
    mine = Origin.of_file(write(tmp_path / "mine.py", "x = 1\n"))
    theirs = Origin.of_file(write(tmp_path / "theirs.py", "x = 2\n"))
    with pytest.raises(RuleDefinitionError, match=r"^mine\.py:3: 'a' is a built-in widget \(built-in names win\)"):
        reg.register("a", object(), origin=mine, where="mine.py:3")
    reg.register("b", 1, origin=mine)
    reg.register("b", 2, origin=mine)  # the same file imported again: fine
    with pytest.raises(
        RuleDefinitionError, match=rf"^theirs\.py:1: widget 'b' is already registered by plugin {mine.path}$"
    ):
        reg.register("b", 3, origin=theirs, where="theirs.py:1")
    assert reg["b"] == 2


def test_origin_is_the_file_and_its_sha256(tmp_path):
    path = write(tmp_path / "plug.py", "def f():\n    return 1\n")
    origin = Origin.of_file(path)
    assert origin.path == str(path.resolve())
    assert origin.sha256 == hashlib.sha256(b"def f():\n    return 1\n").hexdigest()
    assert Origin.of_module("json").path.endswith("json/__init__.py")
    with pytest.raises(UserError, match="cb_no_such_mod: plugin module not found"):
        Origin.of_module("cb_no_such_mod")


def test_a_failed_import_unregisters_from_every_registry(tmp_path):
    one, two = Registry("one"), Registry("two")
    origin = Origin.of_file(write(tmp_path / "bad.py", "x\n"))

    def half_then_fail():
        one.register("p", 1)
        two.register("q", 2)
        raise RuntimeError("boom")

    with pytest.raises(UserError, match="cannot import plugin: RuntimeError: boom"):
        import_attributed(origin, half_then_fail)
    assert "p" not in one and "q" not in two
    import_attributed(origin, lambda: one.register("p", 1))
    assert one.origin("p") == origin  # attributed to the plugin being imported


def test_an_entry_point_group_loads_on_the_first_unknown_name(tmp_path, monkeypatch):
    """A real importlib.metadata entry point (a .dist-info on sys.path), imported on the first lookup
    of a name the registry does not know, once; the entry's origin is the module's file."""
    group = "clipbench.test_registry"
    write(tmp_path / "cb_test_reg_plugin.py", "from cb_test_reg_host import GADGETS\nGADGETS.register('far', 7)\n")
    host = types.ModuleType("cb_test_reg_host")
    host.GADGETS = GADGETS = Registry("gadget", entry_points=group)
    monkeypatch.setitem(sys.modules, "cb_test_reg_host", host)
    write(
        tmp_path / "cb_test_reg-0.1.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: cb-test-reg\nVersion: 0.1\n"
    )
    write(tmp_path / "cb_test_reg-0.1.dist-info" / "entry_points.txt", f"[{group}]\nmine = cb_test_reg_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = dict(generic.IMPORTED)
    try:
        GADGETS.register("near", 1)
        assert GADGETS.lookup("near") == 1 and group not in generic.GROUPS_LOADED  # a known name loads nothing
        assert GADGETS.lookup("far") == 7
        assert GADGETS.origin("far").path == str((tmp_path / "cb_test_reg_plugin.py").resolve())
        assert group in generic.GROUPS_LOADED
        with pytest.raises(UserError, match=r"unknown gadget 'fa' \(did you mean 'far'\?\); valid: far, near"):
            GADGETS.lookup("fa")  # loaded once: the group is not imported again
    finally:
        generic.GROUPS_LOADED.discard(group)
        generic.IMPORTED.clear()
        generic.IMPORTED.update(imported)
        sys.modules.pop("cb_test_reg_plugin", None)


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path
