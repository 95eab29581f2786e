"""Records from a loss hook (TRL's `ClipbenchGRPOTrainer`, the registered verl losses), for `clipbench replay`.

    rec = LossRecorder(run_dir / "record", max_mb=1024, meta={"engine": "trl", "objective": {...}, ...})
    rec.add(opt_step, mini_batch, {"logp": ..., "old_logp": ..., "mask": ..., "advantages": ...}, tokens, seqs, loss)
    rec.write(step)                       # one record (tracking.records layout) of everything added since the last

A loss hook sees micro-batches, not the trainer's plan: each added micro-batch becomes a block of rows
of the record (padded to the record's widest), one slot, and its optimizer step's entry lists it as
one micro-batch of one rank at its own width, with the global counts the hook passed to
`policy_loss`, so the replay repeats the hook's arithmetic. `loss` (the hook's own loss, summed per
optimizer step) is kept in the index: the trained rule's replay reproduces it. Records stop once the
directory would pass `max_mb`. What a hook does not see is not recorded (TRL: rewards and prompt
groups; verl: token ids, so no text): docs/replay.md lists it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clipbench.tracking.records import install_record, records_bytes, staging_dir

SLOT = ("logp", "entropy", "uniforms")  # tensors kept per slot (one slot here)


class LossRecorder:
    def __init__(self, root: str | Path, *, max_mb: float, meta: dict, suffix: str = ""):
        self.root, self.max_bytes, self.meta, self.suffix = Path(root), max_mb * (1 << 20), meta, suffix
        self.micro: list[tuple[int, int, dict, float, float]] = []
        self.losses: dict[int, float] = {}
        self.full = False

    def add(self, opt_step: int, mini_batch: int, tensors: dict, tokens, seqs, loss) -> None:
        """One micro-batch: (b, T) / (b,) tensors (copied to the host), its global counts and loss."""
        if self.full:
            return
        host = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items() if v is not None}
        count = lambda c: None if c is None else float(c)  # noqa: E731 - None: the call's own count
        self.micro.append((opt_step, mini_batch, host, count(tokens), count(seqs)))
        self.losses[opt_step] = self.losses.get(opt_step, 0.0) + float(loss)

    def write(self, step: int) -> Path | None:
        """Everything added since the last write as the record `step_<step>` (None when empty or over budget)."""
        micro, losses = self.micro, self.losses
        self.micro, self.losses = [], {}
        if not micro or self.full:
            return None
        tensors, opt_steps = assemble(micro)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if records_bytes(self.root.parent) + size > self.max_bytes:
            self.full = True
            return None
        for o in opt_steps:
            o["hook_loss"] = losses.get(o["opt_step"])
        name = f"step_{int(step):06d}{self.suffix}"
        return install_record(
            staging_dir(self.root, name), {**self.meta, "step": step, "slots": 1, "opt_steps": opt_steps}, tensors
        )


def assemble(micro: list) -> tuple[dict, list[dict]]:
    """Rows of every micro-batch stacked (padded to the widest), and the optimizer steps' entries."""
    T = max(m[2]["mask"].shape[1] for m in micro)
    names = [k for k in micro[0][2] if all(k in m[2] for m in micro)]
    rows, opt_steps, start = {k: [] for k in names}, [], 0
    for opt_step, mini_batch, t, tokens, seqs in micro:
        b, w = t["mask"].shape
        for k in names:
            x = t[k]
            rows[k].append(torch.nn.functional.pad(x, (0, T - x.shape[1])) if x.dim() == 2 else x)
        entry = {"rows": list(range(start, start + b)), "width": w}
        if not opt_steps or opt_steps[-1]["opt_step"] != opt_step:
            opt_steps.append(
                {
                    "opt_step": opt_step,
                    "epoch": 0,
                    "mini_batch": mini_batch,
                    "rows": [],
                    "ranks": [[]],
                    "global_tokens": tokens,
                    "global_seqs": seqs,
                }
            )
        opt_steps[-1]["rows"] += entry["rows"]
        opt_steps[-1]["ranks"][0].append(entry)
        start += b
    out = {k: torch.cat(v) for k, v in rows.items()}
    for k in SLOT:
        if k in out:
            out[k] = out[k].unsqueeze(0)  # (1, R, T): one slot
    out["mask"] = (out["mask"] != 0).to(torch.uint8)
    return out, opt_steps
