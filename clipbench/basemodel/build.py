"""Building a built-in base model: a char-level tokenizer, a small Qwen3, SFT on arith, a record.

    clipbench base-model arith-steps [--seed S] [--out DIR]      # -> build_base_model(...)

Format (see ``clipbench.tasks.arith``): the tokenizer is character level and prepends ``<bos>``;
prompt ``"37+45="`` -> tokens ``<bos> 3 7 + 4 5 =``; completion ``"82"`` -> tokens ``8 2 <eos>``.
The SFT target is the task's reference completion (``ArithTask.solution``); in the steps format each
'+' step is written either way round at random (both are correct), so the model learns real choices.

SFT stops by a measured criterion, not a step count: every ``eval_every`` steps it samples one
completion at temperature 1.0 for each problem of a validation slice (train-partition expressions
removed from the SFT data) and stops at the first evaluation whose accuracy reaches
``stop_at_sampled_acc``. The result must leave GRPO signal: test accuracy at temperature 1.0 inside
the recipe's ``target_band``. The measured test accuracies (sampled and greedy) go into
``clipbench_base.json``, with the sha256 of the weights.

The models clipbench trains from are the shipped builds (clipbench.models.builtin): a rebuild on
another CPU is a different model (float arithmetic differs between CPUs), so a rebuild goes into a
directory of its own and is used by path (``model.name: DIR``).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from clipbench.basemodel.recipes import BUILTIN_RECIPES, MoeRecipe, Recipe, recipe_record
from clipbench.errors import UserError
from clipbench.models.builtin import BUILTIN_PREFIX, LEGACY_NAMES, META_FILE, cache_root, weights_sha256
from clipbench.tasks.arith import ALPHABET, ArithTask

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def recipe_name(name: str) -> str:
    """The recipe's short name from 'arith-steps', 'builtin:arith-steps' or the legacy 'arith'."""
    short = name[len(BUILTIN_PREFIX) :] if name.startswith(BUILTIN_PREFIX) else name
    short = LEGACY_NAMES.get(short, short)
    if short not in BUILTIN_RECIPES:
        raise UserError(BUILTIN_RECIPES.unknown(name))
    return short


def default_out_dir(name: str, seed: int) -> Path:
    """Where `clipbench base-model NAME --seed S` builds by default: the cache, one directory per seed."""
    return cache_root() / "models" / f"{recipe_name(name)}-seed{seed}"


def _is_built(path: Path) -> bool:
    return (path / META_FILE).is_file()


# ---- tokenizer and model ------------------------------------------------------------------------
def build_tokenizer(corpus: Sequence[str], alphabet: str = ALPHABET):
    """Char-level WordLevel tokenizer trained on ``alphabet`` + corpus; prepends <bos>, never <eos>."""
    # PLC0415, deferred: tokenizers is heavy
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers is heavy

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1, show_progress=False)
    tok.train_from_iterator([alphabet, *corpus], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )


