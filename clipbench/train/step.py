"""The update of one rollout batch on one rank: plan, frozen log-probs, accumulated gradients, step.

    plan = plan_update(batch, mini_batches=4, epochs=1, budget=4096, perm=gen, dist=dist)
    old = frozen_logprobs(model, batch, plan_of_epoch_0, ...)       # (B, T) on every rank
    stats, hist = accumulate_gradients(model, batch, plan[k], inputs, objective, ...)   # backward per micro-batch
    grad_norm, stepped = optimizer_step(model, optimizer, scheduler, grad_clip)

Design choices
- Exact accumulation. Every micro-batch's loss is normalised by its mini-batch's global counts
  (valid completion tokens; sequences with >= 1 valid token), counted before the micro-batch loop
  from the rollout's lengths, which every rank knows. Summed over micro-batches and ranks, the losses
  and gradients are the unsplit mini-batch's for every aggregation: never a micro-batch's own count,
  never divided again by the number of micro-batches (verl#5625), and the count covers exactly the
  rows of this optimizer step (trl#5619).
- Packing. A micro-batch holds at most `budget` tokens counted as rows x padded width (longest
  prompt + longest completion among its rows: what the forward allocates). Rows are sorted by length
  (least padding) and filled greedily; a sequence is never split, one longer than the budget goes
  alone. Budget 0: one micro-batch holding the mini-batch's rows in their original order.
- Sequence-level rules see whole sequences (rows are never split). Random draws (nsr) are pre-drawn
  per (rollout row, position) for each epoch (`draw_uniforms`), so they never depend on the split.
- Lockstep. Each rank's list of micro-batches is padded with empty ones (`()`, run on a placeholder
  row with no valid token) to the longest list over ranks; every rank computes every rank's packing
  itself, so no collective is needed to agree.
- No host sync in the micro-batch loop: statistics stay device tensors, summed per optimizer step,
  transferred once per log. The one sync of a step is the finiteness test of the global gradient norm
  (identical on every rank, so all ranks step or skip together).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from clipbench.models.routing import (
    RouteReplay,
    agreement_metrics,
    agreement_sums,
    load_sums,
    micro_columns,
    moved_tokens,
)
from clipbench.objectives import PolicyLossOutput, combine, finalize, log_ratio_counts
from clipbench.objectives.aggregation import needs_groups
from clipbench.objectives.corrections import REJECTED, apply_correction, correction_stats
from clipbench.objectives.inputs import KEYWORDS, Counts, RuleInputs
from clipbench.objectives.loss import BoundRule, bind
from clipbench.objectives.staleness import TOKENS as STALENESS_TOKENS
from clipbench.objectives.staleness import is_staleness_sum, staleness_stats
from clipbench.train.distributed import Dist, full_tensor
from clipbench.train.logprobs import completion_logprobs
from clipbench.train.moe import RouterLogits
from clipbench.train.packing import Packed, placeholder


@dataclass(frozen=True)
class OptStep:
    """One optimizer step's work on this rank."""

    epoch: int
    index: int  # mini-batch index within the epoch
    micro: tuple[tuple[int, ...], ...]  # this rank's micro-batches as rollout row ids; () = placeholder
    tokens: int  # valid completion tokens of the whole mini-batch (all ranks)
    seqs: int  # sequences of the whole mini-batch with >= 1 valid completion token
    rows: tuple[int, ...] = ()  # the whole mini-batch's rollout rows, in mini-batch order
    ranks: tuple = ()  # every rank's micro-batches, padded like `micro` (a record replays them: train/record.py)


