"""Token level: every rule on one recorded optimizer step, from the recorded inputs alone (no model).

    step = OptStepView(record, record.index["opt_steps"][k])
    res = replay_rule(step, rule, draw=0)       # loss, stats (as metrics.jsonl), g per micro-batch
    row = compare(step, res, trained_res)        # cosine, norm ratio, agreement, departure per quadrant

Design choices
- Training's arithmetic, term for term: each recorded micro-batch of each rank is one `policy_loss`
  call on the same tensors (the recorded float32 log-probs at the micro-batch's own width), with the
  mini-batch's global counts; the losses sum per rank in float32 then over ranks in float64, and the
  diagnostic sums combine and finalise as the trainer's do. So the trained rule reproduces the logged
  loss and counts exactly (tests/test_replay.py), and every other rule is computed the same way.
- g = d loss / d logp per token (the aggregated loss, weights and KL included: what the model's
  backward receives), one `torch.autograd.grad` per micro-batch on the rule's small graph.
- Each rule is bound once per optimizer step (objectives.loss.bind), then called per micro-batch
  with the micro-batch's bundle (objectives.inputs.RuleInputs.of, from the recorded tensors by their
  names). The inputs a rule may read are taken under their keyword (objectives.inputs.KEYWORDS:
  rewards, entropy) and prompt groups as the counts' `groups` whenever the record holds them, so a
  rule that reads an input added later replays once the record has it; a rule whose input the
  record lacks is reported as not replayable, not guessed.
- Draws: a rule that draws replays the recorded uniforms (the trained rule's own draws) as draw 0;
  other draws, and every draw when none was recorded, come from (run seed, "replay", record, slot, draw).
- Cells of the comparisons are the token-ratio quadrants (objectives.diagnostics.cell_index on r and
  A), the same for every rule, so "where the gradient departs" is comparable across rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from clipbench.objectives import CELLS, METHODS, RuleError, combine, finalize
from clipbench.objectives.diagnostics import cell_index
from clipbench.objectives.inputs import GIVEN, KEYWORDS, Counts, RuleInputs
from clipbench.objectives.loss import bind
from clipbench.replay.rules import RuleSpec
from clipbench.seeds import generator

SLOT_INPUTS = ("entropy",)  # recorded per slot (epoch): the policy's own forward


class NotReplayable(Exception):
    """The rule needs an input the record does not hold."""


@dataclass
class OptStepView:
    """One optimizer step of a record: its micro-batches' tensors, cut as training cut them."""

    record: object  # tracking.records.Record
    opt: dict  # its entry in index["opt_steps"]

    @property
    def slot(self) -> int:
        return int(self.opt["epoch"])

    def micro_batches(self) -> list[list[dict]]:
        """Every rank's micro-batches ({"rows", "width"}; empty rows: a placeholder)."""
        return self.opt["ranks"]

    def tensor(self, name: str, rows: torch.Tensor, width: int | None = None, slot: bool = False):
        t = self.record.get(name)
        if t is None:
            return None
        t = t[self.slot] if slot else t
        t = t[rows]
        return t[:, :width] if width is not None and t.dim() == 2 else t

    def inputs(self, mb: dict, uniforms: torch.Tensor | None) -> RuleInputs:
        """The bound rule's bundle for one micro-batch (logp detached: the caller makes it a leaf), with
        every given rule input the record holds, by its keyword, and the mini-batch's counts."""
        rows, w = torch.tensor(mb["rows"], dtype=torch.long), int(mb["width"])
        x = {
            "logp": self.tensor("logp", rows, w, slot=True),
            "old_logp": self.tensor("old_logp", rows, w),
            "advantages": self.tensor("advantages", rows),
            "mask": self.tensor("mask", rows, w).float(),
            "ref_logp": self.tensor("ref_logp", rows, w),
            "weights": self.tensor("weights", rows, w),
            "uniforms": None if uniforms is None else uniforms[rows, :w],
        }
        for kw in KEYWORDS:
            t = self.tensor(kw, rows, w, slot=kw in SLOT_INPUTS)
            if t is not None:
                x[kw] = t
        return RuleInputs.of(**x, counts=self.counts(mb))

    def counts(self, mb: dict) -> Counts:
        """The mini-batch's counts as training passed them (and the rows' prompt groups when recorded)."""
        return Counts(
            global_tokens=self.opt["global_tokens"],
            global_seqs=self.opt["global_seqs"],
            groups=self.tensor("groups", torch.tensor(mb["rows"], dtype=torch.long)),
        )


