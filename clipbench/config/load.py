"""Load a run config: compose it (recipe YAML + dotted overrides, `clipbench.config.compose`) and
validate it against the code it configures.

    cfg = load_run_config("recipes/quickstart.yaml", ["train.steps=5", "objective.method=dapo"])

Every failure is a `ConfigError(file, key, reason)`: one line, exit code 2 at the CLI, nothing written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path

from omegaconf.errors import OmegaConfBaseException

from clipbench.config.compose import compose
from clipbench.config.schema import RANGES, RunConfig, choices, value_at
from clipbench.config.slots import CORRECTION_KEY, migrate
from clipbench.config.stored import from_dict
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
        if is_dataclass(sub):
            if not isinstance(v, Mapping):
                raise ConfigError(source, full, f"expected a section (mapping), got {v!r}")
            _check_unknown(v, type(sub), full + ".", source)


def validate(data: Mapping, source: str | None = None) -> RunConfig:
    """A composed dict -> a validated RunConfig with the method's defaults filled into `objective`
    and the correction's into `sampler.correction`."""
    data = migrate(data, source)
    _check_unknown(data, RunConfig, "", source)
    try:
        cfg = from_dict(data)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or None
        msg = str(e).splitlines()[0]
        raise ConfigError(source, key, msg) from None
    check_values(cfg, source)
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


def check_values(cfg: RunConfig, source: str | None) -> None:
    """Value checks of a structurally valid RunConfig; fills the method's defaults into `objective`.

    Every field against its declaration (`schema.RANGES`, `choices()`), then the cross-field rules
    below, then the objective against its method. The sweep expander's fast path calls this too."""
    from clipbench.objectives import METHODS, validate_params  # noqa: PLC0415 - objectives pulls in torch

    def err(key: str, reason: str):
        raise ConfigError(source, key, reason)

    for key, allowed in choices().items():
        val = value_at(cfg, key)
        if val not in allowed:
            err(key, unknown_choice("value", val, allowed))
    for key, decl in RANGES.items():
        problem = decl.problem(value_at(cfg, key))
        if problem:
            err(key, problem)

    # cross-field rules
    tc, sc = cfg.train, cfg.sampler
    if tc.mini_batches > tc.prompts_per_step * sc.group_size:
        err(
            "train.mini_batches",
            f"{tc.mini_batches} mini-batches cannot split a batch of "
            f"{tc.prompts_per_step * sc.group_size} sequences (prompts_per_step x group_size)",
        )
    if tc.advantage != "group_mean" and sc.group_size < 2:
        err("sampler.group_size", f"advantage '{tc.advantage}' needs group_size >= 2")
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

    # The objective: method from the registry (after the run's plugins are imported), parameters
    # exactly those the method declares.
    from clipbench.objectives.plugins import ensure_plugins  # noqa: PLC0415 - objectives.plugins pulls in torch

    try:
        ensure_plugins(cfg)
    except UserError as e:
        err("plugins", str(e))
    _check_correction(cfg, err)
    obj = dict(cfg.objective)
    method = obj.pop("method", None)
    if method is None:
        err("objective.method", f"missing; choose one of: {', '.join(sorted(METHODS))}")
    if not isinstance(method, str):
        err(
            "objective.method",
            f"must be one method name, got {type(method).__name__} {method!r}"
            + (
                "; to compare several, make it a sweep axis (grid: objective.method: [...])"
                if isinstance(method, list)
                else ""
            ),
        )
    if method not in METHODS:
        err("objective.method", unknown_choice("method", method, METHODS))
    try:
        params = validate_params(method, obj)
    except ValueError as e:
        bad = next((k for k in obj if k not in METHODS[method].defaults), None)
        if bad is None:  # a value error: find the offending key in the message when we can
            bad = next((k for k in obj if f"'{k}'" in str(e) or str(k) in str(e)), None)
        err(f"objective.{bad}" if bad else "objective", str(e))
    cfg.objective = {"method": method, **params}


def _check_correction(cfg: RunConfig, err) -> None:
    """`sampler.correction` against its registry (after the plugins: a plugin may register one);
    fills its defaults. A correction needs the recomputed old log-probs."""
    # PLC0415, deferred: objectives.corrections pulls in torch
    from clipbench.objectives.corrections import validate_correction  # noqa: PLC0415

    setting = dict(cfg.sampler.correction)
    try:
        cfg.sampler.correction = validate_correction(setting)
    except ValueError as e:
        bad = next((k for k in setting if k != "name" and f"'{k}'" in str(e)), None)
        err(f"{CORRECTION_KEY}.{bad or 'name'}", str(e))
    if cfg.model.routing_replay == "r2" and cfg.sampler.old_logp != "recompute":
        err(
            "model.routing_replay",
            "r2 replays the experts of the old-log-prob forward: it needs "
            "sampler.old_logp=recompute (with old_logp=sampler there is none; r3 replays the sampler's)",
        )
    if cfg.sampler.correction["name"] != "none" and cfg.sampler.old_logp != "recompute":
        err(
            f"{CORRECTION_KEY}.name",
            "needs sampler.old_logp=recompute: with old_logp=sampler the rule's ratio is "
            "already taken against the sampler's log-probs (rho = 1)",
        )