def pack_micro_batches(batch: Packed, rows: list[int], budget: int) -> list[list[int]]:
    """Rows grouped into micro-batches of at most `budget` padded tokens (see the module docstring)."""
    if not rows:
        return []
    if budget <= 0:
        return [list(rows)]
    order = sorted(rows, key=lambda i: (-(batch.prompt_lens[i] + batch.completion_lens[i]), i))
    out: list[list[int]] = [[order[0]]]
    for i in order[1:]:
        if (len(out[-1]) + 1) * batch.width(out[-1] + [i]) <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def plan_update(
    batch: Packed, *, mini_batches: int, epochs: int, budget: int, perm: torch.Generator, dist: Dist
) -> list[OptStep]:
    """Every optimizer step of this rollout batch on this rank: `epochs` seeded permutations of the B
    rows, each cut into `mini_batches` strided slices (perm[k::n]) as in one process; each slice
    split over ranks by `dist.share`, packed into micro-batches, padded to the longest rank's count."""
    B = len(batch.completion_lens)
    n = min(mini_batches, B)
    plan = []
    for epoch in range(epochs):
        p = torch.randperm(B, generator=perm).tolist()
        for k in range(n):
            rows = p[k::n]
            packs = [pack_micro_batches(batch, list(share), budget) for share in dist.shares(rows)]
            padded = [tuple(tuple(m) for m in part + [[]] * (max(1, *map(len, packs)) - len(part))) for part in packs]
            valid = [batch.completion_lens[i] for i in rows]
            plan.append(
                OptStep(
                    epoch,
                    k,
                    padded[dist.rank],
                    tokens=sum(valid),
                    seqs=sum(v > 0 for v in valid),
                    rows=tuple(rows),
                    ranks=tuple(padded),
                )
            )
    return plan


def _micro(batch: Packed, rows: tuple[int, ...], pad_id: int, device) -> tuple[Packed, torch.Tensor | None]:
    """(the micro-batch on `device`, its row ids as a device tensor); the placeholder for ()."""
    if not rows:
        return placeholder(pad_id).to(device), None
    return batch.select(list(rows)).to(device), torch.tensor(rows, device=device)


