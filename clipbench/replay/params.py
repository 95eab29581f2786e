"""Parameter level: each rule's gradient at the recorded policy state, and one optimizer step ahead.

    state = load_state(record, opt)                       # None when the record holds no state for opt
    grads = param_gradients(state, step, {label: result})  # parameter gradients per rule
    ahead = lookahead(state, step, grads[label])           # KL(new || old), entropy change, dlogp correct/incorrect

Design choices
- The state is the one the record saved before the optimizer step (checkpoint layout: model and
  AdamW state), loaded into a plain HF model in float32 on the replay's device.
- One forward per micro-batch, cut as training cut it; each rule's parameter gradient is the
  vector-Jacobian product of that forward with the rule's token-level g (d loss / d logp, from
  tokens.py), accumulated over micro-batches: by the chain rule the gradient training's backward
  computes, for R rules at the cost of one forward and R backward passes. The forward's log-probs
  are checked against the recorded ones (`state/logp_max_abs_diff`: 0 on the run's machine, in its dtype:
  replay/run.py runs this level on the thread count the run recorded, since a forward's summation
  order depends on it; on another machine, or a run resumed on another count, a few ulps).
- Lookahead: from the saved weights and optimizer state, one step of the run's optimizer (AdamW, the
  recorded learning rate, the run's gradient clipping) with the rule's gradient, then one forward of
  the same mini-batch: KL(new || old) over the whole vocabulary at the sampling temperature, the
  mean token entropy's change, and the mean change of each completion's log-probability, for correct
  and incorrect completions apart.
- Mixture-of-experts: a record of routing replay r2/r3 holds the route table training's forwards
  replayed; every forward here replays it (the same hooks, models/routing.py), so the forward is
  training's. A record of `none` holds none: its forwards routed freely, as these do.
- Layer groups: embeddings, each decoder layer, the final norm, the head (parameter names of HF's
  decoder models); cosines per group vs the trained rule.
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass

import torch

from clipbench.errors import StoreError
from clipbench.models.routing import RouteReplay, micro_columns
from clipbench.tracking.records import REMEDY, TENSORS
from clipbench.train.checkpoint import load_model_state, one_process_ok
from clipbench.train.logprobs import completion_logprobs
from clipbench.train.packing import Packed, pack


@dataclass
class PolicyState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    saved: tuple  # (model state dict, optimizer state dict) to restore between lookaheads
    packed: Packed
    temperature: float
    grad_clip: float
    routes: torch.Tensor | None = None  # MoE routing replay: the record's route table (B, layers, columns, k) +1


def record_routes(record) -> torch.Tensor | None:
    """The route table a record's forwards replayed (routing replay r2/r3), or None (a dense policy,
    routing replay none, a record from before records held routes); StoreError when a record of
    r2/r3 lacks it."""
    mode, routes = record.index.get("routing_replay"), record.get("routes")
    if mode in ("r2", "r3") and routes is None:
        raise StoreError(
            record.path / TENSORS,
            f"a record of model.routing_replay={mode} without its 'routes' tensor: its forwards cannot route as "
            "training did",
            REMEDY,
        )
    return routes


def rebuild_packed(record, pad_id: int) -> Packed:
    """The rollout batch as training packed it, from the record's token ids."""
    t = record.tensors
    lens = t["mask"].sum(-1).tolist()
    Lp = t["prompt_ids"].shape[1]
    prompts = [row[Lp - n :].tolist() for row, n in zip(t["prompt_ids"], t["prompt_lens"].tolist())]
    completions = [row[:n].tolist() for row, n in zip(t["completion_ids"], lens)]
    return pack(prompts, completions, pad_id)


def load_state(record, opt: dict, device: str = "cpu") -> PolicyState | None:
    """The policy and optimizer before optimizer step `opt` (None when the record did not save them)."""
    # PLC0415, deferred: torch is heavy
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    path = record.state(opt["opt_step"])
    if path is None:
        return None
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path / "model"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path / "model")
    oc = record.index["optimizer"]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt["lr"], betas=tuple(oc["betas"]), weight_decay=oc["weight_decay"], fused=True
    )
    if opt.get("optimizer_state", True):
        load_model_state(path, model=model, optimizer=optimizer)
    else:  # the run's first optimizer step: AdamW had no state yet
        sd = model.state_dict()
        with one_process_ok():
            dcp.load({"model": sd}, checkpoint_id=str(path / "dcp"))
        model.load_state_dict(sd)
    model.to(device).train()
    routes = record_routes(record)
    if routes is not None:
        RouteReplay.attach(model)
        routes = routes.to(device=device, dtype=torch.int32)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    return PolicyState(
        model,
        optimizer,
        saved,
        rebuild_packed(record, tok.pad_token_id),
        record.index.get("temperature", 1.0),
        oc.get("grad_clip", 0.0),
        routes,
    )


@contextlib.contextmanager
def _routed(state: PolicyState, rows: list[int], mb):
    """The forwards inside route micro-batch `mb` (rows `rows`) by the record's routes, if it has them."""
    if state.routes is None:
        yield
        return
    replay = RouteReplay.of(state.model)
    replay.replay(state.routes, torch.tensor(rows, device=state.routes.device), micro_columns(state.packed, mb))
    try:
        yield
    finally:
        replay.off()


