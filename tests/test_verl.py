"""clipbench rules in verl's policy-loss registry (verl 0.9.1 on CPU; `make test-verl` runs these in
.venv-verl, where verl is installed; elsewhere they are skipped):

* every rule, called through verl's own `get_policy_loss_fn("clipbench.<name>")`, equals clipbench's
  `policy_loss` in value and gradient under every aggregation, with verl's global normalisation
  (micro-batches of one rank and ranks of a data-parallel group add up to the whole batch);
* where the rules coincide, they equal verl's own `vanilla` (dual-clip and plain PPO clip), `gspo`,
  `sapo`, `cispo`, `gpg`, `dro`, `geo_mean`, `dppo_tv`, `dppo_kl` and `kl_cov`;
* the rule's parameters come from verl's actor fields and CLIPBENCH_RULE_PARAMS; plugins and the
  registration reach a fresh process through verl's VERL_USE_EXTERNAL_MODULES;
* `clipbench sweep --engine verl --dry-run` prints commands whose overrides load in verl's own config
  schema (Hydra compose of ppo_trainer.yaml, then verl's ActorConfig).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytestmark = pytest.mark.verl
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed (make test-verl)")

from verl.workers.config import ActorConfig  # noqa: E402

import clipbench.integrations.verl as cbverl  # noqa: E402  (registers clipbench.* with verl)
from clipbench.cli import app  # noqa: E402
from clipbench.integrations.verl_settings import FEEDS  # noqa: E402
from clipbench.objectives import METHODS, policy_loss  # noqa: E402
from clipbench.objectives.inputs import GIVEN  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
get = core_algos.get_policy_loss_fn
runner = CliRunner()


def actor(**fields) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, **fields)


def batch(seed: int = 0, B: int = 8, T: int = 7, empty_row: bool = True):
    """Responses of different lengths (the last one all padding, unless empty_row=False), ratios within
    e^+-0.6, advantages of both signs and zero. Returns logp (leaf), old, A (B,), A as verl's (B, T),
    mask (bool)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 3, 6, 1, 7, 4, 0 if empty_row else 2])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    logp = (torch.randn(B, T, generator=g) * 0.5 - 1.5).requires_grad_()
    old = logp.detach() + (torch.rand(B, T, generator=g) - 0.5) * 1.2
    A = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.0, 0.7, -1.3, 0.4])[:B]
    return logp, old, A, A[:, None] * mask, mask


def with_counts(cfg: ActorConfig, mask: torch.Tensor, *, dp_size: int = 1, tokens=None, seqs=None) -> ActorConfig:
    """verl's ppo_loss fills global_batch_info before calling the loss; so do we."""
    cfg.global_batch_info.update(
        dp_size=dp_size,
        batch_num_tokens=tokens if tokens is not None else mask.sum(),
        global_batch_size=seqs if seqs is not None else (mask.sum(-1) > 0).sum(),
        loss_scale_factor=None,
    )
    return cfg


def grad(loss, x):
    (g,) = torch.autograd.grad(loss, x, retain_graph=True)
    return g


def close(a, b, rel=1e-6):
    a, b = a.detach(), b.detach()
    return torch.allclose(a, b, rtol=rel, atol=rel * float(b.abs().max().clamp(min=1e-12)))


@pytest.fixture
def params_env(monkeypatch):
    def set_params(params: dict | None):
        if params is None:
            monkeypatch.delenv(cbverl.PARAMS_ENV, raising=False)
        else:
            monkeypatch.setenv(cbverl.PARAMS_ENV, json.dumps(params))

    return set_params


