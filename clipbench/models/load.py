"""Model names -> local directories -> (model, tokenizer): one code path for every model.

path = resolve_model_name("builtin:arith-steps")      # the shipped directory
model, tok = load_model_and_tokenizer("Qwen/Qwen3-1.7B-Base", dtype="bfloat16", device="cuda")
"""

from __future__ import annotations

import os
from pathlib import Path

from clipbench.errors import UserError, unknown_choice
from clipbench.models.attention import use_fast_attention
from clipbench.models.builtin import BUILTIN_PREFIX, builtin_names, builtin_path
from clipbench.models.dtype import DTYPES

# The longest prompt a run assumes, in tokens: the vLLM engine keeps this room beside the longest
# completion, the memory plan budgets for it, verl drops longer prompts (data.max_prompt_length).
PROMPT_TOKENS = 1024


def resolve_model_name(name: str) -> str:
    """``builtin:<name>`` -> its shipped directory; HF names and local paths unchanged."""
    if not isinstance(name, str) or not name:
        raise UserError(f"model.name: expected a non-empty string, got {name!r}")
    if not name.startswith(BUILTIN_PREFIX):
        return name
    short = name[len(BUILTIN_PREFIX) :]
    if short not in builtin_names():
        raise UserError(
            "model.name: " + unknown_choice("built-in model", name, [BUILTIN_PREFIX + n for n in builtin_names()])
        )
    return str(builtin_path(short))


def looks_local(name: str) -> bool:
    """A filesystem path rather than a hub id ('org/model'): absolute, ./ ../ ~ prefixed, or existing."""
    return os.path.isabs(name) or name.startswith(("./", "../", "~", ".\\")) or os.path.exists(name)


def load_model_and_tokenizer(name: str, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) for an HF name, a local path or a ``builtin:`` name; same code path for all.
    `dtype`: the weights' dtype (float32, bfloat16 or float16; resolve `auto` with models.dtype first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - transformers is heavy

    if dtype not in DTYPES:
        raise UserError("model.dtype: " + unknown_choice("dtype", dtype, DTYPES))
    path = resolve_model_name(name)
    if looks_local(path) and not Path(path).expanduser().is_dir():
        raise UserError(f"model.name: cannot load '{name}': no such directory {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"model.name: cannot load '{name}': {first_line(err)}") from None
    use_fast_attention(model)  # the same numbers as transformers' sdpa, without its key/value copies
    return model, tokenizer


def check_model_config(name: str) -> None:
    """UserError unless the model's config loads (cheap: no weights); `name` as in model.name."""
    from transformers import AutoConfig  # noqa: PLC0415 - transformers is heavy

    path = resolve_model_name(name)
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"model.name: cannot load '{name}': {first_line(err)}") from None
    local = Path(path).expanduser()
    if looks_local(path) and local.is_dir() and not any(next(local.glob(p), None) for p in WEIGHT_FILES):
        raise UserError(
            f"model.name: cannot load '{name}': {local} has a config.json but no weights ({', '.join(WEIGHT_FILES)})"
        )


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what from_pretrained loads (a sharded index names these)


def is_moe(name: str) -> bool:
    """Is model `name` (as in model.name) a mixture-of-experts model (its config names experts)?"""
    cfg = text_config(name)
    return bool(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None))


def text_config(name: str):
    """The transformers config of model `name` (its text model's, for a multimodal one)."""
    from transformers import AutoConfig  # noqa: PLC0415 - transformers is heavy

    cfg = AutoConfig.from_pretrained(resolve_model_name(name))
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def first_line(err: BaseException) -> str:
    """An exception's first line, or its type's name when it has no message."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
