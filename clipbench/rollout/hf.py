"""Sampling with Hugging Face `generate`: batched, left padding, from the training model itself.

Seeding: each prompt's randomness is its own. `generate` runs greedy decoding over the sampled
distribution plus Gumbel noise (`GroupNoise`): at every position, row r of prompt i takes
argmax(log p(v) + g_v), g = -log(-log u) with u drawn from prompt i's own generator (seeded with
`prompt_seeds(seed, P)[i]`, the trainer's seed of that prompt), which is an exact draw from p (the
Gumbel-max trick). So a prompt's completions depend on its seed, the weights and the settings only:
not on the call's other prompts, its position in the call or the process that samples it (up to
float round-off between batch shapes, which moves a token only where two candidates tie to ~1e-7).
torch's global RNG is neither read nor advanced.

Why not HF's own sampling (`do_sample=True`, `torch.multinomial` from the global RNG): its draws
depend on the whole batch, so one process sampling P prompts and two processes sampling P/2 each
would draw different completions (bench: one call of 16 prompts x 8 at the quickstart shape costs
the same with per-prompt noise, ~0.28 s; fixed calls of one prompt, the alternative that keeps
`multinomial`, cost 4x).

Sharded models (FSDP over N processes): `synced_gpus=True` keeps every rank stepping until all ranks'
sequences are done (each step's forward is a collective); the noise of a prompt's rows is drawn at
every position whether or not the row has finished, so it does not depend on the other rows either.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from clipbench.models.routing import RouteReplay
from clipbench.rollout.base import PromptSeeds, Rollout, call_settings, prompt_seeds
from clipbench.rollout.decode import decode, row_exact


class GroupNoise(LogitsProcessor):
    """A transformers logits processor that turns greedy decoding into
    sampling from softmax(warped logits), with each prompt group's noise from its own generator.

    warpers: HF's temperature / top-p processors, applied first (the sampled distribution);
    generators: one per prompt (its n rows are consecutive); records the sampled token's log-prob
    under the sampled distribution at every position (`logps`)."""

    def __init__(self, warpers: list, generators: list[torch.Generator], n: int, record: bool):
        self.warpers, self.generators, self.n, self.record = warpers, generators, n, record
        self.logps: list[torch.Tensor] = []  # per position: (B,) log-prob of the chosen token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = self.log_probs(input_ids, scores)  # (B, V)
        noisy = logp - self.gumbel(logp.shape[1], logp.device)  # + Gumbel(0, 1)
        if self.record:
            self.logps.append(logp.gather(1, noisy.argmax(-1, keepdim=True)).squeeze(1))  # on device: no sync
        return noisy

    def log_probs(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        """(rows, V) float32 log-probs of the sampled distribution (the warpers, then log-softmax)."""
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        return scores.float().log_softmax(-1)

    def gumbel(self, vocab: int, device) -> torch.Tensor:
        """(B, V) -log(-log u) of this position: every row's draw, each prompt's n rows from its generator."""
        u = torch.cat([torch.rand((self.n, vocab), generator=g) for g in self.generators])
        return torch.log(-torch.log(u.to(device)))

    def sample(self, scores: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, its log-prob) of each of `rows` (indices into the B rows), `scores` (len(rows), V) their
        logits: what `__call__` and a greedy choice give those rows. The noise is drawn and transformed for
        all B rows, as `__call__` does, then gathered (rollout/decode.py)."""
        logp = self.log_probs(None, scores)
        chosen = (logp - self.gumbel(logp.shape[1], logp.device)[rows]).argmax(-1)
        return chosen, logp.gather(1, chosen[:, None]).squeeze(1)


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, W) token ids padded on the left to the longest prompt, and their (P, W) attention mask."""
    width = max(len(r) for r in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, r in enumerate(prompts):
        ids[i, width - len(r) :] = torch.tensor(r)
        att[i, width - len(r) :] = 1
    return ids, att


class HFSampler:
    name = "hf"
    # transformers' generate is the readable path; where rollout/decode.py gives its numbers bit for bit
    # (float32 on the CPU, one process), its own loop samples the same tokens with less work
    own_loop = True
    merge_rows = 1024  # generate_calls: calls sampled together up to this many rows (one call's 16 x 64 alone)

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        return_logprobs: bool = False,
        max_batch: int | None = None,
        dtype: torch.dtype = torch.float32,
        synced_gpus: bool = False,
        record_routes: bool = False,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.return_logprobs = return_logprobs
        self.max_batch = max_batch  # prompts per generate call (None: all at once)
        self.dtype = dtype  # compute dtype: float32 weights run under autocast when lower
        self.synced_gpus = synced_gpus  # every rank of a sharded model calls generate in lockstep
        self.record_routes = record_routes  # a MoE policy with routing replay r3: Rollout.routes (models/routing.py)
        self._configs: dict = {}
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token; set tokenizer.pad_token")

    def _generation_config(self, temperature: float, top_p: float, max_new: int):
        """One GenerationConfig per setting (building and validating one per call costs ~1 ms).
        Greedy over the noisy scores of `GroupNoise`, which applies temperature and top-p itself."""
        key = (temperature, top_p, max_new)
        if key not in self._configs:
            from transformers import GenerationConfig  # noqa: PLC0415 - transformers is heavy

            tok = self.tokenizer
            self._configs[key] = GenerationConfig(
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id,
                return_dict_in_generate=True,
            )
        return self._configs[key]

    def _noise(self, seeds: list[int], n: int, temperature: float, top_p: float) -> GroupNoise:
        warpers = ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []) + (
            [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
        )
        return GroupNoise(warpers, [torch.Generator().manual_seed(s) for s in seeds], n, self.return_logprobs)

    def sync_weights(self, model) -> None:  # samples from the training model itself
        self.model = model

    def sleep(self) -> None:  # nothing of its own to release: it samples from the training model
        pass

    def close(self) -> None:
        pass

    def generate_calls(
        self,
        calls: Sequence[tuple[list[str], int | Sequence[int]]],
        n: int,
        *,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        top_p: float | None = None,
    ) -> list[Rollout]:
        """One rollout per call (prompts, seed), each what `generate(prompts, n, seed=seed)` returns. Where
        the own loop is exact (rollout/decode.py), consecutive calls whose prompts pad to the same width
        are sampled as one call of up to `merge_rows` rows: each prompt draws from its own seed and its
        rows are computed on their own, so they are the same tokens, with less work per token."""
        exact = self.own_loop and row_exact(self.model, self.dtype, sharded=self.synced_gpus, routes=self.record_routes)
        settings = dict(temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p)
        if not exact:
            return [self.generate(prompts, n, seed=seed, **settings) for prompts, seed in calls]
        widths = [max((len(self.tokenizer(p)["input_ids"]) for p in prompts), default=0) for prompts, _ in calls]
        out: list[Rollout] = []
        start = 0
        while start < len(calls):
            end = start + 1
            rows = len(calls[start][0]) * n
            while (
                end < len(calls) and widths[end] == widths[start] and rows + len(calls[end][0]) * n <= self.merge_rows
            ):
                rows += len(calls[end][0]) * n
                end += 1
            group = calls[start:end]
            seeds = PromptSeeds(s for prompts, seed in group for s in prompt_seeds(seed, len(prompts)))
            merged = self.generate([p for prompts, _ in group for p in prompts], n, seed=seeds, **settings)
            out += merged.split([len(prompts) * n for prompts, _ in group])
            start = end
        return out

    def _generate(self, ids: torch.Tensor, att: torch.Tensor, n: int, noise: GroupNoise, settings: tuple, device):
        """transformers' generate, greedy over `noise`'s scores, each of the p prompts `ids` (p, W) n times:
        ((p*n, T) the sampled tokens, padded after EOS; (p*n, T) their log-probs when recorded, else None)."""
        out = self.model.generate(
            input_ids=ids.repeat_interleave(n, 0).to(device),
            attention_mask=att.repeat_interleave(n, 0).to(device),
            generation_config=self._generation_config(*settings),
            logits_processor=LogitsProcessorList([noise]),
            synced_gpus=self.synced_gpus,
        )
        gen = out.sequences[:, ids.shape[1] :].cpu()  # (b, T)
        if not noise.record:
            return gen, None
        lp = torch.stack(noise.logps, 1)[:, : gen.shape[1]].cpu() if noise.logps else torch.zeros(len(gen), 0)
        return gen, lp

    @torch.no_grad()
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
        t0 = time.perf_counter()
        temperature, top_p, max_new = call_settings(self, temperature, top_p, max_new_tokens)
        tok, model = self.tokenizer, self.model
        seeds = prompt_seeds(seed, len(prompts))
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        eos = tok.eos_token_id
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        completions: list[list[int]] = []
        logps: list[list[float]] | None = [] if self.return_logprobs else None
        replay = RouteReplay.of(model) if self.record_routes else None
        routes: list | None = [] if replay is not None else None
        chunk = self.max_batch or max(len(prompts), 1)
        try:  # inference mode (~6% faster than no_grad alone, the same numbers), except for a sharded model,
            # whose gathered parameters must stay usable by autograd in the training step after this call
            with (
                torch.inference_mode(not self.synced_gpus),
                torch.autocast(device.type, dtype=self.dtype, enabled=self.dtype != torch.float32),
            ):
                for start in range(0, len(prompts), chunk):
                    part = [ids for ids in prompt_ids[start : start + chunk] for _ in range(n)]  # prompt i: n rows
                    noise = self._noise(seeds[start : start + chunk], n, temperature, top_p)
                    ids, att = left_padded(prompt_ids[start : start + chunk], tok.pad_token_id)  # (p, W) each
                    width = ids.shape[1]
                    if replay is not None:
                        replay.record_generation()
                    if (
                        self.own_loop
                        and max_new > 0
                        and row_exact(model, self.dtype, sharded=self.synced_gpus, routes=replay is not None)
                    ):
                        gen, lp = decode(
                            model, ids, att, n=n, noise=noise, max_new=max_new, eos=eos, pad=tok.pad_token_id
                        )
                    else:
                        gen, lp = self._generate(ids, att, n, noise, (temperature, top_p, max_new), device)
                    chunk_routes = replay.generated_routes(len(part)) if replay is not None else None
                    for i in range(gen.shape[0]):
                        seq = gen[i].tolist()
                        cut = seq.index(eos) + 1 if eos in seq else len(seq)
                        completions.append(seq[:cut])
                        if chunk_routes is not None:  # the row's own columns: its prompt, then its completion
                            own = chunk_routes[i, :, width - len(part[i]) : width + cut]
                            pad = torch.zeros(
                                own.shape[0], len(part[i]) + cut - own.shape[1], own.shape[2], dtype=own.dtype
                            )
                            routes.append(torch.cat([own, pad], 1))
                        if lp is not None:
                            logps.append(lp[i, :cut].tolist())
        finally:
            model.train(was_training)
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        truncated = [not (c and c[-1] == eos) for c in completions]
        rows = [ids for ids in prompt_ids for _ in range(n)]
        return Rollout(
            prompt_ids=rows,
            completion_ids=completions,
            texts=texts,
            truncated=truncated,
            sampler_logp=logps,
            stats={"sample_seconds": time.perf_counter() - t0},
            routes=routes,
        )
