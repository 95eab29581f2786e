"""GPU benchmark: a full GRPO step on a randomly initialised Qwen3-1.7B-shaped model.

    .venv/bin/python bench/bench_gpu.py [--max-new 512] [--prompts 16] [--group 8] [--steps 3] [--warmup 1]
                                        [--peak-tflops X] [--out results/bench/gpu.json]

CUDA only: without a GPU it prints one line saying it is skipped, writes {"skipped": reason} and
exits 0 (`make bench` runs it everywhere; nothing requires a GPU).

The model: transformers' Qwen3ForCausalLM with Qwen3-1.7B's shape (28 layers, hidden 2048, MLP 6144,
16/8 heads of 128, vocabulary 151,936, tied embeddings; 1,720,574,976 parameters), random
weights (seeded), saved once to a temporary directory with a synthetic tokenizer: the built-in arith
models' character-level tokenizer whose vocabulary is padded with filler tokens to 151,936, so that
every id the random model samples decodes (HF, vLLM and TRL all detokenize). Random weights almost
never sample <eos> (1 in 151,936), so every completion runs to `--max-new` tokens: the step's work is
fixed and the same on every arm. Prompts are the arith task's (~10 tokens), rewards are 0 (the
update still runs every forward and backward; advantages are 0).

The run config (recipes/quickstart.yaml with overrides): bfloat16 compute over float32 master
weights, gradient checkpointing, P prompts x G samples, 4 mini-batches of P*G/4 sequences, 1 epoch,
old log-probs recomputed, micro-batches of 4 sequences (train.micro_batch_tokens = 4 x (longest
prompt + max-new); TRL: trl.gradient_accumulation_steps = P*G/4/4), no evaluation. Arms, each in its
own subprocess (a fresh CUDA context and allocator, so one arm's memory never slows the next):
  clipbench/vllm   the built-in loop sampling with vLLM (when vLLM is installed; colocated, sleep off)
  clipbench/hf     the built-in loop sampling with HF `generate`
  trl/<backend>    TRL's GRPOTrainer on the same run config (`engine: trl`, clipbench.engines.trl),
                   with vLLM colocated when clipbench's primary arm uses it, else HF generate
A step's wall time runs from one progress callback to the next (the first `--warmup` excluded); an
arm ends its process right after its last measured step, so the final checkpoint (~20 GB of
weights and AdamW state) is never written.

Reported per arm: s/step; tokens/s/GPU of the step (prompt + completion tokens of the rollout
batch / step time); for clipbench also of the update alone (the same tokens x epochs / time/update)
and the sampler's completion tokens/s (completion tokens / time/sample: vLLM vs HF generate); the
update's MFU = 6 N tokens x epochs / time/update / peak bf16 dense FLOP/s of the GPU (N = all
parameters, the tied head counted once; the old log-prob forward (2 N per token) and gradient
checkpointing's recomputation are not counted, as usual for MFU, so it is conservative); peak from
PEAK_BF16_TFLOPS by device name, or --peak-tflops. And clipbench/TRL ratio of s/step.

Writes results/bench/gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "quickstart.yaml"
# Qwen3-1.7B's config.json (the architecture fields); weights here are random
QWEN3_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# the same structure at a size that builds in a second on a CPU (tests of this script)
QWEN3_TINY = dict(
    QWEN3_1_7B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
    max_position_embeddings=512,
)
SHAPES = {"1.7b": QWEN3_1_7B, "tiny": QWEN3_TINY}
# dense bf16 tensor-core peak, TFLOP/s (vendor datasheets); matched in order against the device name
PEAK_BF16_TFLOPS = (
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
)
ROWS_PER_MICRO = 4
MINI_BATCHES = 4


def skip_reason() -> str | None:
    """Why this benchmark cannot run here (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """Dense bf16 peak of `device_name` (None when unknown and not given)."""
    if override:
        return override
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def synthetic_tokenizer(vocab_size: int):
    """The built-in char-level tokenizer, its vocabulary padded with filler tokens to `vocab_size`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from clipbench.basemodel import BOS, EOS, PAD, UNK, build_tokenizer

    base = build_tokenizer([])
    spec = json.loads(base.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < the base tokenizer's {len(vocab)}")
    vocab.update({f"<f{i}>": i for i in range(len(vocab), vocab_size)})
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )


def build_model_dir(shape: dict, path: Path, seed: int = 0) -> int:
    """A randomly initialised Qwen3 of `shape` and its tokenizer saved to `path` (bfloat16 weights:
    half the disk; training loads float32 master weights). Returns the parameter count."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok = synthetic_tokenizer(shape["vocab_size"])
    config = Qwen3Config(
        **shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(seed)  # transformers' init draws from the global generator: fixed here, before any run
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # init on the GPU: seconds, not minutes
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def run_config(
    model_dir: Path,
    *,
    backend: str,
    engine: str,
    prompts: int,
    group: int,
    max_new: int,
    steps: int,
    device: str = "cuda",
    dtype: str = "bfloat16",
):
    """The benchmark's run config (see the module docstring)."""
    from clipbench.config.load import load_run_config
    from clipbench.tasks import build_run_task

    base = load_run_config(RECIPE, [])
    longest_prompt = max(len(p.prompt) for p in build_run_task(base).train_problems()) + 1  # chars + <bos>
    rows = prompts * group // MINI_BATCHES
    overrides = [
        f"model.name={model_dir}",
        f"model.device={device}",
        f"model.dtype={dtype}",
        "model.gradient_checkpointing=true",
        f"sampler.backend={backend}",
        f"sampler.max_new_tokens={max_new}",
        f"sampler.group_size={group}",
        "sampler.old_logp=recompute",
        "sampler.gpu_memory_utilization=0.3",
        f"train.prompts_per_step={prompts}",
        f"train.mini_batches={MINI_BATCHES}",
        "train.epochs=1",
        f"train.steps={steps}",
        f"train.micro_batch_tokens={ROWS_PER_MICRO * (longest_prompt + max_new)}",
        "train.checkpoint_every=1000000",
        "train.warmup_steps=0",
        "eval.benchmarks=[]",
        "eval.at_start=false",
        "tracking.mlflow=false",
        f"engine={engine}",
    ]
    if engine == "trl":
        overrides.append(f"+trl.gradient_accumulation_steps={max(1, rows // ROWS_PER_MICRO)}")
        if backend == "vllm":
            overrides.append("+trl.vllm_mode=colocate")
    return load_run_config(RECIPE, overrides)


def prompt_tokens_mean(cfg) -> float:
    """Mean prompt length in tokens over the run's training problems (the arith prompts, + <bos>)."""
    from clipbench.tasks import build_run_task

    problems = list(build_run_task(cfg).train_problems())[:2000]
    return statistics.fmean(len(p.prompt) + 1 for p in problems)


# ----------------------------------------------------------------------------------------------
# One arm, in its own process


def run_arm(arm: str, model_dir: Path, args, out: Path) -> None:
    """Train `arm` ("clipbench/vllm", "clipbench/hf", "trl/vllm", "trl/hf") for warmup + steps
    rollout steps; write the per-step figures to `out` and end the process after the last one."""
    import torch

    from clipbench.tracking.sink import NullSink

    engine, backend = arm.split("/")
    cfg = run_config(
        model_dir,
        backend=backend,
        engine="builtin" if engine == "clipbench" else "trl",
        prompts=args.prompts,
        group=args.group,
        max_new=args.max_new,
        steps=args.warmup + args.steps,
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
    )
    rows: dict[int, dict] = {}
    walls: list[float] = []
    clock = {"t": None}

    class Sink(NullSink):
        def log_params(self, params: dict) -> None:
            clock["t"] = time.perf_counter()

        def log_metrics(self, step: int, metrics: dict) -> None:  # one row per optimizer step: keep the first
            if "step" in metrics:
                row = rows.setdefault(metrics["step"], {})
                for k in ("time/sample", "time/score", "time/update", "response_length/mean"):
                    if k in metrics:
                        row.setdefault(k, metrics[k])

    def progress(info: dict) -> None:
        t = time.perf_counter()
        if clock["t"] is not None:
            walls.append(t - clock["t"])
        clock["t"] = t
        if info["step"] == cfg.train.steps:
            result = {
                "arm": arm,
                "per_step_wall": walls,
                "per_step": [rows[s] for s in sorted(rows)],
                "max_memory_allocated_GiB": torch.cuda.max_memory_allocated() / 2**30
                if torch.cuda.is_available()
                else None,
                "prompt_tokens_mean": prompt_tokens_mean(cfg),
                "rows": cfg.train.prompts_per_step * cfg.sampler.group_size,
                "epochs": cfg.train.epochs,
                "micro_batch_tokens": cfg.train.micro_batch_tokens,
                "trl": dict(cfg.trl),
            }
            out.write_text(json.dumps(result, indent=2) + "\n")
            sys.stdout.flush()
            os._exit(0)  # no final checkpoint: the measurement is done

    with tempfile.TemporaryDirectory(prefix="bench_gpu_run_") as run_dir:
        if engine == "clipbench":
            from clipbench.train.loop import run_training

            run_training(cfg, Path(run_dir) / "run", sink=Sink(), progress=progress)
        else:
            from clipbench.engines.trl import run_trl

            # the first step's wall then also counts TRL's set-up: it is a warm-up step
            clock["t"] = time.perf_counter()
            run_trl(cfg, Path(run_dir) / "run", sink=Sink(), progress=progress)
    raise RuntimeError(f"{arm}: the run ended without reaching step {cfg.train.steps}")


# ----------------------------------------------------------------------------------------------
# Summary


def summarize(res: dict, n_params: int, warmup: int, peak: float | None) -> dict:
    wall = res["per_step_wall"][warmup:]
    rows = res["per_step"][warmup:]
    s_step = statistics.median(wall)
    completion = (
        statistics.fmean(r["response_length/mean"] for r in rows)
        if rows and "response_length/mean" in rows[0]
        else None
    )
    out = {"s_per_step": s_step, "steps": len(wall), "max_memory_allocated_GiB": res["max_memory_allocated_GiB"]}
    if completion is not None:
        tokens = res["rows"] * (res["prompt_tokens_mean"] + completion)  # tokens of the rollout batch
        out.update(completion_tokens_mean=completion, step_tokens=tokens, step_tokens_per_s=tokens / s_step)
        if "time/update" in rows[0]:
            t_update = statistics.median(r["time/update"] for r in rows)
            t_sample = statistics.median(r["time/sample"] for r in rows)
            trained = tokens * res["epochs"]
            out.update(
                update_s=t_update,
                sample_s=t_sample,
                update_tokens_per_s=trained / t_update,
                sampler_completion_tokens_per_s=res["rows"] * completion / t_sample,
                update_mfu=6 * n_params * trained / t_update / (peak * 1e12) if peak else None,
            )
    return out


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    w = report["workload"]
    t = Table(
        title=f"GRPO step, Qwen3-{w['shape_name']}-shaped (random init), "
        f"{w['rows']} x {w['max_new']} new tokens, "
        f"{report['device']} (median of {report['steps']} steps)"
    )
    for col in ("arm", "s/step", "tok/s/GPU step", "tok/s/GPU update", "update MFU", "sampler tok/s", "peak GiB"):
        t.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for arm, a in report["arms"].items():
        if "error" in a:
            t.add_row(arm, "failed: " + a["error"].splitlines()[-1][:60], "", "", "", "", "")
            continue
        t.add_row(
            arm,
            f(a["s_per_step"], ".2f"),
            f(a.get("step_tokens_per_s"), ",.0f"),
            f(a.get("update_tokens_per_s"), ",.0f"),
            f(a.get("update_mfu"), ".1%"),
            f(a.get("sampler_completion_tokens_per_s"), ",.0f"),
            f(a.get("max_memory_allocated_GiB"), ".1f"),
        )
    Console(width=130).print(t)
    for k, v in report["ratios"].items():
        print(f"{k}: {v:.3f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new", type=int, default=512, help="completion tokens (default 512)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per rollout step (default 16)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--steps", type=int, default=3, help="measured rollout steps per arm (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="excluded first steps per arm (default 1)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    ap.add_argument(
        "--arms", default=None, help="comma-separated subset of clipbench/vllm,clipbench/hf,trl/vllm,trl/hf"
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.7b", help=argparse.SUPPRESS)  # tiny: tests
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: tests of the plumbing at tiny size
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # internal: run one arm in this process
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--arm-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "gpu.json"))
    args = ap.parse_args(argv)
    if args.arm:
        run_arm(args.arm, Path(args.model_dir), args, Path(args.arm_out))
        return {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reason = skip_reason() if args.device == "cuda" else None
    if reason:
        print(f"bench_gpu: skipped ({reason}; this benchmark needs one CUDA GPU, nothing else does)")
        out.write_text(json.dumps({"benchmark": "gpu", "skipped": reason}) + "\n")
        return {"skipped": reason}

    import torch
    from transformers.utils import logging as hf_logging

    from clipbench.rollout import resolve_backend

    hf_logging.disable_progress_bar()

    primary = resolve_backend("auto") if args.device == "cuda" else "hf"
    arms = (
        args.arms.split(",")
        if args.arms
        else (["clipbench/vllm"] if primary == "vllm" else []) + ["clipbench/hf", f"trl/{primary}"]
    )
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = peak_tflops(device_name, args.peak_tflops)
    report = {
        "benchmark": "GRPO step on a Qwen3-1.7B-shaped model",
        "device": device_name,
        "peak_bf16_tflops": peak,
        "steps": args.steps,
        "warmup": args.warmup,
        "workload": {
            "shape_name": args.shape,
            "shape": SHAPES[args.shape],
            "rows": args.prompts * args.group,
            "prompts": args.prompts,
            "group": args.group,
            "max_new": args.max_new,
            "mini_batches": MINI_BATCHES,
            "rows_per_micro_batch": ROWS_PER_MICRO,
            "dtype": "bfloat16 autocast, float32 master",
            "gradient_checkpointing": True,
        },
        "arms": {},
        "versions": {"torch": torch.__version__},
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        model_dir = Path(tmp) / "model"
        n_params = build_model_dir(SHAPES[args.shape], model_dir)
        report["parameters"] = n_params
        for arm in arms:
            arm_out = Path(tmp) / (arm.replace("/", "_") + ".json")
            cmd = [
                sys.executable,
                __file__,
                "--arm",
                arm,
                "--model-dir",
                str(model_dir),
                "--arm-out",
                str(arm_out),
                "--max-new",
                str(args.max_new),
                "--prompts",
                str(args.prompts),
                "--group",
                str(args.group),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--device",
                args.device,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if proc.returncode != 0 or not arm_out.exists():
                report["arms"][arm] = {"error": (proc.stderr or proc.stdout or f"exit {proc.returncode}")[-4000:]}
                continue
            report["arms"][arm] = summarize(json.loads(arm_out.read_text()), n_params, args.warmup, peak)
    ok = {a: r for a, r in report["arms"].items() if "error" not in r}
    ratios = {}
    for backend in ("vllm", "hf"):
        if f"clipbench/{backend}" in ok and f"trl/{backend}" in ok:
            ratios[f"clipbench/TRL s/step ({backend})"] = (
                ok[f"clipbench/{backend}"]["s_per_step"] / ok[f"trl/{backend}"]["s_per_step"]
            )
    if "clipbench/vllm" in ok and "clipbench/hf" in ok:
        ratios["sampler tokens/s vLLM / HF generate"] = (
            ok["clipbench/vllm"]["sampler_completion_tokens_per_s"]
            / ok["clipbench/hf"]["sampler_completion_tokens_per_s"]
        )
    report["ratios"] = ratios
    report["elapsed_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {out} ({report['elapsed_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
