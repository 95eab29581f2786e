"""The memory plan (clipbench/memory): parameter counts, saved activations counted against PyTorch,
hand-computed plans of Qwen3-shaped runs, the advice it gives and the `clipbench plan` verb.

Every figure here is arithmetic written out in the comments, or a count of what PyTorch really
does (parameters of transformers' own modules on the meta device; bytes autograd saves in a real
forward of the trainer's log-prob function on CPU).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from clipbench.errors import UserError
from clipbench.memory import GIB, Setup, advise, estimate, gib
from clipbench.memory import estimator as est
from clipbench.models import QWEN3, model_shape
from clipbench.models.shapes import ModelShape, from_hf_config

Q17 = QWEN3["Qwen/Qwen3-1.7B-Base"]


# ----------------------------------------------------------------------------------------------
# Shapes and parameter counts


def test_qwen3_1p7b_parameter_count_by_hand():
    # embedding 151936 x 2048 = 311,164,928 (tied: the head is the same matrix)
    # one layer: q 2048x2048 + k, v 2 x 2048x1024 + o 2048x2048 = 12,582,912
    #            + q_norm, k_norm 2 x 128 = 256 + MLP 3 x 2048 x 6144 = 37,748,736 + 2 RMSNorms 4096
    #            = 50,336,000; x 28 layers = 1,409,408,000
    # + final norm 2048 -> 1,720,574,976 (Qwen: "1.7B, 1.4B non-embedding")
    assert Q17.layer_params() == 50_336_000
    assert Q17.n_params() == 311_164_928 + 1_409_408_000 + 2048 == 1_720_574_976
    # KV cache per token in bf16: K and V x 28 layers x 8 kv heads x 128 x 2 B = 114,688
    assert Q17.kv_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2 == 114_688


def _hf_model_on_meta(shape: ModelShape):
    from transformers import AutoConfig, AutoModelForCausalLM

    from clipbench.models.shapes import hf_config

    cfg = (
        hf_config(shape)
        if shape.is_moe
        else AutoConfig.for_model(
            shape.model_type,
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            tie_word_embeddings=shape.tie_word_embeddings,
            **({"attention_bias": shape.o_bias, "mlp_bias": shape.mlp_bias} if shape.model_type == "llama" else {}),
        )
    )
    with torch.device("meta"):
        return cfg, AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", [n for n in QWEN3 if n.endswith("-Base")])
def test_shipped_qwen3_shapes_count_what_transformers_builds(name):
    """The shipped table's parameter count equals transformers' Qwen3 modules (meta device: no memory)."""
    shape = QWEN3[name]
    _, model = _hf_model_on_meta(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.n_params()
    assert QWEN3[name.removesuffix("-Base")].n_params() == shape.n_params()  # post-trained twin


def test_shipped_qwen2_5_7b_shape_counts_what_transformers_builds():
    """Qwen2.5-7B (the NSR-scale recipes' dense model) ships too: plan works offline. By hand:
    embeddings 2 x 152064 x 3584 = 1,089,994,752 (untied); one layer: q 3584^2 + 3584, k and v
    2 x (3584 x 512 + 512), o 3584^2, MLP 3 x 3584 x 18944, 2 norms x 3584 = 233,057,792; x 28
    = 6,525,618,176; + final norm 3584 = 7,615,616,512 (the card's 7.61B, 6.53B non-embedding)."""
    from clipbench.models.shapes import QWEN2_5

    shape = model_shape("Qwen/Qwen2.5-7B")
    assert shape is QWEN2_5["Qwen/Qwen2.5-7B"] and shape.layer_params() == 233_057_792
    assert shape.n_params() == 1_089_994_752 + 6_525_618_176 + 3584 == 7_615_616_512
    _, model = _hf_model_on_meta(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.n_params()


@pytest.mark.parametrize(
    "model_type,extra", [("llama", {"o_bias": True, "mlp_bias": True}), ("qwen2", {"qkv_bias": True}), ("mistral", {})]
)
def test_other_dense_layouts_count_what_transformers_builds(model_type, extra):
    shape = ModelShape(
        "x",
        model_type,
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        **extra,
    )
    cfg, model = _hf_model_on_meta(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.n_params()
    back = from_hf_config(cfg, "x")  # reading the config back gives the same shape
    assert replace(back, max_position_embeddings=None, source="") == shape


def test_model_shape_sources(tmp_path):
    from transformers import MixtralConfig, Qwen3Config

    assert model_shape("Qwen/Qwen3-4B-Base") is QWEN3["Qwen/Qwen3-4B-Base"]  # shipped: no network
    Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    ).save_pretrained(tmp_path / "local")
    local = model_shape(str(tmp_path / "local"))  # a local directory
    assert (local.model_type, local.num_layers, local.num_kv_heads, local.qk_norm) == ("qwen3", 2, 1, True)
    MixtralConfig(num_hidden_layers=1).save_pretrained(tmp_path / "moe")
    moe = model_shape(str(tmp_path / "moe"))  # Mixtral's defaults: 8 experts, top-2
    assert (moe.model_type, moe.num_experts, moe.experts_per_tok, moe.intermediate_size) == ("mixtral", 8, 2, 14336)
    from transformers import Qwen2MoeConfig

    Qwen2MoeConfig(num_hidden_layers=1).save_pretrained(tmp_path / "shared")  # a shared expert: not known
    with pytest.raises(UserError, match=r"'.*shared' is a mixture-of-experts model \(qwen2_moe\) of a layout"):
        model_shape(str(tmp_path / "shared"))


def test_qwen3_30b_a3b_total_and_active_parameters_by_hand():
    q = QWEN3["Qwen/Qwen3-30B-A3B-Base"]
    # attention: q 2048x4096 + k, v 2 x 2048x512 + o 4096x2048 = 18,874,368, + q/k norms 2 x 128 = 18,874,624
    # router 128 x 2048 = 262,144; one expert 3 x 2048 x 768 = 4,718,592; 2 RMSNorms 4,096
    # layer: 18,874,624 + 262,144 + 128 x 4,718,592 (= 603,979,776) + 4,096 = 623,120,640
    # active layer: 18,874,624 + 262,144 + 8 x 4,718,592 (= 37,748,736) + 4,096 = 56,889,600
    # embeddings untied: 2 x 151,936 x 2048 = 622,329,856; final norm 2048
    assert q.layer_params() == 623_120_640 and q.active_layer_params() == 56_889_600
    assert q.n_params() == 622_329_856 + 48 * 623_120_640 + 2048 == 30_532_122_624  # the card: 30.5B
    assert q.n_active_params() == 622_329_856 + 48 * 56_889_600 + 2048 == 3_353_032_704  # the card: 3.3B


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_layouts_count_what_transformers_builds(model_type):
    shape = ModelShape(
        "x",
        model_type,
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        qk_norm=model_type == "qwen3_moe",
        num_experts=6,
        experts_per_tok=2,
    )
    cfg, model = _hf_model_on_meta(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.n_params()
    # active: the dense count less 4 of the 6 experts of each layer (3 x 64 x 96 each)
    assert shape.n_active_params() == shape.n_params() - 3 * 4 * 3 * 64 * 96
    back = from_hf_config(cfg, "x")  # reading the config back gives the same shape
    assert replace(back, max_position_embeddings=None, source="") == shape


# ----------------------------------------------------------------------------------------------
# Saved activations: the formulas against what autograd really saves


def _saved_bytes(model, batch, *, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in the trainer's log-prob forward (parameters
    excluded: they are counted as weights)."""
    from clipbench.train.logprobs import completion_logprobs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        completion_logprobs(model, batch)
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize("mode", ["float32", "autocast", "bf16-sharded"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_saved_activations_are_the_formula(arch, mode, checkpointing):
    """A padded batch of 3 rows through a 2-layer model, as the trainer packs it: the bytes autograd
    saves equal the formula's forward-saved part to the byte, except 4 B per row (the formula's
    log-sum-exp covers T+1 logit positions per row, the code keeps T)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from clipbench.train.packing import pack

    kw = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    cfg = Qwen3Config(**kw) if arch == "qwen3" else LlamaConfig(**kw)
    torch.manual_seed(0)
    model = (Qwen3ForCausalLM if arch == "qwen3" else LlamaForCausalLM)(cfg)
    if mode == "bf16-sharded":  # what FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes with
        model = model.to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in (5, 9, 7)]
    completions = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in (20, 13, 24)]
    batch = pack(prompts, completions, pad_id=0)
    B, S = batch.input_ids.shape  # 3 x (9 + 24)
    T = batch.completion_ids.shape[1]
    got = _saved_bytes(model, batch, autocast=mode == "autocast")

    shape = from_hf_config(cfg, arch)
    p = est.precision("float32" if mode == "float32" else "bfloat16", sharded=mode == "bf16-sharded")
    n = B * S
    if checkpointing:  # each layer's input; cos/sin and the ids are held by the recompute closure
        want = shape.num_layers * n * est.checkpointed_layer_bytes(shape, p) + n * (
            est.per_token_extra_bytes(shape, p) - 2 * shape.head_dim * p.residual - 8
        )
    else:  # every layer's tensors and its additive mask; the ids are saved once
        want = shape.num_layers * (n * est.layer_activation_bytes(shape, p) + est.mask_bytes(p, B, S)) + n * (
            est.per_token_extra_bytes(shape, p) - 8
        )
    want += est.logits_bytes(shape, p, B * (T + 1), backward=False)
    if p.autocast:  # autocast's bf16 weight casts are saved too (counted as weight copies)
        want += est.compute_copy_bytes(shape, p, checkpointing=checkpointing) - (
            est.matmul_params(shape)[0] // shape.num_layers * 2 if checkpointing else 0
        )
    assert got - want == -4 * B


# ----------------------------------------------------------------------------------------------
# Whole plans, by hand


def test_qwen3_1p7b_on_one_80gib_gpu_by_hand():
    """The Table-3 1.7B setting on one GPU: bf16 (autocast), 16,384-token micro-batches,
    checkpointing, vLLM at 0.5 sleeping while training."""
    u = Setup(
        dtype="bfloat16",
        world_size=1,
        device_gib=80,
        prompt_tokens=1024,
        max_new_tokens=4096,
        rows_per_mini_batch=1024,
        micro_batch_tokens=16384,
        generate_rows=4096,
        gradient_checkpointing=True,
        backend="vllm",
        gpu_memory_utilization=0.5,
        sleep_mode=True,
    )
    assert u.micro_batch() == (16384, 3, 16384)  # 3 full 5120-token rows fit in 16,384
    plan = estimate(Q17, u)
    rows = {r.name: r.bytes for r in plan.rows}
    n = 1_720_574_976
    assert rows["parameters (fp32 master)"] == rows["gradients (fp32)"] == 4 * n == 6_882_299_904
    assert rows["AdamW state (2 x fp32)"] == 8 * n == 13_764_599_808
    # autocast + checkpointing: one layer's matmul weights (2048 x 4096 q,k,v + 2048 x 2048 o
    # + 3 x 2048 x 6144 MLP = 50,331,648) and the head (311,164,928), in bf16
    assert rows["weights in bf16 (compute copies)"] == 2 * (50_331_648 + 311_164_928) == 722_993_152
    # one layer saves per token (c = 2 compute, r = 4 residual fp32 under autocast):
    #   input RMSNorm 4h + 4 + 4h + 3 casts x 2h = 14h + 4 = 28,676; post RMSNorm 12h + 4 = 24,580
    #   q/k norm (4 + 2) x 2048 + 4 x 16 + (4 + 2) x 1024 + 4 x 8 = 18,528
    #   SDPA q, k, v repeated to 16 heads 3 x 2 x 2048 + lse 4 x 16 + output 2 x 2048 = 16,448
    #   MLP 4 x 2 x 6144 = 49,152                                     -> 137,384 B per token
    assert est.layer_activation_bytes(Q17, est.precision("bfloat16", False)) == 137_384
    # activations: one recomputed layer 16,384 x 137,384 + its mask 2 x 3 x 5120^2 = 2,408,185,856
    #   + 28 layer inputs 28 x 16,384 x 4 x 2048 = 3,758,096,384
    #   + per token: final norm 8h + 4 = 16,388, cos/sin 2 x 128 x 4 = 1024, ids 16 -> x 16,384 = 285,540,352
    #   + bool padding mask 3 x 5120^2 = 78,643,200                   -> 6,530,465,792
    assert rows["activations, checkpointing on"] == 6_530_465_792
    # logits: 16,384 positions x (head input 2 x 2048 + logits and gradient 2 x 2 x 151,936 + lse 4)
    assert rows["logits + gradient"] == 16384 * (4096 + 607_744 + 4) == 10_024_452_096
    # vLLM: 0.5 x 80 GiB = 42,949,672,960; weights 2 x n = 3,441,149,952; KV = the rest - 1 GiB
    #   = 38,434,781,184 = 65.45 sequences of 5120 x 114,688 B
    assert rows["vLLM weights"] == 3_441_149_952
    assert rows["vLLM KV cache + runtime"] == 42_949_672_960 - 3_441_149_952
    assert plan.kv_cache_bytes == 38_434_781_184 and round(plan.kv_sequences, 2) == 65.45
    # sampling: params + AdamW + vLLM share + 1.5 GiB runtime
    assert plan.phase_bytes("sampling") == 6_882_299_904 + 13_764_599_808 + 42_949_672_960 + 1_610_612_736
    # training: params + grads + AdamW + copies + activations + logits + sleeping engine + runtime
    assert (
        plan.phase_bytes("training")
        == (
            2 * 6_882_299_904
            + 13_764_599_808
            + 722_993_152
            + 6_530_465_792
            + 10_024_452_096
            + 536_870_912
            + 1_610_612_736
        )
        == 46_954_594_304
    )
    assert plan.peak_phase == "sampling" and plan.peak_bytes == 65_207_185_408  # 60.7 GiB
    assert plan.with_margin_bytes == int(65_207_185_408 * 1.1) and plan.fits  # 66.8 GiB of 80
    # awake during training (no sleep mode) the share adds to training: 46.9e9 - 0.5 GiB + 42.9e9
    awake = estimate(Q17, replace(u, sleep_mode=False))
    assert awake.phase_bytes("training") == 46_954_594_304 - 536_870_912 + 42_949_672_960
    assert not awake.fits and "sampler.sleep_mode=true" in advise(Q17, replace(u, sleep_mode=False))


def test_fsdp_shards_state_and_holds_two_layers_unsharded():
    q4 = QWEN3["Qwen/Qwen3-4B-Base"]
    n, layer = q4.n_params(), q4.layer_params()
    u = Setup(
        dtype="bfloat16",
        world_size=8,
        rows_per_mini_batch=512,
        max_new_tokens=3072,
        micro_batch_tokens=16384,
        gradient_checkpointing=True,
    )
    rows = {r.name: r.bytes for r in estimate(q4, u).rows}
    assert rows["parameters (fp32 master)"] == 4 * n // 8 and rows["AdamW state (2 x fp32)"] == 8 * n // 8
    # root group (151,936 x 2560 tied embedding + final norm 2560) + 2 layers in bf16, and one
    # layer's gradient in bf16 + its fp32 copy for the reduce-scatter
    assert rows["weights in bf16 (compute copies)"] == 2 * (151936 * 2560 + 2560 + 2 * layer) + 6 * layer
    # under FSDP2 the residual stream is bf16: a checkpointed layer keeps 2 x 2560 B per token
    assert est.checkpointed_layer_bytes(q4, est.precision("bfloat16", sharded=True)) == 5120


def test_micro_batch_shapes():
    u = Setup(prompt_tokens=1000, max_new_tokens=3000, rows_per_mini_batch=64, world_size=2)
    assert u.micro_batch() == (32 * 4000, 32, 32 * 3001)  # whole share: 64 / 2 ranks, full rows
    assert replace(u, micro_batch_tokens=10_000).micro_batch() == (10_000, 2, 10_000)
    assert replace(u, micro_batch_tokens=1000).micro_batch() == (4000, 1, 4000)  # one sequence alone
    assert replace(u, micro_batch_tokens=10**9).micro_batch() == (128_000, 32, 128_000)  # capped


def test_advice_names_the_knob():
    u = Setup(
        dtype="bfloat16",
        prompt_tokens=1024,
        max_new_tokens=4096,
        rows_per_mini_batch=1024,
        backend="vllm",
        gpu_memory_utilization=0.5,
        sleep_mode=True,
        gradient_checkpointing=True,
    )
    assert not estimate(Q17, u).fits
    knobs = advise(Q17, u)
    assert knobs[0] == "train.micro_batch_tokens=32768"  # the largest power of two that fits
    assert estimate(Q17, replace(u, micro_batch_tokens=32768)).fits
    assert not estimate(Q17, replace(u, micro_batch_tokens=65536)).fits
    # a KV cache that cannot hold one sequence: raise gpu_memory_utilization
    tight = replace(u, micro_batch_tokens=8192, gpu_memory_utilization=0.05)
    plan = estimate(Q17, tight)
    assert not plan.kv_fits and not plan.fits
    assert any(k.startswith("sampler.gpu_memory_utilization=") for k in advise(Q17, tight))
    # 8B on one GPU: 16 B x 8.19e9 params of state alone exceed 80 GiB, only sharding helps
    q8, big = QWEN3["Qwen/Qwen3-8B-Base"], replace(u, micro_batch_tokens=8192, gpu_memory_utilization=0.3)
    assert advise(q8, big) == ["--nproc-per-node 4"]  # the smallest power of two that fits
    assert estimate(q8, replace(big, world_size=4)).fits and not estimate(q8, replace(big, world_size=2)).fits
    # 32B: each GPU's engine needs its own bf16 copy (65.5e9 B) inside its 0.3 x 80 GiB share:
    # no single knob helps (colocated vLLM without tensor parallelism cannot hold it)
    from clipbench.memory.plan import fit_message

    q32 = QWEN3["Qwen/Qwen3-32B-Base"]
    assert advise(q32, big) == []
    assert "no single knob" in fit_message(estimate(q32, big), [], "here")


def test_gib_rounds_to_two_significant_digits():
    assert [gib(x * GIB) for x in (0.0, 0.05, 0.666, 6.43, 99.7, 4769.2)] == ["0", "<0.1", "0.67", "6.4", "100", "4800"]


# ----------------------------------------------------------------------------------------------
# The check `clipbench train` runs, and the verb


def test_check_fits_one_line_error_naming_the_knob():
    from clipbench.config import load_run_config
    from clipbench.engines import preflight
    from clipbench.memory.plan import check_fits

    cfg = load_run_config("recipes/abc_grpo_table3/qwen3_1p7b_grpo.yaml", ["train.micro_batch_tokens=0"])
    with pytest.raises(UserError) as err:
        check_fits(cfg, "Qwen/Qwen3-1.7B-Base", world_size=1, device_gib=80)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("Qwen/Qwen3-1.7B-Base does not fit 1 x 80 GiB GPU: training needs ~")
    assert "set train.micro_batch_tokens=" in msg
    if not torch.cuda.is_available():  # CPU: no memory to check, but the recipe's sleep mode cannot run
        with pytest.raises(UserError, match="sampler.sleep_mode needs a CUDA GPU"):
            preflight(cfg)  # before the model is looked up (this machine cannot reach the hub)


@pytest.mark.slow  # resolves builtin:arith-tiny (built on a fresh machine)
def test_plan_verb_exit_codes_and_json():
    from typer.testing import CliRunner

    from clipbench.cli import app

    runner = CliRunner()
    big = runner.invoke(app, ["plan", "recipes/abc_grpo_table3/qwen3_1p7b_grpo.yaml", "train.micro_batch_tokens=0"])
    assert big.exit_code == 1, big.output
    assert "does not fit" in big.output and "train.micro_batch_tokens=" in big.output
    tiny = runner.invoke(app, ["plan", "recipes/arith_tiny.yaml", "--gpu-memory", "16", "--json"])
    assert tiny.exit_code == 0, tiny.output
    out = json.loads(tiny.stdout)  # a first use builds the model, logging to stderr
    assert out["fits"] and out["params"] > 0 and {r["name"] for r in out["rows"]} >= {"gradients (fp32)"}
    bad = runner.invoke(app, ["plan", "recipes/arith_tiny.yaml", "--gpu-memory", "0"])
    assert bad.exit_code == 2 and "--gpu-memory must be > 0" in bad.output


@pytest.mark.parametrize("slug,gpus", [("qwen3_1p7b", 1), ("qwen3_4b", 8)])
def test_table3_recipes_fit_their_80gib_gpus(slug, gpus):
    """The Table-3 recipes at the paper's batch sizes: 1.7B on one 80 GiB GPU, 4B on 8, with room
    to spare (the plan's peak, margin included, stays under 70 GiB); the same recipe without
    micro-batches would not fit."""
    from clipbench.config import load_run_config
    from clipbench.memory.plan import check_fits

    for method in ("grpo", "abc"):
        cfg = load_run_config(f"recipes/abc_grpo_table3/{slug}_{method}.yaml")
        assert cfg.launch.nproc_per_node == gpus and cfg.sampler.sleep_mode
        plan = check_fits(cfg, cfg.model.name, world_size=gpus, device_gib=80)
        assert plan.fits and plan.with_margin_bytes < 70 * GIB
        with pytest.raises(UserError, match="does not fit"):
            check_fits(
                load_run_config(f"recipes/abc_grpo_table3/{slug}_{method}.yaml", ["train.micro_batch_tokens=0"]),
                cfg.model.name,
                world_size=gpus,
                device_gib=80,
            )


# ----------------------------------------------------------------------------------------------
# The recipe's hardware (launch.gpu, launch.gpu_memory): what plan and rehearse plan on


def test_plan_uses_the_recipes_declared_gpus_unless_told_otherwise():
    """Issue 38: `clipbench plan qwen3_30b_a3b_grpo_r2.yaml` said "does not fit ... set --nproc-per-node
    32" because the recipe's 8 x H200 was only a comment. Now it plans on launch.gpu_memory and says
    which GPUs it assumed and why; a flag wins, and says so."""
    from typer.testing import CliRunner

    from clipbench.cli import app

    runner = CliRunner()
    recipe = "recipes/nsr_scale/qwen3_30b_a3b_grpo_r2.yaml"
    res = runner.invoke(app, ["plan", recipe])
    out = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert out.startswith("hardware: 8 x H200 of 139 GiB (GPUs: launch.nproc_per_node; memory: launch.gpu_memory)")
    assert "fits: ~110 of 139 GiB per GPU" in out
    res = runner.invoke(app, ["plan", recipe, "--gpu-memory", "80", "--nproc-per-node", "16"])
    out = " ".join(res.output.split())
    assert out.startswith(
        "hardware: 16 GPUs of 80 GiB (GPUs: --nproc-per-node; memory: --gpu-memory; "
        "the recipe's launch.gpu_memory is 139 GiB)"
    )
    # a recipe that declares nothing: 80 GiB, and the line says it is the default
    res = runner.invoke(app, ["plan", "recipes/abc_grpo_table3/qwen3_4b_grpo.yaml", "launch.gpu_memory=null"])
    assert " ".join(res.output.split()).startswith(
        "hardware: 8 GPUs of 80 GiB (GPUs: launch.nproc_per_node; memory: the default 80 GiB: "
        "the recipe sets no launch.gpu_memory)"
    )


def test_a_bad_declared_gpu_memory_is_one_line_naming_the_key(tmp_path):
    from typer.testing import CliRunner

    from clipbench.cli import app

    res = CliRunner().invoke(app, ["plan", "recipes/arith_tiny.yaml", "launch.gpu_memory=0"])
    assert res.exit_code == 2
    assert "launch.gpu_memory" in res.output and "(0, 1e+06]" in res.output


def test_every_shipped_gpu_recipe_declares_its_gpus():
    """A recipe of a hub model (written for GPUs) declares launch.gpu and launch.gpu_memory, as its
    header says (the CPU recipes of built-in models declare none)."""
    from pathlib import Path

    from clipbench.config import load_run_config
    from clipbench.config.shipped import RECIPES
    from clipbench.memory.plan import target_hardware
    from clipbench.yamlio import load_yaml_file

    seen = {}
    for path in sorted(Path(RECIPES).rglob("*.yaml")):
        data = load_yaml_file(path)
        if "base" in data or "grid" in data:  # a sweep file
            continue
        cfg = load_run_config(path)
        gpu = not cfg.model.name.startswith("builtin:")
        assert (cfg.launch.gpu_memory is not None) == gpu and (cfg.launch.gpu is not None) == gpu, path
        if gpu:
            seen[path.stem] = target_hardware(cfg).describe().split(" (")[0]
    assert seen == {
        "qwen3_1p7b_abc": "1 x H100 / A100-80GB of 80 GiB",
        "qwen3_1p7b_grpo": "1 x H100 / A100-80GB of 80 GiB",
        "qwen3_4b_abc": "8 x H100 / A100-80GB of 80 GiB",
        "qwen3_4b_grpo": "8 x H100 / A100-80GB of 80 GiB",
        **{f"qwen2_5_7b_dapo{r}": "8 x H100 of 80 GiB" for r in ("", "_decay", "_nsr")},
        **{f"qwen3_30b_a3b_{r}": "8 x H200 of 139 GiB" for r in ("gspo", "gspo_decay", "gspo_nsr", "grpo_r2")},
    }


def test_a_lagged_sampler_counts_its_snapshots_in_host_memory_by_hand():
    """sampler.lag = k keeps k + 1 float32 copies of each rank's shard of the parameters on the host
    (train/lag.py); the device's rows do not change."""
    base = Setup(dtype="bfloat16", world_size=8, device_gib=80, backend="vllm")
    plan, lagged = estimate(Q17, base), estimate(Q17, Setup(**{**vars(base), "lag": 8}))
    n = 1_720_574_976
    assert plan.host_bytes == 0
    assert lagged.host_bytes == 9 * 4 * n // 8 == 7_742_587_392  # 9 copies x 4 B x 1.72B params / 8 ranks
    assert [r.bytes for r in lagged.rows] == [r.bytes for r in plan.rows]
