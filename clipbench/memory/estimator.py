"""How much GPU memory one rank of a run needs, from first principles, before anything loads.

    setup = Setup(dtype="bfloat16", world_size=8, max_new_tokens=3072, micro_batch_tokens=16384, ...)
    plan = estimate(shape, setup)        # rows, the two phase peaks, fits or not
    plan.fits, plan.peak_bytes, [r.name for r in plan.rows], advise(shape, setup)

(`clipbench.memory.plan.setup_for(cfg, ...)` builds the Setup of a run config.)

A rank alternates between two phases, and its peak is the larger of the two:

* sampling: the training state that stays on the GPU (fp32 master weights, AdamW state; gradients
  are assumed freed after each optimizer step) next to the vLLM engine's share
  (`sampler.gpu_memory_utilization` x device memory: its full bf16 copy of the weights, its
  runtime, and the KV cache in the rest), or the HF `generate` KV cache with the hf backend;
* training: the training state, the gradients, the compute-dtype weight copies, the saved
  activations of one micro-batch, the logits working set, and the vLLM share unless
  `sampler.sleep_mode` puts the engine to sleep (level 2 frees its weights and KV cache).

Assumptions (each one is a number below with its arithmetic, or a constant named here):

* Weights: fp32 master weights and fp32 gradients always (`model.dtype` bf16/fp16 is the compute
  dtype: autocast in one process, FSDP2 `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
  over several); AdamW keeps two fp32 moments per parameter; FSDP2 shards all of them evenly over
  the world size (per decoder layer, plus the root: embeddings, final norm, head).
* FSDP2 working set: the root group unsharded for the whole step (its reshard_after_forward is
  off), two decoder layers unsharded at a time (the running one and the prefetched one), and one
  layer's unsharded gradient in bf16 plus its fp32 copy for the reduce-scatter. One process under
  autocast instead keeps a bf16 copy of every matmul weight (autocast's cast cache) until backward;
  with gradient checkpointing only one layer's copies live at a time (plus the head's).
* Activations: the tensors autograd saves for backward in a transformers Qwen3/Llama decoder layer
  with SDPA attention (flash or memory-efficient: no S x S score matrix; its log-sum-exp is
  float32), counted tensor by tensor in `layer_activation_bytes`; RMSNorm computes in float32
  whatever its input. Rows are padded, so there is a padding mask: transformers then repeats k and
  v to every query head (no GQA kernel takes a mask), and SDPA turns the bool mask (B x S x S) into
  an additive one in the compute dtype at every layer, which the attention backward keeps. These
  sums equal, to the byte, what PyTorch saves in a real forward (tests count it on CPU). Gradient
  checkpointing (per decoder layer, as transformers does it) keeps each layer's input and
  recomputes one layer at a time in backward.
* A micro-batch holds at most `train.micro_batch_tokens` token positions, padding included (one
  sequence longer than that goes alone); without it, the whole mini-batch share of the rank, every
  row at full length (prompt + max_new_tokens). Logit positions are bounded by the token positions.
* Logits: the model keeps only completion positions (`logits_to_keep`) in the compute dtype; the
  chunked log-softmax (clipbench/train/logprobs.py) saves them for backward and writes their
  gradient, so training holds two logits-sized tensors (plus one 4 MiB chunk, not counted).
* Runtime: `RUNTIME_GIB` per process for the CUDA context, cuBLAS/NCCL workspaces and the caching
  allocator; vLLM's own activations and sampler buffers take `VLLM_RUNTIME_GIB` of its share
  (eager mode: no CUDA graphs); a sleeping engine keeps `SLEEPING_GIB`.
* Margin: the peak is multiplied by `1 + MARGIN` (allocator fragmentation and temporaries not
  modelled) before it is compared with the device. Figures are shown to 2 significant digits: the
  estimate is not more precise than that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from clipbench.models import PROMPT_TOKENS
from clipbench.models.shapes import ModelShape

GIB = 1 << 30
MARGIN = 0.10  # multiplies the peak: fragmentation, temporaries not modelled
RUNTIME_GIB = 1.5  # CUDA context + cuBLAS/NCCL workspaces + allocator pools, per process
VLLM_RUNTIME_GIB = 1.0  # vLLM activations and sampler buffers inside its share (enforce_eager)
SLEEPING_GIB = 0.5  # what a sleeping (level 2) engine keeps: buffers, allocator pools
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------
# Precision: which dtype each tensor has


@dataclass(frozen=True)
class Precision:
    """compute: matmul/activation itemsize; residual: the residual stream's itemsize;
    autocast: fp32 weights cast per matmul (one process); sharded: FSDP2 with param_dtype=compute."""

    compute: int
    residual: int
    autocast: bool
    sharded: bool


def precision(dtype: str, sharded: bool) -> Precision:
    """float32: everything fp32. bf16/fp16 in one process: autocast over fp32 weights, so the
    residual stream (embedding output + residual adds) stays fp32. bf16/fp16 under FSDP2: the
    weights are cast once to the compute dtype, so the residual stream is in it too."""
    c = ITEMSIZE[dtype]
    if c == 4:
        return Precision(4, 4, autocast=False, sharded=sharded)
    return Precision(c, c if sharded else 4, autocast=not sharded, sharded=sharded)


# ----------------------------------------------------------------------------------------------
# Saved activations, bytes per token (the formulas the tests check against PyTorch)


def rmsnorm_bytes(h: int, p: Precision, consumers: int) -> int:
    """Saved by an RMSNorm and by the `consumers` matmuls reading its output, per token:
    float32 input (4h: pow and the scaling save it), rsqrt (4), the normalised value in the input
    dtype (residual*h: the weight product saves it), and what the matmuls save: under autocast each
    its own cast of the output (compute*h each), else the output itself once (residual*h)."""
    out = consumers * p.compute * h if p.autocast else p.residual * h
    return 4 * h + 4 + p.residual * h + out


def layer_activation_bytes(s: ModelShape, p: Precision) -> int:
    """Bytes one decoder layer saves for backward per token (no checkpointing), padded batch."""
    h, i, a, k, ad, kd, c = (
        s.hidden_size,
        s.intermediate_size,
        s.num_heads,
        s.num_kv_heads,
        s.q_dim,
        s.kv_dim,
        p.compute,
    )
    norms = rmsnorm_bytes(h, p, consumers=3) + rmsnorm_bytes(h, p, consumers=2)  # q,k,v | gate,up
    # Qwen3 q/k norm over each head: float32 input, rsqrt per head, normalised value (compute dtype)
    qk_norm = (4 * ad + 4 * a + c * ad) + (4 * kd + 4 * k + c * kd) if s.qk_norm else 0
    # SDPA inputs: with a padding mask transformers repeats k and v to all query heads (no GQA
    # kernel takes a mask), so q, k, v are a x d each; float32 log-sum-exp per head; the output
    attention = 3 * c * ad + 4 * a + c * ad
    mlp = 4 * c * i  # gate, silu(gate), up, silu(gate) * up
    if s.is_moe:  # per routed expert: its SwiGLU and its gathered input and weighted output; the
        # router's logits and float32 softmax. An estimate: not checked against PyTorch like the dense terms
        mlp = s.experts_per_tok * (mlp + 2 * c * h) + (c + 4) * s.num_experts
    return norms + qk_norm + attention + mlp


def checkpointed_layer_bytes(s: ModelShape, p: Precision) -> int:
    """With gradient checkpointing a layer keeps only its input (residual stream) per token."""
    return p.residual * s.hidden_size


def per_token_extra_bytes(s: ModelShape, p: Precision) -> int:
    """Per token, outside the layers: the final RMSNorm (float32 input, rsqrt, normalised value;
    its output is read by the head at the logit positions only, see `logits_bytes`), rotary cos and
    sin (2 x head_dim in the residual dtype) and int64 input and position ids."""
    h = s.hidden_size
    return (4 * h + 4 + p.residual * h) + 2 * s.head_dim * p.residual + 16


def mask_bytes(p: Precision, rows: int, seq: int) -> int:
    """The additive attention mask SDPA makes from transformers' bool padding mask, per layer call
    (rows x seq x seq in the compute dtype; the attention backward keeps it)."""
    return p.compute * rows * seq * seq


def activation_bytes(s: ModelShape, p: Precision, tokens: int, rows: int, seq: int, *, checkpointing: bool) -> int:
    """Activations of one micro-batch of `tokens` positions in `rows` rows of length `seq`, at the
    peak of its backward: every layer's saved tensors and mask, or (checkpointing) every layer's
    input plus one layer recomputed; the per-token extras; the bool padding mask (rows x seq^2)."""
    layer = tokens * layer_activation_bytes(s, p) + mask_bytes(p, rows, seq)
    layers = s.num_layers * tokens * checkpointed_layer_bytes(s, p) + layer if checkpointing else s.num_layers * layer
    return layers + tokens * per_token_extra_bytes(s, p) + rows * seq * seq


def logits_bytes(s: ModelShape, p: Precision, positions: int, *, backward: bool = True) -> int:
    """Per logit position: the head's input (hidden, compute dtype), the logits (vocab, compute
    dtype) and in training their gradient (same size; clipbench/train/logprobs.py writes it), and
    the float32 log-sum-exp the chunked log-softmax keeps."""
    c = p.compute
    return positions * (c * s.hidden_size + c * s.vocab_size * (2 if backward else 1) + 4)


# ----------------------------------------------------------------------------------------------
# Weights, gradients, optimizer


def matmul_params(s: ModelShape) -> tuple[int, int]:
    """(layer weights, head weights) autocast casts per forward: every projection, and the head."""
    per_layer = (
        s.hidden_size * (s.q_dim + 2 * s.kv_dim)
        + s.q_dim * s.hidden_size
        + (s.mlp_params(s.num_experts) if s.is_moe else 3 * s.hidden_size * s.intermediate_size)
    )  # MoE: router + experts
    return s.num_layers * per_layer, s.vocab_size * s.hidden_size


def compute_copy_bytes(s: ModelShape, p: Precision, *, checkpointing: bool) -> int:
    """Weights held in the compute dtype during a step, beyond the fp32 masters.

    FSDP2: the root group (embeddings, untied head, final norm) unsharded all step, two layers
    unsharded at a time, one layer's unsharded gradient (compute dtype + fp32 for reduce-scatter).
    Autocast (one process): the cast of every matmul weight and of the head, kept by autograd until
    backward; with checkpointing one layer's casts at a time (plus the head's).
    float32 in one process: none."""
    layer = s.layer_params()
    if p.sharded:
        root = s.embedding_params() + s.hidden_size
        return p.compute * (root + 2 * layer) + (p.compute + 4) * layer
    if not p.autocast:
        return 0
    layers, head = matmul_params(s)
    if checkpointing:
        layers = layers // s.num_layers
    return p.compute * (layers + head)


# ----------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Setup:
    """The knobs of a run that decide its memory, per rank."""

    dtype: str = "bfloat16"  # float32 | bfloat16 | float16 (model.dtype; auto = bf16)
    world_size: int = 1  # processes over all nodes (FSDP2 shards over them)
    device_gib: float = 80.0
    prompt_tokens: int = PROMPT_TOKENS
    max_new_tokens: int = 1024
    rows_per_mini_batch: int = 64  # sequences of one optimizer step, all ranks
    micro_batch_tokens: int = 0  # 0: the rank's whole share of a mini-batch at once
    generate_rows: int = 64  # sequences of one generate call on one rank (hf backend)
    gradient_checkpointing: bool = False
    reference_model: bool = False  # train.beta > 0 keeps a frozen copy in the compute dtype
    backend: str = "vllm"  # vllm | hf
    gpu_memory_utilization: float = 0.3
    sleep_mode: bool = False
    sampler_logprobs: bool = False  # hf backend: generate keeps every step's scores
    lag: int = 0  # sampler.lag: k + 1 snapshots of the parameters in host memory (train/lag.py)

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def micro_batch(self) -> tuple[int, int, int]:
        """(token positions, rows, logit positions) of the largest micro-batch of a rank."""
        seq = self.seq_tokens
        rows_rank = math.ceil(self.rows_per_mini_batch / self.world_size)
        if self.micro_batch_tokens <= 0:
            return rows_rank * seq, rows_rank, rows_rank * (self.max_new_tokens + 1)
        tokens = min(max(self.micro_batch_tokens, seq), rows_rank * seq)
        return tokens, max(1, tokens // seq), tokens


@dataclass(frozen=True)
class Row:
    name: str
    bytes: int
    phases: tuple[str, ...]  # "sampling", "training": where it is resident
    how: str  # the arithmetic, in words


@dataclass
class MemoryPlan:
    shape: ModelShape
    setup: Setup
    rows: list[Row]
    kv_cache_bytes: int  # vLLM: what its share leaves for KV; hf: what generate needs
    kv_sequences: float  # full-length sequences the vLLM KV cache holds at once

    def phase_bytes(self, phase: str) -> int:
        return sum(r.bytes for r in self.rows if phase in r.phases)

    @property
    def peak_phase(self) -> str:
        return max(("sampling", "training"), key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def with_margin_bytes(self) -> int:
        return int(self.peak_bytes * (1 + MARGIN))

    @property
    def device_bytes(self) -> int:
        return int(self.setup.device_gib * GIB)

    @property
    def kv_fits(self) -> bool:
        """vLLM needs room for at least one full-length sequence."""
        return self.setup.backend != "vllm" or self.kv_sequences >= 1

    @property
    def fits(self) -> bool:
        return self.kv_fits and self.with_margin_bytes <= self.device_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory per rank the plan counts beside the device's: a lagged sampler's snapshots,
        k + 1 float32 copies of the rank's shard of the parameters (train/lag.py)."""
        return 0 if self.setup.lag == 0 else (self.setup.lag + 1) * 4 * self.shape.n_params() // self.setup.world_size


