"""Load a run config: compose it (recipe YAML + dotted overrides, `clipbench.config.compose`) and
validate it against the code it configures.

    cfg = load_run_config("recipes/quickstart.yaml", ["train.steps=5", "objective.name=dapo"])

Every failure is a `ConfigError(file, key, reason)`: one line, exit code 2 at the CLI, nothing written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import fields
from pathlib import Path

from omegaconf.errors import OmegaConfBaseException

from clipbench.config.compose import compose
from clipbench.config.schema import RANGES, SLOTS, RunConfig, choices, is_section, value_at
from clipbench.config.slots import checked, migrate
from clipbench.config.stored import set_slot, typed
from clipbench.errors import ConfigError, UserError, did_you_mean, unknown_choice
from clipbench.tasks.arith import ArithKnobError, ArithKnobs


def _known_keys(dc) -> list[str]:
    return [f.name for f in fields(dc)]


def _check_unknown(data: Mapping, dc_type, prefix: str, source: str | None) -> None:
    """Unknown keys with did-you-mean (OmegaConf's own message is less helpful)."""
    known = _known_keys(dc_type)
    for k, v in data.items():
        full = f"{prefix}{k}"
        if k not in known:
            raise ConfigError(
                source, full, "unknown key" + did_you_mean(k, known) + f"; valid keys here: {', '.join(known)}"
            )
        f = next(f for f in fields(dc_type) if f.name == k)
        sub = f.default_factory() if callable(getattr(f, "default_factory", None)) else None  # type: ignore[misc]
        if is_section(type(sub)):
            if not isinstance(v, Mapping):
                raise ConfigError(source, full, f"expected a section (mapping), got {v!r}")
            _check_unknown(v, type(sub), full + ".", source)


_NOT_CONVERTED = re.compile(r"^Value '(?P<value>.*)' of type '(?P<type>\w+)' could not be converted to (?P<to>\w+)$")
_WANTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}
_GIVEN = {
    "ListConfig": "a list",
    "DictConfig": "a mapping",
    "str": "a string",
    "int": "an integer",
    "float": "a number",
}


def _type_reason(message: str) -> str:
    """OmegaConf's 'Value '[0, 1]' of type 'ListConfig' could not be converted to Integer' in words: 'expected
    an integer, got a list: [0, 1] (one run takes one value; ...)'; any other message as it is."""
    m = _NOT_CONVERTED.match(message)
    if m is None:
        return message
    wanted = _WANTED.get(m["to"], m["to"])
    reason = f"expected {wanted}, got {_GIVEN.get(m['type'], m['type'])}: {m['value']}"
    if m["type"] in ("ListConfig", "list"):
        reason += " (one run takes one value; to run several, sweep them: `clipbench sweep SWEEP KEY=a,b`)"
    return reason


def validate(data: Mapping, source: str | None = None) -> RunConfig:
    """A composed dict (each component in any of its forms) -> a validated RunConfig, each
    component's parameters resolved by its registry (the method's defaults filled into `objective`,
    the correction's into `sampler.correction`). An error names the key as `data` wrote it."""
    _check_unknown(migrate(data, source), RunConfig, "", source)
    try:
        cfg, named = typed(data, source)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or None
        raise ConfigError(source, key, _type_reason(str(e).splitlines()[0])) from None
    check_values(cfg, source, named)
    return cfg


def load_run_config(path: str | Path | None, overrides: Iterable[str] = (), plugins: Iterable[str] = ()) -> RunConfig:
    """``plugins``: extra rule files/modules (the CLI's --plugin, relative to the working directory),
    merged into the recipe's ``plugins`` list."""
    overrides = list(overrides)
    data = compose(path, overrides)
    if plugins:
        # PLC0415, deferred: objectives.plugins pulls in torch
        from clipbench.objectives.plugins import merge_specs, resolve  # noqa: PLC0415

        data["plugins"] = merge_specs(data.get("plugins") or [], [resolve(p) for p in plugins])
    try:
        return validate(data, str(path) if path else "command line")
    except ConfigError as e:  # a key the command line set: name the override, not the recipe
        given = next((o for o in overrides if _overrides_key(o, e.key)), None)
        if given is None or not path:
            raise
        raise ConfigError(f"command line ({given})", e.key, e.reason) from None


def _overrides_key(override: str, key: str | None) -> bool:
    """Whether `key=value` (or `+key=...`) sets `key`, a section above it, or a key inside it."""
    if not key or "=" not in override:
        return False
    k = override.split("=", 1)[0].lstrip("+~")
    return k == key or key.startswith(k + ".") or k.startswith(key + ".")


