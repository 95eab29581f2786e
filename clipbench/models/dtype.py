"""What `model.dtype` means, in one place.

    compute_dtype("auto", torch.device("cuda"))   # bfloat16 on a GPU that supports it, else float32

`model.dtype` is the compute dtype of a run: float32 master weights always; bfloat16 / float16 run
the forward passes in that dtype (autocast in one process, FSDP's parameter dtype when sharded) and
the sampler in it. `auto` is bfloat16 on a CUDA device that supports it and float32 everywhere else
(CPU kernels in bfloat16 are slower than float32 and round the small models' log-probs).
"""

from __future__ import annotations

import torch

from clipbench.errors import UserError, unknown_choice

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = (*DTYPES, "auto")


def compute_dtype(name: str, device: torch.device | str, *, bf16_supported: bool | None = None) -> torch.dtype:
    """The torch dtype of `model.dtype` on `device`. `bf16_supported`: whether the CUDA device
    runs bfloat16 (None: ask torch; a plan for a GPU this machine does not have passes True)."""
    if name == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        if bf16_supported is None:
            bf16_supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16_supported else torch.float32
    if name not in DTYPES:
        raise UserError("model.dtype: " + unknown_choice("dtype", name, CHOICES))
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (the config's spelling)."""
    return str(dtype).removeprefix("torch.")
