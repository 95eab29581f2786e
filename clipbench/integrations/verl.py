"""Every clipbench rule in verl's policy-loss registry, as `clipbench.<name>` (verl 0.9).

Importing this module registers `clipbench.grpo`, `clipbench.nsr`, ... (every name in
`clipbench.objectives.METHODS`, user plugins included) with verl's `register_policy_loss`, under
verl's signature `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights) -> (loss, metrics)`. verl imports it in every process that imports verl, its Ray
workers included, in either of verl's own ways:

* installed clipbench declares the entry point `verl.plugins: clipbench = clipbench.integrations.verl`,
  which verl loads at import (its default `VERL_USE_EXTERNAL_PLUGINS=auto`); nothing to add;
* or `VERL_USE_EXTERNAL_MODULES=clipbench.integrations.verl` in the environment of the launch.

A verl user then selects a rule and sets its parameters with overrides:

    python3 -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.actor.policy_loss.loss_mode=clipbench.nsr \\
        actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \\
        actor_rollout_ref.actor.loss_agg_mode=token-mean \\
        '+ray_kwargs.ray_init.runtime_env.env_vars.CLIPBENCH_RULE_PARAMS={"p": 0.5, "delta": 0.1}'

Parameters, later wins: the registry's defaults; verl's own actor fields where they mean the same for
verl's losses (`verl_settings.VERL_FIELDS`: `clip_ratio_low`/`clip_ratio_high` -> eps_low/eps_high, or
dppo's div_low/div_high; `clip_ratio_c` -> dual_clip's c or dppo's is_cap; `tau_pos`/`tau_neg`;
`policy_loss.dro_beta`, `policy_loss.clip_cov_*`, `policy_loss.kl_cov_ratio`, `policy_loss.ppo_kl_coef`);
then the JSON object in the environment variable
`CLIPBENCH_RULE_PARAMS` (verl's actor config is a closed dataclass, so the rest cannot live there;
`ray_kwargs.ray_init.runtime_env.env_vars` carries it to every worker). `CLIPBENCH_PLUGINS` (paths or
module names, separated by `os.pathsep`; `clipbench.objectives.plugins`) are imported first, with the
installed `clipbench.rules` entry points, so their rules are registered too.
Every value is checked by the registry on first use: a bad one is a one-line ValueError.

Design choices:

* The per-token loss is clipbench's (the bound rule's `token_loss` on one `RuleInputs`), times verl's rollout
  correction weights when given; it is aggregated by verl's own `agg_loss` with
  `config.global_batch_info` (dp size, global token and sequence counts), so the normalisation is
  exactly verl's for every loss it ships, micro-batching and data parallelism included.
* clipbench rules take one advantage per sequence: verl's (B, T) outcome advantages (GRPO, RLOO, ...)
  are constant over a response; a response whose advantages vary over its tokens (GAE) is refused.
* Metrics: verl averages a policy loss's metrics over micro-batches and ranks, so clipbench's counts
  (and gradient masses) are reported per valid token of the micro-batch: `actor/clipbench/{cell}/{count}`,
  `actor/clipbench/clip_events`, plus `actor/clipbench/ratio/{mean,max,min}` and `approx_kl`, and
  verl's own `actor/pg_clipfrac` (zero-gradient tokens with A != 0) and `actor/ppo_kl`.
* What verl's call passes is declared once (`verl_settings.FEEDS`: no given rule input): a rule
  reading one (topr's sequence reward, aspo's entropy, rollout_is's sampler log-probs) is refused by
  it at the preflight, and at its first call here. A rule's mini-batch statistic (bapo, m2po) is
  computed per call (verl's micro-batch), as its sources do.
* NSR's coin flips: a torch.Generator per call seeded from (actor.data_loader_seed, rank, call
  number in this process); verl's global RNG is untouched.
* Recording (docs/replay.md): with `CLIPBENCH_RECORD_DIR` in the workers' environment (the engine
  sets it for train.record.every=1), every call's inputs (log-probs, old log-probs, advantages,
  mask, rollout weights, the draws) and verl's global counts go to one record per call and process
  (`clipbench.integrations.record`), until `CLIPBENCH_RECORD_MAX_MB`; `clipbench replay` reads them.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from clipbench.integrations.record import LossRecorder
from clipbench.integrations.verl_settings import (
    FEEDS,
    PARAMS_ENV,
    PLUGINS_ENV,
    RECORD_DIR_ENV,
    RECORD_MAX_MB_ENV,
    VERL_FIELDS,
)
from clipbench.objectives import METHODS
from clipbench.objectives.inputs import RuleInputs
from clipbench.objectives.loss import BoundRule, bind
from clipbench.objectives.plugins import load_plugins
from clipbench.seeds import derive_seed as _seed  # the one seed derivation

PREFIX = "clipbench."
_CALLS = itertools.count()


def _load_plugins() -> None:
    """The user's rule files/modules named in CLIPBENCH_PLUGINS (and installed `clipbench.rules`)."""

    load_plugins([e for e in os.environ.get(PLUGINS_ENV, "").split(os.pathsep) if e])


