"""Checkpoints: model (save_pretrained), optimizer, scheduler and trainer state in one directory.

Written to `checkpoints/.tmp-*` and swapped in with renames, so `checkpoints/last` is always a
complete checkpoint (a crash mid-save leaves the previous one, possibly as `checkpoints/prev`).
"""

from __future__ import annotations

import json
import os
import shutil
import secrets
from pathlib import Path

import torch

from clipbench.tracking.store import share_like_umask


def save_checkpoint(last: Path, *, model, tokenizer, optimizer, scheduler, state: dict) -> None:
    root = last.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # 0777 minus the umask, like every file in it (mkdtemp would make it 0700)
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    install_checkpoint(tmp, last)


def install_checkpoint(tmp: Path, last: Path) -> None:
    """Swap a complete checkpoint directory `tmp` (with its state.json) in as `last`, by renames only.
    Its files get the modes the umask gives first (safetensors writes 0600, mkdtemp makes 0700):
    colleagues read a shared results store."""
    share_like_umask(tmp)
    prev = last.parent / "prev"
    if prev.exists():
        shutil.rmtree(prev)
    if last.exists():
        os.replace(last, prev)
    os.replace(tmp, last)
    shutil.rmtree(prev, ignore_errors=True)


def find_checkpoint(last: Path) -> Path | None:
    """The newest complete checkpoint (`last`, else `prev` left by a crash mid-swap)."""
    for d in (last, last.parent / "prev"):
        if (d / "state.json").is_file():
            return d
    return None


def load_checkpoint(path: Path, *, optimizer, scheduler) -> dict:
    """Restores optimizer and scheduler in place; returns the trainer state. The model weights are
    loaded by the caller with from_pretrained(path / 'model')."""
    blob = torch.load(path / "optim.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    return json.loads((path / "state.json").read_text())