VERL_AGGS = list(FEEDS.aggregations.of)  # verl 0.9.1's loss_agg_mode values, as the engine declares them
VERL_CANNOT = set(GIVEN) - set(FEEDS.passes)  # the given inputs verl's policy-loss signature does not pass


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_rule_through_verls_registry_equals_clipbench(method, params_env, monkeypatch):
    """For each aggregation: verl's function (with verl's agg_loss over the batch's global counts)
    gives clipbench's policy_loss value and gradient; NSR's draws use the generator it documents.
    A rule reading an input verl does not pass is refused with one line."""
    params = dict(METHODS[method].defaults)
    params_env(params)
    logp, old, A, A_bt, mask = batch()
    maskf = mask.float()
    if any(i in METHODS[method].inputs for i in VERL_CANNOT):
        with pytest.raises(ValueError, match="verl's policy-loss signature does not pass"):
            get(f"clipbench.{method}")(old, logp, A_bt, mask, "token-mean", with_counts(actor(), mask))
        return
    for agg in VERL_AGGS:
        monkeypatch.setattr(cbverl, "_CALLS", itertools.count())  # call 0 of this process
        cfg = with_counts(actor(), mask)
        loss_v, metrics = get(f"clipbench.{method}")(old, logp, A_bt, mask, agg, cfg)
        gen = torch.Generator().manual_seed(cbverl._seed(cfg.data_loader_seed, "nsr", 0, 0))
        ref = policy_loss(method, logp, old, A, maskf, agg=agg, generator=gen, max_len=mask.shape[1], **params)
        assert close(loss_v, ref.loss), (method, agg, float(loss_v), float(ref.loss))
        assert close(grad(loss_v, logp), grad(ref.loss, logp)), (method, agg)
    shares = sum(metrics[f"actor/clipbench/{c}/tokens"] for c in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy"))
    assert shares == pytest.approx(1.0)  # every valid token in exactly one cell
    assert metrics["actor/clipbench/clip_events"] == pytest.approx(float(ref.stats["clip_events"]) / mask.sum().item())


@pytest.mark.parametrize("agg", VERL_AGGS)
def test_global_normalisation_over_micro_batches_and_ranks(agg, params_env):
    """verl's global_batch_info: uneven micro-batches of one rank add up to the whole batch's loss and
    gradient; two ranks (dp_size=2, gradients averaged as DDP/FSDP do) give the same gradient."""
    params_env(None)
    logp, old, A, A_bt, mask = batch(1)
    fn = get("clipbench.dapo")
    tokens, seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    whole, _ = fn(old, logp, A_bt, mask, agg, with_counts(actor(), mask))
    parts = [slice(0, 3), slice(3, 8)]
    micro = [
        fn(old[s], logp[s], A_bt[s], mask[s], agg, with_counts(actor(), mask[s], tokens=tokens, seqs=seqs))[0]
        for s in parts
    ]
    assert close(sum(micro), whole)
    assert close(grad(sum(micro), logp), grad(whole, logp))
    ranks = [
        fn(old[s], logp[s], A_bt[s], mask[s], agg, with_counts(actor(), mask[s], dp_size=2, tokens=tokens, seqs=seqs))[
            0
        ]
        for s in parts
    ]
    assert close(sum(grad(r, logp) for r in ranks) / 2, grad(whole, logp))


@pytest.mark.parametrize(
    "verl_name, ours, fields, agg",
    [
        ("vanilla", "dual_clip", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}, "token-mean"),
        (
            "vanilla",
            "grpo",
            {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 1e9},
            "seq-mean-token-mean",
        ),
        ("gspo", "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "seq-mean-token-mean"),
        ("gspo", "gspo_token", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "seq-mean-token-mean"),
        ("gspo", "gspo", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3}, "token-mean"),
        ("sapo", "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "seq-mean-token-mean"),
        ("cispo", "cispo", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, "token-mean"),
        ("gpg", "gpg", {}, "token-mean"),
        ("dro", "dro", {"policy_loss": {"dro_beta": 0.05}}, "token-mean"),
        ("geo_mean", "geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, "seq-mean-token-mean"),
        ("dppo_tv", "dppo_tv", {"clip_ratio_low": 0.15, "clip_ratio_high": 0.15, "clip_ratio_c": 20.0}, "token-mean"),
        ("dppo_kl", "dppo_kl", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 20.0}, "token-mean"),
        ("kl_cov", "kl_cov", {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1}}, "token-mean"),
    ],
)
def test_equal_to_verls_own_losses_where_the_rules_coincide(verl_name, ours, fields, agg, params_env):
    """The parameters come from verl's own actor fields (no CLIPBENCH_RULE_PARAMS): the same config runs
    both. Value and gradient per token equal; dual_clip with c = clip_ratio_c is verl's vanilla, and
    vanilla with a cap that never binds is plain PPO clip (grpo). (Every response has a token: verl's
    geo_mean counts an all-padding response in its mean over sequences, clipbench's seq-means do not.)"""
    params_env(None)
    logp, old, A, A_bt, mask = batch(2, empty_row=False)
    if "policy_loss" in fields:
        from verl.workers.config import PolicyLossConfig

        fields = {**fields, "policy_loss": PolicyLossConfig(**fields["policy_loss"])}
    cfg = with_counts(actor(**fields), mask)
    theirs, their_metrics = get(verl_name)(old, logp, A_bt, mask, agg, cfg)
    mine, my_metrics = get(f"clipbench.{ours}")(old, logp, A_bt, mask, agg, cfg)
    assert close(mine, theirs), (float(mine), float(theirs))
    assert close(grad(mine, logp), grad(theirs, logp))
    if verl_name in ("vanilla", "gspo", "sapo", "cispo"):  # verl's ppo_kl: mean of old - new log-probs
        assert my_metrics["actor/ppo_kl"] == pytest.approx(their_metrics["actor/ppo_kl"], rel=1e-6, abs=1e-9)
    if verl_name == "vanilla":  # verl's clip fraction: tokens whose clipped branch is taken
        assert my_metrics["actor/pg_clipfrac"] == pytest.approx(their_metrics["actor/pg_clipfrac"])