@dataclass
class RuleResult:
    rule: RuleSpec
    loss: float
    stats: dict  # finalised, as metrics.jsonl logs them
    g: list = field(default_factory=list)  # per micro-batch (rows, width, g (b, w)), every rank in order


def uniforms_for(step: OptStepView, rule: RuleSpec, draw: int) -> torch.Tensor | None:
    """(R, T) draws for a rule that draws: the recorded ones as draw 0, else seeded fresh ones."""
    if not METHODS[rule.method].needs_draws(rule.kwargs):
        return None
    recorded = step.record.get("uniforms")
    if draw == 0 and recorded is not None:
        return recorded[step.slot]
    idx = step.record.index
    shape = tuple(step.record.tensors["old_logp"].shape)
    return torch.rand(shape, generator=generator(idx.get("seed", 0), "replay", idx.get("step", 0), step.slot, draw))


def replay_rule(step: OptStepView, rule: RuleSpec, draw: int = 0) -> RuleResult:
    """The rule's loss, finalised stats and per-token gradients on one recorded optimizer step."""
    obj = step.record.index["objective"]
    try:
        bound = bind(rule.method, rule.kwargs, agg=obj["agg"], beta=obj["beta"], max_len=obj["max_len"])
    except ValueError as e:  # e.g. an aggregation this version does not know
        raise NotReplayable(f"{rule.label}: {e}") from None
    missing = [n for n in bound.reads if step.record.get(GIVEN[n]["keyword"]) is None]
    if missing:
        raise NotReplayable(f"{rule.label} reads {', '.join(missing)}, which this record does not hold")
    u = uniforms_for(step, rule, draw)
    rank_losses, sums, grads = [], [], []
    for rank in step.micro_batches():
        losses = []
        for mb in rank:
            if not mb["rows"]:
                losses.append(torch.zeros(()))  # a placeholder: no token, loss 0 (as in training)
                continue
            x = step.inputs(mb, u)
            logp = x.logp.clone().requires_grad_(True)
            try:
                out = bound(replace(x, logp=logp))
            except (ValueError, RuleError) as e:  # e.g. an input or aggregation this record lacks
                raise NotReplayable(f"{rule.label}: {e}") from None
            (g,) = torch.autograd.grad(out.loss, logp, allow_unused=True)
            grads.append((mb["rows"], int(mb["width"]), torch.zeros_like(logp) if g is None else g.detach()))
            losses.append(out.loss.detach())
            sums.append(out.sums)
        rank_losses.append(torch.stack(losses).sum().to(torch.float64))  # StepStats.sums: float32 sum per rank
    loss = float(torch.stack(rank_losses).sum())  # the all-reduce over ranks, in float64
    return RuleResult(rule, loss, {k: float(v) for k, v in finalize(combine(sums)).items()}, grads)


def flat_g(step: OptStepView, res: RuleResult) -> torch.Tensor:
    """(R, T) the per-token gradient of the whole mini-batch (0 outside it), float64."""
    out = torch.zeros(step.record.tensors["old_logp"].shape, dtype=torch.float64)
    for rows, w, g in res.g:
        out[torch.tensor(rows), :w] = g.to(torch.float64)
    return out


