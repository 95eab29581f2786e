"""Mixture-of-experts models on the HF path, with the shipped builtin:arith-steps-moe (a Qwen3-MoE of
8 experts, top-2): exact micro-batching and ranks (float64, as tests/test_microbatch.py), the
built-in loop over 2 real processes (FSDP2, one unit per decoder layer, experts inside) with
activation checkpointing against one process, and `train.router_aux_loss_coef`.
"""

from __future__ import annotations

import pytest
import torch
from test_microbatch import _make_batch, _run  # noqa: E402

from clipbench.models import load_model_and_tokenizer, resolve_model_name
from clipbench.train.step import Objective

MOE = "builtin:arith-steps-moe"
# the MoE model's own task (worked steps): rewards vary within groups, so the updates are not zero
STEPS = {"task.format": "steps", "task.operands": 3, "sampler.max_new_tokens": 32}


@pytest.fixture(scope="module")
def moe():
    model, tok = load_model_and_tokenizer(resolve_model_name(MOE))
    model.set_experts_implementation("eager")  # torch._grouped_mm (the CPU default) has no float64
    return model.double(), tok


@pytest.mark.slow
@pytest.mark.parametrize("method, agg", [("grpo", "token-mean"), ("gspo", "seq-mean-token-sum")])
def test_moe_step_is_exact_over_micro_batches_and_ranks(moe, method, agg):
    """Routing is per token, so a split mini-batch routes every token as the whole one does: the
    gradients of every parameter (router and packed experts included) agree to 1e-12 relative."""
    model, tok = moe
    batch = _make_batch(model, tok)
    objective = Objective(method, {}, agg, 0.0, max_len=12)
    loss0, counts0, grads0, _ = _run(model, tok, batch, objective, budget=0)
    assert counts0["clip_events"] > 0 and loss0 != 0.0
    assert grads0["model.layers.0.mlp.gate.weight"].norm() > 0  # the router learns
    assert grads0["model.layers.3.mlp.experts.gate_up_proj"].norm() > 0  # so do the experts
    for budget, world in ((40, 1), (40, 2)):
        loss, counts, grads, micro = _run(model, tok, batch, objective, budget=budget, world=world)
        assert len([n for m in micro for n in m]) > 1, micro
        assert abs(loss - loss0) <= 1e-6 * max(abs(loss0), 1.0)
        assert {k: v for k, v in counts.items() if "mass" not in k} == {
            k: v for k, v in counts0.items() if "mass" not in k
        }
        for name, g0 in grads0.items():
            assert (grads[name] - g0).norm() <= 1e-12 * g0.norm() + 1e-15, (budget, world, name)


def _one_process(tmp_path, replay: str):
    from test_distributed import RECIPE, overrides

    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    rd = RunDir(tmp_path / "one" / "run")
    run_training(
        load_run_config(RECIPE, overrides(**{"model.name": MOE, "model.routing_replay": replay, **STEPS})), rd.path
    )
    return rd


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_moe_on_two_processes_with_checkpointing_trains_the_run_one_process_trains(replay, tmp_path):
    """FSDP2 over torchrun (a unit per Qwen3MoeDecoderLayer: attention, router and packed experts)
    with activation checkpointing: the same loss, grad_norm and counts per optimizer step, and the
    same final parameters, as one process without checkpointing; with r2 (each rank records its
    rows' routes, shared by an all-reduce) and r3 (the HF sampler generating in lockstep on the
    sharded model records the routes; every rank gathers every row's) too."""
    import yaml
    from test_distributed import RECIPE, RUN, clipbench

    from clipbench.tracking.store import RunDir

    one = _one_process(tmp_path, replay)
    sweep = tmp_path / "dp.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "name": "dp",
                "base": RECIPE,
                "grid": {"seed": [0]},
                "overrides": {
                    **RUN,
                    "model.name": MOE,
                    "model.routing_replay": replay,
                    **STEPS,
                    "launch.nproc_per_node": 2,
                    "model.gradient_checkpointing": True,
                },
            }
        )
    )
    res = clipbench("sweep", str(sweep), "--results-dir", str(tmp_path / "results"))
    assert res.returncode == 0, res.stdout + res.stderr
    (run_dir,) = [p for p in (tmp_path / "results" / "dp").iterdir() if p.is_dir() and not p.name.startswith(".")]
    rd = RunDir(run_dir)
    assert rd.status()["state"] == "finished" and rd.status()["world_size"] == 2
    assert sum(r["grad_norm"] > 0 for r in one.read_metrics()) >= 6  # real updates to compare
    same_moe_training(one, rd)


