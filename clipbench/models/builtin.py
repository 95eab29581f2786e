"""The built-in base models, shipped with the package: the same bytes on every machine.

    builtin:arith-tiny    a char-level Qwen3 fine-tuned on arith, answer format: "37+45=" -> "82"
    builtin:arith-steps   ... on arith in the worked-steps format: "37+45-12=" -> "37+45=82 82-12=70 #70"
    builtin:arith-steps-moe  the same task on a char-level Qwen3-MoE (8 experts, top-2, 0.50M parameters)
    builtin:arith-organism   arith-steps' task and model, SFT on solutions half of which carry a slip: the
                             base of the organism regime (recipes/organism.yaml)

Each is a Hugging Face model directory under ``clipbench/models/weights/<name>/`` (weights,
config, tokenizer) with ``clipbench_base.json``, the record of its build (the arith task it was
fine-tuned on, the recipe, the measured accuracies, the machine). It is loaded like any HF model.
Why shipped rather than built on first use: the build's floating-point arithmetic differs between
CPUs, so a rebuild on another machine is a different model, and every result trained from it
moves with it. ``clipbench base-model NAME`` (clipbench.basemodel) still rebuilds one from its
recipe, into a directory of its own; every run records the sha256 of the weights it started from
(:func:`weights_sha256`), so a report can tell when runs did not start from the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

from clipbench.errors import UserError, unknown_choice

BUILTIN_PREFIX = "builtin:"
META_FILE = "clipbench_base.json"  # the build record, beside the weights
SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
LEGACY_NAMES = {"arith": "arith-tiny"}  # `clipbench base-model arith` predates arith-steps
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def builtin_names() -> tuple[str, ...]:
    """The built-in models this package ships (one directory each under models/weights/)."""
    return tuple(sorted(d.name for d in SHIPPED_DIR.iterdir() if (d / META_FILE).is_file()))


def builtin_name(name: str) -> str:
    """A built-in model's short name from 'arith-steps', 'builtin:arith-steps' or the legacy 'arith'."""
    short = name[len(BUILTIN_PREFIX) :] if name.startswith(BUILTIN_PREFIX) else name
    short = LEGACY_NAMES.get(short, short)
    if short not in builtin_names():
        raise UserError(unknown_choice("built-in model", name, [*builtin_names(), *LEGACY_NAMES]))
    return short


def builtin_path(name: str) -> Path:
    """The shipped directory of built-in model `name` ('arith-steps' or 'builtin:arith-steps')."""
    return SHIPPED_DIR / builtin_name(name)


def read_build_info(path: str | Path) -> dict:
    """The ``clipbench_base.json`` a build wrote ({} for a model that clipbench did not build)."""
    p = Path(path) / META_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


def cache_root() -> Path:
    """``$CLIPBENCH_CACHE`` or ``~/.cache/clipbench``: where rebuilt base models go by default."""
    env = os.environ.get("CLIPBENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clipbench"


def weights_sha256(path: str | Path) -> str | None:
    """sha256 of a model directory's weight files (names sorted; each file's name and bytes), or
    None when `path` is not a local directory holding weights (a hub id not in the local cache)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None
    files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return None
    return _sha256_files(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@lru_cache(maxsize=64)
def _sha256_files(files: tuple[tuple[str, int, int], ...]) -> str:
    """(path, size, mtime) keys the cache: a file rewritten in place is hashed again."""
    h = hashlib.sha256()
    for name, _, _ in files:
        h.update(Path(name).name.encode() + b"\0")
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
