"""Every random draw of a run comes from a seed derived from (run seed, purpose, step, ...).

No global RNG state: each consumer builds its own stream, so a resumed run replays exactly what an
uninterrupted one would have drawn, and a draw never depends on how work is split over
micro-batches or processes (the parts name the draw, not the worker that makes it).
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts) -> int:
    """A 63-bit seed from (seed, purpose, step, ...): independent streams without global RNG state."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def generator(*parts, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded with derive_seed(*parts)."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))
