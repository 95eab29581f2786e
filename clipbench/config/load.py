"""Compose a run config (recipe YAML + dotted overrides), validate it against the code it configures.

    cfg = load_run_config("recipes/quickstart.yaml", ["train.steps=5", "objective.method=dapo"])

Every failure is a `ConfigError(file, key, reason)`: one line, exit code 2 at the CLI, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from clipbench.config.schema import CHOICES, RunConfig
from clipbench.errors import ConfigError, UserError, did_you_mean, unknown_choice

# Keys whose relative values are paths relative to the recipe file (when they look like paths).
PATH_KEYS = ("model.name", "task.path", "eval.data_dir")


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; syntax errors and non-mappings become ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), None, "file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else None
        raise ConfigError(str(path), where, f"YAML syntax error: {getattr(e, 'problem', e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), None, f"expected a mapping at top level, got {type(data).__name__}")
    return data


def parse_overrides(overrides: Iterable[str], source: str | None = "command line") -> dict:
    """['a.b=1', 'c=x'] -> nested dict, values parsed as YAML scalars/lists."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(source, item, "overrides must look like key=value (e.g. train.steps=10)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        if not key:
            raise ConfigError(source, item, "empty key in override")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        set_dotted(out, key, value)
    return out


def set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(None, key, f"'{p}' is not a section")
    d[parts[-1]] = value


def deep_merge(base: Mapping, over: Mapping) -> dict:
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _resolve_paths(d: dict, base_dir: Path) -> dict:
    """Relative paths in a recipe are relative to the recipe file (HF names are left alone)."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        val = d.get(section, {}).get(name) if isinstance(d.get(section), dict) else None
        if isinstance(val, str) and (val.startswith("./") or val.startswith("../")):
            d[section][name] = str((base_dir / val).resolve())
    return _resolve_plugins(d, base_dir)


def _resolve_plugins(d: dict, base_dir: Path) -> dict:
    """`plugins`: .py paths made absolute (relative to base_dir); module names unchanged."""
    from clipbench.objectives.plugins import resolve

    if isinstance(d.get("plugins"), list):
        d["plugins"] = [resolve(p, base_dir) if isinstance(p, str) and p.strip() else p for p in d["plugins"]]
    return d


def _known_keys(dc) -> list[str]:
    return [f.name for f in fields(dc)]


def _check_unknown(data: Mapping, dc_type, prefix: str, source: str | None) -> None:
    """Unknown keys with did-you-mean (OmegaConf's own message is less helpful)."""
    known = _known_keys(dc_type)
    for k, v in data.items():
        full = f"{prefix}{k}"
        if k not in known:
            raise ConfigError(source, full, "unknown key" + did_you_mean(k, known) + f"; valid keys here: {', '.join(known)}")
        f = next(f for f in fields(dc_type) if f.name == k)
        sub = f.default_factory() if callable(getattr(f, "default_factory", None)) else None  # type: ignore[misc]
        if is_dataclass(sub):
            if not isinstance(v, Mapping):
                raise ConfigError(source, full, f"expected a section (mapping), got {v!r}")
            _check_unknown(v, type(sub), full + ".", source)


def compose(recipe: str | Path | Mapping | None, overrides: Iterable[str] | Mapping = (), *, source: str | None = None) -> dict:
    """Recipe (file or mapping) + overrides -> a plain dict (not yet validated)."""
    if recipe is None:
        data, base_dir = {}, Path.cwd()
    elif isinstance(recipe, Mapping):
        data, base_dir = dict(recipe), Path.cwd()
    else:
        source = source or str(recipe)
        data, base_dir = read_yaml(recipe), Path(recipe).resolve().parent
    data = _resolve_paths(deep_merge({}, data), base_dir)
    over = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    return deep_merge(data, _resolve_plugins(over, Path.cwd()))  # override paths: relative to the cwd


def validate(data: Mapping, source: str | None = None) -> RunConfig:
    """A composed dict -> a validated RunConfig with the method's defaults filled into `objective`."""
    _check_unknown(data, RunConfig, "", source)
    try:
        conf = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(dict(data)))
        conf = OmegaConf.to_container(conf, resolve=True)
        cfg = from_dict(conf)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or None
        msg = str(e).splitlines()[0]
        raise ConfigError(source, key, msg) from None
    check_values(cfg, source)
    return cfg