def same_moe_training(a, b) -> None:
    """tests/test_distributed.py's same_training, with grad norms and the final parameters within 5e-5
    relative (measured on MoE: up to 1.3e-5 for a grad norm and 1.2e-5 for the worst tensor after 12
    steps, against the dense model's 1e-5): float32 sums in another order over 2 ranks."""
    from test_distributed import COUNTS

    from clipbench.train.checkpoint import load_policy

    ra, rb = a.read_metrics(), b.read_metrics()
    assert [r["opt_step"] for r in ra] == [r["opt_step"] for r in rb] == list(range(1, 13))
    for x, y in zip(ra, rb):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * max(abs(x["loss"]), 1.0), (x["opt_step"], x["loss"], y["loss"])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 5e-5 * max(x["grad_norm"], 1e-6), x["opt_step"]
        assert {k: v for k, v in x.items() if k.split("/")[0] in COUNTS and "mass" not in k} == {
            k: v for k, v in y.items() if k.split("/")[0] in COUNTS and "mass" not in k
        }
        assert x["reward/mean"] == y["reward/mean"]
        assert {k: v for k, v in x.items() if k.startswith("routing/")} == pytest.approx(
            {k: v for k, v in y.items() if k.startswith("routing/")}, abs=1e-9
        )
    pa, pb = (load_policy(rd.checkpoint_dir)[0].state_dict() for rd in (a, b))
    worst = max(float((pa[k] - pb[k]).norm() / pa[k].norm()) for k in pa)
    assert worst <= 5e-5, worst


# ---- train.router_aux_loss_coef -----------------------------------------------------------------
def test_router_logits_hooks_collect_what_transformers_computes_the_aux_loss_from():
    """The hooks see each decoder layer's router logits: the load-balancing loss from them is the
    model's own `aux_loss` (output_router_logits=True) on the same padded batch, to the bit."""
    from clipbench.train.moe import RouterLogits, routers

    model, tok = load_model_and_tokenizer(resolve_model_name(MOE))
    enc = tok(["12+34-5=", "7+8="], padding=True, return_tensors="pt")
    with torch.no_grad():
        own = model(**enc, output_router_logits=True).aux_loss
        with RouterLogits(model) as routed:
            model(**enc)
    assert len(routers(model)) == len(routed.logits) == 4 and routed.logits[0].shape == (2 * 9, 8)
    assert torch.equal(routed.aux_loss(enc["attention_mask"]), own)
    assert 1.0 < float(own) < 8.0  # top-2 of 8: 2.0 when balanced, 8 when one expert takes every token
    with RouterLogits(model, on=False) as off:
        assert off is None


def _run_aux(tmp_path, coef: float, *extra: str):
    from test_distributed import RECIPE, overrides

    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    rd = RunDir(tmp_path / f"aux{coef}")
    over = overrides(
        **{
            "model.name": MOE,
            "train.steps": 1,
            "train.router_aux_loss_coef": coef,
            "task.format": "steps",
            "task.operands": 3,
            "sampler.max_new_tokens": 32,
            "sampler.group_size": 8,
        }
    )
    run_training(load_run_config(RECIPE, over + list(extra)), rd.path)
    return rd.read_metrics()