def _forward(state: PolicyState, rows: list[int], *, grad: bool):
    mb = state.packed.select(rows).to(next(state.model.parameters()).device)
    with torch.set_grad_enabled(grad), _routed(state, rows, mb):
        logp, ent = completion_logprobs(state.model, mb, temperature=state.temperature)
    return mb, logp, ent


@contextlib.contextmanager
def threads(n: int | None):
    """torch's intra-op thread count set to `n` inside (None: left as it is), restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def param_gradients(state: PolicyState, step, results: dict) -> tuple[dict[str, list[torch.Tensor]], float]:
    """{label: [grad per parameter]} for each rule's token-level result (tokens.RuleResult), and the
    largest |logp - recorded logp| of the forward."""
    params = [p for p in state.model.parameters() if p.requires_grad]
    grads = {label: [torch.zeros_like(p) for p in params] for label in results}
    diff = 0.0
    by_mb = {label: {tuple(rows): g for rows, _, g in res.g} for label, res in results.items()}
    recorded = step.record.tensors["logp"][step.slot]
    for rank in step.micro_batches():
        for mb in rank:
            if not mb["rows"]:
                continue
            _, logp, _ = _forward(state, mb["rows"], grad=True)
            diff = max(diff, float((logp.detach().cpu() - recorded[mb["rows"], : logp.shape[1]]).abs().max()))
            for label, acc in grads.items():
                g = by_mb[label][tuple(mb["rows"])].to(logp.device)
                for a, d in zip(
                    acc, torch.autograd.grad(logp, params, grad_outputs=g, retain_graph=True, allow_unused=True)
                ):
                    if d is not None:
                        a.add_(d)
    return grads, diff


def global_norm(grads: list[torch.Tensor]) -> float:
    """As clip_grad_norm_ computes it: the norm of the per-tensor norms."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def layer_groups(model) -> list[tuple[str, list[int]]]:
    """[(group, parameter indices)] in order: embeddings, layer 0..L-1, final norm, head, others."""
    groups: dict[str, list[int]] = {}
    for i, (name, _p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad):
        m = re.search(r"\.layers\.(\d+)\.", name)
        key = (
            f"layer {int(m.group(1))}"
            if m
            else "embed"
            if "embed" in name
            else "head"
            if "lm_head" in name
            else "norm"
            if "norm" in name
            else "other"
        )
        groups.setdefault(key, []).append(i)
    return list(groups.items())


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    na, nb = global_norm(a), global_norm(b)
    return dot / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)


@torch.no_grad()
def _dists(state: PolicyState, rows: list[int]):
    """(log-distributions over the vocabulary (b, w, V), token log-probs (b, w), entropy (b, w), mask)."""
    mb, logp, ent = _forward(state, rows, grad=False)
    T = mb.completion_ids.shape[1]
    with _routed(state, rows, mb):
        out = state.model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            use_cache=False,
            logits_to_keep=T + 1,
        )
    logits = out.logits[:, :-1].float()
    return torch.log_softmax(logits / state.temperature, -1), logp, ent, mb.completion_mask


def lookahead(
    state: PolicyState, step, grads: list[torch.Tensor], before: dict | None = None, lr: float | None = None
) -> dict:
    """One optimizer step with `grads` from the saved state, measured on the mini-batch; `before`: the
    state's own distributions (computed once per state with `measure`); `lr`: the step's learning rate
    instead of the recorded optimizer's (a rule at its own tuned rate), restored with the state after."""
    before = before or measure(state, step)
    model, opt = state.model, state.optimizer
    restore(state)
    params = [p for p in model.parameters() if p.requires_grad]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, state.grad_clip if state.grad_clip > 0 else float("inf"))
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    used = opt.param_groups[0]["lr"]
    opt.step()
    opt.zero_grad(set_to_none=True)
    after = measure(state, step)
    restore(state)
    return {**_changes(before, after, step), "lookahead/lr": float(used)}


def restore(state: PolicyState) -> None:
    """The model and optimizer back at the recorded state."""
    state.model.load_state_dict(state.saved[0])
    state.optimizer.load_state_dict(copy.deepcopy(state.saved[1]))


def measure(state: PolicyState, step) -> dict:
    """Per micro-batch: log-distributions, token log-probs, entropies, mask (the policy as it is now)."""
    return {tuple(mb["rows"]): _dists(state, mb["rows"]) for rank in step.micro_batches() for mb in rank if mb["rows"]}


def _changes(before: dict, after: dict, step) -> dict:
    correct = step.record.get("correct")
    kl = ent = n = 0.0
    seq = {True: [], False: []}
    for rows, (lq_old, lp_old, h_old, mask) in before.items():
        lq_new, lp_new, h_new, _ = after[rows]
        kl += float(((lq_new.exp() * (lq_new - lq_old)).sum(-1) * mask).sum())
        ent += float(((h_new - h_old) * mask).sum())
        n += float(mask.sum())
        d = ((lp_new - lp_old) * mask).sum(-1)
        for r, v in zip(rows, d.tolist()):
            seq[bool(correct is not None and correct[r] > 0)].append(v)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "lookahead/kl": kl / max(n, 1.0),
        "lookahead/entropy_change": ent / max(n, 1.0),
        "lookahead/dlogp_correct": mean(seq[True]) if correct is not None else float("nan"),
        "lookahead/dlogp_incorrect": mean(seq[False]),
    }