def estimate(s: ModelShape, u: Setup) -> MemoryPlan:
    """The memory plan of one rank (see the module docstring for every assumption)."""
    p = precision(u.dtype, u.sharded)
    n, world, both = s.n_params(), u.world_size, ("sampling", "training")
    shard = f" / {world} ranks" if world > 1 else ""
    rows = [
        Row("parameters (fp32 master)", 4 * n // world, both, f"4 B x {n / 1e9:.2f}B params{shard}"),
        Row("gradients (fp32)", 4 * n // world, ("training",), f"4 B x params{shard}"),
        Row("AdamW state (2 x fp32)", 8 * n // world, both, f"8 B x params{shard}"),
    ]
    copies = compute_copy_bytes(s, p, checkpointing=u.gradient_checkpointing)
    if copies:
        how = (
            "FSDP2: root + 2 layers unsharded, 1 layer's grads"
            if p.sharded
            else "autocast casts: " + ("one layer + head" if u.gradient_checkpointing else "all matmul weights")
        )
        rows.append(Row(f"weights in {_dtype_name(p.compute)} (compute copies)", copies, ("training",), how))
    if u.reference_model:
        rows.append(Row("reference model", p.compute * n // world, both, f"{p.compute} B x params{shard}"))

    tokens, mb_rows, positions = u.micro_batch()
    seq = u.seq_tokens
    where = f"{tokens:,} tokens ({mb_rows} x {seq} max)"
    for ckpt in (True, False):
        act = activation_bytes(s, p, tokens, mb_rows, seq, checkpointing=ckpt)
        used = ckpt == u.gradient_checkpointing
        rows.append(
            Row(
                f"activations, checkpointing {'on' if ckpt else 'off'}" + ("" if used else " (not used)"),
                act,
                ("training",) if used else (),
                where,
            )
        )
    rows.append(
        Row(
            "logits + gradient",
            logits_bytes(s, p, positions),
            ("training",),
            f"{positions:,} positions x 2 x {s.vocab_size:,} x {p.compute} B",
        )
    )

    kv_bytes, kv_seqs = 0, 0.0
    if u.backend == "vllm":
        share = int(u.gpu_memory_utilization * u.device_gib * GIB)
        weights = p.compute * n
        kv_bytes = max(0, share - weights - int(VLLM_RUNTIME_GIB * GIB))
        kv_seqs = kv_bytes / (s.kv_bytes_per_token(p.compute) * seq)
        rows.append(
            Row(
                "vLLM weights",
                weights,
                ("sampling",) if u.sleep_mode else both,
                f"{p.compute} B x params (a full copy per GPU)",
            )
        )
        rows.append(
            Row(
                "vLLM KV cache + runtime",
                share - weights,
                ("sampling",) if u.sleep_mode else both,
                f"{u.gpu_memory_utilization:g} x {u.device_gib:g} GiB - weights; KV: {kv_seqs:.1f} x {seq}-token seqs",
            )
        )
        if u.sleep_mode:
            rows.append(Row("vLLM asleep (level 2)", int(SLEEPING_GIB * GIB), ("training",), "assumed"))
    else:
        gen_rows = u.generate_rows
        kv_bytes = gen_rows * seq * s.kv_bytes_per_token(p.compute)
        rows.append(
            Row(
                "HF generate KV cache",
                kv_bytes,
                ("sampling",),
                f"{gen_rows} rows x {seq} tokens x {s.kv_bytes_per_token(p.compute):,} B",
            )
        )
        if p.autocast:
            layers, head = matmul_params(s)
            rows.append(Row("HF generate weight casts", p.compute * (layers + head), ("sampling",), "autocast"))
        if u.sampler_logprobs:
            rows.append(
                Row(
                    "HF generate scores",
                    gen_rows * u.max_new_tokens * s.vocab_size * 4,
                    ("sampling",),
                    "float32 scores of every step (output_scores)",
                )
            )
    rows.append(Row("CUDA runtime", int(RUNTIME_GIB * GIB), both, "assumed per process"))
    return MemoryPlan(s, u, rows, kv_bytes, kv_seqs)


def _dtype_name(itemsize: int) -> str:
    return {4: "fp32", 2: "bf16"}[itemsize]


def gib(n: int | float) -> str:
    """Bytes as GiB rounded to 2 significant digits (the estimate's precision): 0.67, 6.4, 4800."""
    x = n / GIB
    if x == 0:
        return "0"
    if x < 0.095:
        return "<0.1"
    r = float(f"{x:.2g}")
    return f"{r:.2f}" if r < 1 else f"{r:.1f}" if r < 10 else f"{r:.0f}"


# ----------------------------------------------------------------------------------------------
# Advice: which single knob makes a run fit


def advise(s: ModelShape, u: Setup, *, nnodes: int = 1) -> list[str]:
    """One-knob changes that make a plan that does not fit fit, most local first."""
    out: list[str] = []
    if u.micro_batch_tokens <= 0 or u.micro_batch_tokens > u.seq_tokens:
        start = u.micro_batch_tokens if u.micro_batch_tokens > 0 else u.micro_batch()[0]
        m = _largest_fitting_budget(s, u, start)
        if m is not None:
            out.append(f"train.micro_batch_tokens={m}")
    if not u.gradient_checkpointing and estimate(s, replace(u, gradient_checkpointing=True)).fits:
        out.append("model.gradient_checkpointing=true")
    if u.backend == "vllm" and not u.sleep_mode and estimate(s, replace(u, sleep_mode=True)).fits:
        out.append("sampler.sleep_mode=true")
    if u.backend == "vllm":
        util = _best_utilization(s, u)
        if util is not None and util != u.gpu_memory_utilization:
            out.append(f"sampler.gpu_memory_utilization={util:g}")
    per_node = u.world_size // nnodes
    for nproc in (2, 4, 8, 16, 32, 64):
        if nproc > per_node and estimate(s, replace(u, world_size=nproc * nnodes)).fits:
            out.append(f"--nproc-per-node {nproc}" + (f" (x {nnodes} nodes)" if nnodes > 1 else ""))
            break
    return out


def _largest_fitting_budget(s: ModelShape, u: Setup, start: int) -> int | None:
    """The largest micro-batch token budget below `start` with which the plan fits: a power of two
    at least one full-length sequence long, else exactly one sequence (the smallest budget)."""
    m = 1 << (start - 1).bit_length() - 1 if start > 1 else 0  # largest power of two < start
    while m >= u.seq_tokens:
        if estimate(s, replace(u, micro_batch_tokens=m)).fits:
            return m
        m //= 2
    one = u.seq_tokens
    return one if start > one and estimate(s, replace(u, micro_batch_tokens=one)).fits else None


def _best_utilization(s: ModelShape, u: Setup) -> float | None:
    """The largest gpu_memory_utilization (0.05 steps) with which the plan fits, if any."""
    for step in range(19, 0, -1):
        util = step / 20
        if estimate(s, replace(u, gpu_memory_utilization=util)).fits:
            return util
    return None