@pytest.mark.slow
def test_router_aux_loss_is_logged_and_trained_only_when_asked(tmp_path):
    """coef 0: no router_aux_loss key; coef 0.5: logged every optimizer step, the policy loss of the
    first step unchanged (the same forward) but its gradient, and so the later steps, differ."""
    none, aux = _run_aux(tmp_path, 0.0), _run_aux(tmp_path, 0.5)
    assert all("router_aux_loss" not in r for r in none)
    assert all(1.0 < r["router_aux_loss"] < 8.0 for r in aux) and len(aux) == 4
    assert aux[0]["loss"] == none[0]["loss"]
    assert none[0]["grad_norm"] > 0 and aux[0]["grad_norm"] != none[0]["grad_norm"]
    assert aux[1]["loss"] != none[1]["loss"]


def test_a_dense_model_refuses_a_router_aux_loss(tmp_path):
    import subprocess
    import sys

    from test_distributed import RECIPE, REPO

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipbench",
            "train",
            RECIPE,
            "train.router_aux_loss_coef=0.01",
            "--results-dir",
            str(tmp_path / "results"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (
        f"error: {RECIPE}: train.router_aux_loss_coef: 'builtin:arith-tiny' is a dense model "
        f"(no router to balance); set it to 0 or train a mixture-of-experts model"
    )
    assert not (tmp_path / "results").exists()


# ---- clipbench rehearse: a random 2-layer model of the recipe's MoE family -----------------------
def test_rehearsal_of_a_30b_a3b_recipe_generates_a_2_layer_qwen3_moe(tmp_path):
    """The plan names total and active parameters; the generated model is a Qwen3-MoE of 2 layers,
    8 experts, top-2 (the 30B's 128 and 8, shrunk), random weights. (The whole rehearsal of
    qwen3_4b_grpo.yaml with model.name=Qwen/Qwen3-30B-A3B-Base passed in 80 s on 2 cores.)"""
    from test_rehearse import REPO
    from transformers import AutoModelForCausalLM

    from clipbench.config import load_run_config, to_dict
    from clipbench.models import QWEN3
    from clipbench.rehearse.local import build_model
    from clipbench.rehearse.scale import Machine, rehearsal_config

    real = to_dict(
        load_run_config(REPO / "recipes/abc_grpo_table3/qwen3_4b_grpo.yaml", ["model.name=Qwen/Qwen3-30B-A3B-Base"])
    )
    plan = rehearsal_config(real, Machine(world_cap=2, cuda=False, vllm=False))
    model_part = {p.name: p for p in plan.parts}["model"]
    assert "Qwen/Qwen3-30B-A3B-Base (30.53B, 3.35B active, 128 experts top-8, qwen3_moe)" in model_part.detail
    assert "qwen3_moe of 2 layers, 8 experts top-2" in model_part.detail
    path = build_model(plan.generate_model["shape"], ["12+3=15"], tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 2, 8, 2)
    assert (cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size, cfg.tie_word_embeddings) == (64, 32, 128, False)
    assert QWEN3["Qwen/Qwen3-30B-A3B-Base"].num_experts == 128  # the shipped shape is untouched


# ---- engine trl ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_engine_trl_trains_the_moe_model_with_its_router_aux_loss(tmp_path):
    """TRL's GRPOTrainer trains builtin:arith-steps-moe through clipbench's rule; the router's
    load-balancing loss (GRPOConfig.router_aux_loss_coef, mapped) is logged as router_aux_loss."""
    pytest.importorskip("trl")
    from test_trl import RECIPE, TINY

    from clipbench.config import load_run_config
    from clipbench.engines import train_run
    from clipbench.tracking.store import RunDir

    over = {**TINY, "model.name": MOE, "train.router_aux_loss_coef": 0.01}
    cfg = load_run_config(RECIPE, ["engine=trl", *(f"{k}={v}" for k, v in over.items())])
    train_run(cfg, tmp_path / "run")
    rows = RunDir(tmp_path / "run").read_metrics()
    assert rows and all(1.0 < r["router_aux_loss"] < 8.0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)


def test_the_moe_keys_at_their_defaults_leave_every_run_id_as_it_was():
    """Run ids handed out before the MoE keys existed stay valid (the ids below are those of bdf71ea)."""
    from test_rehearse import REPO

    from clipbench.config import load_run_config, run_id

    assert run_id(load_run_config(REPO / "recipes/quickstart.yaml")) == "ca24f4760273"
    assert run_id(load_run_config(REPO / "recipes/arith_tiny.yaml")) == "7854dcc6128e"
    assert (
        run_id(load_run_config(REPO / "recipes/quickstart.yaml", ["train.router_aux_loss_coef=0.01"])) != "ca24f4760273"
    )


# ---- model.routing_replay -----------------------------------------------------------------------
def _experts_chosen(model):
    """A hook on every experts module: the top-k indices each forward hands it (what the MoE block uses)."""
    seen = []
    mods = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    handles = [m.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone())) for m in mods]
    return seen, handles


