"""`clipbench base-model NAME [--seed S] [--out DIR] [--force]`: rebuild a built-in base model.

Prints the directory, the build's accuracy and the sha256 of its weights next to the shipped build's
(the same bytes only on a machine whose float arithmetic matches the one that built the shipped
weights: a CPU with other kernels builds a different model, clipbench.models.builtin).
"""

from __future__ import annotations

import sys
from pathlib import Path

from clipbench.basemodel import build_base_model, recipe_name
from clipbench.models import builtin_names, builtin_path, read_build_info


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def base_model_command(name: str, *, out: Path | None, seed: int, force: bool) -> Path:
    short = recipe_name(name)
    path = build_base_model(short, out, seed=seed, force=force, log=_to_stderr)
    info = read_build_info(path)
    shipped = read_build_info(builtin_path(short)) if short in builtin_names() else {}
    same = shipped.get("weights_sha256") == info.get("weights_sha256")
    _to_stderr(
        f"sha256 of the weights {info.get('weights_sha256')}; the shipped builtin:{short} "
        f"(seed {shipped.get('seed')}) is {shipped.get('weights_sha256')}: "
        + ("the same bytes" if same else f"a different model; train on this one with model.name={path}")
    )
    print(path)
    return path
