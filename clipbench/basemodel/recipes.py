"""The recipes of the built-in base models: the arith task, the model's shape, the SFT settings.

``BUILTIN_RECIPES[name]`` is everything that determines built-in model ``name``; it is recorded in
the model's ``clipbench_base.json``. The weights clipbench trains from are shipped with the package
(clipbench.models.builtin); ``clipbench base-model NAME`` rebuilds them from these recipes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from clipbench.models.builtin import LEGACY_NAMES
from clipbench.registry import Registry
from clipbench.tasks.arith import ARITH_DEFAULTS, ArithKnobs


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the built model (recorded in ``clipbench_base.json``)."""

    task: ArithKnobs = ARITH_DEFAULTS  # the arith task the model is SFT'd on (seed: the build seed)
    target_band: tuple[float, float] = (0.15, 0.60)  # sampled (T=1) test accuracy that leaves GRPO signal
    # model (Qwen3 architecture)
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    init_std: float = 0.02
    # SFT
    batch_size: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 50
    grad_clip: float = 1.0
    max_steps: int = 4000
    eval_every: int = 50
    val_size: int = 256
    stop_at_sampled_acc: float = 0.30
    sft_slip_rate: float = 0.0  # steps format: share of SFT completions with one slip (tasks.arith.slipped_steps)
    # final measurement on the test split
    test_samples_per_problem: int = 4
    num_threads: int = 1  # fixed: CPU results depend on the thread count; 1 is also robust
    # when other processes share the cores


@dataclass(frozen=True)
class MoeRecipe(Recipe):
    """A Qwen3-MoE recipe: every decoder layer's MLP is ``num_experts`` SwiGLU experts of width
    ``moe_intermediate_size``, ``num_experts_per_tok`` of them routed per token (softmax, top-k,
    renormalised). A subclass, so the dense recipes' records stay as they were built."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0  # load-balancing loss added to the SFT loss (0: none)


# Recipe fields added after models were built and shipped, at the value that leaves a build unchanged:
# a record leaves them out at that value, so every shipped record still names its recipe.
ADDED_LATER = {"sft_slip_rate": 0.0}


def recipe_record(recipe: Recipe) -> dict:
    """The recipe as ``clipbench_base.json`` records it: every field, less ADDED_LATER's at their value."""
    out = dataclasses.asdict(recipe)
    return {k: v for k, v in out.items() if not (k in ADDED_LATER and v == ADDED_LATER[k])}


# builtin name -> its recipe. arith-tiny: today's answer-only model (its weights must never change:
# caches and tests rely on them). arith-steps: worked steps, calibrated in docs/studies/calibration.md.
BUILTIN_RECIPES: Registry[Recipe] = Registry("built-in model", also=LEGACY_NAMES)
BUILTIN_RECIPES.register("arith-tiny", Recipe())
BUILTIN_RECIPES.register(
    "arith-steps",
    Recipe(
        task=ArithKnobs(operands=3, format="steps"),
        target_band=(0.15, 0.40),
        batch_size=64,  # longer sequences than arith-tiny's: half the batch, same steps budget
        eval_every=25,
        stop_at_sampled_acc=0.25,
    ),
)
# arith-organism: the organism regime's base model (recipes/organism.yaml, docs/studies/organism.md). The
# same recipe as arith-steps (stopping at 30% sampled rather than 25%), but half of its SFT solutions carry one slip (a sum step's
# result off by 1 or 10, carried on to a wrong answer), as text written by people does: the model
# learns the right steps as the mode with mistakes around them, so it samples with more entropy
# than it needs and its greedy answer beats its sampled one, the room RL sharpens into.
BUILTIN_RECIPES.register(
    "arith-organism",
    dataclasses.replace(
        BUILTIN_RECIPES["arith-steps"], target_band=(0.15, 0.45), stop_at_sampled_acc=0.30, sft_slip_rate=0.5
    ),
)
# arith-steps-moe: the same task and stopping rule as arith-steps, on a tiny Qwen3-MoE (hidden 64 and
# head_dim 32, the smallest head vLLM's CPU attention serves; experts 64 wide, so the float32 weights
# stay under 2 MB as package data: 0.50M parameters, of which 0.39M in experts).
BUILTIN_RECIPES.register(
    "arith-steps-moe",
    MoeRecipe(
        task=ArithKnobs(operands=3, format="steps"),
        target_band=(0.15, 0.40),
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        batch_size=64,
        eval_every=25,
        stop_at_sampled_acc=0.25,
    ),
)
DEFAULT_RECIPE = BUILTIN_RECIPES["arith-tiny"]