def test_routing_replay_forces_the_recorded_experts_with_the_live_routers_weights():
    """Recorded routes replayed on the same weights give the same logits bit for bit (the weights
    gathered from the softmax are the router's own); on a policy whose routers moved, the replayed
    experts are the recorded ones while the routers' gradient still flows; tokens of an entry 0
    (nothing recorded) keep the live choice."""
    from clipbench.models.routing import RouteReplay
    from clipbench.train.packing import pack

    model, tok = load_model_and_tokenizer(resolve_model_name(MOE))
    packed = pack(
        [tok(p)["input_ids"] for p in ("12+34-5=", "7+8=", "99-9+1=")],
        [tok(c, add_special_tokens=False)["input_ids"] for c in ("12+34=46 46-5=41 #41", "7+8=15", "9")],
        tok.pad_token_id,
    )
    kw = dict(input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids)
    rows, cols = torch.arange(3), slice(0, packed.input_ids.shape[1])
    replay = RouteReplay.attach(model)
    table = replay.new_table(*packed.input_ids.shape)
    with torch.no_grad():
        plain = model(**kw).logits
        replay.record(table, rows, cols)
        recorded = model(**kw).logits
        replay.replay(table, rows, cols)
        replayed = model(**kw).logits
    replay.off()
    assert torch.equal(plain, recorded) and torch.equal(plain, replayed)
    assert table.shape == (3, 4, packed.input_ids.shape[1], 2) and bool((table > 0).all())

    moved, _ = load_model_and_tokenizer(resolve_model_name(MOE))  # the routers move: some tokens choose other experts
    with torch.no_grad():
        for r in RouteReplay.attach(moved).routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    seen, handles = _experts_chosen(moved)
    with torch.no_grad():
        moved(**kw)
    free = [s.clone() for s in seen]
    seen.clear()
    RouteReplay.of(moved).replay(table, rows, cols)
    moved(**kw).logits.sum().backward()
    RouteReplay.of(moved).off()
    for h in handles:
        h.remove()
    want = [(table[:, layer].reshape(-1, 2) - 1).long() for layer in range(4)]
    assert any(not torch.equal(f, w) for f, w in zip(free, want))  # left alone, the routes moved
    assert all(torch.equal(s, w) for s, w in zip(seen, want))  # replayed: the recorded experts
    assert all(r.weight.grad is not None and r.weight.grad.norm() > 0 for r in RouteReplay.of(moved).routers)

    observer, _ = load_model_and_tokenizer(resolve_model_name(MOE))  # replay none: the hooks only observe
    with torch.no_grad():
        for a, b in zip(RouteReplay.attach(observer, replaces=False).routers, RouteReplay.of(moved).routers):
            a.weight.copy_(b.weight)
        plain_moved = observer(**kw).logits
        RouteReplay.of(observer).replay(table, rows, cols)
        observed = observer(**kw).logits
    changed = dict(RouteReplay.of(observer).changed)
    RouteReplay.of(observer).off()
    assert torch.equal(plain_moved, observed)  # nothing replaced
    assert any(bool(c.any()) for c in changed.values())  # but the moved routes are seen

    partial = table.clone()
    partial[:, :, -1] = 0  # the last column: nothing recorded
    seen, handles = _experts_chosen(moved)
    RouteReplay.of(moved).replay(partial, rows, cols)
    with torch.no_grad():
        moved(**kw)
    RouteReplay.of(moved).off()
    for h in handles:
        h.remove()
    width = packed.input_ids.shape[1]
    last = torch.arange(3) * width + width - 1  # each row's last column
    assert torch.equal(seen[0][last], free[0][last])  # the live router's choice (layer 0: the same input as free)
    for layer, s in enumerate(seen):
        keep = torch.ones(3 * width, dtype=torch.bool)
        keep[last] = False
        assert torch.equal(s[keep], want[layer][keep])