@functools.lru_cache(maxsize=256)
def _bound(method: str, verl_values: tuple, env: str) -> BoundRule:
    """The rule bound under these parameters: once per setting and process, not per call."""
    params = {k: v for k, v in verl_values if k in METHODS[method].defaults}
    if env:
        try:
            extra = json.loads(env)
        except json.JSONDecodeError as e:
            raise ValueError(f"{PARAMS_ENV}: not a JSON object ({e.msg}): {env!r}") from None
        if not isinstance(extra, dict):
            raise ValueError(f"{PARAMS_ENV}: expected a JSON object of parameters, got {env!r}")
        params.update(extra)
    try:
        return bind(method, params)
    except ValueError as e:
        raise ValueError(f"{e} (parameters from verl's actor config and {PARAMS_ENV})") from None


def rule_params(method: str, config) -> dict[str, Any]:
    """The parameters of `method` under a verl actor config (see the module docstring)."""
    return dict(bound_rule(method, config).params)


def bound_rule(method: str, config) -> BoundRule:
    """`method` bound under a verl actor config's parameters (cached per setting)."""
    verl_values = []
    for param, fields in VERL_FIELDS.items():
        if param not in METHODS[method].defaults:
            continue
        for f in fields:
            v = _field(config, f)
            if v is not None:
                verl_values.append((param, float(v)))
                break
    return _bound(method, tuple(verl_values), os.environ.get(PARAMS_ENV, ""))


def _field(config, dotted: str):
    """A (dotted) field of verl's actor config, None when absent."""
    node = config
    for part in dotted.split("."):
        node = node.get(part) if node is not None else None
    return node


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) advantages constant over each response -> (B,); ValueError when they vary."""
    if advantages.dim() == 1:
        return advantages
    n = mask.sum(-1)  # (B,)
    seq = (advantages * mask).sum(-1) / n.clamp(min=1.0)  # (B,)
    dev = ((advantages - seq[:, None]).abs() * mask).amax() if advantages.numel() else advantages.new_zeros(())
    if float(dev) > 1e-6 * max(1.0, float(seq.abs().max()) if seq.numel() else 1.0):
        raise ValueError(
            "clipbench rules take one advantage per sequence (outcome advantages such as GRPO's "
            "or RLOO's); these advantages vary over the tokens of a response"
        )
    return seq


def make_loss_fn(method: str):
    """The verl policy-loss function of clipbench's `method`."""

    def clipbench_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ):
        from verl.trainer.ppo.core_algos import agg_loss  # noqa: PLC0415 - optional: verl

        bound = bound_rule(method, config)
        if why := FEEDS.refusal("objective", method):  # a given input verl's signature does not pass
            raise ValueError(f"clipbench.{method}: {why}")
        params = bound.params
        maskf = response_mask.to(torch.float32)  # (B, T)
        adv = sequence_advantages(advantages.to(torch.float32), maskf)  # (B,)
        seed = config.get("data_loader_seed", 0) if config is not None else 0
        call = next(_CALLS)
        gen = torch.Generator(device=log_prob.device).manual_seed(_seed(seed, "nsr", _rank(), call))
        u = (
            torch.rand(log_prob.shape, generator=gen, device=gen.device).to(log_prob.device) if bound.draws else None
        )  # the rule's own draw, kept for a record
        out = bound(
            RuleInputs.of(
                logp=log_prob,
                old_logp=old_log_prob,
                advantages=adv,
                mask=maskf,
                generator=gen,
                uniforms=u,
                weights=rollout_is_weights,
            )
        )
        info = dict(config.get("global_batch_info", None) or {}) if config is not None else {}
        # out.token_loss: (B, T), rollout weights included, 0 at padding; verl's own global normalisation
        loss = agg_loss(loss_mat=out.token_loss, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **info)
        if os.environ.get(RECORD_DIR_ENV):
            record_call(
                call,
                method,
                params,
                loss_agg_mode,
                info,
                loss,
                logp=log_prob.float(),
                old_logp=old_log_prob.float(),
                advantages=adv,
                mask=maskf,
                weights=rollout_is_weights,
                uniforms=u,
            )
        return loss, _metrics(out.stats, maskf, log_prob, old_log_prob)

    clipbench_policy_loss.__name__ = f"clipbench_{method}"
    clipbench_policy_loss.__doc__ = f"clipbench rule {method!r}: {METHODS[method].formula}"
    return clipbench_policy_loss


