"""`clipbench rehearse`: a dress rehearsal of a recipe on this machine, before GPUs are booked.

    result = rehearse("recipes/abc_grpo_table3/qwen3_4b_grpo.yaml", results_dir=Path("results"))
    result.parts        # every part of the recipe: ran as in the recipe / ran scaled (from -> to) / skipped (why)
    result.plan         # the real recipe's memory plan per GPU (clipbench plan)
    result.ok           # nothing that can run here failed

The recipe's own code path, end to end, shrunk (rehearse/scale.py says how): the same preflight as
`clipbench train` (clipbench.engines.preflight), `clipbench train` itself over the recipe's processes
(capped at 2 on a CPU), killed after its first checkpoint and resumed, its results store, MLflow
mirror and report checked, then the memory plan of the real recipe. Files go to
<results>/rehearse/<recipe>/: the generated model and data (local.py), the rehearsal's recipe.yaml,
its results store (results/), the two launches' logs and the report.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clipbench.errors import UserError
from clipbench.rehearse import run as steps
from clipbench.rehearse.scale import Machine, Part, rehearsal_config
from clipbench.tracking.files import check_writable_dir
from clipbench.yamlio import dump_yaml

__all__ = ["Rehearsal", "machine", "rehearse"]


@dataclass
class Rehearsal:
    recipe: str
    work: Path
    parts: list[Part]
    plan: object | None = None  # the real recipe's memory.estimator.MemoryPlan
    plan_note: str = ""  # why there is none, or the knobs that make it fit
    nproc: int = 1  # the real recipe's GPUs per node
    hardware: object | None = None  # the GPUs the plan is for: memory.plan.Hardware (which, and why)
    seconds: float = 0.0
    skipped: list[Part] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.how == "failed" for p in self.parts)

    def verdict(self) -> str:
        failed = [p for p in self.parts if p.how == "failed"]
        if failed:
            return (
                f"rehearsal FAILED ({self.seconds:.0f} s): "
                + "; ".join(f"{p.name}: {p.detail}" for p in failed)
                + f"; logs in {self.work}"
            )
        skipped = [p for p in self.parts if p.how == "skipped"]
        tail = f"; skipped here: {', '.join(p.name for p in skipped)}" if skipped else ""
        fits = (
            ""
            if self.plan is None
            else (
                " The real recipe fits its GPUs."
                if self.plan.fits
                else " The real recipe does NOT fit its GPUs (see the plan)."
            )
        )
        return f"rehearsal passed ({self.seconds:.0f} s): everything that can run here ran{tail}.{fits}"


def machine(world: int | None = None) -> Machine:
    """This machine: processes a run may use (--nproc-per-node, else 2 on a CPU, the GPUs on a GPU
    machine), CUDA, vllm importable."""
    # PLC0415, deferred: torch is heavy
    import torch  # noqa: PLC0415

    from clipbench.rollout.vllm_engine import is_available  # noqa: PLC0415

    cuda = torch.cuda.is_available()
    cap = world or (torch.cuda.device_count() if cuda else 2)
    return Machine(world_cap=cap, cuda=cuda, vllm=is_available())


def rehearse(
    recipe: str | Path,
    overrides: list[str] = (),
    *,
    nproc_per_node: int | None = None,
    results_dir: Path = Path("results"),
    tracking_uri: str | None = None,
    plugins: list[str] = (),
    gpu_memory: float | None = None,
    say: Callable[[str], None] = lambda msg: None,
) -> Rehearsal:
    """Rehearse `recipe` (see the module docstring); `say` receives progress lines; `gpu_memory`: the
    GiB of each of the real recipe's GPUs, for its memory plan (`clipbench plan --gpu-memory`; None:
    the recipe's launch.gpu_memory, else 80)."""

    # PLC0415, deferred: omegaconf is heavy
    from clipbench.config import load_run_config, run_id, to_dict  # noqa: PLC0415
    from clipbench.engines import preflight  # noqa: PLC0415
    from clipbench.rehearse.local import write_local  # noqa: PLC0415 - rehearse.local pulls in numpy
    from clipbench.tracking.mirror import default_tracking_uri  # noqa: PLC0415 - tracking.mirror pulls in torch

    t0 = time.time()
    real = load_run_config(recipe, list(overrides), plugins=plugins)  # ConfigError: one line, nothing written
    check_local_model(real.model.name)  # the rehearsal trains a random model: the recipe's own is checked here
    work = check_writable_dir(results_dir) / "rehearse" / Path(recipe).stem
    plan = rehearsal_config(to_dict(real), machine(nproc_per_node))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    say(f"rehearsing {recipe} in {work}")
    write_local(plan, work)
    results = work / "results"
    uri = tracking_uri or default_tracking_uri(results)
    plan.config["tracking"]["tracking_uri"] = None  # the command line's (or the embedded store) decides
    plan.add(
        "tracking",
        "as" if plan.config["tracking"]["mlflow"] else "skipped",
        f"MLflow at {uri}" if plan.config["tracking"]["mlflow"] else "tracking.mlflow is false",
    )
    small = work / "recipe.yaml"
    small.write_text(dump_yaml(plan.config))
    cfg = load_run_config(small)
    out = Rehearsal(str(recipe), work, plan.parts, nproc=real.launch.nproc_per_node)
    say("preflight")
    try:
        preflight(cfg, str(small))
        plan.add("preflight", "ran", "clipbench.engines.preflight, as clipbench train runs it")
    except Exception as e:  # noqa: BLE001 - the rehearsal reports it
        plan.add("preflight", "failed", str(e))
    if out.ok:
        run_dir = results / "train" / run_id(cfg)
        steps.train_kill_resume(plan, small, results, uri, run_dir, say)
        if out.ok:
            say("checking the results store, MLflow and the report")
            steps.check_store(plan, run_dir, uri)
            steps.check_report(plan, results, work / "report")
    memory_plan(out, real, gpu_memory)
    out.seconds = time.time() - t0
    return out


def memory_plan(out: Rehearsal, real, gpu_memory: float | None = None) -> None:
    """The real recipe's memory plan per GPU on its GPUs (its processes; `gpu_memory` GiB each, else
    the recipe's launch.gpu_memory, else 80: `memory.plan.target_hardware`), as `clipbench plan`
    computes it."""
    # PLC0415, deferred: torch is heavy
    from clipbench.memory.estimator import advise, estimate  # noqa: PLC0415
    from clipbench.memory.plan import setup_for, target_hardware  # noqa: PLC0415
    from clipbench.models import resolve_model_name  # noqa: PLC0415
    from clipbench.models.shapes import model_shape  # noqa: PLC0415

    try:
        shape = model_shape(resolve_model_name(real.model.name))
    except UserError as e:
        out.plan_note = f"no memory plan: {e}"
        return
    out.hardware = hw = target_hardware(real, gpu_memory=gpu_memory)  # the real recipe's processes
    out.nproc = hw.nproc
    setup = setup_for(real, world_size=hw.nproc, device_gib=hw.gpu_gib, shape=shape)
    out.plan = estimate(shape, setup)
    out.plan_note = "" if out.plan.fits else "; ".join(advise(shape, setup))


def check_local_model(name: str) -> None:
    """A recipe's model.name that is a local directory (or a built-in) must load as `clipbench train`
    would: its config and weights (UserError, one line, before anything is written). A hub id is not
    looked up here (no network is assumed)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.models import check_model_config, resolve_model_name  # noqa: PLC0415
    from clipbench.models.load import looks_local  # noqa: PLC0415

    if looks_local(resolve_model_name(name)):
        check_model_config(name)
