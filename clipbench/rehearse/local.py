"""The local files a rehearsal runs on: a small model of the recipe's family, generated math problems
in the training loader's own format, generated benchmark files, and the micro-batch budget that
makes every mini-batch split.

    write_local(plan, work)      # fills plan.config's paths; writes work/model, work/data/...

Generated problems are arithmetic questions ("What is 37 + 45?" -> "82"), numbered, seeded; they
only have to be read, rendered, sampled and graded by the recipe's own code, not solved.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from clipbench.rehearse.scale import EVAL_PROBLEMS, EXPERTS, TOP_K, Plan
from clipbench.tasks import build_run_task
from clipbench.tasks.benchmarks import ARITH_SPLITS, get_benchmark
from clipbench.tasks.templates import render

TRAIN_PROBLEMS = 32
LAYERS, HIDDEN, HEAD_DIM, FFN = 2, 64, 32, 128  # the generated model (head_dim 32: vLLM's CPU kernels)
POSITIONS = 512  # room for a templated prompt of characters + completion


def questions(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` (question, answer) pairs of two-number arithmetic, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(2, 99, size=2))
        op = "+-*"[int(rng.integers(3))]
        out.append((f"What is {a} {op} {b}?", str({"+": a + b, "-": a - b, "*": a * b}[op])))
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_math_problems(path: Path, seed: int) -> list[tuple[str, str]]:
    """The training pool in the dapo schema (open-r1/DAPO-Math-17k-Processed's columns)."""
    qa = questions(TRAIN_PROBLEMS, seed)
    write_jsonl(
        path,
        [
            {
                "prompt": q,
                "solution": a,
                "data_source": "clipbench-rehearsal",
                "ability": "MATH",
                "reward_model": {"ground_truth": a, "style": "rule"},
                "extra_info": {"index": str(i)},
            }
            for i, (q, a) in enumerate(qa)
        ],
    )
    return qa


def write_benchmarks(data_dir: Path, names: list[str], seed: int) -> list[tuple[str, str]]:
    """Each benchmark's local file (`tasks.benchmarks`: its file name), in its schema: gsm8k
    question + answer ('#### n'), the others problem + answer."""

    out = []
    for k, name in enumerate(names):
        qa = questions(EVAL_PROBLEMS, seed + 1 + k)
        gsm = name == "gsm8k"
        write_jsonl(
            data_dir / get_benchmark(name).local_file,
            [
                {"id": i, "question": q, "answer": f"#### {a}"} if gsm else {"id": i, "problem": q, "answer": a}
                for i, (q, a) in enumerate(qa)
            ],
        )
        out += qa
    return out


def build_model(shape, corpus: list[str], out_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised model of `shape`'s family (its model_type, tied head, grouped-query
    attention when it has it; a mixture-of-experts family: EXPERTS experts of width FFN, TOP_K per
    token), shrunk, with a char tokenizer of `corpus` (clipbench.basemodel's)."""

    # PLC0415, deferred: torch is heavy
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: PLC0415

    from clipbench.basemodel.build import build_tokenizer  # noqa: PLC0415
    from clipbench.models.shapes import hf_config  # noqa: PLC0415

    tok = build_tokenizer(corpus)
    if shape.is_moe:
        shape = replace(
            shape, num_experts=min(EXPERTS, shape.num_experts), experts_per_tok=min(TOP_K, shape.experts_per_tok)
        )
    heads = HIDDEN // HEAD_DIM
    config = hf_config(
        shape,
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=1 if shape.num_kv_heads < shape.num_heads else heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=POSITIONS,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def write_local(plan: Plan, work: Path) -> None:
    """Write what `plan` generates under `work` and point its config at it."""

    cfg, seed = plan.config, plan.config["seed"]
    texts = []
    if plan.math_problems:
        path = work / "data" / "train.jsonl"
        texts += [render(cfg["task"]["template"], q) + a for q, a in write_math_problems(path, seed)]
        cfg["task"]["path"] = str(path)
    if plan.benchmarks:
        texts += [render("dapo", q) + a for q, a in write_benchmarks(work / "data", plan.benchmarks, seed)]
        cfg["eval"]["data_dir"] = str(work / "data")
        cfg["eval"]["benchmarks"] = [b for b in cfg["eval"]["benchmarks"] if b in plan.benchmarks or b in ARITH_SPLITS]
    if plan.generate_model is not None:
        cfg["model"]["name"] = str(build_model(plan.generate_model["shape"], texts, work / "model", seed))
    if plan.micro_batch_scaled:
        real, budget = cfg["train"]["micro_batch_tokens"], split_budget(cfg)
        (part,) = [p for p in plan.parts if p.name == "train.micro_batch_tokens"]
        part.detail = (
            f"{real} -> {budget}: below two rows of the shortest prompt, so each rank's share of every "
            "mini-batch runs as >= 2 micro-batches (checked after the run)"
        )
        cfg["train"]["micro_batch_tokens"] = budget


def split_budget(cfg: dict) -> int:
    """A micro-batch token budget no two rows fit in: 2 x (the shortest prompt + 1 token) - 1 (a
    micro-batch holds rows x the longest prompt + completion among them)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is heavy

    from clipbench.config import from_dict  # noqa: PLC0415 - config pulls in omegaconf
    from clipbench.models import resolve_model_name  # noqa: PLC0415 - models pulls in torch

    run = from_dict(cfg)
    tok = AutoTokenizer.from_pretrained(resolve_model_name(run.model.name))
    shortest = min(len(tok(p.prompt)["input_ids"]) for p in build_run_task(run).train_problems())
    return 2 * (shortest + 1) - 1
