"""Recording the rule's inputs of a rollout step in the built-in loop, for `clipbench replay` (docs/replay.md).

    recorder = Recorder(cfg, rd, dist, model, sink)         # setup: train.record
    capture = recorder.start(step, packed, batch, inputs)    # update: NO_CAPTURE unless this step is recorded
    for s in plan:
        accumulate_gradients(..., record=capture.forwards(s, inputs))   # each forward's logp and entropy
        capture.before_optimizer_step(s, trainer)                       # opt_step, lr; the state when asked
        optimizer_step(...)
    capture.finish()                                         # summed over ranks; rank 0 writes the record

Design choices
- What is recorded is what the rule saw: each micro-batch's float32 log-probs and entropies (at its
  own width), the rollout's old log-probs, advantages, mask, sampler log-probs, reference log-probs,
  the sampler correction's weights and each epoch's uniforms, plus what later rules and
  aggregations may read (rewards, correctness, prompt groups) and the token ids (text in reports).
- A mixture-of-experts policy with routing replay (model.routing_replay r2, r3) records the route
  table its forwards replayed (rows x layers x columns x k experts, +1, 0: none; int16), the same
  for every epoch, so the replay's forwards route as training did; with `none` the forwards routed
  freely, and a replay's forward of the same state routes the same way, so nothing is recorded.
  An epoch's optimizer steps cover every row once, so the log-probs are kept as (epochs, B, T): one
  slot per epoch (clipbench.tracking.records holds the layout).
- Each optimizer step's mini-batch rows and every rank's micro-batches (placeholders included) are
  in the index, so a replay sums exactly the terms training summed, in the same order.
- No host sync during the update: the capture writes device tensors in place; `finish` sums them over
  ranks (each row is one rank's per epoch: one collective per recorded rollout step) and moves them
  to the host once.
- The policy before an optimizer step (train.record.state: last or all) is saved with the record as a
  checkpoint-layout DCP of the model and the optimizer (sharded for large models, loadable at any
  world size), after the step's backward (gradients present, so DCP never initialises an empty
  optimizer state by stepping it) and before the optimizer moves the weights.
- Size: the planned bytes of each record are known from its shapes before anything is written, on
  every rank alike; a record that would take the run's records past train.record.max_mb is skipped
  (noted in status.json) and recording stops there.
- Recording draws no random number and changes no tensor the update uses: a recorded run trains
  exactly as an unrecorded one (tests/test_record.py), and resumes like one (truncated records are
  written again).
"""

from __future__ import annotations

import torch

from clipbench.objectives import METHODS
from clipbench.tracking.records import (
    install_record,
    record_name,
    record_root,
    record_steps,
    records_bytes,
    staging_dir,
    state_name,
)
from clipbench.train.checkpoint import save_model_state

MB = 1 << 20


def state_mode(cfg) -> str:
    """train.record.state resolved: auto is `last` for the built-in loop."""
    mode = cfg.train.record.state
    return "last" if mode == "auto" else mode


class NoCapture:
    """The capture of a rollout step that is not recorded: every hook does nothing."""

    def forwards(self, s, inputs):
        return None

    def before_optimizer_step(self, s, trainer) -> None:
        pass

    def finish(self) -> None:
        pass


NO_CAPTURE = NoCapture()


class Recorder:
    """Decides which rollout steps are recorded and keeps the run's record budget (every rank alike)."""

    def __init__(self, cfg, rd, dist, model, sink=None):
        self.cfg, self.rd, self.dist, self.sink = cfg, rd, dist, sink
        self.every = cfg.train.record.every
        self.n_params = sum(p.numel() for p in model.parameters())  # global counts, sharded or not
        self.used = records_bytes(rd.path) if self.every else 0  # after a resume's truncation: the kept ones
        self.full = False

    def start(self, step: int, packed, batch, inputs):
        """The capture of rollout step `step`: NO_CAPTURE unless it is recorded and fits the budget."""
        if not self.every or step % self.every or self.full:
            return NO_CAPTURE
        size = planned_bytes(self.cfg, packed, inputs, self.n_params)
        if self.used + size > self.cfg.train.record.max_mb * MB:
            self.full = True
            if self.dist.main:
                self.rd.update_status(
                    record_note=f"recording stopped at rollout step {step}: its record ({size / MB:.1f} "
                    f"MB) would take the run's records past train.record.max_mb="
                    f"{self.cfg.train.record.max_mb}"
                )
            return NO_CAPTURE
        self.used += size
        return Capture(self, step, packed, batch, inputs)


