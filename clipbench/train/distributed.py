"""Data parallelism for one run: which process does what, FSDP2 sharding, collectives, torchrun.

    dist = init_distributed(cfg.model.device)   # the one place that reads RANK / WORLD_SIZE
    dist.share(items)                           # this rank's contiguous block of a list
    shard_model(model, dist, compute_dtype)     # fully_shard per decoder block + root (N > 1)

Design choices
- One place knows the rank. `init_distributed` reads torchrun's environment once and returns a
  `Dist`; everything else receives it (or the rows it should handle) and never reads the environment
  or torch.distributed's globals. `Dist.block` is the one rule that splits work: a contiguous block
  of a sequence per rank.
- What a rank does. It samples a contiguous block of each round's prompts (whole groups, so a group's
  advantages never cross ranks), then every rank gathers the whole rollout (token ids and rewards:
  small next to the model), so every rank knows every mini-batch's composition and global counts
  without another collective, and trains a contiguous block of each mini-batch's rows. The global
  mini-batches are therefore exactly the single-process ones.
- Lockstep. FSDP all-gathers parameters in every forward and reduce-scatters gradients in every
  backward, so every rank runs the same number of forward/backward calls: a rank with fewer
  micro-batches runs empty ones (one token, zero mask: zero loss and gradient), and `generate` runs
  with synced_gpus=True (a finished rank keeps stepping until all are done).
- Gradients. FSDP averages gradients over ranks. Each rank's loss is normalised by the whole
  mini-batch's counts, so the right gradient is the sum over ranks: the loss is multiplied by the
  world size (`loss_scale`), which works on every backend (gloo has no PREMUL_SUM, which
  `set_gradient_divide_factor` needs).
- Sharding. `fully_shard` on every decoder block (the classes HF lists in `_no_split_modules`) and
  on the root (embeddings, final norm, tied head); float32 sharded master weights and optimizer
  state; with model.dtype bfloat16/float16 a MixedPrecisionPolicy computes in that dtype and reduces
  gradients in float32. Every rank loads the base weights on CPU before sharding (simple; it needs
  host memory for one full copy per local rank). Backends: nccl on CUDA, gloo on CPU.
- Launch. `torchrun_command` builds `python -m torch.distributed.run --standalone ...` (one node);
  across nodes, run torchrun yourself with its rendezvous flags and `-m clipbench train ...`.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as tdist

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """`model.device`: auto = cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(frozen=True)
class Dist:
    """This process's place in the run. World 1 (the default) means no process group at all."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        """Rank 0: the only process that writes the results store and the sink."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def loss_scale(self) -> float:
        """Multiplies each rank's loss so that FSDP's gradient average is the sum over ranks."""
        return float(self.world)

    def block(self, n: int, rank: int | None = None) -> range:
        """The positions of `n` items that `rank` (default: this one) handles: a contiguous block."""
        r = self.rank if rank is None else rank
        return range(r * n // self.world, (r + 1) * n // self.world)

    def share(self, items: Sequence[T]) -> Sequence[T]:
        b = self.block(len(items))
        return items[b.start : b.stop]

    def shares(self, items: Sequence[T]) -> list[Sequence[T]]:
        """Every rank's share, in rank order (to plan what the others do without asking them)."""
        return [items[b.start : b.stop] for b in (self.block(len(items), r) for r in range(self.world))]

    # collectives (no-ops in a single process)
    def gather(self, obj) -> list:
        """[rank 0's obj, rank 1's obj, ...] on every rank (picklable objects)."""
        if not self.sharded:
            return [obj]
        out: list = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.sharded:
            tdist.all_reduce(
                t, op={"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}[op]
            )
        return t

    def barrier(self) -> None:
        if self.sharded:
            tdist.barrier()


def under_torchrun() -> bool:
    """True in a process started by torchrun (it sets LOCAL_RANK and WORLD_SIZE)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> Dist:
    """This process's `Dist`, from torchrun's environment; initialises the process group when N > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else 1
    dev = resolve_device(device)
    if world == 1:
        return Dist(device=dev)
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not tdist.is_initialized():
        tdist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return Dist(rank=rank, world=world, device=dev)


def close_distributed() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def raise_on_sigterm() -> None:
    """torchrun stops the other ranks with SIGTERM when one dies: turn it into SystemExit so that a
    rank's `finally` / `except` blocks run (rank 0 marks the run failed). Engines without a
    preemption checkpoint only (the built-in loop's ranks take SIGTERM as a preemption request:
    train/preempt.py)."""

    def handler(signum, frame):
        raise SystemExit("stopped by SIGTERM (torchrun stops every rank when one of them fails)")

    signal.signal(signal.SIGTERM, handler)


# ----------------------------------------------------------------------------------------------
# FSDP2


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model (the classes in its `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise RuntimeError(f"{type(model).__name__}: no decoder blocks to shard (no _no_split_modules match)")
    return blocks


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype) -> torch.nn.Module:
    """`fully_shard` every decoder block, then the root, over all ranks of the process group.
    Parameters stay float32 (master weights); a lower `compute_dtype` is FSDP's param dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415 - torch is heavy

    mp = (
        MixedPrecisionPolicy()
        if compute_dtype == torch.float32
        else MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    )
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (e.g. clip_grad_norm_'s norm of sharded gradients); others unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ----------------------------------------------------------------------------------------------
# Launch


# How long torchrun waits for its ranks after passing them a signal before it kills them: a preempted
# rank finishes its optimizer step and writes a checkpoint in that time (torchrun's default is 30 s;
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT overrides it). A cluster's own grace period still bounds it.
SHUTDOWN_TIMEOUT_S = 600
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's own default list


def torchrun_command(nproc: int, module: str, args: Sequence[str], signals: Sequence[str] = ()) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE ARGS` (one node);
    torchrun passes `signals` (beyond its own list) on to the ranks and gives them SHUTDOWN_TIMEOUT_S."""
    handle = ",".join(dict.fromkeys([*TORCHRUN_SIGNALS, *signals]))
    timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={int(nproc)}",
        f"--signals-to-handle={handle}",
        f"--shutdown-timeout={timeout}",
        "-m",
        module,
        *args,
    ]
