"""Preemption: a signal asks a run to stop at its next safe point, checkpointed and resumable.

    stop = StopRequest.install(["SIGTERM", "SIGUSR1"])  # SIGTERM and the run's launch.preempt_signal
    stop.agreed(dist)                                     # at a safe point: did any rank get one? (a collective)
    stop.restore(); stop.chain()                          # our handlers out; the previous handler runs

A cluster (SLURM) sends SIGTERM, or the signal a job asked for (`sbatch --signal=USR1@120`), some time
before it kills a job. The built-in loop checks at its safe points whether any rank received one:
the top of a rollout step and right after its sampling (nothing changed the weights yet: a checkpoint
of the step boundary; the samples are drawn again on resume, from the same weights and seeds), and
after every optimizer step (a checkpoint taken mid-rollout-step: the rollout batch, the rule's fixed
inputs, the next optimizer step's index and the partial statistics go with it, so the resumed run
continues that rollout step). Then the run's status is "preempted", the MLflow mirror is flushed and
the run raises `RunPreempted`; a resumed run equals an uninterrupted one (tests/test_preempt.py).

One flag per process, all-reduced at each safe point (MAX): every rank stops at the same point, also
when only one of them was signalled. SIGTERM of a rank because another rank died (torchrun stopping
the group) sets the flag too; the dead rank then makes the next collective fail, and the run fails.

`chain()`: a job scheduler's own handler of the signal (submitit's requeue, installed before the
run's) runs once the checkpoint is written, so the job is requeued and resumes the run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, fields

import torch

from clipbench.errors import RunPreempted
from clipbench.tracking.store import RunState
from clipbench.train.distributed import Dist

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")  # what `launch.preempt_signal` may name (SIGTERM always asks)
INTERRUPTS = ("SIGINT", "SIGHUP")  # Ctrl-C and a closed terminal: they stop a run at a checkpoint too
STOP_SIGNALS = SIGNALS + INTERRUPTS  # what a sweep and its idle workers keep: start no further run


def preempt_signals(cfg) -> list[str]:
    """The signals that ask this run to stop: SIGTERM, Ctrl-C's SIGINT, SIGHUP, its launch.preempt_signal, and submitit's
    when this process is a submitit job (its handler then requeues the job: `chain`)."""
    return sorted({"SIGTERM", *INTERRUPTS, cfg.launch.preempt_signal} | ({submitit_signal()} - {None}))


def submitit_signal() -> str | None:
    """The signal submitit sends a job before its time limit or on preemption (its requeue handler's),
    when this process is a submitit job; else None."""

    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")


class StopRequest:
    """Records the first of its signals; `agreed` turns it into a decision every rank shares."""

    def __init__(self, signums: tuple[int, ...] = (), forward=None):
        self.signums, self.forward = signums, forward
        self.received: int | None = None
        self.previous: dict[int, object] = {}

    @classmethod
    def install(cls, names, forward=None) -> StopRequest:
        """Handlers for `names` (SIGTERM, SIGUSR1, ...); `forward(signum)`: also pass each signal on
        (a launcher to its torchrun). A no-op outside the main thread (a signal handler can only be
        set there: a run in a thread is not preemptible)."""
        stop = cls(tuple(sorted({int(getattr(signal, n)) for n in names})), forward)
        if threading.current_thread() is threading.main_thread():
            for signum in stop.signums:
                stop.previous[signum] = signal.signal(signum, stop._handle)
                outer = _request_of(stop.previous[signum])
                if outer is not None and outer.received == signum and stop.received is None:
                    stop.received = signum  # asked before this run installed its handlers: stop at its first safe point
        return stop

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        if self.forward is not None:
            self.forward(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def agreed(self, dist: Dist) -> bool:
        """True on every rank when any rank received a signal (one small all-reduce when sharded)."""
        if not self.signums:  # no handlers (NO_STOP): never, on every rank alike
            return False
        if not dist.sharded:
            return self.received is not None
        flag = torch.tensor([float(self.received is not None)], device=dist.device)
        return bool(dist.all_reduce_(flag, "max").item())

    def restore(self) -> None:
        """Our handlers out. A signal we received is passed on to the request we were nested in (a
        sweep's, around its run's): a run that finished after a signal (say during its final
        evaluation) still tells the sweep to start nothing more."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
            outer = _request_of(handler)
            if outer is not None and self.received == signum and outer.received is None:
                outer.received = signum

    def chain(self) -> None:
        """Run the handler the received signal had before ours (a scheduler's requeue), if any."""
        handler = self.previous.get(self.received)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(self.received, None)


def _request_of(handler) -> StopRequest | None:
    """The StopRequest whose handler `handler` is (a request installed around ours), else None."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, StopRequest) else None


NO_STOP = StopRequest()  # never asked: runs started without handlers (a library call, a test)


# ----------------------------------------------------------------------------------------------
# A rollout step interrupted after an optimizer step: what its resumption needs


@dataclass
class Partial:
    """The state of a rollout step that stopped after `next` of its optimizer steps."""

    batch: object  # train.batch.RolloutBatch
    inputs: dict  # the rule's fixed inputs (train.step.StepInputs fields), on the CPU
    next: int  # index in the update's plan of the next optimizer step
    hist: torch.Tensor | None  # log-ratio counts of the steps done, summed over ranks
    mismatch: dict  # the rollout batch's mismatch metrics (logged on each of its rows)

    def to_save(self) -> dict:
        return {
            "batch": self.batch,
            "inputs": self.inputs,
            "next": self.next,
            "hist": self.hist,
            "mismatch": self.mismatch,
        }

    def step_inputs(self, cls, device):
        """The saved inputs as `cls` (StepInputs) on `device`."""
        names = {f.name for f in fields(cls)}
        return cls(
            **{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.inputs.items() if k in names}
        )


def cpu_inputs(inputs) -> dict:
    """A StepInputs' tensors on the CPU (every field: what a rule reads is what is saved)."""
    return {
        f.name: (v.detach().cpu() if isinstance(v := getattr(inputs, f.name), torch.Tensor) else v)
        for f in fields(inputs)
    }


def mark_preempted(trainer, step: int, stop: StopRequest) -> None:
    """Rank 0: status preempted (resumable) with where it stopped; then every rank raises."""
    if trainer.dist.main:
        trainer.rd.set_status(
            RunState.PREEMPTED,
            step=step,
            opt_step=trainer.state["opt_step"],
            signal=stop.name,
            preempted_at=time.time(),
            skipped_nonfinite=trainer.state["skipped_nonfinite"],
        )
    trainer.dist.barrier()
    raise RunPreempted(
        f"preempted by {stop.name} at rollout step {step} (optimizer step "
        f"{trainer.state['opt_step']}); a checkpoint was written",
        signal=stop.name,
    )