def build_model(recipe: Recipe, tokenizer, generator: torch.Generator):
    """A fresh Qwen3ForCausalLM (Qwen3MoeForCausalLM for a MoeRecipe), initialised from ``generator``
    (not the global RNG): every matrix (router and packed experts included) ~ N(0, init_std), norms 1."""
    from transformers import GenerationConfig  # noqa: PLC0415 - transformers is heavy

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        initializer_range=recipe.init_std,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if isinstance(recipe, MoeRecipe):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: PLC0415 - transformers is heavy

        config = Qwen3MoeConfig(
            **common,
            num_experts=recipe.num_experts,
            num_experts_per_tok=recipe.num_experts_per_tok,
            moe_intermediate_size=recipe.moe_intermediate_size,
            norm_topk_prob=recipe.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=recipe.router_aux_loss_coef,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: PLC0415 - transformers is heavy

        model = Qwen3ForCausalLM(Qwen3Config(**common))
    with torch.no_grad():
        for _name, p in model.named_parameters():  # tied lm_head is listed once (as embed_tokens)
            if p.dim() == 1:  # RMSNorm scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, recipe.init_std, generator=generator)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def describe(recipe: Recipe) -> str:
    """'Qwen3 3x128' or 'Qwen3-MoE 4x64, 8 experts top-2'."""
    if isinstance(recipe, MoeRecipe):
        return (
            f"Qwen3-MoE {recipe.num_layers}x{recipe.hidden_size}, {recipe.num_experts} experts "
            f"top-{recipe.num_experts_per_tok}"
        )
    return f"Qwen3 {recipe.num_layers}x{recipe.hidden_size}"


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


# ---- SFT data -----------------------------------------------------------------------------------
def encode_sft(tokenizer, prompts: Sequence[str], completions: Sequence[str]):
    """Right-padded SFT tensors for ``<bos> prompt completion <eos>``.

    Returns input_ids (N, L), attention_mask (N, L) and loss_mask (N, L): loss_mask[i, t] = 1 iff
    token t+1 is a completion token (completion or <eos>), i.e. position t predicts the completion.
    """
    p_ids = tokenizer(list(prompts))["input_ids"]  # each starts with <bos>
    a_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    seqs = [p + a + [tokenizer.eos_token_id] for p, a in zip(p_ids, a_ids)]
    L = max(map(len, seqs))
    n = len(seqs)
    input_ids = torch.full((n, L), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, L), dtype=torch.long)
    loss_mask = torch.zeros((n, L), dtype=torch.float32)
    for i, (p, s) in enumerate(zip(p_ids, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        loss_mask[i, len(p) - 1 : len(s) - 1] = 1.0  # positions predicting completion tokens and <eos>
    return input_ids, attention_mask, loss_mask


def sft_loss(model, input_ids, attention_mask, loss_mask, aux_coef: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over completion tokens (teacher forcing), plus ``aux_coef`` times the
    model's load-balancing loss when non-zero (a mixture-of-experts model). Shapes: all (B, L)."""
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, **({"output_router_logits": True} if aux_coef else {})
    )
    logits = out.logits  # (B, L, V)
    targets = input_ids[:, 1:]  # (B, L-1)
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none"
    ).view_as(targets)  # (B, L-1)
    m = loss_mask[:, :-1]
    loss = (nll * m).sum() / m.sum()
    return loss + aux_coef * out.aux_loss if aux_coef else loss


# ---- sampling (explicit generator; the GRPO trainer uses model.generate instead) ----------------
@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    batch_size: int = 512,
) -> list[str]:
    """Decode completions of left-padded prompts; ``temperature == 0`` means greedy.

    Positions follow the attention mask (cumsum - 1), as ``model.generate`` does with left padding.
    Keys and values are cached: one prompt pass, then one token per row per step.
    """
    model.eval()
    out: list[str] = []
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[start : start + batch_size]), padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]  # (B, P)
        n_prompt = ids.shape[1]
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        step_ids, cache = ids, None  # (B, P), then (B, 1)
        for _ in range(max_new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            res = model(
                input_ids=step_ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
            )
            cache, logits = res.past_key_values, res.logits[:, -1].float()  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            step_ids = nxt[:, None]
            ids = torch.cat([ids, step_ids], dim=1)
            mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
            done |= nxt == eos
            if bool(done.all()):
                break
        out += tokenizer.batch_decode(ids[:, n_prompt:], skip_special_tokens=True)
    return out


def accuracy(task, problems, completions: Sequence[str]) -> float:
    return sum(task.is_correct(c, p) for c, p in zip(completions, problems)) / max(len(problems), 1)


def max_completion_tokens(task, problems) -> int:
    """Longest reference completion in characters (= tokens, char level) + 1 for <eos>."""
    return max(len(task.solution(p)) for p in problems) + 1


# ---- the build ----------------------------------------------------------------------------------
def _split_validation(problems, val_size: int):
    """(sft, val): val = the first ``val_size`` distinct expressions; every copy of them leaves sft."""
    val, seen = [], set()
    for p in problems:
        if len(val) == val_size:
            break
        if p.prompt not in seen:
            seen.add(p.prompt)
            val.append(p)
    sft = [p for p in problems if p.prompt not in seen]
    return sft, val


def _lr_at(step: int, recipe: Recipe) -> float:
    """Linear warmup, then constant."""
    return recipe.lr * min(1.0, (step + 1) / max(recipe.warmup_steps, 1))


def train_sft(model, tokenizer, task, recipe: Recipe, seed: int, log: Callable[[str], None]) -> dict:
    """SFT until sampled validation accuracy reaches ``recipe.stop_at_sampled_acc`` (or max_steps)."""
    sft, val = _split_validation(task.train_problems(), recipe.val_size)
    rng = random.Random(seed * 1000 + 4)  # which way round each commutative step is written
    slips = random.Random(seed * 1000 + 5)  # which completions carry a slip, and which (its own generator:
    # a recipe without slips draws exactly what it drew before slips existed)
    completions = [
        task.solution(p, rng, slip=slips if recipe.sft_slip_rate and slips.random() < recipe.sft_slip_rate else None)
        for p in sft
    ]
    input_ids, attn, loss_mask = encode_sft(tokenizer, [p.prompt for p in sft], completions)
    max_new = max_completion_tokens(task, task.train_problems()) + 1
    g_batch = torch.Generator().manual_seed(seed * 1000 + 1)
    g_eval = torch.Generator().manual_seed(seed * 1000 + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)
    history, step, reached = [], 0, False
    t0 = time.perf_counter()
    while step < recipe.max_steps and not reached:
        model.train()
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, recipe)
        idx = torch.randint(0, input_ids.shape[0], (recipe.batch_size,), generator=g_batch)  # (B,)
        loss = sft_loss(model, input_ids[idx], attn[idx], loss_mask[idx], getattr(recipe, "router_aux_loss_coef", 0.0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        step += 1
        if step % recipe.eval_every == 0 or step == recipe.max_steps:
            comps = sample_completions(
                model, tokenizer, [p.prompt for p in val], max_new_tokens=max_new, temperature=1.0, generator=g_eval
            )
            acc = accuracy(task, val, comps)
            last_loss = float(loss.detach())
            history.append({"step": step, "loss": round(last_loss, 5), "val_sampled_acc": acc})
            log(
                f"  sft step {step:5d}  loss {last_loss:.4f}  val sampled acc {acc:.3f}"
                f"  ({time.perf_counter() - t0:.0f}s)"
            )
            reached = acc >= recipe.stop_at_sampled_acc
    return {
        "steps": step,
        "reached_target": reached,
        "history": history,
        "sft_examples": len(sft),
        "val_size": len(val),
        "max_new_tokens": max_new,
    }


def measure_test_accuracy(model, tokenizer, task, recipe: Recipe, seed: int) -> dict:
    """Sampled (T=1, ``test_samples_per_problem`` each) and greedy accuracy on the full test split."""
    test = list(task.test_problems())
    max_new = max_completion_tokens(task, task.train_problems()) + 1
    g = torch.Generator().manual_seed(seed * 1000 + 3)
    k = recipe.test_samples_per_problem
    rep = [p for p in test for _ in range(k)]
    sampled = accuracy(
        task,
        rep,
        sample_completions(
            model, tokenizer, [p.prompt for p in rep], max_new_tokens=max_new, temperature=1.0, generator=g
        ),
    )
    greedy = accuracy(
        task,
        test,
        sample_completions(
            model, tokenizer, [p.prompt for p in test], max_new_tokens=max_new, temperature=0.0, generator=None
        ),
    )
    n = len(rep)
    return {
        "test_sampled_acc": sampled,
        "test_sampled_n": n,
        "test_sampled_se": math.sqrt(max(sampled * (1 - sampled), 1e-12) / n),
        "test_greedy_acc": greedy,
        "test_greedy_n": len(test),
    }


FORMAT_INFO = {  # what clipbench_base.json says about the format (documentation for its readers)
    "answer": {"prompt": "<expression>=", "completion": "<integer><eos>", "example": "37+45= -> 82"},
    "steps": {
        "prompt": "<expression>=",
        "completion": "<left><op><right>=<result> ... #<integer><eos>",
        "example": "37+45-12= -> 37+45=82 82-12=70 #70",
        "commutative_steps": "either order",
    },
}


def _portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class 'PreTrainedTokenizerFast', which transformers 4.x and 5.x both load
    (5.x writes its own alias 'TokenizersBackend'), so a vLLM env with another version can read it."""
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _atomic_replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move ``tmp`` to ``out_dir``; an existing ``out_dir`` is swapped out first, then deleted."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        os.replace(out_dir, old / "x")
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_base_model(
    name: str = "arith-tiny",
    out_dir: str | Path | None = None,
    *,
    seed: int = 0,
    force: bool = False,
    log: Callable[[str], None] = print,
    recipe: Recipe | None = None,
) -> Path:
    """Train the tokenizer and the tiny Qwen3 of built-in model ``name`` and save them to ``out_dir``.

    ``name``: a key of ``BUILTIN_RECIPES`` (``builtin:`` prefix and the legacy 'arith' accepted).
    ``recipe`` defaults to the model's own (tests pass smaller ones). ``out_dir`` defaults to
    ``default_out_dir(name, seed)`` in the cache. An already built ``out_dir`` is returned untouched unless ``force``. Written
    atomically (temp dir beside it + ``os.replace``). Deterministic for a fixed seed and recipe on CPU
    (same weights twice).
    """
    name = recipe_name(name)
    recipe = recipe if recipe is not None else BUILTIN_RECIPES[name]
    arith = ArithTask(seed=seed, **recipe.task.knobs())
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(name, seed)
    if _is_built(out_dir) and not force:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.num_threads)
    try:
        train = arith.train_problems()
        tokenizer = build_tokenizer(
            [p.prompt for p in train] + [arith.solution(p) for p in train], alphabet=arith.alphabet
        )
        model = build_model(recipe, tokenizer, torch.Generator().manual_seed(seed))
        n_params = count_parameters(model)
        log(f"building {BUILTIN_PREFIX}{name}: {describe(recipe)}, {n_params} parameters, vocab {len(tokenizer)}")
        sft = train_sft(model, tokenizer, arith, recipe, seed, log)
        measured = measure_test_accuracy(model, tokenizer, arith, recipe, seed)
    finally:
        torch.set_num_threads(old_threads)
    build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    lo, hi = recipe.target_band
    in_band = lo <= measured["test_sampled_acc"] <= hi
    log(
        f"  test accuracy: sampled (T=1) {measured['test_sampled_acc']:.3f}, greedy "
        f"{measured['test_greedy_acc']:.3f}; {sft['steps']} steps in {build_s:.0f}s"
    )
    if not in_band:
        log(f"  WARNING: sampled accuracy outside the target band [{lo}, {hi}]")
    meta = {
        "name": BUILTIN_PREFIX + name,
        "task": {"name": arith.name, "seed": seed, **recipe.task.knobs()},
        "format": {**FORMAT_INFO[recipe.task.format], "bos_prepended": True, "char_level": True},
        "recipe": recipe_record(recipe),
        "seed": seed,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "sft": sft,
        "measured": {**measured, "target_band": list(recipe.target_band), "in_band": in_band},
        "build_seconds": round(build_s, 2),  # wall clock: grows when other processes share the cores
        "build_cpu_seconds": round(build_cpu_s, 2),  # CPU time of this process (one thread)
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the final dir gets the usual mode
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_class(tmp)
        meta["weights_sha256"] = weights_sha256(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _atomic_replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