def load_run_config(path: str | Path | None, overrides: Iterable[str] = (), plugins: Iterable[str] = ()) -> RunConfig:
    """``plugins``: extra rule files/modules (the CLI's --plugin, relative to the working directory),
    merged into the recipe's ``plugins`` list."""
    data = compose(path, overrides)
    if plugins:
        from clipbench.objectives.plugins import merge_specs, resolve

        data["plugins"] = merge_specs(data.get("plugins") or [], [resolve(p) for p in plugins])
    return validate(data, str(path) if path else "command line")


def check_values(cfg: RunConfig, source: str | None) -> None:
    """Value checks of a structurally valid RunConfig; fills the method's defaults into `objective`."""
    from clipbench.objectives import AGGREGATIONS, METHODS, validate_params

    def err(key: str, reason: str):
        raise ConfigError(source, key, reason)

    for key, choices in CHOICES.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        if node not in choices:
            err(key, unknown_choice("value", node, choices))
    if cfg.trl and cfg.engine != "trl":
        err("trl", f"GRPOConfig settings for engine 'trl', but engine is '{cfg.engine}'")
    if cfg.train.agg not in AGGREGATIONS:
        err("train.agg", unknown_choice("aggregation", cfg.train.agg, AGGREGATIONS))

    positive_ints = {
        "train.steps": cfg.train.steps, "train.prompts_per_step": cfg.train.prompts_per_step,
        "train.mini_batches": cfg.train.mini_batches, "train.epochs": cfg.train.epochs,
        "train.checkpoint_every": cfg.train.checkpoint_every,
        "sampler.group_size": cfg.sampler.group_size, "sampler.max_new_tokens": cfg.sampler.max_new_tokens,
        "eval.n": cfg.eval.n, "tracking.batch_every": cfg.tracking.batch_every,
    }
    for key, v in positive_ints.items():
        if v < 1:
            err(key, f"must be >= 1, got {v}")
    if cfg.train.mini_batches > cfg.train.prompts_per_step * cfg.sampler.group_size:
        err("train.mini_batches", f"{cfg.train.mini_batches} mini-batches cannot split a batch of "
            f"{cfg.train.prompts_per_step * cfg.sampler.group_size} sequences (prompts_per_step x group_size)")
    if cfg.train.advantage != "group_mean" and cfg.sampler.group_size < 2:
        err("sampler.group_size", f"advantage '{cfg.train.advantage}' needs group_size >= 2")
    for key, v in {"train.lr": cfg.train.lr, "sampler.temperature": cfg.sampler.temperature,
                   "eval.temperature": cfg.eval.temperature}.items():
        if not v > 0:
            err(key, f"must be > 0, got {v}")
    for key, v in {"sampler.top_p": cfg.sampler.top_p, "eval.top_p": cfg.eval.top_p}.items():
        if not 0 < v <= 1:
            err(key, f"must be in (0, 1], got {v}")
    for key, v in {"train.beta": cfg.train.beta, "train.grad_clip": cfg.train.grad_clip,
                   "train.weight_decay": cfg.train.weight_decay, "train.warmup_steps": cfg.train.warmup_steps,
                   "eval.every": cfg.eval.every}.items():
        if v < 0:
            err(key, f"must be >= 0, got {v}")
    if cfg.eval.limit is not None and cfg.eval.limit < 1:
        err("eval.limit", f"must be >= 1 or null, got {cfg.eval.limit}")
    # micro-batching, data parallelism, skipped steps (clipbench/train)
    for key, v in {"train.micro_batch_tokens": cfg.train.micro_batch_tokens,
                   "sampler.prompts_per_call": cfg.sampler.prompts_per_call}.items():
        if v < 0:
            err(key, f"must be >= 0 (0 = no limit), got {v}")
    if not 0 <= cfg.train.max_skipped_frac <= 1:
        err("train.max_skipped_frac", f"must be in [0, 1], got {cfg.train.max_skipped_frac}")
    if cfg.launch.nproc_per_node < 1:
        err("launch.nproc_per_node", f"must be >= 1, got {cfg.launch.nproc_per_node}")
    if cfg.train.prompts_per_step % cfg.launch.nproc_per_node:
        err("launch.nproc_per_node", f"{cfg.launch.nproc_per_node} processes cannot share "
            f"train.prompts_per_step={cfg.train.prompts_per_step} prompts by whole groups (make it a multiple)")
    if not (math.isfinite(cfg.sampler.mismatch_is_cap) and cfg.sampler.mismatch_is_cap >= 1):
        err("sampler.mismatch_is_cap", f"must be a finite number >= 1 (a cap below 1 scales down tokens the "
            f"sampler and trainer agree on), got {cfg.sampler.mismatch_is_cap}")
    if cfg.sampler.mismatch_is != "none" and cfg.sampler.old_logp != "recompute":
        err("sampler.mismatch_is", "needs sampler.old_logp=recompute: with old_logp=sampler the ratio is "
            "already taken against the sampler's log-probs")
    if cfg.sampler.sleep_mode and cfg.sampler.backend == "hf":
        err("sampler.sleep_mode", "applies to the vllm backend (the hf backend samples from the training model itself)")
    if cfg.task.name == "math" and not cfg.task.path:
        err("task.path", "task 'math' needs a path: a .jsonl/.parquet file or a Hugging Face dataset name")
    if cfg.task.name == "arith":  # checked by the knobs' owner (its cheap checks: no problem is drawn)
        from clipbench.tasks.arith import ArithKnobError, ArithKnobs

        try:
            ArithKnobs(**{k: getattr(cfg.task, k) for k in ArithKnobs.names()})
        except ArithKnobError as e:
            err(f"task.{e.knob}", str(e))

    # The objective: method from the registry (after the run's plugins are imported), parameters
    # exactly those the method declares.
    from clipbench.objectives.plugins import ensure_plugins

    try:
        ensure_plugins(cfg)
    except UserError as e:
        err("plugins", str(e))
    obj = dict(cfg.objective)
    method = obj.pop("method", None)
    if method is None:
        err("objective.method", f"missing; choose one of: {', '.join(sorted(METHODS))}")
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

    try:
        from clipbench.tasks.benchmarks import BENCHMARKS
    except ImportError:  # pragma: no cover - tasks always ship with the package
        BENCHMARKS = None
    if BENCHMARKS is not None:
        for b in cfg.eval.benchmarks:
            if b not in BENCHMARKS:
                err("eval.benchmarks", unknown_choice("benchmark", b, BENCHMARKS))