def check_values(cfg: RunConfig, source: str | None, named: Mapping[str, str] | None = None) -> None:
    """Value checks of a structurally valid RunConfig: every field against its declaration
    (`schema.RANGES`, `choices()`), the cross-field rules, then each component against its registry
    (after the run's plugins are imported), whose resolved parameters replace its own. `named`:
    {slot: the dotted key that named its component, as written} (`stored.typed`), for the errors."""

    def err(key: str, reason: str):
        raise ConfigError(source, key, reason)

    _check_fields(cfg, err)
    _check_cross_field(cfg, err)
    from clipbench.objectives.plugins import ensure_plugins  # noqa: PLC0415 - objectives.plugins pulls in torch

    try:
        ensure_plugins(cfg)
    except UserError as e:
        err("plugins", str(e))
    named = {**{which: f"{decl.key}.name" for which, decl in SLOTS.items()}, **(named or {})}
    for which, decl in SLOTS.items():
        set_slot(cfg, which, checked(decl, value_at(cfg, decl.key), named[which], source))
    _check_components(cfg, named, err)


def _check_fields(cfg: RunConfig, err) -> None:
    """Every field against its declaration (the components: against their registries, later)."""
    components = {decl.key for decl in SLOTS.values()}
    for key, allowed in choices().items():
        val = value_at(cfg, key)
        if key not in components and val not in allowed:
            err(key, unknown_choice("value", val, allowed))
    for key, decl in RANGES.items():
        problem = decl.problem(value_at(cfg, key))
        if problem:
            err(key, problem)


def _check_cross_field(cfg: RunConfig, err) -> None:
    """The rules between fields (those of the components: `_check_components`)."""
    tc, sc = cfg.train, cfg.sampler
    if tc.mini_batches > tc.prompts_per_step * sc.group_size:
        err(
            "train.mini_batches",
            f"{tc.mini_batches} mini-batches cannot split a batch of "
            f"{tc.prompts_per_step * sc.group_size} sequences (prompts_per_step x group_size)",
        )
    if tc.overlong.enabled and tc.overlong.buffer > sc.max_new_tokens:
        err(
            "train.overlong.buffer",
            f"must be <= sampler.max_new_tokens ({sc.max_new_tokens}), got {tc.overlong.buffer}",
        )
    if tc.prompts_per_step % cfg.launch.nproc_per_node:
        err(
            "launch.nproc_per_node",
            f"{cfg.launch.nproc_per_node} processes cannot share "
            f"train.prompts_per_step={tc.prompts_per_step} prompts by whole groups (make it a multiple)",
        )
    if sc.sleep_mode and sc.backend == "hf":
        err("sampler.sleep_mode", "applies to the vllm backend (the hf backend samples from the training model itself)")
    if cfg.model.routing_replay == "r2" and sc.old_logp != "recompute":
        err(
            "model.routing_replay",
            "r2 replays the experts of the old-log-prob forward: it needs "
            "sampler.old_logp=recompute (with old_logp=sampler there is none; r3 replays the sampler's)",
        )
    if cfg.task.name == "math" and not cfg.task.path:
        err("task.path", "task 'math' needs a path: a .jsonl/.parquet file or a Hugging Face dataset name")
    from clipbench.tasks.benchmarks import BENCHMARKS  # noqa: PLC0415 - tasks.benchmarks pulls in numpy

    for b in cfg.eval.benchmarks:
        if b not in BENCHMARKS:
            err("eval.benchmarks", unknown_choice("benchmark", b, BENCHMARKS))
    if len(set(cfg.eval.benchmarks)) != len(cfg.eval.benchmarks):
        err("eval.benchmarks", f"lists a benchmark twice: {cfg.eval.benchmarks}")
    if cfg.task.name == "arith":  # checked by the knobs' owner (its cheap checks: no problem is drawn)
        try:
            ArithKnobs(**{k: getattr(cfg.task, k) for k in ArithKnobs.names()})
        except ArithKnobError as e:
            err(f"task.{e.knob}", str(e))


def _check_components(cfg: RunConfig, named: Mapping[str, str], err) -> None:
    """The rules between a component and the other fields."""
    sc = cfg.sampler
    if cfg.train.advantage.name != "group_mean" and sc.group_size < 2:
        err("sampler.group_size", f"advantage '{cfg.train.advantage.name}' needs group_size >= 2")
    if sc.correction.name != "none" and sc.old_logp != "recompute":
        err(
            named["correction"],
            "needs sampler.old_logp=recompute: with old_logp=sampler the rule's ratio is "
            "already taken against the sampler's log-probs (rho = 1)",
        )