@torch.no_grad()
def frozen_logprobs(
    model,
    batch: Packed,
    plan: list[OptStep],
    *,
    pad_id: int,
    temperature: float,
    compute=contextlib.nullcontext,
    dist: Dist,
    routes: tuple[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(B, T) float32 log-probs of every completion token under `model` (the policy before this
    update, or the reference), on `dist.device`, 0 at padding. Each rank runs the micro-batches of
    `plan` (one epoch's steps cover every row once); with N ranks the rows are summed over ranks
    (each row is computed by exactly one), so every rank holds every row for every epoch.
    `routes` (a MoE policy with routing replay): ("record", table) writes each token's experts into
    the table (summed over ranks like the log-probs), ("replay", table) routes by it."""
    out = torch.zeros(batch.completion_ids.shape, device=dist.device)  # (B, T)
    replay = RouteReplay.of(model) if routes is not None else None
    for step in plan:
        for rows in step.micro:
            mb, idx = _micro(batch, rows, pad_id, dist.device)
            if replay is not None:
                route_micro_batch(replay, routes, idx, batch, mb)
            with compute():
                lp, _ = completion_logprobs(model, mb, temperature=temperature, with_entropy=False)
            if idx is not None:
                out[idx, : lp.shape[1]] = lp.float() * mb.completion_mask
    if replay is not None:
        replay.off()
        if routes[0] == "record":
            dist.all_reduce_(routes[1])
    return dist.all_reduce_(out)


def route_micro_batch(
    replay: RouteReplay, routes: tuple[str, torch.Tensor], idx: torch.Tensor | None, batch: Packed, mb: Packed
) -> None:
    """Point the routers' hooks at this micro-batch's window of the route table (record or replay);
    the placeholder (idx None) routes freely."""
    mode, table = routes
    if idx is None:
        replay.off()
    elif mode == "record":
        replay.record(table, idx, micro_columns(batch, mb))
    else:
        replay.replay(table, idx, micro_columns(batch, mb))


def own_rows(steps: list[OptStep], B: int, device) -> torch.Tensor:
    """(B,) 1.0 on the rollout rows that `steps` hand this rank, else 0 (one epoch's steps: each row
    is some rank's exactly once, so sums over these rows, all-reduced, cover the batch once)."""
    out = torch.zeros(B, device=device)
    for step in steps:
        for rows in step.micro:
            out[list(rows)] = 1.0
    return out


@dataclass(frozen=True)
class Objective:
    """The run's policy loss: rule, its parameters, aggregation, KL weight, fixed length; the rule
    bound once here (`bound`: looked up, parameters validated, objectives/loss.py), not per micro-batch."""

    method: str
    params: dict
    agg: str
    beta: float
    max_len: int
    router_aux_loss_coef: float = 0.0  # MoE: the routers' load-balancing loss weight (train/moe.py)
    bound: BoundRule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bound = bind(self.method, self.params, agg=self.agg, beta=self.beta, max_len=self.max_len)
        object.__setattr__(self, "bound", bound)

    @classmethod
    def from_config(cls, cfg) -> Objective:
        rule = cfg.objective
        return cls(
            rule.name,
            dict(rule.params),
            cfg.train.agg.name,
            cfg.train.beta,
            cfg.sampler.max_new_tokens,
            cfg.train.router_aux_loss_coef,
        )

    @property
    def draws(self) -> bool:
        """Does this rule (with these parameters) draw random numbers?"""
        return self.bound.draws

    @property
    def reads_rollout_logp(self) -> bool:
        """Does this rule read the sampler's log-probs (rollout_is)?"""
        return "rollout_logp" in self.bound.reads

    @property
    def stat(self) -> bool:
        """Does this rule read a statistic of the whole mini-batch (bapo, m2po)?"""
        return self.bound.has_stat

    def loss(self, inputs: RuleInputs) -> PolicyLossOutput:
        """The bound rule's policy loss on one micro-batch's bundle (objectives.inputs.RuleInputs: its
        log-probs, mask and entropy, its rows' StepInputs, the mini-batch's counts and statistic)."""
        return self.bound(inputs)


def draw_uniforms(shape: torch.Size, generator: torch.Generator, device) -> torch.Tensor:
    """(B, T) uniforms in [0, 1), one per (rollout row, position): the draws of stochastic rules,
    the same whatever the micro-batch and rank split."""
    return torch.rand(shape, generator=generator).to(device)


@dataclass
class StepInputs:
    """Per-row tensors of the rollout batch on the device, indexed by rollout row id."""

    advantages: torch.Tensor  # (B,)
    old_logp: torch.Tensor  # (B, T)
    ref_logp: torch.Tensor | None = None  # (B, T)
    uniforms: torch.Tensor | None = None  # (B, T) this epoch's draws of a stochastic rule
    weights: torch.Tensor | None = None  # (B, T) the sampler correction's weights (objectives/corrections)
    sampler_logp: torch.Tensor | None = None  # (B, T) the sampler's log-probs: the mismatch; rollout_is's input
    correction_status: torch.Tensor | None = None  # (B, T) int8: what the correction did to each token
    routes: torch.Tensor | None = None  # (B, layers, Lp + T, k) int32: MoE routing replay's experts (+1; 0: none)
    rewards: torch.Tensor | None = None  # (B,) each row's reward (rules that read it: topr)
    groups: tuple[int, ...] = ()  # each row's prompt group (prompt-mean)
    mask: torch.Tensor | None = None  # (B, T) the completion mask on the device (the mini-batch's counts)

    def rows(self, idx: torch.Tensor | None, width: int) -> RuleInputs:
        """The loss's inputs for a micro-batch's rows, trimmed to its `width` (zeros for the
        placeholder, idx None), as the call's bundle (the forward's logp, mask and entropy and the
        mini-batch's counts are the caller's to add): old_logp, advantages, uniforms, ref_logp,
        weights, correction_status and the given rule inputs held here (objectives.inputs.GIVEN:
        rewards, sampler_logp)."""
        return RuleInputs.of(**{name: _take(getattr(self, name), idx, width) for name in ROW_INPUTS})


# The per-row tensors of StepInputs each micro-batch's loss takes: the fixed ones and every given
# rule input (by its keyword) the rollout provides here.
ROW_INPUTS = ("old_logp", "advantages", "uniforms", "ref_logp", "weights", "correction_status") + tuple(
    k for k in KEYWORDS if k in {f.name for f in fields(StepInputs)}
)


@dataclass
class StepStats:
    """One optimizer step's statistics on this rank, as device tensors that combine over micro-batches
    and ranks: the rule's diagnostic sums (objectives.diagnostics), the loss, the token entropy's sum
    and count, and on the first step of a rollout batch the sampler/trainer mismatch sums.

    `sums()` flattens them for the reduction across ranks (one collective per kind, with every step
    of the rollout batch); `metrics(reduced)` turns one reduced step into its logged values."""

    rule: list = field(default_factory=list)  # each micro-batch's PolicyLossOutput.sums
    loss: list = field(default_factory=list)  # each micro-batch's share of the mini-batch loss
    entropy: list = field(default_factory=list)  # (summed token entropy, tokens) per micro-batch
    mismatch: list = field(default_factory=list)  # the mismatch's sums (objectives.corrections)
    staleness: list = field(default_factory=list)  # the rollout batch's staleness sums (objectives.staleness)
    router_aux: list = field(default_factory=list)  # MoE: each micro-batch's share of the load-balancing loss
    routing: list = field(default_factory=list)  # MoE routing replay: each micro-batch's agreement sums

    def add(self, out: PolicyLossOutput, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        self.rule.append(out.sums)
        self.loss.append(out.loss.detach())
        self.entropy.append(((entropy * mask).sum(), mask.sum()))

    def add_rollout(self, sums: dict[str, torch.Tensor]) -> None:
        """The rollout batch's own sums (measured once, on its first optimizer step): the mismatch's
        and the staleness's, each kind combined with its own."""
        stale = {k: v for k, v in sums.items() if is_staleness_sum(k)}
        rest = {k: v for k, v in sums.items() if not is_staleness_sum(k)}
        if rest:
            self.mismatch.append(rest)
        if stale:
            self.staleness.append(stale)

    def sums(self) -> dict[str, torch.Tensor]:
        ent = torch.stack([torch.stack(e) for e in self.entropy]).sum(0).to(torch.float64)
        out = {
            **combine(self.rule),
            "loss": torch.stack(self.loss).sum().to(torch.float64),
            "entropy/sum": ent[0],
            "entropy/tokens": ent[1],
        }
        if self.mismatch:
            out.update(combine(self.mismatch))
        if self.staleness:
            out.update(combine(self.staleness))
        if self.router_aux:
            out["router_aux_loss"] = torch.stack(self.router_aux).sum().to(torch.float64)
        if self.routing:
            out.update(combine(self.routing))
        return out

    @staticmethod
    def metrics(reduced: dict[str, torch.Tensor]) -> dict[str, float]:
        """loss, entropy (token mean), the rule's finalised stats, and the mismatch's when present."""
        rule = {
            k: v
            for k, v in reduced.items()
            if k not in ("loss", "entropy/sum", "entropy/tokens", "router_aux_loss")
            and not k.startswith(("mismatch/", "routing/"))
            and not is_staleness_sum(k)
        }
        out = {
            "entropy": float(reduced["entropy/sum"] / reduced["entropy/tokens"].clamp(min=1.0)),
            "loss": float(reduced["loss"]),
            **{k: float(v) for k, v in finalize(rule).items()},
        }
        if "router_aux_loss" in reduced:
            out["router_aux_loss"] = float(reduced["router_aux_loss"])
        if "routing/tokens" in reduced:
            out.update(agreement_metrics(reduced))
        if "mismatch/tokens" in reduced:
            out.update(correction_stats({k: v for k, v in reduced.items() if k.startswith("mismatch/")}))
        if STALENESS_TOKENS in reduced:
            out.update(staleness_stats(reduced))
        return out


@dataclass
class MiniBatch:
    """What every micro-batch of one optimizer step shares (`mini_batch_inputs`): the mini-batch's
    counts (objectives.inputs.Counts; prompt-mean's group_tokens per rollout row (B,), sliced per
    micro-batch) and a rule's mini-batch statistic."""

    counts: Counts
    group_tokens: torch.Tensor | None = None  # (B,) each rollout row's prompt group's tokens (prompt-mean)
    batch_stat: dict | None = None

    def rows(self, idx: torch.Tensor | None, width: int) -> Counts:
        """The counts of one micro-batch (its rows' group_tokens)."""
        if self.group_tokens is None:
            return self.counts
        return replace(self.counts, group_tokens=_take(self.group_tokens, idx, width))


def mini_batch_counts(step: OptStep, inputs: StepInputs, agg: str, mask: torch.Tensor) -> MiniBatch:
    """The mini-batch's normalisers: valid tokens and sequences (without the correction's rejected
    tokens, which leave the denominators), and for prompt-mean its prompt groups and each row's
    group's tokens (B,). Device tensors where they depend on the correction; no host sync."""
    grouped = needs_groups(agg)
    if inputs.correction_status is None and not grouped:
        return MiniBatch(Counts(global_tokens=step.tokens, global_seqs=step.seqs))
    rows = torch.tensor(step.rows, dtype=torch.long, device=mask.device)
    counted = mask[rows] > 0  # (b, T)
    tokens, seqs = step.tokens, step.seqs
    if inputs.correction_status is not None:
        counted = counted & (inputs.correction_status[rows] != REJECTED)
        tokens, seqs = counted.sum().float(), counted.any(-1).sum().float()
    if not grouped:
        return MiniBatch(Counts(global_tokens=tokens, global_seqs=seqs))
    ids = sorted({inputs.groups[r] for r in step.rows})
    which = torch.tensor([ids.index(inputs.groups[r]) for r in step.rows], device=rows.device)  # (b,)
    per_group = torch.zeros(len(ids), device=rows.device).index_add_(0, which, counted.sum(-1).float())
    group_tokens = torch.zeros(len(inputs.groups), device=rows.device).index_copy_(0, rows, per_group[which])
    return MiniBatch(Counts(global_tokens=tokens, global_seqs=seqs, global_prompts=len(ids)), group_tokens)


def mini_batch_inputs(
    model,
    batch: Packed,
    step: OptStep,
    inputs: StepInputs,
    objective: Objective,
    *,
    pad_id: int,
    temperature: float,
    compute=contextlib.nullcontext,
    dist: Dist,
) -> MiniBatch:
    """What the step's micro-batches share: the mini-batch's counts and, for a rule with a mini-batch
    statistic split over micro-batches or ranks, that statistic from a no-grad forward of the whole
    mini-batch (every rank's rows, all-reduced) before any backward: the split then equals the
    unsplit step. Unsplit, the rule computes it on its one call (no extra forward)."""
    mask = inputs.mask if inputs.mask is not None else batch.completion_mask.to(dist.device)  # (B, T)
    out = mini_batch_counts(step, inputs, objective.agg, mask)
    if objective.stat and (len(step.micro) > 1 or dist.world > 1):
        current = frozen_logprobs(
            model,
            batch,
            [step],
            pad_id=pad_id,
            temperature=temperature,
            compute=compute,
            dist=dist,
            routes=None if inputs.routes is None else ("replay", inputs.routes),
        )
        # (B, T): the policy before this step, on the step's rows
        rows = torch.tensor(step.rows, dtype=torch.long, device=current.device)
        out.batch_stat = objective.bound.mini_batch_stat(
            RuleInputs.of(
                logp=current[rows], old_logp=inputs.old_logp[rows], advantages=inputs.advantages[rows], mask=mask[rows]
            )
        )
    return out


def accumulate_gradients(
    model,
    batch: Packed,
    step: OptStep,
    inputs: StepInputs,
    objective: Objective,
    *,
    pad_id: int,
    temperature: float,
    compute=contextlib.nullcontext,
    dist: Dist,
    histogram: bool = False,
    mismatch: bool = False,
    record: Callable | None = None,
) -> tuple[StepStats, torch.Tensor | None]:
    """Forward + backward of each micro-batch of `step` (gradients accumulate in `.grad`); returns
    this rank's statistics of the step and the log-ratio counts (or None). With `mismatch`, this
    forward (the policy before the step) measures the sampler's mismatch on its rows, for free.
    `record(idx, logp, entropy)`: a recorded step's capture (train/record.py) sees each forward."""
    stats, hist = StepStats(), None
    shared = mini_batch_inputs(
        model, batch, step, inputs, objective, pad_id=pad_id, temperature=temperature, compute=compute, dist=dist
    )  # counts, statistic
    replay = RouteReplay.of(model) if inputs.routes is not None else None
    for rows in step.micro:
        mb, idx = _micro(batch, rows, pad_id, dist.device)
        if replay is not None:  # set until the next micro-batch: the backward's checkpoint recompute replays too
            route_micro_batch(replay, ("replay", inputs.routes), idx, batch, mb)
        with compute(), RouterLogits(model, on=objective.router_aux_loss_coef > 0) as routed:
            logp, entropy = completion_logprobs(model, mb, temperature=temperature)  # (b, T) each
        logp, mask = logp.float(), mb.completion_mask
        moved = None if replay is None else moved_tokens(replay, mb, idx is not None)  # (layers, b, T) MoE routes
        x = replace(
            inputs.rows(idx, mask.shape[1]),  # old_logp, advantages, ...
            logp=logp,
            mask=mask,
            entropy=entropy,
            counts=shared.rows(idx, mask.shape[1]),
            stat=shared.batch_stat,
            # the clip's cells split by whether the token's experts moved
            token_splits=None if moved is None else {"experts_moved": moved.any(0), "experts_kept": ~moved.any(0)},
        )
        out = objective.loss(x)  # rule, aggregation
        loss = out.loss
        if routed is not None:  # per forward, as TRL and transformers: weighted by the micro-batch's rows
            aux = routed.aux_loss(mb.attention_mask) * (len(rows) / len(step.rows))  # 0 for a placeholder
            loss = loss + objective.router_aux_loss_coef * aux
            stats.router_aux.append(aux.detach().float())
        (loss * dist.loss_scale).backward()  # gradients accumulate
        stats.add(out, entropy, mask)
        if moved is not None:  # the live routers' choice against the replayed experts
            stats.routing.append({**agreement_sums(moved, mask), **load_sums(replay, mb, idx is not None)})
        if record is not None:
            record(idx, logp.detach(), entropy.detach())
        if mismatch:
            stats.mismatch.append(
                apply_correction(None, _take(inputs.sampler_logp, idx, mask.shape[1]), logp.detach(), mask).sums
            )
        if histogram and idx is not None:
            hist = add_histograms(hist, log_ratio_counts(logp.detach(), x.old_logp, x.A, mask))
    if replay is not None:
        replay.off()
    return stats, hist


def _take(t: torch.Tensor | None, idx: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """A micro-batch's rows of a per-row (B,) or (B, T) tensor, trimmed to `width` columns (zeros
    for the placeholder, idx None)."""
    if t is None:
        return None
    if idx is None:
        return t.new_zeros((1, 1) if t.dim() == 2 else (1,))
    return t[idx, :width] if t.dim() == 2 else t[idx]


def add_histograms(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Log-ratio counts (`log_ratio_counts`, device tensors) added bin by bin; `a` None is empty."""
    return b if a is None else a + b


def optimizer_step(
    model, optimizer, scheduler, grad_clip: float, loss: torch.Tensor | None = None
) -> tuple[torch.Tensor, bool]:
    """Clip (grad_clip 0 = no clipping; the norm is computed either way), then step, unless the
    global gradient norm is not finite: then the step is skipped (gradients dropped, LR schedule not
    advanced). `loss`: this rank's loss of the step; when it is not finite (a rule that returns inf
    with finite gradients) the norm is made NaN, so the step is skipped and counted the same way, on
    every rank alike. Returns (pre-clip global norm as a 0-d tensor, stepped)."""
    if loss is not None:
        nonfinite_loss_poisons_grad(model, loss)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    norm = full_tensor(norm).detach()
    stepped = bool(torch.isfinite(norm))  # the step's one host sync; the same global norm on every rank
    if stepped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


def nonfinite_loss_poisons_grad(model, loss: torch.Tensor) -> None:
    """Multiply one gradient element block by 1 (exactly: nothing changes) or by NaN when `loss` is not
    finite, without a host sync: the global norm then reads NaN on every rank (its all-reduce carries
    it), and the one check of the step skips it. The block is a parameter whose local shard is not
    empty (FSDP may leave a rank an empty shard)."""
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
        if g.numel():
            g.mul_(torch.where(torch.isfinite(loss), 1.0, float("nan")).to(g.dtype))
            return
