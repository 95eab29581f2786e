"""Building the built-in base models (`clipbench base-model NAME`): recipes and the SFT build.

    from clipbench.basemodel import build_base_model, BUILTIN_RECIPES
    build_base_model("arith-steps", out_dir, seed=0)

The models runs train from are the shipped builds (clipbench.models.builtin); this package rebuilds
them. It sits above models and tasks (it fine-tunes a model on the arith task) and below commands.
"""

from clipbench.basemodel.build import (
    BOS,
    EOS,
    PAD,
    UNK,
    build_base_model,
    build_model,
    build_tokenizer,
    default_out_dir,
    recipe_name,
)
from clipbench.basemodel.recipes import BUILTIN_RECIPES, DEFAULT_RECIPE, MoeRecipe, Recipe

__all__ = [
    "BOS",
    "BUILTIN_RECIPES",
    "DEFAULT_RECIPE",
    "EOS",
    "MoeRecipe",
    "PAD",
    "Recipe",
    "UNK",
    "build_base_model",
    "build_model",
    "build_tokenizer",
    "default_out_dir",
    "recipe_name",
]
