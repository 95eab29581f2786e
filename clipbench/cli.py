"""The `clipbench` command: a thin Typer app. Each verb parses its options and calls one function of
clipbench.commands (one module per verb: the only code that prints or parses flags)."""

from __future__ import annotations

import sys
import warnings
from functools import wraps
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated

import typer

from clipbench.errors import (
    RunFailed,
    RunPreempted,
    UserError,
    disk_reason,
    no_space_left,
    stop_exit_code,
)
from clipbench.tracking.store_format import STORE_FORMAT

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="clipbench: which clipping rule wins, where, and why. Ablations of GRPO-style policy-loss "
    "clipping rules with a built-in GRPO loop, MLflow tracking and Avg@k / Pass@k reports.",
)


def _version(value: bool) -> None:
    if value:
        try:
            v = version("clipbench")
        except PackageNotFoundError:  # run from a source tree that is not installed
            v = "unknown (not installed)"
        typer.echo(f"clipbench {v} (results store format {STORE_FORMAT})")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print the version and the results-store format, then exit.",
    ),
):
    """clipbench: which clipping rule wins, where, and why."""


from clipbench.commands.options import (  # noqa: E402  shared options, declared once
    GpuMemory,
    Overrides,
    Plugins,
    Recipe,
    ReportFormat,
    ResultsDir,
    TrackingUri,
)


def _load_plugins(plugins: list[str] | None) -> None:
    from clipbench.objectives.plugins import load_plugins  # noqa: PLC0415 - objectives pulls in torch

    load_plugins(plugins or [])


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


_RESERVE = [bytearray(4 << 20)]  # freed on a MemoryError, so that its one line can still be printed


def _user_errors(fn):
    """Bad input: one line on stderr, exit code 2. A run that failed for a stated reason: exit 1. A
    run preempted by a signal (checkpointed, resumable): exit 75. Warnings: one line."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        warnings.formatwarning = _one_line_warning
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except RunFailed as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        except RunPreempted as e:  # checkpointed and resumable: the same command with --resume continues
            typer.echo(f"preempted: {e}", err=True)
            raise typer.Exit(stop_exit_code(e.signal)) from None
        except OSError as e:  # a full disk outside a run (a manifest, a report): one line, exit 1
            if (full := no_space_left(e)) is None:
                raise
            typer.echo(f"error: {disk_reason(full)}{f' writing {e.filename}' if e.filename else ''}", err=True)
            raise typer.Exit(1) from None
        except MemoryError:  # a process-wide memory limit: one line (the reserve freed to print it)
            _RESERVE.clear()
            typer.echo(
                "error: out of memory (MemoryError): this process's memory limit (`ulimit -v`, a cgroup) is too "
                "small for it; raise it and rerun the same command (finished runs are kept, others resume)",
                err=True,
            )
            raise typer.Exit(1) from None

    return wrapper


@app.command("sweep")
@_user_errors
def sweep(
    file: Annotated[Path, typer.Argument(help="Sweep YAML, or a shipped sweep by name (clipbench recipes).")],
    overrides: Overrides = None,
    *,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; write nothing.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="With --dry-run: one JSON object per run.")] = False,
    results_dir: ResultsDir = Path("results"),
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Local worker processes.")] = 1,
    launcher: Annotated[
        str | None,
        typer.Option("--launcher", help="Hydra launcher plugin: joblib, submitit_slurm, submitit_local, ray, basic."),
    ] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Rerun runs that failed.")] = False,
    tracking_uri: TrackingUri = None,
    plugins: Plugins = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="builtin or trl: the engine of every run (engine=...); verl: each run as a verl command "
            "(--dry-run prints them).",
        ),
    ] = None,
):
    """Expand a declarative sweep into runs and execute them (resumable)."""
    # PLC0415, deferred: verbs load on use: `--help` stays light
    from clipbench.commands.sweep_start import finished_rerun, sweep_stage  # noqa: PLC0415

    plain = not (dry_run or json_out or launcher or engine) and jobs >= 1
    with sweep_stage(file) as stage:  # from the first second on a terminal: what it is doing
        if finished_rerun(
            file, overrides or [], results_dir=results_dir, plugins=plugins or [], plain=plain, stage=stage
        ):
            return
        from clipbench.commands.sweep import sweep_command  # noqa: PLC0415 - torch, through the expansion

        sweep_command(
            file,
            overrides,
            dry_run=dry_run,
            json_out=json_out,
            results_dir=results_dir,
            jobs=jobs,
            launcher=launcher,
            retry_failed=retry_failed,
            tracking_uri=tracking_uri,
            plugins=plugins,
            engine=engine,
            stage=stage,
        )


@app.command()
@_user_errors
def train(
    recipe: Recipe,
    overrides: Overrides = None,
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its last checkpoint."),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", help="Train over N processes (torchrun, FSDP2): launch.nproc_per_node=N."
    ),
    results_dir: ResultsDir = Path("results"),
    tracking_uri: TrackingUri = None,
    plugin: Plugins = None,
):
    """Run one training run end to end (over N processes with --nproc-per-node; under torchrun, one rank)."""
    from clipbench.commands.train import train_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    train_command(
        recipe,
        overrides or [],
        resume=resume,
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        nproc_per_node=nproc_per_node,
        plugins=plugin or [],
    )


@app.command()
@_user_errors
def plan(
    recipe: Recipe,
    overrides: Overrides = None,
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", help="GPUs per node (default: launch.nproc_per_node, else 1)."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes (FSDP shards over nproc x nnodes GPUs)."),
    gpu_memory: GpuMemory = None,
    prompt_tokens: int | None = typer.Option(
        None,
        "--prompt-tokens",
        help="Longest prompt assumed, tokens (default: clipbench's prompt "
        "room, clipbench.models.PROMPT_TOKENS; at most the model context "
        "less sampler.max_new_tokens).",
    ),
    json_out: bool = typer.Option(False, "--json", help="The plan as JSON."),
):
    """GPU memory per rank before anything loads (weights, AdamW, activations, vLLM); exit 1 if it won't fit."""
    from clipbench.commands.plan import plan_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    raise typer.Exit(
        plan_command(
            recipe,
            overrides or [],
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            gpu_memory=gpu_memory,
            prompt_tokens=prompt_tokens,
            json_out=json_out,
        )
    )