def planned_bytes(cfg, packed, inputs, n_params: int) -> int:
    """A record's size, from shapes every rank knows before anything is written: per token 4 bytes for
    each slot of logp, entropy (and uniforms), old_logp, token id, optional inputs, 1 for the mask;
    the prompts; the policy states (AdamW: weights and two moments, 12 bytes per parameter)."""
    (B, T), E = packed.completion_ids.shape, cfg.train.epochs
    per_token = (
        4 * 2 * E + 4 + 4 + 1 + 4 * sum(t is not None for t in (inputs.ref_logp, inputs.weights, inputs.sampler_logp))
    )
    per_token += 4 * E if _draws(cfg) else 0
    routes = recorded_routes(cfg, inputs)
    per_route = 0 if routes is None else 2 * routes[0].numel()  # int16, per row: layers x columns x k
    n_states = {"none": 0, "last": 1, "all": E * min(cfg.train.mini_batches, B)}[state_mode(cfg)]
    return B * T * per_token + 4 * packed.input_ids.numel() + 32 * B + B * per_route + n_states * n_params * 12


def recorded_routes(cfg, inputs) -> torch.Tensor | None:
    """The route table the update's forwards replayed (r2, r3: (B, layers, columns, k) int32 +1), or None
    (a dense policy, or routing replay none: the forwards routed freely)."""
    return inputs.routes if cfg.model.routing_replay != "none" else None


