"""Run configs: the schema (the one place defaults live) and compose/validate."""

from clipbench.config.compose import compose, parse_overrides, read_yaml
from clipbench.config.identity import run_id
from clipbench.config.load import load_run_config, validate
from clipbench.config.schema import RunConfig
from clipbench.config.stored import dump_yaml, from_dict, recorded, setting, to_dict
from clipbench.yamlio import flatten  # dotted keys of nested mappings (owned below config and tasks)

__all__ = [
    "RunConfig",
    "compose",
    "dump_yaml",
    "flatten",
    "from_dict",
    "load_run_config",
    "parse_overrides",
    "read_yaml",
    "recorded",
    "run_id",
    "setting",
    "to_dict",
    "validate",
]
