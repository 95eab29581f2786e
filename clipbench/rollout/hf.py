"""Sampling with Hugging Face `generate`: batched, left padding, from the training model itself.

Seeding: `generate` draws from torch's global RNG, so each call runs inside `torch.random.fork_rng`
seeded with the call's `seed`; nothing leaks into (or depends on) the caller's global RNG state.

Sharded models (FSDP over N processes): `synced_gpus=True` keeps every rank stepping until all ranks'
sequences are done (each step's forward is a collective); a finished rank draws no more random numbers,
so its completions are those it would sample alone.
"""

from __future__ import annotations

import time

import torch

from clipbench.rollout.base import Rollout, call_settings


class HFSampler:
    name = "hf"

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, return_logprobs: bool = False, max_batch: int | None = None,
                 dtype: torch.dtype = torch.float32, synced_gpus: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.return_logprobs = return_logprobs
        self.max_batch = max_batch  # rows per generate call (None: all at once)
        self.dtype = dtype  # compute dtype: float32 weights run under autocast when lower
        self.synced_gpus = synced_gpus  # every rank of a sharded model calls generate in lockstep
        self._configs: dict = {}
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token; set tokenizer.pad_token")

    def _generation_config(self, temperature: float, top_p: float, max_new: int):
        """One GenerationConfig per setting (building and validating one per call costs ~1 ms)."""
        key = (temperature, top_p, max_new)
        if key not in self._configs:
            from transformers import GenerationConfig

            tok = self.tokenizer
            self._configs[key] = GenerationConfig(
                do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                return_dict_in_generate=True, output_scores=self.return_logprobs)
        return self._configs[key]

    def sync_weights(self, model) -> None:  # samples from the training model itself
        self.model = model

    def sleep(self) -> None:  # nothing of its own to release: it samples from the training model
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, *, seed: int, temperature: float | None = None,
                 max_new_tokens: int | None = None, top_p: float | None = None) -> Rollout:
        t0 = time.perf_counter()
        temperature, top_p, max_new = call_settings(self, temperature, top_p, max_new_tokens)
        tok, model = self.tokenizer, self.model
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        rows = [ids for ids in prompt_ids for _ in range(n)]  # prompt i owns rows i*n .. i*n+n-1
        eos = tok.eos_token_id
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        completions: list[list[int]] = []
        logps: list[list[float]] | None = [] if self.return_logprobs else None
        chunk = self.max_batch or len(rows)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    torch.autocast(device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                torch.manual_seed(seed)
                for start in range(0, len(rows), chunk):
                    part = rows[start:start + chunk]
                    width = max(len(r) for r in part)
                    ids = torch.full((len(part), width), tok.pad_token_id, dtype=torch.long)
                    att = torch.zeros((len(part), width), dtype=torch.long)
                    for i, r in enumerate(part):  # left padding
                        ids[i, width - len(r):] = torch.tensor(r)
                        att[i, width - len(r):] = 1
                    out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                         generation_config=self._generation_config(temperature, top_p, max_new),
                                         synced_gpus=self.synced_gpus)
                    gen = out.sequences[:, width:].cpu()  # (b, T')
                    if self.return_logprobs:
                        # scores are the processed logits (temperature, top-p): the sampled distribution
                        scores = torch.stack(out.scores, 1).float().log_softmax(-1).cpu()  # (b, T', V)
                        lp = scores.gather(-1, gen.unsqueeze(-1)).squeeze(-1)
                    for i in range(gen.shape[0]):
                        seq = gen[i].tolist()
                        cut = seq.index(eos) + 1 if eos in seq else len(seq)
                        completions.append(seq[:cut])
                        if logps is not None:
                            logps.append(lp[i, :cut].tolist())
        finally:
            model.train(was_training)
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        truncated = [not (c and c[-1] == eos) for c in completions]
        return Rollout(prompt_ids=rows, completion_ids=completions, texts=texts, truncated=truncated,
                       sampler_logp=logps, stats={"sample_seconds": time.perf_counter() - t0})