class Capture:
    """One recorded rollout step: device buffers filled during the update, written by `finish`."""

    def __init__(self, recorder: Recorder, step: int, packed, batch, inputs):
        self.r, self.step, self.packed, self.batch, self.inputs = recorder, step, packed, batch, inputs
        (B, T), E, dev = packed.completion_ids.shape, recorder.cfg.train.epochs, recorder.dist.device
        self.logp = torch.zeros(E, B, T, device=dev)
        self.entropy = torch.zeros(E, B, T, device=dev)
        self.uniforms = torch.zeros(E, B, T, device=dev) if _draws(recorder.cfg) else None
        self.opt_steps: list[dict] = []
        self.tmp = record_root(recorder.rd.path) / f".tmp-{record_name(step)}"
        if recorder.dist.main:
            staging_dir(self.tmp.parent, record_name(step))
        recorder.dist.barrier()

    # -- hooks of the update --------------------------------------------------------------------

    def forwards(self, s, inputs):
        """The hook `accumulate_gradients` calls with each micro-batch of optimizer step `s`."""
        if self.uniforms is not None and s.index == 0:  # drawn once per epoch (loop.update)
            self.uniforms[s.epoch] = inputs.uniforms

        def record(idx, logp, entropy):
            if idx is not None:  # a placeholder has no rows
                self.logp[s.epoch, idx, : logp.shape[1]] = logp
                self.entropy[s.epoch, idx, : entropy.shape[1]] = entropy.float()

        return record

    def before_optimizer_step(self, s, trainer) -> None:
        """The optimizer step's place in the run; the policy and optimizer before it, when asked."""
        opt_step = trainer.state["opt_step"] + 1  # numbered as metrics.jsonl numbers it
        lens = self.packed.completion_lens
        self.opt_steps.append(
            {
                "opt_step": opt_step,
                "epoch": s.epoch,
                "mini_batch": s.index,
                "rows": list(s.rows),
                "ranks": [
                    [{"rows": list(m), "width": max(1, max((lens[i] for i in m), default=1))} for m in rank]
                    for rank in s.ranks
                ],
                "global_tokens": s.tokens,
                "global_seqs": s.seqs,
                "lr": trainer.optimizer.param_groups[0]["lr"],
            }
        )
        mode, cfg = state_mode(self.r.cfg), self.r.cfg
        last = s.epoch == cfg.train.epochs - 1 and s.index == min(cfg.train.mini_batches, len(lens)) - 1
        if mode == "all" or (mode == "last" and last):
            self.opt_steps[-1].update(state=state_name(opt_step), optimizer_state=bool(trainer.optimizer.state))
            save_model_state(
                self.tmp / state_name(opt_step),
                model=trainer.model,
                optimizer=trainer.optimizer,
                tokenizer=trainer.tokenizer,
                dist=trainer.dist,
            )

    def finish(self) -> None:
        """Sum the captured slots over ranks, move everything to the host once, rank 0 installs it."""
        dist = self.r.dist
        slots = dist.all_reduce_(torch.stack([self.logp, self.entropy]))  # each row is one rank's per epoch
        if dist.main:
            tensors = {"logp": slots[0], "entropy": slots[1], **self.row_tensors()}
            if self.uniforms is not None:
                tensors["uniforms"] = self.uniforms
            path = install_record(self.tmp, self.index(), tensors)
            self.r.rd.update_status(records=record_steps(self.r.rd.path))
            if self.r.sink is not None:  # the index (small) mirrors to MLflow; the tensors stay in the store
                self.r.sink.log_artifact(path / "index.json", f"record/{path.name}")
        dist.barrier()

    # -- what the record holds --------------------------------------------------------------------

    def row_tensors(self) -> dict[str, torch.Tensor]:
        p, inputs, batch = self.packed, self.inputs, self.batch
        B, Lp = len(p.completion_lens), p.input_ids.shape[1] - p.completion_ids.shape[1]
        out = {
            "completion_ids": p.completion_ids.to(torch.int32),
            "mask": (p.completion_mask != 0).to(torch.uint8),
            "advantages": inputs.advantages.float(),
            "old_logp": inputs.old_logp.float(),
            "groups": torch.arange(B) // self.r.cfg.sampler.group_size,
            "prompt_ids": p.input_ids[:, :Lp].to(torch.int32),
            "prompt_lens": torch.tensor(p.prompt_lens, dtype=torch.int32),
        }
        for name in ("ref_logp", "weights", "sampler_logp"):
            if getattr(inputs, name) is not None:
                out[name] = getattr(inputs, name).float()
        for name in ("rewards", "correct"):
            if getattr(batch, name) is not None:
                out[name] = getattr(batch, name).float()
        routes = recorded_routes(self.r.cfg, inputs)
        if routes is not None:
            out["routes"] = routes.to(torch.int16)
        return out

    def index(self) -> dict:
        cfg = self.r.cfg
        rule = cfg.objective
        return {
            "engine": "builtin",
            "step": self.step,
            "world_size": self.r.dist.world,
            "seed": cfg.seed,
            "objective": {
                "method": rule.name,
                "params": rule.params,
                "agg": cfg.train.agg.name,
                "beta": cfg.train.beta,
                "max_len": cfg.sampler.max_new_tokens,
            },
            "model": cfg.model.name,
            "routing_replay": cfg.model.routing_replay,
            "temperature": cfg.sampler.temperature,
            "group_size": cfg.sampler.group_size,
            "optimizer": {
                "name": "adamw",
                "lr": cfg.train.lr,
                "betas": list(cfg.train.betas),
                "weight_decay": cfg.train.weight_decay,
                "grad_clip": cfg.train.grad_clip,
            },
            "slots": cfg.train.epochs,
            "opt_steps": self.opt_steps,
        }


def _draws(cfg) -> bool:
    """Does the trained rule draw uniforms (then each epoch's draws are recorded)?"""

    rule = cfg.objective
    return METHODS[rule.name].needs_draws(rule.params)
