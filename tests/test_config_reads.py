"""The run config is read one way outside clipbench/config (issue 26 part 3): typed, with the default
owned by the schema (`clipbench.config.setting(cfg, "tracking.experiment")`, or a RunConfig's
attributes), never a raw dict read that carries its own copy of a default such as
`cfg.get("tracking", {}).get("experiment", "clipbench")`.

The scan reads every module of the package (as tests/test_architecture.py reads the imports) and
flags a `.get(key, default)` whose key is a section of the run config, or whose receiver is such a
section (`cfg["tracking"].get(...)`, `cfg.get("sampler", {}).get(...)`, `(cfg.get("task") or
{}).get(...)`), and a section read with a default of its own (`cfg.get("train") or {}`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clipbench.config import recorded, setting
from clipbench.config.schema import RunConfig, leaf_keys

PACKAGE = Path(__file__).resolve().parent.parent / "clipbench"
# The run config's sections (mappings): a read of one with a default is a copied default.
SECTIONS = {key.split(".")[0] for key in leaf_keys() if "." in key} | {"objective", "trl"}
# Reads that look like one but are not of a run config: (file, expression) -> what it reads.
NOT_RUN_CONFIG = {
    ("replay/run.py", "rec.index.get('model', '')"): "a replay record's index: the model name it recorded",
    ("sweep/spec.py", "data.get('plugins') or []"): "a sweep file's own plugins key",
}
# Modules on a floor below config (docs/architecture.md): they cannot import its reader.
BELOW_CONFIG = ("objectives/", "tasks/", "models/")


def _section_read(node: ast.AST) -> bool:
    """Whether `node` reads a section of a run config: x.get("train", ...), x["train"], (x.get("train") or {})."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
        return _section_read(node.values[0])
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in SECTIONS
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in SECTIONS
    )


def raw_reads_with_defaults(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every raw read with its own default of a run-config key in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"):
            continue
        if len(node.args) + len(node.keywords) < 2:
            continue  # no default of its own
        if _section_read(node) or _section_read(node.func.value):
            out.append((node.lineno, ast.unparse(node)))
    for node in ast.walk(ast.parse(source)):  # cfg.get("train") or {}
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and _section_read(node.values[0]):
            if isinstance(node.values[0], ast.Call) and len(node.values[0].args) == 1:  # not already flagged
                out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_raw_read_of_the_run_config_with_a_default_outside_config():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("config/", *BELOW_CONFIG)):
            continue
        for line, expr in raw_reads_with_defaults(path.read_text()):
            if (rel, expr) not in NOT_RUN_CONFIG:
                found.append(f"clipbench/{rel}:{line}: {expr}")
    assert not found, "read these with clipbench.config.setting (the schema owns the default):\n" + "\n".join(found)


def test_the_scan_sees_each_form_of_a_raw_read():
    flagged = raw_reads_with_defaults(
        "a = cfg.get('tracking', {}).get('experiment', 'clipbench')\n"
        "b = cfg['launch'].get('nproc_per_node', 1)\n"
        "c = (cfg.get('sampler') or {}).get('correction', None)\n"
        "d = cfg.get('objective', {})\n"
        "e = cfg.get('tracking')\n"  # no default of its own: not flagged
        "f = point.get('steps', 3)\n"  # not a run-config section: not flagged
        "g = cfg.get('train') or {}\n"
    )
    assert sorted(line for line, _ in flagged) == [1, 1, 2, 3, 3, 4, 7]  # 1, 3: the outer and the inner read


def test_setting_reads_the_schemas_default_where_a_stored_config_lacks_the_key():
    stored = {"seed": 3, "tracking": {"experiment": "mine"}}  # e.g. a run config from before `launch`
    assert setting(stored, "seed") == 3 and setting(stored, "tracking.experiment") == "mine"
    assert setting(stored, "launch.nproc_per_node") == 1 == RunConfig().launch.nproc_per_node
    assert setting(stored, "tracking.sinks") == ["mlflow"] and setting(stored, "objective.method") == "grpo"
    assert setting({"objective": {"method": "nsr", "p": 0.5}}, "objective.p") == 0.5  # a component's parameter
    for key in ("tracking.experimnet", "train", "objective.p"):  # a typo, a section, an unset parameter
        with pytest.raises(KeyError):
            setting(stored, key)


def test_recorded_reads_none_where_a_partial_config_records_nothing():
    """A report of runs must not guess what a partial config left out (health's total steps)."""
    stored = {"seed": 3, "train": {"steps": 10}}
    assert recorded(stored, "train.steps") == 10 and recorded(stored, "seed") == 3
    assert recorded(stored, "train.lr") is None and recorded(stored, "objective.method") is None
    with pytest.raises(KeyError):
        recorded(stored, "train.stepz")


def test_a_stored_component_reads_as_a_slot_none_where_the_config_records_none():
    """The readers of stored runs (report, sync, replay) read a component through the translation
    (`recorded_slot`), never by the stored form's keys."""
    from clipbench.config.schema import Slot
    from clipbench.config.stored import recorded_slot

    assert recorded_slot({"objective": {"method": "nsr", "p": 0.5}}, "objective") == Slot("nsr", {"p": 0.5})
    assert recorded_slot({"sampler": {"correction": {"name": "tis", "cap": 3.0}}}, "correction") == Slot(
        "tis", {"cap": 3.0}
    )
    assert recorded_slot({"train": {"agg": "token-sum"}}, "aggregation") == Slot("token-sum")
    assert recorded_slot({"seed": 3}, "objective") is None
    assert recorded_slot({"objective": {"p": 0.5}}, "objective") is None  # a partial config: no name, no guess
