"""Run configs: the schema (the one place defaults live) and compose/validate."""

from clipbench.config.load import (
    compose,
    dump_yaml,
    from_dict,
    load_run_config,
    parse_overrides,
    read_yaml,
    recorded,
    run_id,
    setting,
    to_dict,
    validate,
)
from clipbench.config.schema import RunConfig
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
