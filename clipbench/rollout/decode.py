"""The hf sampler's decode loop on one CPU process: `generate`'s tokens, bit for bit, with less work.

    if row_exact(model, dtype, sharded=False, routes=False):
        tokens, logps = decode(model, ids, att, n=8, noise=noise, max_new=48, eos=2, pad=0)

`HFSampler.generate` (rollout/hf.py) calls transformers' `generate` greedily over `GroupNoise`'s
scores. This loop computes the same thing with the model's own forward, and skips work that cannot
change a token:

1. One prefill per prompt. A prompt's n rows are the same tokens, so its keys, values and first
   logits are computed once and copied to its n rows (`generate` computes them n times).
2. Finished rows leave the batch. `generate` keeps every row in every forward until the last row of
   the batch has its EOS (the rows that finished are fed padding). Here a row's forwards stop at its
   EOS: the rows still sampling are gathered into a smaller batch whenever an eighth of the batch has
   finished since the last gathering.
3. A preallocated key/value cache. `generate`'s cache concatenates every layer's keys and values at
   every position (a copy of the whole cache per token); here each position is written in place and
   attention reads a view of the positions written so far.

Why the numbers cannot move: on this CPU every operation of the forward computes a row from that
row alone, the same whatever the other rows are. Matrix products of 4 rows or more take the same
kernel whatever their row count (3 or fewer take another one, whose sums round differently, so the
batch never shrinks below 4 rows, or below its start when that is smaller); attention reads each
row's keys in the same positions, left padding included (a row's padded width is its call's, as in
`generate`; an extra key, even a masked one, moves the result in the last bit, so prompts of
different widths are never sampled together); the rest is elementwise or reduces one row. The
noise is drawn and transformed for every row, as `generate`'s processor does, and then gathered.
`row_exact` says where that has been checked (tests/test_fast_decode.py: the tokens and log-probs
equal `generate`'s; tests/test_organism_pinned.py: whole runs keep their recorded numbers): float32
on the CPU with one torch thread (a sweep's runs on one core each; with more threads a product is
split among them by its shape, and a row's sums can round differently with the batch), one process,
a dense Qwen3 (the built-in models), no routes recorded. Elsewhere the sampler calls `generate`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

MIN_ROWS = 4  # matrix products of fewer rows take another kernel on the CPU (another rounding)
GATHER_EVERY = 8  # gather the live rows once 1/8 of the computed rows have finished


def row_exact(model, dtype: torch.dtype, *, sharded: bool, routes: bool) -> bool:
    """Does `decode` give `generate`'s numbers for this model and setting (see the module docstring)?"""
    device = next(model.parameters()).device
    return (
        device.type == "cpu"
        and torch.get_num_threads() == 1  # several threads split a product by its shape: rows round differently
        and dtype == torch.float32
        and next(model.parameters()).dtype == torch.float32
        and not sharded
        and not routes
        and getattr(model.config, "model_type", None) == "qwen3"
    )


class _Rows(DynamicLayer):
    """One layer's keys and values in preallocated (rows, heads, width, dim) buffers; `update` writes the
    new positions in place and returns views of the positions written so far. `width` is set by the
    cache's owner (a subclass per call)."""

    width = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self.k = key_states.new_empty(b, h, self.width, d)
        self.v = value_states.new_empty(b, h, self.width, d)
        self.filled = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[2]
        self.k[:, :, self.filled : end] = key_states
        self.v[:, :, self.filled : end] = value_states
        self.filled = end
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys, self.values = self.k[:, :, : self.filled], self.v[:, :, : self.filled]

    def take(self, rows: torch.Tensor) -> None:
        """Keep `rows` (a gather: new buffers of their positions so far)."""
        self.k, self.v = self.k[rows], self.v[rows]
        self._views()

    def repeat(self, n: int) -> None:
        """Each row n times, consecutively."""
        self.k, self.v = self.k.repeat_interleave(n, 0), self.v.repeat_interleave(n, 0)
        self._views()


def _cache(width: int) -> Cache:
    layer = type("_RowsOfCall", (_Rows,), {"width": width})
    return Cache(layer_class_to_replicate=layer)


def _prefill(model, ids: torch.Tensor, att: torch.Tensor, pos: torch.Tensor, n: int, cache: Cache, padded: bool):
    """(P*n, V) float32 logits of the next token after each prompt, the cache holding every row's
    prompt. One forward per prompt when there are enough prompts for the row-exact kernels, else one
    per row, as `generate` does."""
    once = n > 1 and ids.shape[0] >= MIN_ROWS
    if not once:
        ids, att, pos = (t.repeat_interleave(n, 0) for t in (ids, att, pos))
    out = model(
        input_ids=ids,
        attention_mask=att if padded else None,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
    if once:
        for layer in cache.layers:
            layer.repeat(n)
        logits = logits.repeat_interleave(n, 0)
    return logits


@torch.inference_mode()
def decode(
    model, ids: torch.Tensor, att: torch.Tensor, *, n: int, noise, max_new: int, eos: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample n completions of each of the P left-padded prompts `ids` (P, W) (`att`: their attention
    mask), greedily over `noise`'s scores (rollout/hf.py: `GroupNoise`, prompt i owning rows
    i*n .. i*n+n-1). Returns ((P*n, T) tokens, padded after EOS, T the positions sampled: as
    `generate`'s sequences after the prompt; (P*n, T) each token's log-prob when `noise.record`, else None)."""
    P, W = ids.shape
    B = P * n
    pos = (att.cumsum(-1) - 1).masked_fill_(att == 0, 0)  # generate's positions: left padding skipped
    padded = not bool(att.all())  # generate drops an all-ones mask
    cache = _cache(W + max_new)
    logits = _prefill(model, ids, att, pos, n, cache, padded)  # (B, V)
    mask = torch.cat([att.repeat_interleave(n, 0), att.new_ones(B, max_new)], 1)  # (B, W + max_new)
    last = pos[:, -1].repeat_interleave(n, 0)  # (B,) each row's position of its last prompt token
    tokens = torch.full((B, max_new), pad, dtype=torch.long)
    logps = torch.zeros(B, max_new) if noise.record else None
    rows = torch.arange(B)  # the rows this batch computes, in order
    live = torch.ones(B, dtype=torch.bool)  # which of `rows` have not sampled their EOS
    floor = min(MIN_ROWS, B)
    T = 0
    for t in range(max_new):
        T = t + 1
        chosen, lp = noise.sample(logits, rows)  # (len(rows),) each
        chosen = torch.where(live, chosen, pad)  # generate feeds padding to finished rows
        tokens[rows, t] = chosen
        if logps is not None:
            logps[rows, t] = lp
        live &= chosen != eos
        n_live = int(live.sum())
        if n_live == 0 or T == max_new:
            break
        if len(rows) - n_live >= max(len(rows) // GATHER_EVERY, 1) and n_live >= floor:
            keep = live.nonzero().squeeze(1)
            rows, live, chosen = rows[keep], live[keep], chosen[keep]
            for layer in cache.layers:
                layer.take(keep)
        out = model(
            input_ids=chosen[:, None],
            attention_mask=mask[rows, : W + T] if padded else None,
            position_ids=(last[rows] + T)[:, None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
    return tokens[:, :T], None if logps is None else logps[:, :T]
