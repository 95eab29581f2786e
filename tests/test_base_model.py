"""The tiny built-in base model: a real build (the suite's one build of builtin:arith-tiny, which the
training tests load too), reload through the plain Hugging Face path, tokenizer, sampling with
model.generate, name resolution and errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

import clipbench.basemodel.build as bm
from clipbench import models
from clipbench.basemodel import BUILTIN_RECIPES, DEFAULT_RECIPE, Recipe
from clipbench.basemodel.recipes import recipe_record
from clipbench.errors import UserError
from clipbench.tasks.arith import ArithKnobs, ArithTask

# One worker builds the model once for the whole module (pytest -n 2 --dist loadfile: a file runs on one worker).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("base_model")]  # builds base models

SMALL = Recipe(  # a 1-layer model and 30 steps: for determinism and plumbing, not accuracy
    task=ArithKnobs(train_size=2000, test_size=50),
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_steps=30,
    eval_every=15,
    val_size=32,
    test_samples_per_problem=1,
)


@pytest.fixture(scope="module")
def built() -> Path:
    """``builtin:arith-tiny`` as it resolves: the build shipped with the package (the one the other
    test files train from too)."""
    return Path(models.resolve_model_name("builtin:arith-tiny"))


@pytest.fixture(scope="module")
def loaded(built):
    model = AutoModelForCausalLM.from_pretrained(built)
    tok = AutoTokenizer.from_pretrained(built)
    return model.eval(), tok


def test_build_measures_accuracy_inside_the_grpo_band(built):
    info = models.read_build_info(built)
    m = info["measured"]
    # 2000 samples at T=1 -> se about 0.011; the band is what leaves GRPO signal
    assert 0.15 <= m["test_sampled_acc"] <= 0.60, m
    assert m["in_band"] is True and m["test_sampled_n"] == 500 * 4
    assert m["test_greedy_acc"] >= m["test_sampled_acc"] - 3 * m["test_sampled_se"]  # greedy is no worse
    sft = info["sft"]
    assert sft["reached_target"] is True and sft["steps"] < DEFAULT_RECIPE.max_steps
    last = sft["history"][-1]
    assert last["val_sampled_acc"] >= DEFAULT_RECIPE.stop_at_sampled_acc
    assert all(h["val_sampled_acc"] < DEFAULT_RECIPE.stop_at_sampled_acc for h in sft["history"][:-1])
    assert info["build_cpu_seconds"] > 0  # recorded (its budget is a benchmark figure, not a test)
    assert info["recipe"] == json.loads(json.dumps(recipe_record(DEFAULT_RECIPE)))


def test_reload_through_auto_classes(built, loaded):
    model, tok = loaded
    assert isinstance(model, Qwen3ForCausalLM)
    cfg = model.config
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size == len(tok) == 19  # 4 specials + 15 characters of ALPHABET
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (3, 128, 4, 2)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == models.read_build_info(built)["parameters"]
    # 19*128 embed + 3 * (q 128*128 + k,v 2*128*64 + o 128*128 + mlp 3*128*256 + norms 2*128 + qk-norms 2*32) + 128
    assert n_params == 19 * 128 + 3 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256 + 2 * 128 + 2 * 32) + 128
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (
        tok.eos_token_id,
        tok.pad_token_id,
        tok.bos_token_id,
    )
    assert len({tok.eos_token_id, tok.pad_token_id, tok.bos_token_id}) == 3
    assert json.loads((built / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tokenizer_is_char_level_and_round_trips(loaded):
    _, tok = loaded
    assert tok.padding_side == "left"
    for text in ["37+45=", "82", "-3", "12*3-7=", "0", bm.ALPHABET]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
        assert len(ids) == len(text) + 1  # one token per character, plus <bos>
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
    assert tok.convert_ids_to_tokens(tok("9/")["input_ids"]) == ["<bos>", "9", "<unk>"]
    batch = tok(["1+2=", "10+20="], padding=True)
    assert batch["attention_mask"] == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    tok.padding_side = "right"  # configurable by callers
    assert tok(["1+2=", "10+20="], padding=True)["attention_mask"][0] == [1, 1, 1, 1, 1, 0, 0]
    tok.padding_side = "left"


def _generate(model, tok, prompts, **kw):
    enc = tok(prompts, padding=True, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=5, **kw)
    return out[:, enc["input_ids"].shape[1] :]  # (B, new)


def test_generate_samples_with_left_padding_and_stops_at_eos(loaded):
    """Sampled accuracy through model.generate (what the GRPO trainer uses), 500 problems x 1 sample
    at T=1. The build measured ~0.3-0.4 (se 0.011); with n=500 the sd of this estimate is at most
    0.022, so (0.10, 0.70) is > 9 sd away from anything inside the band."""
    model, tok = loaded
    task = ArithTask()
    test = list(task.test_problems())
    with torch.random.fork_rng():
        torch.manual_seed(0)
        new = _generate(model, tok, [p.prompt for p in test], do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    texts = tok.batch_decode(new, skip_special_tokens=True)
    acc = sum(task.is_correct(t, p) for t, p in zip(texts, test)) / len(test)
    assert 0.10 < acc < 0.70, acc
    own = models.read_build_info(model.name_or_path)["measured"]["test_sampled_acc"]
    assert abs(acc - own) < 0.10  # same distribution as the build's own sampler: diff sd ~0.025
    stopped = 0
    for row in new.tolist():
        if tok.eos_token_id in row:
            stopped += 1
            cut = row.index(tok.eos_token_id)
            assert all(t == tok.pad_token_id for t in row[cut + 1 :])  # nothing after EOS but padding
    assert stopped >= 0.95 * len(test)  # answers have <= 3 chars, 5 new tokens allowed


def test_greedy_generate_matches_own_sampler_and_is_padding_invariant(loaded):
    model, tok = loaded
    prompts = [p.prompt for p in ArithTask().test_problems(64)]
    hf = tok.batch_decode(_generate(model, tok, prompts, do_sample=False), skip_special_tokens=True)
    own = bm.sample_completions(model, tok, prompts, max_new_tokens=5, temperature=0.0, generator=None)
    assert hf == own
    alone = [tok.decode(_generate(model, tok, [p], do_sample=False)[0], skip_special_tokens=True) for p in prompts[:8]]
    assert alone == hf[:8]


def test_resolve_model_name(built):
    assert built == models.builtin_path("arith-tiny") and (built / "model.safetensors").is_file()
    assert models.resolve_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert models.resolve_model_name("/some/local/dir") == "/some/local/dir"
    with pytest.raises(
        UserError,
        match=r"model.name: unknown built-in model 'builtin:arith-tny' "
        r"\(did you mean 'builtin:arith-tiny'\?\); "
        r"valid: builtin:arith-organism, builtin:arith-steps, builtin:arith-steps-moe, builtin:arith-tiny",
    ):
        models.resolve_model_name("builtin:arith-tny")
    with pytest.raises(UserError, match="non-empty string"):
        models.resolve_model_name("")


def test_shipped_builds_are_their_recorded_bytes():
    """Every shipped built-in model has a recipe, and its weights are the bytes its build recorded
    (sha256 of the weight files): what every run records as its starting point."""
    assert models.builtin_names() == tuple(sorted(BUILTIN_RECIPES))
    for name in models.builtin_names():
        path = models.builtin_path(name)
        info = models.read_build_info(path)
        assert info["name"] == f"builtin:{name}"
        assert models.weights_sha256(path) == info["weights_sha256"], name
        assert info["recipe"] == json.loads(json.dumps(recipe_record(BUILTIN_RECIPES[name]))), name


def test_load_model_and_tokenizer(built, tmp_path):
    model, tok = models.load_model_and_tokenizer("builtin:arith-tiny", dtype="bfloat16")
    assert isinstance(model, Qwen3ForCausalLM) and model.dtype == torch.bfloat16
    assert tok.eos_token_id == model.generation_config.eos_token_id
    with pytest.raises(UserError, match=r"model.dtype: unknown dtype 'fp32'"):
        models.load_model_and_tokenizer(str(built), dtype="fp32")
    with pytest.raises(UserError, match=r"^model.name: cannot load '/nonexistent/model': no such directory"):
        models.load_model_and_tokenizer("/nonexistent/model")
    with pytest.raises(UserError, match=rf"^model.name: cannot load '{tmp_path}': "):
        models.load_model_and_tokenizer(str(tmp_path))  # a directory without a model
    # conftest sets HF_HUB_OFFLINE=1: an unavailable hub name fails at once
    with pytest.raises(UserError, match=r"^model.name: cannot load 'no-such-org/no-such-model': "):
        models.load_model_and_tokenizer("no-such-org/no-such-model")


def test_build_is_deterministic_and_atomic(tmp_path):
    """Same seed -> byte-identical weights and tokenizer; a forced rebuild replaces the directory
    in place; an existing build is returned untouched without force."""
    logs: list[str] = []
    a = bm.build_base_model("arith", tmp_path / "a", seed=5, recipe=SMALL, log=logs.append)
    b = bm.build_base_model("arith", tmp_path / "b", seed=5, recipe=SMALL, log=lambda m: None)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ia, ib = models.read_build_info(a), models.read_build_info(b)
    assert ia["measured"] == ib["measured"] and ia["sft"] == ib["sft"]
    # 30 steps of a 1-layer model cannot reach the target: recorded, and warned about
    assert ia["sft"]["reached_target"] is False and ia["sft"]["steps"] == 30
    assert any("WARNING" in m for m in logs)

    c = bm.build_base_model("arith", tmp_path / "a", seed=6, recipe=SMALL, log=lambda m: None)  # no force
    assert models.read_build_info(c)["seed"] == 5
    c = bm.build_base_model("arith", tmp_path / "a", seed=6, recipe=SMALL, force=True, log=lambda m: None)
    assert models.read_build_info(c)["seed"] == 6
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp dirs left behind


def test_unknown_name():
    with pytest.raises(
        UserError,
        match=r"unknown built-in model 'arth' \(did you mean 'arith'\?\); "
        r"valid: arith, arith-organism, arith-steps, arith-steps-moe, arith-tiny",
    ):
        bm.build_base_model("arth")
    assert bm.recipe_name("arith") == bm.recipe_name("builtin:arith-tiny") == "arith-tiny"  # legacy name


def test_builtin_models_and_their_tasks():
    """arith-tiny's recipe is frozen (its shipped weights are in use); arith-steps is the worked-steps
    task of the quickstart. `built_on_task` is the task a built-in model is for (eval uses it)."""
    from clipbench.commands.eval import built_on_task

    assert DEFAULT_RECIPE is BUILTIN_RECIPES["arith-tiny"] and DEFAULT_RECIPE.task == ArithKnobs()
    steps = BUILTIN_RECIPES["arith-steps"]
    assert steps.task.format == "steps" and steps.task.operands == 3
    assert built_on_task(models.builtin_path("arith-steps")) == ArithTask(**steps.task.knobs())
    assert built_on_task(models.builtin_path("arith-tiny")) == ArithTask()


def test_steps_build_sft_targets_and_tokenizer(tmp_path):
    """The same builder with a steps task: the tokenizer knows '#', the SFT targets are the worked
    solutions, the format is recorded, and the build is deterministic (plumbing: a 1-layer model)."""
    recipe = dataclasses.replace(SMALL, task=ArithKnobs(operands=4, format="steps", train_size=2000, test_size=50))
    a = bm.build_base_model("arith-steps", tmp_path / "a", seed=1, recipe=recipe, log=lambda m: None)
    b = bm.build_base_model("arith-steps", tmp_path / "b", seed=1, recipe=recipe, log=lambda m: None)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    info = models.read_build_info(a)
    assert info["name"] == "builtin:arith-steps" and info["task"]["format"] == "steps" and info["task"]["seed"] == 1
    assert info["format"]["example"] == "37+45-12= -> 37+45=82 82-12=70 #70"
    task = ArithTask(seed=1, **recipe.task.knobs())
    longest = max(len(task.solution(p)) for p in task.train_problems())
    assert info["sft"]["max_new_tokens"] == longest + 2  # + <eos> + 1 spare
    tok = AutoTokenizer.from_pretrained(a)
    assert len(tok) == 20 and tok.convert_ids_to_tokens(tok("#7")["input_ids"]) == ["<bos>", "#", "7"]
    p = task.test_problems()[0]
    ids, _, lm = bm.encode_sft(tok, [p.prompt], [task.solution(p)])
    target = ids[0, 1:][lm[0, :-1].bool()]  # what the loss trains: the solution, then <eos>
    assert tok.decode(target[:-1]) == task.solution(p) and target[-1] == tok.eos_token_id


def test_sft_loss_only_on_completion_tokens():
    """encode_sft marks exactly the positions that predict answer tokens and <eos>."""
    tok = bm.build_tokenizer(["12+3=", "15"])
    ids, attn, lm = bm.encode_sft(tok, ["12+3=", "1-9="], ["15", "-8"])
    # "<bos>12+3=15<eos>": 9 tokens; positions 5,6,7 ('=', '1', '5') predict '1', '5', <eos>
    assert ids.shape == (2, 9)
    assert lm[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0]
    assert attn[0].tolist() == [1] * 9
    # "<bos>1-9=-8<eos>" is 8 tokens, right-padded to 9
    assert lm[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0] and attn[1].tolist() == [1] * 8 + [0]
    assert ids[1, -1].item() == tok.pad_token_id


# ---- builtin:arith-steps-moe: the mixture-of-experts twin of arith-steps ----------------------------
def test_moe_build_is_a_qwen3_moe_with_arith_steps_accuracy():
    """The shipped MoE build: 8 experts, top-2, hidden 64, head_dim 32 (vLLM's CPU attention needs 32),
    SFT'd on arith-steps' task by the same stopping rule, to a sampled accuracy in the same band."""
    from transformers import Qwen3MoeForCausalLM

    path = models.builtin_path("arith-steps-moe")
    info = models.read_build_info(path)
    m, recipe = info["measured"], BUILTIN_RECIPES["arith-steps-moe"]
    assert info["task"] == models.read_build_info(models.builtin_path("arith-steps"))["task"]
    assert 0.15 <= m["test_sampled_acc"] <= 0.40 and m["in_band"] is True and m["test_sampled_n"] == 2000
    assert info["sft"]["reached_target"] is True and info["sft"]["steps"] < recipe.max_steps
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, Qwen3MoeForCausalLM)
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers) == (
        8,
        2,
        64,
        32,
        4,
    )
    assert cfg.router_aux_loss_coef == 0.0 and cfg.norm_topk_prob is True and cfg.mlp_only_layers == []
    # 20*64 embed (tied) + 4 * (q 64*128 + k,v 2*64*64 + o 128*64 (= 3*64*128) + qk-norms 2*32 + router 8*64
    #                          + experts 8 * 3*64*64 + norms 2*64) + 64 = 1,280 + 4 * 123,584 + 64 = 495,680
    n = sum(p.numel() for p in model.parameters())
    assert n == info["parameters"] == 20 * 64 + 4 * (3 * 64 * 128 + 64 + 8 * 64 + 8 * 3 * 64 * 64 + 128) + 64
    assert cfg.moe_intermediate_size == 64  # experts 64 wide: the float32 file stays under 2 MB
    shape = models.model_shape(str(path))  # the memory plan reads it: total and active parameters
    assert shape.n_params() == 495_680 and shape.n_active_params() == 495_680 - 4 * 6 * 3 * 64 * 64  # 200,768


MOE_SMALL = bm.MoeRecipe(
    task=ArithKnobs(train_size=2000, test_size=50),
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    num_experts=4,
    moe_intermediate_size=32,
    max_steps=10,
    eval_every=10,
    val_size=16,
    test_samples_per_problem=1,
)


def test_moe_build_is_deterministic_and_the_aux_loss_is_trained_when_asked(tmp_path):
    """Same seed -> the same bytes; router_aux_loss_coef > 0 adds the load-balancing loss (other weights)."""
    a = bm.build_base_model("arith-steps-moe", tmp_path / "a", seed=2, recipe=MOE_SMALL, log=lambda m: None)
    b = bm.build_base_model("arith-steps-moe", tmp_path / "b", seed=2, recipe=MOE_SMALL, log=lambda m: None)
    c = bm.build_base_model(
        "arith-steps-moe",
        tmp_path / "c",
        seed=2,
        log=lambda m: None,
        recipe=dataclasses.replace(MOE_SMALL, router_aux_loss_coef=0.01),
    )
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    info = models.read_build_info(a)
    assert info["recipe"]["num_experts"] == 4 and info["sft"]["steps"] == 10
    assert json.loads((c / "config.json").read_text())["router_aux_loss_coef"] == 0.01


# ---- builtin:arith-organism: arith-steps' task and model, SFT on solutions with slips -------------
def test_shipped_organism_model_record():
    """The organism's base model: the steps task, half of its SFT solutions slipped, and the room RL
    sharpens into: sampled (T=1) test accuracy well below greedy (measured at the build: 26.7% of
    2000 samples against 53.8% greedy on the 500 test problems)."""
    from clipbench.commands.eval import built_on_task

    path = models.builtin_path("arith-organism")
    info = models.read_build_info(path)
    recipe = BUILTIN_RECIPES["arith-organism"]
    assert recipe.sft_slip_rate == 0.5 and info["recipe"]["sft_slip_rate"] == 0.5
    assert built_on_task(path) == ArithTask(**recipe.task.knobs())
    m = info["measured"]
    assert m["in_band"] and m["test_greedy_acc"] - m["test_sampled_acc"] > 0.2
    assert info["weights_sha256"] == models.weights_sha256(path)


def test_slips_change_only_the_slipped_builds(tmp_path):
    """sft_slip_rate draws from a generator of its own: a recipe without slips builds the same bytes
    as before slips existed (arith-steps is unchanged), and one with slips trains on other targets."""
    recipe = dataclasses.replace(SMALL, task=ArithKnobs(operands=3, format="steps", train_size=500, test_size=20))
    plain = bm.build_base_model("arith-steps", tmp_path / "a", seed=1, recipe=recipe, log=lambda m: None)
    again = bm.build_base_model(
        "arith-steps",
        tmp_path / "b",
        seed=1,
        recipe=dataclasses.replace(recipe, sft_slip_rate=0.0),
        log=lambda m: None,
    )
    slipped = bm.build_base_model(
        "arith-steps",
        tmp_path / "c",
        seed=1,
        recipe=dataclasses.replace(recipe, sft_slip_rate=0.5),
        log=lambda m: None,
    )
    assert (plain / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (plain / "model.safetensors").read_bytes() != (slipped / "model.safetensors").read_bytes()