def _metrics(stats: dict, maskf: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> dict:
    """verl metrics (floats, one host transfer): counts as shares of the micro-batch's valid tokens."""
    n = maskf.sum().clamp(min=1.0)
    keys, vals = [], []
    for k, v in stats.items():
        share = k == "clip_events" or "/" in k and not k.startswith(("ratio/", "seq_ratio/"))
        keys.append(f"actor/clipbench/{k}")
        vals.append(v / n if share else v)
    zero_grad = sum(stats[f"{c}/zero_grad"] for c in ("q1", "q2", "q3", "q4", "on_policy"))
    keys += ["actor/pg_clipfrac", "actor/ppo_kl"]
    vals += [zero_grad / n, ((old_log_prob - log_prob.detach()) * maskf).sum() / n]
    return dict(
        zip(keys, torch.stack([torch.as_tensor(v, dtype=torch.float32).to(maskf.device) for v in vals]).tolist())
    )


_RECORDERS: dict[str, LossRecorder] = {}


def verl_counts(info: dict, agg: str, T: int) -> tuple[float | None, float | None, int]:
    """(global_tokens, global_seqs, max_len) of clipbench's aggregation for verl's global batch info:
    verl divides by batch_num_tokens / global_batch_size and multiplies by dp_size."""
    dp = info.get("dp_size", 1) or 1
    tokens, seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    return (
        None if tokens is None else float(tokens) / dp,
        None if seqs is None else float(seqs) / dp,
        int(info.get("loss_scale_factor") or T),
    )


def record_call(call: int, method: str, params: dict, agg: str, info: dict, loss, **tensors) -> None:
    """One call of a registered loss as one record (docs/replay.md): its inputs and verl's counts."""
    root = os.environ[RECORD_DIR_ENV]
    tokens, seqs, max_len = verl_counts(info, agg, tensors["mask"].shape[1])
    if root not in _RECORDERS:
        rank = _rank()
        meta = {
            "engine": "verl",
            "seed": 0,
            "rank": rank,
            "objective": {"method": method, "params": dict(params), "agg": agg, "beta": 0.0, "max_len": max_len},
        }
        _RECORDERS[root] = LossRecorder(
            root,
            max_mb=float(os.environ.get(RECORD_MAX_MB_ENV, "1024")),
            meta=meta,
            suffix=f".rank{rank}" if rank else "",
        )
    rec = _RECORDERS[root]
    rec.meta["objective"].update(method=method, params=dict(params), agg=agg, max_len=max_len)
    rec.add(call + 1, 0, tensors, tokens, seqs, loss)
    rec.write(call)


def register_all() -> list[str]:
    """Register `clipbench.<name>` for every clipbench rule verl does not have yet; returns the names."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss  # noqa: PLC0415 - optional: verl

    added = []
    for method in METHODS:
        name = PREFIX + method
        if name not in POLICY_LOSS_REGISTRY:
            register_policy_loss(name)(make_loss_fn(method))
            added.append(name)
    return added


_load_plugins()
register_all()