# ---------------------------------------------------------------------------------------------
# Plain-dict round trip and the run id


def to_dict(cfg: RunConfig) -> dict:
    """Plain, JSON-able, fully resolved dict."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def from_dict(d: Mapping) -> RunConfig:
    conf = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(dict(d)))
    return OmegaConf.to_object(conf)  # type: ignore[return-value]


# Sections that do not change what a run computes, so they stay out of its identity.
# plugins: where a rule is found (the manifest records its hash); launch: how many processes train the run.
NOT_IN_ID = ("name", "tracking", "plugins", "launch")
# Top-level keys added after run ids were first handed out: at these values they stay out of the
# hash, so every run id from before they existed is unchanged.
ID_DEFAULTS = {"engine": "builtin", "trl": {}}


def in_id(key: str, value: Any) -> bool:
    """Whether a top-level key of a resolved config counts in its run id."""
    return key not in NOT_IN_ID and not (key in ID_DEFAULTS and value == ID_DEFAULTS[key])


def run_id(cfg: RunConfig | Mapping) -> str:
    """12 hex chars of sha256 over the canonical JSON of the resolved config (minus tracking/name and
    the ID_DEFAULTS keys at their defaults)."""
    d = to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg)
    d = {k: v for k, v in d.items() if in_id(k, v)}
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def flatten(d: Mapping, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1} (lists kept as values)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dump_yaml(cfg: RunConfig | Mapping) -> str:
    d = to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg)
    return yaml.safe_dump(d, sort_keys=False)


def env_tracking_uri() -> str | None:
    return os.environ.get("MLFLOW_TRACKING_URI") or None