def _run_r2(tmp_path, name: str, *extra: str):
    from test_distributed import RECIPE, overrides

    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    rd = RunDir(tmp_path / name)
    over = overrides(
        **{
            "model.name": MOE,
            "train.steps": 2,
            "task.format": "steps",
            "task.operands": 3,
            "sampler.max_new_tokens": 32,
            "sampler.group_size": 8,
            "train.lr": 1e-3,
        }
    )
    run_training(load_run_config(RECIPE, over + list(extra)), rd.path)
    return rd.read_metrics()


@pytest.mark.slow
def test_r2_is_on_policy_at_the_first_step_and_exact_under_micro_batches_and_checkpointing(tmp_path):
    """With r2 the first optimizer step of each rollout batch has ratio 1 exactly (the update's forward
    routes as the old-log-prob forward did); split micro-batches with activation checkpointing (whose
    recompute replays the routes) log the same losses (1e-6), grad norms (5e-5: float32 sums in another
    order, measured up to 1.5e-5; the float64 test holds every gradient to 1e-12) and counts as the
    whole mini-batch; and the replay is live: without it the later steps differ."""
    whole = _run_r2(tmp_path, "whole", "model.routing_replay=r2")
    split = _run_r2(
        tmp_path,
        "split",
        "model.routing_replay=r2",
        "train.micro_batch_tokens=160",
        "model.gradient_checkpointing=true",
    )
    free = _run_r2(tmp_path, "free")
    assert len(whole) == len(split) == len(free) == 8
    for r in (whole[0], whole[4]):
        assert r["ratio/max"] == r["ratio/min"] == 1.0, r
    for a, b in zip(whole, split):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * max(abs(a["loss"]), 1.0), (a["opt_step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-5 * max(a["grad_norm"], 1e-6), a["opt_step"]
        assert {k: v for k, v in a.items() if k.split("/")[0] in ("q1", "q2", "q3", "q4") and "mass" not in k} == {
            k: v for k, v in b.items() if k.split("/")[0] in ("q1", "q2", "q3", "q4") and "mass" not in k
        }
    assert all(a["micro_batches"] == 1 for a in whole) and any(b["micro_batches"] > 1 for b in split)
    assert whole[0]["loss"] == free[0]["loss"] and whole[1]["loss"] != free[1]["loss"]
    # routing agreement (old routes vs the live routers' choice): whole at each rollout batch's first
    # step, then tokens whose experts moved in some layer; only logged when routes are replayed
    for r in (whole[0], whole[4]):
        assert r["routing/changed_frac"] == 0.0 and all(r[f"routing/agree/l{i}"] == 1.0 for i in range(4))
    assert all(0.0 < r["routing/changed_frac"] < 1.0 for r in whole[1:4] + whole[5:])
    assert all(r["routing/changed_frac"] >= 1.0 - min(r[f"routing/agree/l{i}"] for i in range(4)) for r in whole)
    assert all(abs(a["routing/changed_frac"] - b["routing/changed_frac"]) <= 0.01 for a, b in zip(whole, split))
    # without replay the hooks only observe: the same diagnostics, the routes free to move
    assert free[0]["routing/changed_frac"] == 0.0 and all(0.0 < r["routing/changed_frac"] < 1.0 for r in free[1:4])
    # the clip's cells split by whether the token's experts moved: the two halves add up to each cell
    cells = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
    for r in whole:
        for c in cells:
            for f in ("tokens", "out_of_band"):
                assert r[f"experts_moved/{c}/{f}"] + r[f"experts_kept/{c}/{f}"] == r[f"{c}/{f}"], (r["opt_step"], c, f)
        total = sum(r[f"{c}/tokens"] for c in cells)
        assert sum(r[f"experts_moved/{c}/tokens"] for c in cells) == round(r["routing/changed_frac"] * total)
    assert sum(r[f"experts_moved/{c}/out_of_band"] for r in whole for c in cells) > 0  # clip events on moved tokens
    # expert load: the busiest expert's share over the mean share, - 1 (0: balanced; top-2 of 8: at most 8/2 - 1)
    for r in whole:
        per_layer = [r[f"routing/load_maxvio/l{i}"] for i in range(4)]
        assert all(0.0 <= v <= 3.0 for v in per_layer) and r["routing/load_maxvio"] == max(per_layer)


@pytest.mark.parametrize(
    "override, words",
    [
        (["model.routing_replay=r2"], "model.routing_replay: 'builtin:arith-tiny' (qwen3) has no router it knows"),
        (
            ["model.name=builtin:arith-steps-moe", "model.routing_replay=r2", "sampler.old_logp=sampler"],
            "model.routing_replay: r2 replays the experts of the old-log-prob forward: it needs sampler.old_logp=recompute",
        ),
        (["model.name=builtin:arith-steps-moe", "model.routing_replay=r3", "sampler.backend=vllm"], None),
        (["model.name=builtin:arith-steps-moe", "model.routing_replay=r4"], "model.routing_replay: unknown value 'r4'"),
    ],
)
def test_routing_replay_refusals_are_one_line_exit_2_nothing_written(tmp_path, override, words):
    """A dense model, r2 without a recomputed old log-prob, r3 from vLLM (GPU-only here: vllm is not
    installed, or needs Triton), an unknown mode: one line, exit 2, nothing written."""
    import subprocess
    import sys

    from test_distributed import RECIPE, REPO

    res = subprocess.run(
        [sys.executable, "-m", "clipbench", "train", RECIPE, *override, "--results-dir", str(tmp_path / "results")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1, err
    assert words is None or words in err, err
    assert not (tmp_path / "results").exists()


def test_policy_loss_splits_the_cells_over_named_token_subsets():
    """token_splits: each named subset's cell counts (tokens, out of band); two complementary subsets
    add up to the cells' totals; the loss is unchanged; without it, no such keys."""
    from clipbench.objectives import policy_loss

    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g) * 0.1 - 1.0
    old = logp + torch.randn(4, 6, generator=g) * 0.4
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    mask = torch.ones(4, 6)
    mask[2, 4:] = 0
    moved = torch.rand(4, 6, generator=g) > 0.5
    plain = policy_loss("grpo", logp, old, adv, mask)
    split = policy_loss("grpo", logp, old, adv, mask, token_splits={"experts_moved": moved, "experts_kept": ~moved})
    assert torch.equal(plain.loss, split.loss) and not any(k.startswith("experts_") for k in plain.stats)
    for c in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy"):
        for f in ("tokens", "out_of_band"):
            assert (
                split.stats[f"experts_moved/{c}/{f}"] + split.stats[f"experts_kept/{c}/{f}"] == split.stats[f"{c}/{f}"]
            )
    assert float(
        sum(split.stats[f"experts_moved/{c}/tokens"] for c in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy"))
    ) == float((moved & (mask > 0)).sum())
    assert float(split.stats["clip_events"]) > 0


def test_the_moe_metrics_are_mirrored_to_mlflow():
    from clipbench.tracking.mirror import mirror_points

    row = {
        "opt_step": 3,
        "step": 1,
        "routing/changed_frac": 0.5,
        "routing/agree/l0": 0.9,
        "routing/load_maxvio": 1.2,
        "experts_moved/q1/tokens": 3.0,
        "experts_kept/q1/out_of_band": 1.0,
        "router_aux_loss": 2.0,
    }
    points, _ = mirror_points(1, row, lambda k: k)
    assert {name for name, at, _ in points if at == 3} == set(row) - {"opt_step", "step"}


# ---- r3: the sampler's routes (HF sampler) --------------------------------------------------------
def test_the_hf_sampler_records_the_routes_it_generated_with():
    """Rollout.routes: per row (layers, prompt + completion tokens, k), nothing for the last sampled
    token of the call's longest rows (never fed back; a row that ended earlier fed its <eos> back
    while the others generated); placed in the packed batch's layout they are the experts a full forward
    of the same weights chooses (KV-cached generation routes every token as the full sequence does:
    measured equal on this CPU, float32)."""
    from clipbench.models.routing import RouteReplay, row_routes_table
    from clipbench.rollout.hf import HFSampler
    from clipbench.train.packing import pack

    model, tok = load_model_and_tokenizer(resolve_model_name(MOE))
    replay = RouteReplay.attach(model)
    sampler = HFSampler(model, tok, max_new_tokens=30)
    sampler.record_routes = True
    ro = sampler.generate(["12+34-5=", "7+8+9="], 2, seed=[1, 2])
    assert len(ro.routes) == 4 and replay.mode is None
    longest = max(len(c) for c in ro.completion_ids)
    assert len({len(c) for c in ro.completion_ids}) > 1  # rows of other lengths
    for r, p, c in zip(ro.routes, ro.prompt_ids, ro.completion_ids):
        assert r.shape == (4, len(p) + len(c), 2) and bool((r[:, :-1] > 0).all())
        assert bool((r[:, -1] == 0).all()) == (len(c) == longest)  # the last token fed back or not
    packed = pack(ro.prompt_ids, ro.completion_ids, tok.pad_token_id)
    width, prompt_width = packed.input_ids.shape[1], packed.input_ids.shape[1] - packed.completion_ids.shape[1]
    sampled = row_routes_table(ro.routes, packed.prompt_lens, width, prompt_width)
    recorded = replay.new_table(*packed.input_ids.shape)
    replay.record(recorded, torch.arange(4), slice(0, width))
    with torch.no_grad():
        model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids)
    replay.off()
    has = sampled > 0
    assert int(has.all(-1).sum()) == 4 * sum(
        len(p) + len(c) - (len(c) == longest) for p, c in zip(ro.prompt_ids, ro.completion_ids)
    )
    assert torch.equal(sampled[has], recorded[has])


@pytest.mark.slow
def test_r3_replays_the_samplers_routes_from_the_first_step(tmp_path):
    """r3 (HF sampler): the old-log-prob forward and the update replay the sampler's experts: ratio 1
    exactly at each rollout batch's first step, where the routing agreement is the sampler's against
    the trainer's (full here: the same weights and kernels)."""
    rows = _run_r2(tmp_path, "r3", "model.routing_replay=r3")
    assert len(rows) == 8
    for r in (rows[0], rows[4]):
        assert r["ratio/max"] == r["ratio/min"] == 1.0 and r["routing/changed_frac"] == 0.0
    assert all(0.0 < r["routing/changed_frac"] < 1.0 for r in rows[1:4] + rows[5:])


def test_plan_names_total_and_active_parameters_of_a_moe_model():
    """`clipbench plan` of a recipe on Qwen3-30B-A3B (shipped shape: no network): the title and the
    JSON carry the total and the active parameters; every expert counts in the memory rows."""
    import json

    from test_rehearse import REPO
    from typer.testing import CliRunner

    from clipbench.cli import app

    recipe = str(REPO / "recipes/abc_grpo_table3/qwen3_4b_grpo.yaml")
    over = ["model.name=Qwen/Qwen3-30B-A3B-Base"]
    text = CliRunner().invoke(app, ["plan", recipe, *over, "--nproc-per-node", "16"])
    assert "Qwen/Qwen3-30B-A3B-Base: 30.53B params (3.35B active: 128 experts, 8 per token)" in " ".join(
        text.output.split()
    )
    out = json.loads(CliRunner().invoke(app, ["plan", recipe, *over, "--nproc-per-node", "16", "--json"]).stdout)
    assert (out["params"], out["active_params"]) == (30_532_122_624, 3_353_032_704)
    assert out["model"]["num_experts"] == 128 and out["model"]["experts_per_tok"] == 8
    adam = next(r for r in out["rows"] if r["name"] == "AdamW state (2 x fp32)")
    assert adam["bytes"] == 8 * 30_532_122_624 // 16  # every expert's optimizer state