@app.command()
@_user_errors
def rehearse(
    recipe: Recipe,
    overrides: Overrides = None,
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", help="Processes for the rehearsal (default: the recipe's, at most 2 on a CPU)."
    ),
    gpu_memory: GpuMemory = None,
    results_dir: ResultsDir = Path("results"),
    tracking_uri: TrackingUri = None,
    plugin: Plugins = None,
):
    """A recipe's own code path end to end, shrunk to this machine: a model of its family, its task, sampler,
    processes, micro-batches, a checkpoint, a kill and a resume, evaluation, tracking; then its memory plan."""
    from clipbench.commands.rehearse import rehearse_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    raise typer.Exit(
        rehearse_command(
            recipe,
            overrides or [],
            nproc_per_node=nproc_per_node,
            results_dir=results_dir,
            tracking_uri=tracking_uri,
            plugins=plugin or [],
            gpu_memory=gpu_memory,
        )
    )


@app.command("eval")
@_user_errors
def eval_(
    model: str = typer.Option(..., "--model", help="HF name, local path, builtin:arith-tiny, or a run dir."),
    benchmarks: str = typer.Option("aime24,aime25,amc23", "--benchmarks", help="Comma-separated."),
    n: int = typer.Option(64, "--n", help="Samples per problem."),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Local copies of the benchmarks."),
    limit: int | None = typer.Option(None, "--limit", help="Problems per benchmark."),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens"),
    temperature: float = typer.Option(1.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    backend: str = typer.Option("auto", "--backend", help="auto | hf | vllm"),
    out: Path | None = typer.Option(None, "--out", help="Directory for the correctness matrices."),
    plugin: Plugins = None,
):
    """Avg@n and unbiased Pass@k of a model on benchmarks."""
    from clipbench.commands.eval import eval_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    _load_plugins(plugin)
    eval_command(
        model=model,
        benchmarks=benchmarks,
        n=n,
        data_dir=data_dir,
        limit=limit,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        backend=backend,
        out=out,
    )


@app.command()
@_user_errors
def report(
    sweep: str | None = typer.Argument(None, help="Sweep name (default: every sweep in the results dir)."),
    baseline: str | None = typer.Option(None, "--baseline", help="Method the Gain row compares against."),
    fmt: ReportFormat = "rich",
    results_dir: ResultsDir = Path("results"),
    out: Path | None = typer.Option(
        None, "--out", help="Output directory for files (default results/reports/<sweep>)."
    ),
    replicate: str | None = typer.Option(
        None,
        "--replicate",
        help="A second sweep (name, or path to its "
        "directory) every claim must replicate on, instead of the two halves "
        "of the seeds.",
    ),
    tune_on: str | None = typer.Option(
        None,
        "--tune-on",
        help="Read a learning-rate axis on this benchmark alone (a validation split, e.g. arith-val): "
        "each rule's best rate and lr*, the peak of its fitted curve.",
    ),
    replay: bool = typer.Option(
        True,
        "--replay/--no-replay",
        help="The replay section of a sweep whose runs recorded (every rule on their batches); "
        "--no-replay leaves it to `clipbench replay`.",
    ),
    plugin: Plugins = None,
):
    """Comparison tables (Table 3 layout), clip-quadrant table, claims (with whether they replicate) and plots."""
    from clipbench.commands.report import report_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    _load_plugins(plugin)
    report_command(
        sweep,
        baseline=baseline,
        fmt=fmt,
        results_dir=results_dir,
        out=out,
        replicate=replicate,
        tune_on=tune_on,
        replay=replay,
    )


@app.command()
@_user_errors
def replay(
    target: str = typer.Argument(..., help="A run directory, SWEEP/RUN_ID, or a sweep (name or directory)."),
    rules: str | None = typer.Option(
        "all",
        "--rules",
        help="all, sweep (the rules the target's runs trained), or rules with parameters and grids: "
        "grpo,dapo(eps_high=0.28,0.4),nsr(p=0.5).",
    ),
    steps: str | None = typer.Option(
        None,
        "--steps",
        help="Optimizer steps (as metrics.jsonl numbers them), e.g. 24,30-40; default every recorded one.",
    ),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line per (optimizer step, rule)."),
    fmt: ReportFormat = "rich",
    out: Path | None = typer.Option(None, "--out", help="Output directory (default results/reports/<sweep>/replay)."),
    draws: int = typer.Option(1, "--draws", help="Replays of each rule that draws random numbers (nsr): mean, sd."),
    top: int = typer.Option(5, "--top", help="Tokens where each rule departs most from the trained one, per step."),
    no_params: bool = typer.Option(False, "--no-params", help="Token level only (skip the recorded policy states)."),
    device: str = typer.Option("cpu", "--device", help="Where the parameter level runs the model (cpu, cuda)."),
    lr: str | None = typer.Option(
        None,
        "--lr",
        help="RULE=RATE,...: each named rule's look-ahead step at that learning rate (its own tuned rate) "
        "instead of the run's; 'sweep': each rule at the rate its own runs in the target trained at.",
    ),
    results_dir: ResultsDir = Path("results"),
    plugin: Plugins = None,
):
    """Counterfactual replay: every rule on the same recorded batches (train.record.every=N), vs the trained rule."""
    from clipbench.commands.replay import replay_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    _load_plugins(plugin)
    replay_command(
        target,
        rules=rules,
        steps=steps,
        json_out=json_out,
        results_dir=results_dir,
        fmt=fmt,
        out=out,
        draws=draws,
        top=top,
        params=not no_params,
        device=device,
        lr=lr,
    )


@app.command()
@_user_errors
def methods(
    words: list[str] | None = typer.Argument(
        None,
        help="A rule or correction: its full card; other words: the entries whose name, level, summary or source "
        "holds every one (sequence, verl). Default: every entry.",
    ),
    long: bool = typer.Option(False, "--long", help="The summaries in full, over lines (not cut at the width)."),
    plugin: Plugins = None,
):
    """Every registered clip rule and sampler correction by name, one line each; NAME's card: formula, parameters, source."""
    from clipbench.commands.methods import print_methods  # noqa: PLC0415 - verbs load on use: `--help` stays light

    _load_plugins(plugin)
    print_methods(words=words or [], wrap=long)


@app.command()
@_user_errors
def engines(
    words: list[str] | None = typer.Argument(
        None, help="Words of run-config keys (train.agg, sampler): those keys, each engine's treatment in full."
    ),
    long: bool = typer.Option(False, "--long", help="Every key and what each engine feeds the loss, in full."),
    fmt: str = typer.Option("rich", "--format", help="rich | markdown (docs/engines.md)"),
):
    """Every engine, and how it treats every run-config key: honoured, mapped (to what) or refused (why)."""
    from clipbench.commands.engines import engines_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    engines_command(fmt, words=words or [], long=long)


@app.command("base-model")
@_user_errors
def base_model(
    name: str = typer.Argument(
        "arith-tiny",
        help="Built-in model: arith-tiny (answer only), arith-steps "
        "(worked steps), arith-steps-moe (worked steps, a Qwen3-MoE "
        "of 8 experts, top-2); 'arith' is arith-tiny.",
    ),
    out: Path | None = typer.Option(None, "--out", help="Directory (default: <cache>/models/NAME-seedS)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when cached."),
    seed: int = typer.Option(0, "--seed"),
):
    """Rebuild a built-in base model (tokenizer + small Qwen3 or Qwen3-MoE, SFT on arith) from its recipe; runs train from
    the build shipped with clipbench (builtin:<name>), or from this one by path (model.name=DIR)."""
    # PLC0415, deferred: verbs load on use: `--help` stays light
    from clipbench.commands.base_model import base_model_command  # noqa: PLC0415

    base_model_command(name, out=out, seed=seed, force=force)


@app.command()
@_user_errors
def sync(
    sweep: str | None = typer.Argument(None, help="Sweep name (default: all)."),
    results_dir: ResultsDir = Path("results"),
    tracking_uri: TrackingUri = None,
    sink: str = typer.Option("mlflow", "--sink", help="The mirror to fill in: mlflow, wandb or tensorboard."),
):
    """Replay runs and metrics a mirror lacks (MLflow by default; after an outage, or to add a mirror)."""
    from clipbench.commands.sync import sync_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    sync_command(sweep, results_dir=results_dir, tracking_uri=tracking_uri, sink=sink)


@app.command()
@_user_errors
def recipes(
    words: list[str] | None = typer.Argument(
        None, help="Keep the entries whose name, scale or summary holds every word (gpu, cpu, table3, sweep)."
    ),
    show: str | None = typer.Option(None, "--show", help="Print one shipped recipe or sweep (to copy)."),
    long: bool = typer.Option(False, "--long", help="The full table, with the expected times."),
):
    """The recipes and sweeps shipped with clipbench, runnable by name from any directory: one line each."""
    from clipbench.commands.recipes import recipes_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    recipes_command(show, words or [], long)


@app.command()
@_user_errors
def init(
    directory: Path = typer.Argument(Path("."), help="Where to write the kit (created if missing)."),
    force: bool = typer.Option(False, "--force", help="Overwrite the kit's files if they exist."),
):
    """A starter kit to edit: a sweep over two rules and three seeds, a rule file, the next commands."""
    from clipbench.commands.init import init_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    init_command(directory, force=force)


@app.command()
@_user_errors
def doctor(
    results_dir: ResultsDir = Path("results"),
    tracking_uri: TrackingUri = None,
    json_out: bool = typer.Option(False, "--json", help="One JSON object per row."),
):
    """What this machine can run: torch, GPUs, vLLM, TRL, verl, the sampler and engines picked, MLflow,
    threads; with the command that fixes each missing piece."""
    from clipbench.commands.doctor import doctor_command  # noqa: PLC0415 - verbs load on use: `--help` stays light

    doctor_command(results_dir=results_dir, tracking_uri=tracking_uri, json_out=json_out)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