@dataclass
class Cells:
    """Each valid token of the mini-batch, its token-ratio cell (objectives.diagnostics.CELLS)."""

    rows: torch.Tensor  # (N,) row ids
    cols: torch.Tensor  # (N,) positions
    cell: torch.Tensor  # (N,) index into CELLS

    @classmethod
    def of(cls, step: OptStepView) -> Cells:
        rec, rows = step.record, torch.tensor(step.opt["rows"], dtype=torch.long)
        mask = rec.tensors["mask"][rows] != 0
        r = torch.exp((rec.tensors["logp"][step.slot][rows] - rec.tensors["old_logp"][rows]).clamp(-20, 20))
        A = rec.tensors["advantages"][rows].reshape(-1, 1)
        ii, jj = mask.nonzero(as_tuple=True)
        return cls(rows[ii], jj, cell_index(A, r)[ii, jj])


def compare(cells: Cells, g: torch.Tensor, g_ref: torch.Tensor, top: int = 0) -> dict:
    """A rule's g against the trained rule's on the mini-batch's valid tokens: cosine, norm ratio,
    the agreement table (gradient on/off; per cell: `cut`, tokens whose gradient this rule switches
    off, `added`, tokens it gives one the trained rule does not), the share of |g| per cell and the
    departure sum |g - g_ref| (over the trained rule's sum |g_ref| = `ref_l1`; NaN when the trained
    rule has no gradient on the step) per cell; the `top` tokens that differ most."""
    a, b = g[cells.rows, cells.cols], g_ref[cells.rows, cells.cols]
    na, nb = a.norm(), b.norm()
    on_a, on_b = a != 0, b != 0
    ref_l1 = float(b.abs().sum())
    ref_mass = b.abs().sum() if ref_l1 > 0 else torch.tensor(float("nan"), dtype=b.dtype)  # no reference gradient
    same = torch.equal(a, b)  # the trained rule itself (and its twins): exactly 1, not 1 - 1e-16
    out = {
        "grad_cosine": 1.0 if same else float(a @ b / (na * nb)) if na > 0 and nb > 0 else 0.0,
        "grad_norm_ratio": 1.0 if same and nb > 0 else float(na / nb) if nb > 0 else float("nan"),
        "agree/both": int((on_a & on_b).sum()),
        "agree/rule_only": int((on_a & ~on_b).sum()),
        "agree/trained_only": int((~on_a & on_b).sum()),
        "agree/neither": int((~on_a & ~on_b).sum()),
        "departure": float((a - b).abs().sum() / ref_mass),
        "ref_l1": ref_l1,
    }
    mass = a.abs().sum().clamp(min=1e-300)
    for i, c in enumerate(CELLS):
        sel = cells.cell == i
        out[f"mass/{c}"] = float(a[sel].abs().sum() / mass)
        out[f"departure/{c}"] = float((a[sel] - b[sel]).abs().sum() / ref_mass)
        out[f"cut/{c}"] = int((sel & ~on_a & on_b).sum())  # the trained rule's gradient, switched off here
        out[f"added/{c}"] = int((sel & on_a & ~on_b).sum())  # a gradient the trained rule switched off
    if top:
        k = min(top, a.numel())
        order = (a - b).abs().topk(k).indices if k else torch.empty(0, dtype=torch.long)
        out["disagree"] = [
            {
                "row": int(cells.rows[i]),
                "pos": int(cells.cols[i]),
                "cell": CELLS[int(cells.cell[i])],
                "g": float(a[i]),
                "g_trained": float(b[i]),
            }
            for i in order
            if a[i] != b[i]
        ]
    return out


def cosine_matrix(gs: list[torch.Tensor]) -> list[list[float]]:
    """Pairwise cosines of flattened gradients (1 where both are zero, 0 where one is)."""
    m = torch.stack([g.reshape(-1) for g in gs]).to(torch.float64)
    n = m.norm(dim=1)
    dots = m @ m.T
    denom = n[:, None] * n[None, :]
    cos = torch.where(denom > 0, dots / denom.clamp(min=1e-300), (n[:, None] == n[None, :]).to(dots))
    return cos.tolist()
