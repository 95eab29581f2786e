"""Compose a run config (recipe YAML + dotted overrides), validate it against the code it configures.

    cfg = load_run_config("recipes/quickstart.yaml", ["train.steps=5", "objective.method=dapo"])

Every failure is a `ConfigError(file, key, reason)`: one line, exit code 2 at the CLI, nothing written.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from clipbench import yamlio
from clipbench.config.schema import CHOICES, RANGES, SLOTS, RunConfig, Slot, SlotDecl, leaf_keys
from clipbench.config.shipped import recipe_path
from clipbench.errors import ConfigError, UserError, did_you_mean, unknown_choice
from clipbench.tasks import TASK_NAMES
from clipbench.tasks.arith import FORMATS, ArithKnobError, ArithKnobs
from clipbench.tasks.templates import TEMPLATE_CHOICES
from clipbench.yamlio import YamlError, load_yaml_file, load_yaml_text

# Keys whose relative values are paths relative to the recipe file (when they look like paths).
PATH_KEYS = ("model.name", "task.path", "eval.data_dir")


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping (a recipe or a sweep file) with the project's one YAML reader
    (`clipbench.yamlio`: UTF-8 only, duplicate keys refused); every problem is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), None, "file not found" if not path.exists() else "not a regular file")
    try:
        data = load_yaml_file(path)
    except YamlError as e:
        raise ConfigError(str(path), f"line {e.line}" if e.line else None, e.reason) from None
    except OSError as e:
        raise ConfigError(str(path), None, f"cannot read: {e.strerror or e}") from None
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
            value = load_yaml_text(raw) if raw.strip() else ""
        except YamlError as e:
            if "duplicate key" in e.reason:
                raise ConfigError(source, key, e.reason) from None
            value = raw  # not YAML: the raw string (e.g. a path with a colon)
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
    from clipbench.objectives.plugins import resolve  # noqa: PLC0415 - objectives.plugins pulls in torch

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
            raise ConfigError(
                source, full, "unknown key" + did_you_mean(k, known) + f"; valid keys here: {', '.join(known)}"
            )
        f = next(f for f in fields(dc_type) if f.name == k)
        sub = f.default_factory() if callable(getattr(f, "default_factory", None)) else None  # type: ignore[misc]
        if is_dataclass(sub):
            if not isinstance(v, Mapping):
                raise ConfigError(source, full, f"expected a section (mapping), got {v!r}")
            _check_unknown(v, type(sub), full + ".", source)


def compose(
    recipe: str | Path | Mapping | None, overrides: Iterable[str] | Mapping = (), *, source: str | None = None
) -> dict:
    """Recipe (file or mapping) + overrides -> a plain dict (not yet validated)."""
    if recipe is None:
        data, base_dir = {}, Path.cwd()
    elif isinstance(recipe, Mapping):
        data, base_dir = dict(recipe), Path.cwd()
    else:
        recipe = recipe_path(recipe)  # a local file, else the shipped recipe of that name
        source = source or str(recipe)
        data, base_dir = read_yaml(recipe), Path(recipe).resolve().parent
    data = _resolve_paths(deep_merge({}, one_form(data, source)), base_dir)
    over = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    over = one_form(over, source if isinstance(overrides, Mapping) else "command line")
    return deep_merge(data, _resolve_plugins(over, Path.cwd()))  # override paths: relative to the cwd


# ---------------------------------------------------------------------------------------------
# Keys that changed shape: a config written before reads as today's (manifests, run configs, recipes)

LEGACY_CORRECTION = ("mismatch_is", "mismatch_is_cap")  # sampler.* -> sampler.correction (truncated IS)
CORRECTION_KEY = "sampler.correction"


def migrate(data: Mapping, source: str | None = None) -> dict:
    """`data` in today's shape: `sampler.mismatch_is` / `mismatch_is_cap` (truncated IS, before the
    corrections had a registry) become `sampler.correction` ({name: none} or {name: tis, level,
    cap}: the same weights); a bare name (`sampler.correction: icepop`) becomes {name: icepop}."""
    sampler = data.get("sampler") if isinstance(data, Mapping) else None
    if not isinstance(sampler, Mapping):
        return dict(data)
    sampler = dict(sampler)
    old = {k: sampler.pop(k) for k in LEGACY_CORRECTION if k in sampler}
    if old:
        if "correction" in sampler:
            raise ConfigError(source, "sampler.mismatch_is", "replaced by sampler.correction: set only the latter")
        mode, cap = old.get("mismatch_is", "none"), old.get("mismatch_is_cap", 2.0)
        if mode not in ("none", "token", "sequence"):
            raise ConfigError(
                source, "sampler.mismatch_is", unknown_choice("value", mode, ("none", "token", "sequence"))
            )
        sampler["correction"] = (
            {"name": "none"}
            if mode == "none"
            else {
                "name": "tis",
                "level": mode,
                "floor": 0.0,
                "cap": float(cap) if isinstance(cap, int) and not isinstance(cap, bool) else cap,
            }
        )
    return one_form({**data, "sampler": sampler}, source)


def one_form(data: Mapping, source: str | None = None) -> dict:
    """Every component slot (`schema.SLOTS`) of `data` in its stored form: the one YAML form
    ``{name: <component>, <param>: ...}`` and a bare name both become ``{method: ...}`` for the
    objective, ``{name: ...}`` for the correction, the bare name for the aggregation and the
    advantage (whose components take no parameters). A partial layer (overrides) is left partial."""
    out = dict(data)
    for decl in SLOTS.values():
        head, _, rest = decl.key.partition(".")
        section = out if not rest else out.get(head)
        if not isinstance(section, Mapping) or (rest or head) not in section:
            continue
        value = _stored_slot(decl, section[rest or head], source)
        out = {**out, head: value} if not rest else {**out, head: {**section, rest: value}}
    return out


def _stored_slot(decl: SlotDecl, value: Any, source: str | None) -> Any:
    if isinstance(value, str) and not decl.bare:
        return {decl.name_key: value}
    if not isinstance(value, Mapping) or "name" not in value:
        return value
    if decl.bare:
        extra = sorted(k for k in value if k != "name")
        if extra:
            raise ConfigError(
                source, f"{decl.key}.{extra[0]}", f"the {decl.slot} '{value['name']}' takes no parameters"
            )
        return value["name"]
    if decl.name_key == "name":
        return dict(value)
    if decl.name_key in value:
        raise ConfigError(
            source,
            f"{decl.key}.name",
            f"set the name once: {decl.key}.name ({decl.key}.{decl.name_key} is its older form)",
        )
    return {(decl.name_key if k == "name" else k): v for k, v in value.items()}


def slot(cfg: RunConfig, which: str) -> Slot:
    """The component in slot `which` (objective | correction | aggregation | advantage) of a
    validated RunConfig, its parameters resolved."""
    decl = SLOTS[which]
    value = _get(cfg, decl.key)
    if decl.bare:
        return Slot(value)
    params = dict(value)
    return Slot(params.pop(decl.name_key), params)


def slot_components(which: str) -> dict[str, dict[str, Any]]:
    """{component name: its parameters' defaults} of a slot's registry (read at call time: the run's
    plugins may have added to it)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.objectives import METHODS  # noqa: PLC0415
    from clipbench.objectives.corrections import CORRECTIONS, correction_names  # noqa: PLC0415

    if which == "objective":
        return {m: dict(spec.defaults) for m, spec in METHODS.items()}
    if which == "correction":
        return {n: dict(CORRECTIONS[n].defaults) if n in CORRECTIONS else {} for n in correction_names()}
    return dict.fromkeys(choices()[SLOTS[which].key], {})


def resolve_slot(which: str, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of component `name` in slot `which`: its registry's defaults merged with
    `params` and checked (ValueError naming the problem)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.objectives import validate_params  # noqa: PLC0415
    from clipbench.objectives.corrections import validate_correction  # noqa: PLC0415

    if which == "objective":
        return validate_params(name, dict(params))
    if which == "correction":
        out = validate_correction({"name": name, **params})
        out.pop("name")
        return out
    if params:
        raise ValueError(f"the {which} '{name}' takes no parameters, got {sorted(params)}")
    return {}


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


@functools.lru_cache(maxsize=1)
def choices() -> dict[str, tuple[str, ...]]:
    """Every closed choice of the run config: the schema's own (`schema.CHOICES`) and the lists
    owned by the packages a key configures (read from there, never copied)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.objectives import AGGREGATIONS  # noqa: PLC0415
    from clipbench.objectives.advantages import ADVANTAGES  # noqa: PLC0415

    return {
        **CHOICES,
        "task.name": tuple(TASK_NAMES),
        "task.template": tuple(TEMPLATE_CHOICES),
        "task.format": FORMATS,
        "train.agg": tuple(AGGREGATIONS),
        "train.advantage": tuple(ADVANTAGES),
    }


def _get(cfg: RunConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_values(cfg: RunConfig, source: str | None) -> None:
    """Value checks of a structurally valid RunConfig; fills the method's defaults into `objective`.

    Every field against its declaration (`schema.RANGES`, `choices()`), then the cross-field rules
    below, then the objective against its method. The sweep expander's fast path calls this too."""
    from clipbench.objectives import METHODS, validate_params  # noqa: PLC0415 - objectives pulls in torch

    def err(key: str, reason: str):
        raise ConfigError(source, key, reason)

    for key, allowed in choices().items():
        val = _get(cfg, key)
        if val not in allowed:
            err(key, unknown_choice("value", val, allowed))
    for key, decl in RANGES.items():
        problem = decl.problem(_get(cfg, key))
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


# ---------------------------------------------------------------------------------------------
# Plain-dict round trip and the run id


def to_dict(cfg: RunConfig) -> dict:
    """Plain, JSON-able, fully resolved dict (a validated RunConfig holds plain values only)."""
    return dataclasses.asdict(cfg)


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The structured config of RunConfig, built once (OmegaConf.merge copies it)."""
    return OmegaConf.structured(RunConfig)


def from_dict(d: Mapping) -> RunConfig:
    """A RunConfig from a (nested) mapping, typed by OmegaConf's structured-config rules (strings
    converted to numbers where the schema says so, unknown keys refused); values not checked."""
    return OmegaConf.to_object(OmegaConf.merge(_schema(), OmegaConf.create(migrate(d))))  # type: ignore[return-value]


# Sections that do not change what a run computes, so they stay out of its identity.
# plugins: where a rule is found (the manifest records its hash); launch: how many processes train the run.
NOT_IN_ID = ("name", "tracking", "plugins", "launch", "train.record")  # top-level keys or dotted sections
# Top-level keys added after run ids were first handed out: at these values they stay out of the
# hash, so every run id from before they existed is unchanged.
ID_DEFAULTS = {"engine": "builtin", "trl": {}}
# Nested keys added later, the same way: (section, key) -> the value that keeps them out of the hash.
NESTED_ID_DEFAULTS = {
    ("train", "router_aux_loss_coef"): 0.0,
    ("model", "routing_replay"): "none",
    ("eval", "n_ends"): None,
}
# Rule parameters added to a rule after its runs had ids: (method, parameter) -> the value that keeps
# it out of the hash, so every run id of that rule from before the parameter existed is unchanged.
OBJECTIVE_ID_DEFAULTS = {("cispo", "unified_mask"): False}


def in_id(key: str, value: Any) -> bool:
    """Whether a top-level key of a resolved config counts in its run id."""
    return key not in NOT_IN_ID and not (key in ID_DEFAULTS and value == ID_DEFAULTS[key])


def outside_id(key: str) -> bool:
    """Whether a dotted key lies in a part of the config that never counts in the run id (NOT_IN_ID)."""
    return any(key == k or key.startswith(k + ".") for k in NOT_IN_ID)


def _without_nested(d: dict) -> dict:
    """`d` without the dotted sections of NOT_IN_ID (e.g. train.record)."""
    out = dict(d)
    for dotted in (k for k in NOT_IN_ID if "." in k):
        head, *rest = dotted.split(".")
        if isinstance(out.get(head), dict):
            out[head] = _without_nested_path(out[head], rest)
    return out


def _without_nested_path(d: dict, path: list[str]) -> dict:
    out = dict(d)
    if len(path) == 1:
        out.pop(path[0], None)
    elif isinstance(out.get(path[0]), dict):
        out[path[0]] = _without_nested_path(out[path[0]], path[1:])
    return out


def _id_sampler(sampler: Mapping) -> dict:
    """The sampler section as the run id hashes it: a correction the former keys could express is
    hashed as those keys (`mismatch_is`, `mismatch_is_cap`), so every run id from before
    `sampler.correction` existed is unchanged; any other correction is hashed as itself. (A former
    config with mismatch_is none and a cap other than 2, a cap nothing read, hashes as cap 2.)"""
    out = dict(sampler)
    corr = out.pop("correction", None)
    if corr is None:
        return out
    corr = dict(corr)
    if corr.get("name") == "none" and len(corr) == 1:
        return {**out, "mismatch_is": "none", "mismatch_is_cap": 2.0}
    if corr.get("name") == "tis" and set(corr) <= {"name", "level", "cap", "floor"} and corr.get("floor", 0.0) == 0.0:
        return {**out, "mismatch_is": corr.get("level", "token"), "mismatch_is_cap": corr.get("cap", 2.0)}
    return {**out, "correction": corr}


def _id_objective(objective: Mapping) -> dict:
    """The objective as the run id hashes it: without the OBJECTIVE_ID_DEFAULTS parameters of its
    method at their id values."""
    method = objective.get("method")
    return {
        k: v
        for k, v in objective.items()
        if not ((method, k) in OBJECTIVE_ID_DEFAULTS and OBJECTIVE_ID_DEFAULTS[(method, k)] == v)
    }


def run_id(cfg: RunConfig | Mapping) -> str:
    """12 hex chars of sha256 over the canonical JSON of the resolved config (minus tracking/name, the
    ID_DEFAULTS keys and OBJECTIVE_ID_DEFAULTS rule parameters at their defaults; the sampler
    correction as `_id_sampler` states)."""
    d = to_dict(cfg) if isinstance(cfg, RunConfig) else migrate(cfg)
    d = {k: v for k, v in _without_nested(d).items() if in_id(k, v)}
    for (section, key), default in NESTED_ID_DEFAULTS.items():
        if isinstance(d.get(section), Mapping) and d[section].get(key, default) == default:
            d[section] = {k: v for k, v in d[section].items() if k != key}
    if isinstance(d.get("sampler"), Mapping):
        d["sampler"] = _id_sampler(d["sampler"])
    if isinstance(d.get("objective"), Mapping):
        d["objective"] = _id_objective(d["objective"])
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    return to_dict(RunConfig())


@functools.lru_cache(maxsize=1)
def _readable() -> tuple[frozenset[str], tuple[str, ...]]:
    """(the leaf keys of the run config, the free-form mappings among them: objective, trl,
    sampler.correction, whose own keys are their components' parameters)."""

    leaves = leaf_keys()
    flat = yamlio.flatten(_defaults())
    return frozenset(leaves), tuple(k for k in leaves if k not in flat or isinstance(flat[k], dict))


def setting(config: RunConfig | Mapping, key: str) -> Any:
    """The value of the dotted run-config `key` (a leaf, or a parameter inside the objective, the
    correction or `trl`) in a run config: a RunConfig, or a stored one (a manifest's, a run's
    run_config.json, perhaps written before the key existed), where a key it lacks reads as the
    schema's default (the one owner of defaults: no reader keeps its own copy). KeyError for a key
    that is not one of the run config's, or a parameter that is neither set nor defaulted.

        setting(manifest_cfg, "launch.nproc_per_node") -> 1 (for a config from before `launch`)"""
    value, default = _lookup(config, key)
    if value is not _UNSET:
        return value
    if default is _UNSET:
        raise KeyError(key)
    return copy.deepcopy(default)


def recorded(config: RunConfig | Mapping, key: str) -> Any:
    """What a run config records at the dotted run-config `key`, None where it records nothing: for
    readers that must not guess (a report of runs whose configs may be partial), where `setting`
    reads the schema's default. KeyError for a key that is not one of the run config's."""
    value, _ = _lookup(config, key)
    return None if value is _UNSET else value


def _lookup(config: RunConfig | Mapping, key: str) -> tuple[Any, Any]:
    """(the value at `key` in `config`, the schema's default there), either _UNSET where absent."""
    leaves, free = _readable()
    if key not in leaves and not any(key.startswith(f + ".") for f in free):
        raise KeyError(key)
    node: Any = config
    default: Any = _defaults()
    for part in key.split("."):
        default = default.get(part, _UNSET) if isinstance(default, Mapping) else _UNSET
        if isinstance(node, Mapping):
            node = node.get(part, _UNSET)
        elif node is not _UNSET:
            node = getattr(node, part, _UNSET)
    return node, default


_UNSET = object()


def dump_yaml(cfg: RunConfig | Mapping) -> str:
    return yamlio.dump_yaml(to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg))
