"""One interface for every sampler backend.

A rollout of P prompts x n samples is grouped by prompt: prompt i owns rows i*n .. i*n+n-1.
Token ids are plain Python lists (ragged); the trainer pads them itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # (P*n) ragged: tokens of the prompt of each row
    completion_ids: list[list[int]]  # (P*n) ragged: sampled tokens, EOS included when generated
    texts: list[str]  # (P*n) decoded completions (special tokens skipped)
    truncated: list[bool]  # (P*n) True when max_new_tokens was hit before EOS
    sampler_logp: list[list[float]] | None = None  # (P*n) ragged: sampler's log-prob of each token
    stats: dict = field(default_factory=dict)  # backend timings etc.
    # (P*n) each row's routes (layers, prompt + completion tokens, k) int32 +1, 0 where none (the last
    # token): a MoE policy's experts as the sampler chose them (HFSampler with record_routes)
    routes: list | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def split(self, sizes: Sequence[int]) -> list[Rollout]:
        """Consecutive parts of `sizes` rows each, as separate calls would return them; the sampling
        seconds shared among them by their rows."""
        parts, start = [], 0
        for size in sizes:
            rows = slice(start, start + size)
            parts.append(
                Rollout(
                    prompt_ids=self.prompt_ids[rows],
                    completion_ids=self.completion_ids[rows],
                    texts=self.texts[rows],
                    truncated=self.truncated[rows],
                    sampler_logp=None if self.sampler_logp is None else self.sampler_logp[rows],
                    stats={k: v * size / max(len(self), 1) for k, v in self.stats.items()},
                    routes=None if self.routes is None else self.routes[rows],
                )
            )
            start += size
        return parts


@runtime_checkable
class Sampler(Protocol):
    name: str

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
        """Sample ``n`` completions of each prompt. Same weights + same seeds -> same rollout.

        ``seed``: the call's seed (prompt i's randomness is ``prompt_seeds(seed, P)[i]``) or one seed
        per prompt. Each prompt's n samples draw from that prompt's seed alone, so a prompt samples
        the same completions whichever call, position or process it is sampled in (up to float
        round-off between batch shapes). ``temperature`` / ``max_new_tokens`` / ``top_p`` override
        the sampler's settings for this call (evaluation samples with its own settings)."""
        ...

    def sync_weights(self, model) -> None:
        """Make the sampler sample from ``model``'s current weights (after an optimizer step)."""
        ...

    def sleep(self) -> None:
        """Release the sampler's accelerator memory while the trainer updates (vLLM with
        sampler.sleep_mode; a no-op otherwise). The next sync_weights / generate wakes it."""
        ...

    def close(self) -> None: ...


class PromptSeeds(tuple):
    """Seeds already derived per prompt (`prompt_seeds`' own output), used as they are: the calls of
    several seeds sampled as one call (`HFSampler.generate_calls`) keep each prompt's randomness."""


def prompt_seeds(seed: int | Sequence[int], n_prompts: int) -> list[int]:
    """One seed per prompt of a call, 56 bits each: hashes of (seed, prompt index) for a call seed, or
    the given per-prompt seeds folded to 56 bits (`PromptSeeds`: taken as they are). Far apart, so
    that seed + j (vLLM's seed for the j-th sample of a request) never collides between prompts."""
    if isinstance(seed, PromptSeeds):
        if len(seed) != n_prompts:
            raise ValueError(f"{len(seed)} seeds for {n_prompts} prompts")
        return list(seed)
    if isinstance(seed, int):
        return [int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:7], "big") for i in range(n_prompts)]
    seeds = [int(s) for s in seed]
    if len(seeds) != n_prompts:
        raise ValueError(f"{len(seeds)} seeds for {n_prompts} prompts")
    return [int.from_bytes(hashlib.sha256(f"prompt:{s}".encode()).digest()[:7], "big") for s in seeds]


def call_settings(
    sampler, temperature: float | None, top_p: float | None, max_new_tokens: int | None
) -> tuple[float, float, int]:
    """A `generate` call's (temperature, top_p, max_new_tokens): its overrides, else the sampler's own."""
    return (
        sampler.temperature if temperature is None else temperature,
        sampler.top_p if top_p is None else top_p,
        sampler.max_new_tokens if max_new_tokens is None else max_new_tokens,
    )
