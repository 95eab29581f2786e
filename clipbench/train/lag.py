"""Policy lag (`sampler.lag: k`): rollout step t is sampled by the policy as it was after rollout step
t - k (the first k steps by the oldest policy there is, the base model), as the stale workers of an
asynchronous trainer sample (AReaL's bounded staleness, prime-rl's async level, PipelineRL's lag).

    lag = PolicyLag(k)
    lag.observe(step, model)                     # before step t samples: the policy now is theta_t
    with lag.behaviour(step, model, sampler):    # theta_{max(0, t-k)} swapped into the model
        batch = collect_rollout(...)             # (and synced into a vLLM engine)
    # the model is theta_t again; the update trains theta_t on the stale batch

Design choices
- Snapshots, not stale workers: the last k + 1 policies are kept as copies of each parameter's local
  data (a shard under FSDP2) in host memory, and the behaviour policy is swapped into the training
  model for the rollout and swapped back after it, whatever happens inside. A sharded model drops
  its unsharded copies at each swap (FSDP2's root group keeps one from a forward to the next
  backward), so every forward gathers the shards that are in place. The hf sampler samples
  from the training model itself; a vLLM engine is synced with the swapped-in weights (and with the
  current ones again at the end of the update, as every run's engine is, so evaluation samples the
  current policy). The optimizer never sees the swap: it steps the parameters themselves.
- Exact and resumable: a snapshot is a bit-for-bit copy, so a lagged run samples what a run whose
  sampler really were k steps behind would. The snapshots belong to the checkpoint (`save` / `load`:
  torch.distributed.checkpoint, so a checkpoint of N processes resumes on M), and observing a step
  twice (a run stopped after its rollout samples it again on resume) keeps one snapshot of it.
- What the clip sees is the run's `sampler.old_logp`: `sampler`, the behaviour policy's log-probs (the
  ratio carries the whole staleness: slime, verl's asynchronous recipes); `recompute`, the current
  policy's before the update (AReaL's decoupled objective; the behaviour-to-current gap goes through
  `sampler.correction`). Either way the batch's staleness is logged (objectives/staleness.py).
- k = 0 swaps nothing and keeps nothing: every run from before the key existed computes as before.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from clipbench.train.checkpoint import one_process_ok

LAG_DIR = "lag"  # a checkpoint's snapshots: lag/<step>/ (torch.distributed.checkpoint)


@dataclass
class Snapshot:
    step: int  # the policy after this many rollout steps
    tensors: list[torch.Tensor]  # each parameter's local data, on the host, in `model.parameters()` order


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own data: its shard for an FSDP2 DTensor (storage shared under no_grad)."""
    return p.to_local() if hasattr(p, "to_local") else p


class PolicyLag:
    """The last k + 1 policies of a run with `sampler.lag: k`, and the swap of the oldest into the model."""

    def __init__(self, k: int):
        self.k = k
        self.snapshots: deque[Snapshot] = deque(maxlen=k + 1)

    @property
    def active(self) -> bool:
        return self.k > 0

    @torch.no_grad()
    def observe(self, step: int, model: torch.nn.Module) -> None:
        """Keep the policy before rollout step `step` samples (theta_step); one snapshot per step."""
        if not self.active:
            return
        if self.snapshots and self.snapshots[-1].step == step:
            return  # already kept (a rollout step sampled again after a stop): the same weights
        tensors = [_local(p).detach().to("cpu", copy=True) for p in model.parameters()]
        self.snapshots.append(Snapshot(step, tensors))

    def lag(self, step: int) -> int:
        """The lag of rollout step `step`: k, or fewer in the first k steps (the base model samples them)."""
        return step - self.snapshots[0].step if self.active else 0

    @contextlib.contextmanager
    def behaviour(self, step: int, model: torch.nn.Module, sampler):
        """The behaviour policy of rollout step `step` in `model` (and `sampler`) for the block; the
        current weights back in `model` after it, also when the block raises."""
        if not self.active:
            yield 0
            return
        params = list(model.parameters())
        current = [_local(p).detach().clone() for p in params]  # on the device: swapped back bit for bit
        try:
            self._load(self.snapshots[0].tensors, params, model)
            sampler.sync_weights(model)  # a vLLM engine's copy; the hf sampler samples from `model` itself
            yield self.lag(step)
        finally:
            self._load(current, params, model)

    @staticmethod
    @torch.no_grad()
    def _load(tensors: list[torch.Tensor], params: list[torch.Tensor], model: torch.nn.Module) -> None:
        for p, t in zip(params, tensors, strict=True):
            _local(p).copy_(t)
        _reshard(model)

    # ---- checkpoints ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The rollout steps whose policies are kept (a checkpoint's state.json lists them)."""
        return [s.step for s in self.snapshots]

    def save(self, path: Path, model: torch.nn.Module) -> None:
        """Every rank (collective): each snapshot as `path/lag/<step>/`, its tensors laid out as the
        model's parameters (a DTensor's shard as that shard of the global tensor)."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - torch.distributed.checkpoint is heavy

        names = [n for n, _ in model.named_parameters()]
        for snap in self.snapshots:
            state = {n: _as_param(t, p) for n, t, p in zip(names, snap.tensors, model.parameters(), strict=True)}
            with one_process_ok():
                dcp.save({"policy": state}, checkpoint_id=str(path / LAG_DIR / str(snap.step)))

    def load(self, path: Path, model: torch.nn.Module, steps: list[int]) -> None:
        """Every rank: the snapshots of `steps` from a checkpoint `save` wrote (any world size)."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - torch.distributed.checkpoint is heavy

        self.snapshots.clear()
        named = list(model.named_parameters())
        for step in steps:
            state = {n: _as_param(torch.empty_like(_local(p), device="cpu"), p) for n, p in named}
            with one_process_ok():
                dcp.load({"policy": state}, checkpoint_id=str(path / LAG_DIR / str(step)))
            self.snapshots.append(Snapshot(step, [_local(t).clone() for t in state.values()]))


def _reshard(model: torch.nn.Module) -> None:
    """Drop the unsharded copies FSDP2 keeps of a sharded model's parameters (the root group keeps its
    own from a forward to the next backward), so that the next forward gathers the shards as they are
    now. A model in one process has none."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - torch.distributed is heavy

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _as_param(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`local` (a host copy of `p`'s own data) laid out as `p`: a DTensor with p's mesh and placements
    for a sharded parameter, else itself."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch.distributed is heavy

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def snapshot_bytes(n_params: int, bytes_per_param: int, k: int) -> int:
    """Host memory the snapshots of `sampler.lag: k` hold: k + 1 copies of the parameters (a rank's
    shard of them under FSDP)."""
    return 0 if k == 0 else (k + 1) * n_params * bytes_per_param
