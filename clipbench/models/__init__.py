"""Models: which model a name means, how it loads, in which dtype it computes, its shape.

    resolve_model_name("builtin:arith-steps")     # a local directory (built-in models ship with the package)
    load_model_and_tokenizer(name, dtype, device)
    compute_dtype(cfg.model.dtype, device)        # what `auto` means, in one place
    model_shape(name)                             # layers, heads, parameters (Qwen3 shapes shipped)

The floor every package that touches a model reads (train, memory, rollout, eval); it imports
nothing of clipbench but errors. Building the built-in models is clipbench.basemodel's, above it.
"""

from clipbench.models.builtin import (
    BUILTIN_PREFIX,
    META_FILE,
    builtin_name,
    builtin_names,
    builtin_path,
    cache_root,
    read_build_info,
    weights_sha256,
)
from clipbench.models.dtype import DTYPES, compute_dtype, dtype_name
from clipbench.models.load import (
    PROMPT_TOKENS,
    check_model_config,
    first_line,
    is_moe,
    load_model_and_tokenizer,
    looks_local,
    resolve_model_name,
    text_config,
)
from clipbench.models.shapes import QWEN3, ModelShape, model_shape

__all__ = [
    "BUILTIN_PREFIX",
    "DTYPES",
    "META_FILE",
    "PROMPT_TOKENS",
    "QWEN3",
    "ModelShape",
    "builtin_name",
    "builtin_names",
    "builtin_path",
    "cache_root",
    "check_model_config",
    "compute_dtype",
    "dtype_name",
    "first_line",
    "is_moe",
    "load_model_and_tokenizer",
    "looks_local",
    "model_shape",
    "read_build_info",
    "resolve_model_name",
    "text_config",
    "weights_sha256",
]
