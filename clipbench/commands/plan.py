"""`clipbench plan RECIPE [key=value ...]`: the memory plan of a run per GPU, before anything loads.

    clipbench plan recipes/nsr_scale/qwen3_30b_a3b_grpo_r2.yaml             # on the recipe's 8 x H200
    clipbench plan recipes/abc_grpo_table3/qwen3_4b_grpo.yaml --gpu-memory 40 --json

The GPUs planned on are the recipe's (`launch.nproc_per_node`, `launch.gpu`, `launch.gpu_memory`)
unless --nproc-per-node / --nnodes / --gpu-memory say otherwise (80 GiB when neither says:
clipbench.memory.plan.target_hardware); the plan's first line says which and why.

Exit code: 0 when the run fits, 1 when it does not (the last line says by how much and which knob
to turn), 2 for bad input. The assumptions are listed in clipbench/memory/estimator.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from clipbench.config import load_run_config
from clipbench.errors import UserError
from clipbench.memory.estimator import MARGIN, MemoryPlan, advise, estimate, gib
from clipbench.memory.plan import Hardware, fit_message, setup_for, target_hardware
from clipbench.models import PROMPT_TOKENS, resolve_model_name
from clipbench.models.shapes import model_shape


def plan_command(
    recipe,
    overrides: list[str],
    *,
    nproc_per_node: int | None,
    nnodes: int,
    gpu_memory: float | None,
    prompt_tokens: int | None,
    json_out: bool,
) -> int:
    """Print the plan of RECIPE; return 0 when it fits, 1 when it does not."""

    prompt_tokens = PROMPT_TOKENS if prompt_tokens is None else prompt_tokens

    for key, v in {
        "--nproc-per-node": 1 if nproc_per_node is None else nproc_per_node,
        "--nnodes": nnodes,
        "--prompt-tokens": prompt_tokens,
    }.items():
        if v < 1:
            raise UserError(f"{key} must be >= 1, got {v}")
    check_gpu_memory(gpu_memory)
    cfg = load_run_config(recipe, overrides)
    hw = target_hardware(cfg, nproc_per_node=nproc_per_node, nnodes=nnodes, gpu_memory=gpu_memory)
    shape = model_shape(resolve_model_name(cfg.model.name))
    setup = setup_for(
        cfg, world_size=hw.nproc * hw.nnodes, device_gib=hw.gpu_gib, prompt_tokens=prompt_tokens, shape=shape
    )
    plan = estimate(shape, setup)
    knobs = [] if plan.fits else advise(shape, setup, nnodes=nnodes)
    if json_out:
        print(json.dumps(plan_json(plan, knobs, hw), indent=2))
    else:
        render(plan, knobs, hw)
    return 0 if plan.fits else 1


def check_gpu_memory(gpu_memory: float | None) -> None:
    """UserError for a --gpu-memory that is not a positive number of GiB (None: the recipe's)."""
    if gpu_memory is not None and not gpu_memory > 0:
        raise UserError(f"--gpu-memory must be > 0 (GiB), got {gpu_memory}")


def plan_json(plan: MemoryPlan, knobs: list[str], hw: Hardware) -> dict:
    return {
        "hardware": hw.as_dict(),
        "model": asdict(plan.shape),
        "params": plan.shape.n_params(),
        "active_params": plan.shape.n_active_params(),
        "setup": asdict(plan.setup),
        "rows": [{"name": r.name, "bytes": r.bytes, "phases": list(r.phases), "how": r.how} for r in plan.rows],
        "sampling_bytes": plan.phase_bytes("sampling"),
        "training_bytes": plan.phase_bytes("training"),
        "peak_phase": plan.peak_phase,
        "with_margin_bytes": plan.with_margin_bytes,
        "device_bytes": plan.device_bytes,
        "kv_cache_bytes": plan.kv_cache_bytes,
        "kv_sequences": plan.kv_sequences,
        "fits": plan.fits,
        "knobs": knobs,
        "host_bytes": plan.host_bytes,
    }


def render(plan: MemoryPlan, knobs: list[str], hw: Hardware) -> None:
    """The plan as a table, after one line naming the GPUs it is for and why."""
    s, u = plan.shape, plan.setup
    nproc, nnodes = hw.nproc, hw.nnodes
    con = Console(highlight=False)
    con.print(f"hardware: {hw.describe()}")
    mb_tokens, mb_rows, _ = u.micro_batch()
    moe = (
        f" ({s.n_active_params() / 1e9:.2f}B active: {s.num_experts} experts, {s.experts_per_tok} per token)"
        if s.is_moe
        else ""
    )
    title = (
        f"{s.name}: {s.n_params() / 1e9:.2f}B params{moe}, {u.dtype}, "
        f"{nproc} GPU{'s' if nproc > 1 else ''}"
        + (f" x {nnodes} nodes" if nnodes > 1 else "")
        + f" of {u.device_gib:g} GiB"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("per GPU")
    table.add_column("GiB", justify="right")
    table.add_column("sampling", justify="center")
    table.add_column("training", justify="center")
    table.add_column("how")
    for r in plan.rows:
        style = "dim" if not r.phases else None
        table.add_row(
            r.name,
            gib(r.bytes),
            "x" if "sampling" in r.phases else "",
            "x" if "training" in r.phases else "",
            r.how,
            style=style,
        )
    table.add_section()
    samp, train = plan.phase_bytes("sampling"), plan.phase_bytes("training")
    table.add_row("phase total", "", gib(samp), gib(train), f"peak: {plan.peak_phase}")
    table.add_row(
        f"peak + {MARGIN:.0%} margin", gib(plan.with_margin_bytes), "", "", f"device {u.device_gib:g} GiB", style="bold"
    )
    con.print(table)
    con.print(
        f"micro-batch: {mb_tokens:,} token positions ({mb_rows} x {u.seq_tokens} max: "
        f"{u.prompt_tokens} prompt + {u.max_new_tokens} new), checkpointing "
        f"{'on' if u.gradient_checkpointing else 'off'}; sampler {u.backend}"
        + (f", sleep mode {'on' if u.sleep_mode else 'off'}" if u.backend == "vllm" else "")
    )
    if plan.host_bytes:
        con.print(
            f"host memory: ~{gib(plan.host_bytes)} GiB per GPU's process ({gib(plan.host_bytes * nproc)} per node) "
            f"for sampler.lag={u.lag}: {u.lag + 1} float32 copies of its share of the parameters"
        )
    if plan.fits:
        con.print(f"[green]fits[/]: ~{gib(plan.with_margin_bytes)} of {u.device_gib:g} GiB per GPU")
    else:
        con.print(f"[red]does not fit[/]: {fit_message(plan, knobs, 'here').split(': ', 1)[1]}")