def test_parameters_from_verl_fields_and_the_environment(params_env):
    params_env(None)
    cfg = actor(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=5.0)
    assert cbverl.rule_params("dual_clip", cfg) == {"eps_low": 0.1, "eps_high": 0.3, "c": 5.0}
    assert cbverl.rule_params("abc", cfg) == METHODS["abc"].defaults  # no verl field means eps1..eps4
    params_env({"p": 0.25, "eps_high": 0.4})  # the environment wins over verl's fields
    assert cbverl.rule_params("nsr", cfg) == {**METHODS["nsr"].defaults, "eps_low": 0.1, "eps_high": 0.4, "p": 0.25}
    for bad, msg in [({"pp": 0.5}, "did you mean 'p'"), ({"p": 2.0}, "'p' must be in [0, 1]")]:
        params_env(bad)
        with pytest.raises(ValueError, match=re.escape(msg)) as e:
            cbverl.rule_params("nsr", cfg)
        assert "\n" not in str(e.value) and "CLIPBENCH_RULE_PARAMS" in str(e.value)
    os.environ[cbverl.PARAMS_ENV] = "{p: 1"
    with pytest.raises(ValueError, match="not a JSON object"):
        cbverl.rule_params("nsr", cfg)


def test_token_varying_advantages_are_refused(params_env):
    params_env(None)
    logp, old, A, A_bt, mask = batch()
    gae = A_bt * torch.linspace(0.5, 1.5, A_bt.shape[1])  # GAE-style: varies along the response
    with pytest.raises(ValueError, match="one advantage per sequence"):
        get("clipbench.grpo")(old, logp, gae, mask, "token-mean", with_counts(actor(), mask))


PLUGIN = REPO / "examples" / "plugins" / "lower_only.py"  # the one-file plugin of docs/plugins.md


