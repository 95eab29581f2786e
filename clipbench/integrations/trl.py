"""clipbench's clip rules as the policy loss of TRL's `GRPOTrainer`.

    from trl import GRPOConfig
    from clipbench.integrations.trl import ClipbenchGRPOTrainer

    trainer = ClipbenchGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=my_reward, train_dataset=ds,
                                   args=GRPOConfig(output_dir="out", loss_type="dapo"),
                                   method="nsr", params={"p": 0.5, "delta": 0.1})
    trainer.train()

Any rule in `clipbench.objectives.METHODS` (built-in or registered by a user's plugin) with any
aggregation replaces TRL's policy loss; everything else stays TRL's (generation, vLLM modes,
rewards, advantages, reference model, accelerate / DeepSpeed / FSDP, logging to `report_to`).

Design choices:

* One override, `_compute_loss`: TRL's own forward (`_get_per_token_logps_and_entropies`, so its
  temperature, chunking and multimodal inputs apply), TRL's old and reference log-probs and
  advantages, then the run's bound rule on one `RuleInputs` (clipbench.objectives).
* Exact global normalisation. An optimizer step accumulates `gradient_accumulation_steps` (GA)
  micro-batches on each of W processes, and DDP/DeepSpeed/FSDP average the W gradients. Each
  micro-batch's loss gets the *optimizer step's* global counts / W as `global_tokens` /
  `global_seqs` (valid tokens for token-mean; sequences with a valid token for the seq-means),
  counted from the micro-batches of this window in TRL's generation buffer and summed over
  processes. The GA micro-batch losses then add up to the loss of the whole optimizer step, whatever
  the split. TRL's own count spans the generation batch and is rescaled by GA / steps_per_generation,
  which is the wrong window when the two differ (trl#5619); here the window must lie inside one
  generation batch (steps_per_generation x num_iterations a multiple of GA), else the trainer
  refuses to start.
* The aggregation defaults to the one TRL's `loss_type` names (dapo/bnpo/cispo/vespo:
  token-mean; grpo/sapo: seq-mean-token-mean; dr_grpo: seq-mean-token-sum-norm over
  `max_completion_length`; luspo: seq-mean-token-sum); `agg=` picks any other.
* Diagnostics: the `sums` of every micro-batch of an optimizer step are combined, all-reduced over
  processes and finalized (`clipbench.objectives.combine / all_reduce_sums / finalize`: counts add up,
  means are token-weighted, extrema are extrema), with the token-weighted entropy, and appended once
  per optimizer step to TRL's metrics, so they reach every `report_to` backend under clipbench's names
  (`q1/out_of_band`, `clip_events`, `ratio/max`, `entropy`, ...).
* TRL features that change the loss in ways a clip rule cannot see are refused with a one-line
  ValueError naming the setting (entropy masks and bonuses, off-policy sequence masks, TRL's own
  sequence-level ratio, `delta`). vLLM's truncated importance-sampling weights
  (`vllm_importance_sampling_correction`) multiply the rule's per-token loss as in TRL; the KL term
  (beta > 0) is clipbench's k3, as TRL's (times the token ratio with `use_bias_correction_kl`).
* What the loss call passes is declared once (`integrations/trl_settings.py: FEEDS`): rules reading
  the token entropy (aspo) get TRL's entropies of the same forward; a rule reading a given input it
  does not pass (topr's sequence reward, rollout_is's sampler log-probs) and an aggregation reading
  each row's prompt group (TRL's rows are shuffled) are refused by it in one line, here and at the
  engine's preflight. Rules with a mini-batch statistic (bapo, m2po) compute it per micro-batch, as
  their sources do. token-sum is multiplied by the process count (DDP averages), as verl's. TRL's masked importance sampling (token_mask, sequence_mask) zeroes
  weights: those tokens are counted per cell as masked (`correction/<cell>/masked`).
* NSR's coin flips come from a generator seeded by (args.seed, optimizer step, micro-batch, rank):
  no global RNG is touched, so TRL's own sampling stream is the same as with its built-in losses.
* Recording (`record={"dir": ..., "every": N, "max_mb": M}`, docs/replay.md): every N-th generation
  batch, each micro-batch's rule inputs go to a `clipbench.integrations.record.LossRecorder`, one
  record per generation batch (and process), for `clipbench replay`.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from clipbench.config.schema import RecordConfig  # train.record.max_mb's default: the schema's
from clipbench.integrations.record import LossRecorder
from clipbench.integrations.trl_settings import FEEDS
from clipbench.objectives import (
    AGGREGATIONS,
    METHODS,
    aggregate,
    all_reduce_sums,
    combine,
    finalize,
    kl_k3,
    log_ratio_histogram,
)
from clipbench.objectives.corrections import KEPT, MASKED
from clipbench.objectives.inputs import Counts, RuleInputs
from clipbench.objectives.loss import bind
from clipbench.seeds import derive_seed as _seed  # the one seed derivation

# TRL loss_type -> the clipbench aggregation it computes (when `agg` is not given).
AGG_OF_LOSS_TYPE = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
}
# Inputs of TRL's forward besides ids and mask (multimodal models), passed through unchanged.
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def check_trl_args(args, method: str) -> None:
    """Refuse GRPOConfig settings the clipbench loss cannot honour (one-line ValueError)."""

    def refuse(field: str, value, why: str) -> None:
        raise ValueError(f"GRPOConfig.{field}={value!r}: {why}")

    if args.top_entropy_quantile < 1.0:
        refuse(
            "top_entropy_quantile", args.top_entropy_quantile, "entropy masks are not supported with clipbench rules"
        )
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        refuse("entropy_coef", args.entropy_coef, "the entropy bonus is not supported with clipbench rules")
    if args.off_policy_mask_threshold is not None:
        refuse(
            "off_policy_mask_threshold",
            args.off_policy_mask_threshold,
            "off-policy sequence masks are not supported with clipbench rules",
        )
    if args.importance_sampling_level != "token":
        refuse(
            "importance_sampling_level",
            args.importance_sampling_level,
            "the ratio level is the rule's own (use method='gspo' or 'gspo_token' for sequence ratios)",
        )
    if args.delta is not None:
        refuse("delta", args.delta, "use method='dual_clip' and its parameter c")
    ga, spg, mu = args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations
    if (spg * mu) % ga:
        refuse(
            "gradient_accumulation_steps",
            ga,
            f"an optimizer step must lie inside one generation batch for an exact global loss "
            f"normalisation: steps_per_generation x num_iterations ({spg} x {mu}) must be a multiple of "
            f"gradient_accumulation_steps (TRL's own count covers the wrong window here, trl#5619)",
        )


class ClipbenchGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with a clipbench rule as its policy loss (see the module docstring).

    method: a name in clipbench.objectives.METHODS; params: its parameters (defaults from the
    registry); agg: an aggregation (default: the one `args.loss_type` names); log_histograms: keep
    the log-ratio histogram of every micro-batch in `self.clipbench_histograms` (for callers that
    store them, like clipbench's `engine: trl`)."""

    def __init__(
        self,
        *args,
        method: str = "grpo",
        params: dict[str, Any] | None = None,
        agg: str | None = None,
        log_histograms: bool = False,
        record: dict | None = None,
        **kwargs,
    ):
        if method not in METHODS:
            raise ValueError(f"unknown clipbench method {method!r}; valid: {', '.join(sorted(METHODS))}")
        bound = bind(method, dict(params or {}))  # looked up and validated once, before TRL loads anything
        for slot, name in (("objective", method), ("aggregation", agg)):  # what TRL's loss call cannot feed
            if name is not None and (why := FEEDS.refusal(slot, name)):
                raise ValueError(why)
        self.clipbench_method = method
        self.clipbench_params = bound.params
        super().__init__(*args, **kwargs)
        check_trl_args(self.args, method)
        self.clipbench_agg = agg or AGG_OF_LOSS_TYPE.get(self.args.loss_type, "token-mean")
        if self.clipbench_agg not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.clipbench_agg!r}; valid: {', '.join(AGGREGATIONS)}")
        self.clipbench_rule = bound.with_loss(
            agg=self.clipbench_agg,
            beta=0.0 if self.args.use_bias_correction_kl else self.beta,  # the corrected KL is added here
            max_len=self.max_completion_length,
        )
        self.clipbench_histograms: list[dict] = [] if log_histograms else None
        self._cb_sums: list[dict] = []  # the diagnostics sums of this optimizer step's micro-batches
        self._cb_counts: tuple | None = None  # (buffer, window start, (tokens, seqs))
        self._cb_recorder = self._recorder(record) if record and record.get("every") else None

    # -- the optimizer step's global counts -------------------------------------------------------

    def _window_counts(self, inputs: dict, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, seqs) of this optimizer step over all processes, divided by the process count."""

        def counts(batches):
            tok = seq = 0
            for b in batches:
                m = b["completion_mask"] if "tool_mask" not in b else b["completion_mask"] * b["tool_mask"]
                tok = tok + m.sum()
                seq = seq + (m.sum(-1) > 0).sum()
            return torch.stack([torch.as_tensor(tok), torch.as_tensor(seq)]).float()

        if mode != "train":  # evaluation: one batch, no accumulation
            c = self.accelerator.reduce(counts([inputs]), reduction="sum") / self.accelerator.num_processes
            return c[0].clamp(min=1.0), c[1].clamp(min=1.0)
        ga, spg = self.current_gradient_accumulation_steps, self.args.steps_per_generation
        start = self._step - self._step % ga
        cached = self._cb_counts
        if cached is None or cached[0] is not self._buffered_inputs or cached[1] != start:
            window = [self._buffered_inputs[s % spg] for s in range(start, start + ga)]
            c = self.accelerator.reduce(counts(window), reduction="sum") / self.accelerator.num_processes
            cached = self._cb_counts = (self._buffered_inputs, start, (c[0].clamp(min=1.0), c[1].clamp(min=1.0)))
        return cached[2]

    # -- the loss -------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]  # (B, T)
        logp, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _FORWARD_KEYS},
        )  # (B, T)
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old  # TRL skips it when the batch is on-policy
        adv = inputs["advantages"]
        if adv.dim() == 2 and adv.shape[1] == 1:
            adv = adv.squeeze(1)
        if adv.dim() != 1:
            raise ValueError(f"clipbench rules take one advantage per sequence, got shape {tuple(adv.shape)}")

        micro = self._step % self.current_gradient_accumulation_steps if mode == "train" else 0
        gen = torch.Generator(device=logp.device).manual_seed(
            _seed(self.args.seed, "nsr", mode, self.state.global_step, micro, self.accelerator.process_index)
        )
        tokens, seqs = self._window_counts(inputs, mode)
        weights = (
            inputs["importance_sampling_ratio"] if self.use_vllm and self.vllm_importance_sampling_correction else None
        )  # TRL's truncated / masked importance-sampling weights of the policy term
        maskf = mask.to(torch.float32)
        status = None
        if weights is not None:
            weights = weights.expand_as(logp)  # sequence modes: (B, 1)
            status = torch.where((weights == 0) & (maskf > 0), MASKED, KEPT).to(torch.int8)
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        corrected_kl = ref is not None and self.args.use_bias_correction_kl
        u = (
            torch.rand(logp.shape, generator=gen, device=gen.device).to(logp.device)
            if self.clipbench_rule.draws
            else None
        )  # the rule's own draw
        out = self.clipbench_rule(
            RuleInputs.of(
                logp=logp,
                old_logp=old,
                advantages=adv,
                mask=maskf,
                counts=Counts(global_tokens=tokens, global_seqs=seqs),
                generator=gen,
                uniforms=u,
                weights=weights,
                ref_logp=None if corrected_kl else ref,
                entropy=entropies,
                correction_status=status,
            )
        )
        loss, sums = out.loss, dict(out.sums)
        if corrected_kl:  # TRL's importance-sampling-corrected KL: k3 times the token ratio
            kl = kl_k3(logp, ref) * torch.exp(logp - old) * maskf  # (B, T)
            loss = loss + self.beta * aggregate(
                kl, maskf, self.clipbench_agg, self.max_completion_length, global_tokens=tokens, global_seqs=seqs
            )
            sums["kl_ref/sum"] = kl.detach().sum().to(torch.float64)
        if self.clipbench_agg == "token-sum":  # no normaliser: DDP's average over processes is undone
            loss = loss * self.accelerator.num_processes
        if self.aux_loss_enabled:
            scale = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / scale
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())

        sums["entropy/sum"] = (entropies.detach() * maskf).sum().to(torch.float64)  # a "sum" key for combine
        if self._cb_recorder is not None and mode == "train":
            self._record(
                out.loss,
                tokens,
                seqs,
                logp=logp,
                old_logp=old,
                advantages=adv,
                mask=maskf,
                weights=weights,
                ref_logp=None if corrected_kl else ref,
                entropy=entropies,
                uniforms=u,
                completion_ids=completion_ids,
            )
        self._cb_sums.append(sums)
        if self.clipbench_histograms is not None and mode == "train":
            self.clipbench_histograms.append(log_ratio_histogram(logp.detach(), old, adv, mask))
        if mode != "train" or micro == self.current_gradient_accumulation_steps - 1:  # the step's last micro-batch
            for k, v in self._step_stats().items():
                self._metrics[mode][k].append(v)
        return loss

    # -- recording (docs/replay.md) -------------------------------------------------------------------

    def _recorder(self, record: dict) -> LossRecorder:
        obj = {
            "method": self.clipbench_method,
            "params": dict(self.clipbench_params),
            "agg": self.clipbench_agg,
            "beta": 0.0 if self.args.use_bias_correction_kl else self.beta,
            "max_len": self.max_completion_length,
        }
        self._cb_record_every = int(record["every"])
        meta = {
            "engine": "trl",
            "objective": obj,
            "seed": self.args.seed,
            "world_size": self.accelerator.num_processes,
            "temperature": self.args.temperature,
            "kl": "bias-corrected" if self.args.use_bias_correction_kl else "k3",
        }
        suffix = f".rank{self.accelerator.process_index}" if self.accelerator.num_processes > 1 else ""
        return LossRecorder(record["dir"], max_mb=record.get("max_mb", RecordConfig.max_mb), meta=meta, suffix=suffix)

    def _record(self, loss, tokens, seqs, **tensors) -> None:
        """This micro-batch's rule inputs, when its generation batch is recorded; the record is written
        after the generation batch's last micro-batch (one record per generation batch: TRL's rollout step)."""
        every = self.args.steps_per_generation * self.num_iterations  # micro-batches per generation batch
        k = self._step // every
        if k % self._cb_record_every:
            return
        ga = self.current_gradient_accumulation_steps
        tensors = {name: (t.float() if t.is_floating_point() else t) for name, t in tensors.items() if t is not None}
        self._cb_recorder.add(self.state.global_step + 1, (self._step % every) // ga, tensors, tokens, seqs, loss)
        if (self._step + 1) % every == 0:
            self._cb_recorder.write(k)

    def _step_stats(self) -> dict[str, float]:
        """The optimizer step's diagnostics: its micro-batches combined, reduced over processes, one
        host transfer."""
        sums = combine(self._cb_sums)
        self._cb_sums = []
        if self.accelerator.num_processes > 1:
            sums = all_reduce_sums(sums)
        stats = finalize(sums)
        stats["entropy"] = sums["entropy/sum"] / sums["n_tokens"].clamp(min=1.0)
        return dict(zip(stats, torch.stack([v.to(torch.float64) for v in stats.values()]).tolist()))