def test_a_fresh_verl_process_gets_every_rule_and_plugins_through_its_extension_point(tmp_path):
    """Only verl's own mechanism: VERL_USE_EXTERNAL_MODULES (as set on every Ray worker by the printed
    commands) makes `import verl` register clipbench's rules, the user's plugin rule included."""
    plugin = PLUGIN
    code = (
        "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(sorted(k for k in R if k.startswith('clipbench.')))"
    )
    env = {
        **os.environ,
        "VERL_USE_EXTERNAL_MODULES": "clipbench.integrations.verl",
        "CLIPBENCH_PLUGINS": str(plugin),
        "VERL_USE_EXTERNAL_PLUGINS": "none",
        "PYTHONPATH": str(REPO),
    }
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    names = eval(p.stdout.strip().splitlines()[-1])  # noqa: S307 - our own print
    assert set(names) == {f"clipbench.{m}" for m in [*METHODS, "lower_only"]}


def test_installed_clipbench_registers_through_verls_plugin_entry_point():
    """With clipbench installed (its `verl.plugins` entry point) a plain `import verl` registers the rules:
    no environment variable, the default VERL_USE_EXTERNAL_PLUGINS=auto."""
    from importlib.metadata import entry_points

    if not any(ep.value == "clipbench.integrations.verl" for ep in entry_points(group="verl.plugins")):
        pytest.skip("this environment's clipbench metadata predates the entry point (pip install -e .)")
    code = (
        "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print('clipbench.nsr' in R, 'clipbench.gppo' in R)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.split()[-2:] == ["True", "True"], (p.stdout, p.stderr[-2000:])


@pytest.mark.parametrize(
    "setting",
    [
        {"name": "tis"},
        {"name": "tis", "level": "sequence", "cap": 3.0},
        {"name": "icepop"},
        {"name": "kl_rs"},
        {"name": "kl_rs", "estimator": "k1", "level": "seq_mean"},
    ],
)
def test_the_correction_maps_onto_verls_rollout_correction(setting):
    """sampler.correction's overrides compose with verl's ppo_trainer.yaml and become verl's
    RolloutCorrectionConfig; verl's own helper then computes clipbench's weights and masks."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from clipbench.config.schema import Slot
    from clipbench.engines.verl import _hydra_value, correction_overrides
    from clipbench.objectives.corrections import REJECTED, apply_correction, validate_correction

    setting = validate_correction(setting)
    params = dict(setting)
    slot = Slot(params.pop("name"), params)  # the validated sampler.correction of a RunConfig
    overrides = [f"{k}={_hydra_value(v)}" for k, v in correction_overrides(slot).items()]
    config_dir = str(Path(core_algos.__file__).resolve().parents[1] / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        rc = compose("ppo_trainer", overrides=overrides).algorithm.rollout_correction
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(8, 6, generator=g) * 2
    rollout = old + 0.3 * torch.randn(8, 6, generator=g)
    mask = torch.ones(8, 6)
    mask[2, 4:] = 0
    weights, new_mask, _ = compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
    )
    ours = apply_correction(setting, rollout, old, mask)
    if setting["name"] == "kl_rs":
        assert weights is None and torch.equal(new_mask, mask * (ours.status != REJECTED))
    else:
        assert torch.equal(new_mask, mask)
        torch.testing.assert_close(weights.batch["rollout_is_weights"], ours.weights, rtol=1e-6, atol=0)


def test_sweep_engine_verl_dry_run_overrides_load_in_verls_config_schema(tmp_path, unload_plugins):
    """Each printed command's overrides compose with verl's ppo_trainer.yaml (Hydra, strict keys) and
    convert to verl's ActorConfig; the rule, its parameters, batch sizes, seed and logger are the run's."""
    import yaml
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    f = tmp_path / "s.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "verl_plan",
                "base": str(REPO / "recipes" / "arith_tiny.yaml"),
                "plugins": [str(PLUGIN)],
                "overrides": {"train.mini_batches": 2},
                "grid": {"objective.method": ["grpo", "nsr", "lower_only"], "seed": [0, 3]},
            }
        )
    )
    res = tmp_path / "results"
    p = runner.invoke(app, ["sweep", str(f), "--engine", "verl", "--json", "--results-dir", str(res)])
    assert p.exit_code == 0, p.output[-2000:]
    plans = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(plans) == 6 and not res.exists()  # nothing written
    config_dir = str(Path(core_algos.__file__).resolve().parents[1] / "config")
    for plan in plans:
        cmd = plan["command"]
        assert cmd[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
        assert plan["env"]["VERL_USE_EXTERNAL_MODULES"] == "clipbench.integrations.verl"
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose("ppo_trainer", overrides=cmd[3:])
        act = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        method, seed = plan["label"].split()[0], int(plan["label"].split("seed=")[1])
        assert act.policy_loss.loss_mode == f"clipbench.{method}"
        assert act.ppo_mini_batch_size == 4 and cfg.data.train_batch_size == 8 and cfg.actor_rollout_ref.rollout.n == 8
        assert cfg.data.seed == seed == act.data_loader_seed == cfg.actor_rollout_ref.rollout.seed
        assert list(cfg.trainer.logger) == ["console", "mlflow"] and act.loss_agg_mode == "token-mean"
        env_vars = cfg.ray_kwargs.ray_init.runtime_env.env_vars
        assert json.loads(env_vars.CLIPBENCH_RULE_PARAMS) == METHODS[method].defaults
        assert env_vars.VERL_USE_EXTERNAL_MODULES == "clipbench.integrations.verl"
        assert env_vars.CLIPBENCH_PLUGINS == str(PLUGIN)  # the workers import the sweep's plugin too
        if "eps_high" in METHODS[method].defaults:
            assert act.clip_ratio_high == METHODS[method].defaults["eps_high"]
    text = runner.invoke(app, ["sweep", str(f), "--engine", "verl", "--dry-run", "--results-dir", str(res)])
    line = next(block for block in text.stdout.split("\n\n") if "seed=3" in block.splitlines()[0])
    argv = shlex.split(line.split("\n", 1)[1].replace("\\\n", " "))  # the shell line, parsed as a shell would
    assert argv[0] == "VERL_USE_EXTERNAL_MODULES=clipbench.integrations.verl" and argv[1:4] == cmd[:3]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_recording_through_the_registered_loss_replays_verls_loss(agg, params_env, monkeypatch, tmp_path):
    """CLIPBENCH_RECORD_DIR (train.record.every=1): every call of a registered loss is one record; the
    replay of the trained rule (nsr: its recorded draws) gives the loss verl's agg_loss computed, to
    float32 round-off (verl divides by its global counts and multiplies by dp_size, clipbench divides
    by their quotient), over two micro-batches with global counts."""
    from clipbench.replay.rules import RuleSpec
    from clipbench.replay.tokens import OptStepView, replay_rule
    from clipbench.tracking.records import list_records, load_record

    params = {"eps_low": 0.2, "eps_high": 0.28, "delta": 0.1, "p": 0.5}
    params_env(params)
    monkeypatch.setenv(cbverl.RECORD_DIR_ENV, str(tmp_path / "record"))
    monkeypatch.setattr(cbverl, "_CALLS", itertools.count())
    monkeypatch.setattr(cbverl, "_RECORDERS", {})
    logp, old, A, A_bt, mask = batch(2)
    tokens, seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    losses = []
    for s in (slice(0, 3), slice(3, 8)):
        cfg = with_counts(actor(), mask[s], dp_size=2, tokens=tokens, seqs=seqs)
        losses.append(get("clipbench.nsr")(old[s], logp[s], A_bt[s], mask[s], agg, cfg)[0])
    records = [load_record(p) for p in list_records(tmp_path)]
    assert [r.index["step"] for r in records] == [0, 1] and all(r.index["engine"] == "verl" for r in records)
    for rec, loss in zip(records, losses):
        (opt,) = rec.index["opt_steps"]
        assert opt["hook_loss"] == pytest.approx(float(loss), rel=1e-6)
        got = replay_rule(OptStepView(rec, opt), RuleSpec.of("nsr", params)).loss
        assert got == pytest.approx(float(loss), rel=1e-6)
