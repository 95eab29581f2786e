"""The policy's log-probs and entropy of sampled completions: the one path training runs.

    logp, ent = completion_logprobs(model, packed, temperature=T)    # (B, T) each; packing.py lays rows out

Memory-efficient per-token log-probs and entropy from logits.

A naive ``log_softmax(logits.float()).gather(...)`` materialises a float32 copy of the whole
(B, T, V) vocabulary tensor (plus a second one for its gradient, and a bf16 input gets upcast
first). Here the rows are processed in chunks of ``chunk_size`` rows (default: about 2^20 logits,
4 MiB of float32, per chunk); a chunk holds whole sequences when they fit (a small vocabulary: the
built-in models' whole micro-batch is one chunk), else part of one sequence. Every value is computed
per vocabulary row, so the chunking never changes a number (tests/test_logprobs.py: bit for bit):

* ``selective_log_softmax`` keeps only a (B, T) logsumexp from the forward; its backward writes
  the (B, T, V) logits gradient (which autograd needs anyway) chunk by chunk, recomputing the
  softmax of each chunk. Peak extra memory: the gradient (1x logits) + one chunk.
* ``entropy_from_logits`` (no grad) needs one chunk of temporaries at a time.

Computation is in float32 whatever the logits dtype (bf16 logits are upcast chunk by chunk), so
the result equals the naive float32 computation on the same (upcast) logits within ~1e-6.
``temperature`` divides the logits inside each chunk (no full-size scaled copy).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from clipbench.train.packing import Packed

DEFAULT_CHUNK_ELEMS = 1 << 20  # logits per chunk (4 MiB in float32)


def _chunk_rows(vocab: int, chunk_size: int | None) -> int:
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_ELEMS // max(1, vocab))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size (rows per chunk) must be a positive integer, got {chunk_size!r}")
    return chunk_size


def _as_3d(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V) or (N, V), got shape {tuple(logits.shape)}")
    return logits


def _chunks(b_size: int, t_size: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(bs, ts): slices logits[bs, ts] of at most ``rows`` vocabulary rows: whole sequences
    (logits[b0:b1], as many as fit) when one fits, else part of one (logits[b:b+1, t0:t1]). Each
    slice is a block of whole vocabulary rows, so no copy is made even when logits is a
    non-contiguous (B, T, V) view such as ``out.logits[:, :-1]``."""
    if t_size <= rows:  # whole sequences: one Python iteration per chunk, not per sequence
        per = rows // max(t_size, 1)
        for b0 in range(0, b_size, per):
            yield slice(b0, min(b0 + per, b_size)), slice(0, t_size)
        return
    for b in range(b_size):
        for t0 in range(0, t_size, rows):
            yield slice(b, b + 1), slice(t0, min(t0 + rows, t_size))


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 chunk / temperature (a copy only when needed)."""
    z = chunk.float()
    if temperature != 1.0:
        z = z / temperature if z is chunk else z.div_(temperature)
    return z


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, temperature, rows):
        lg = _as_3d(logits)
        idx = index.reshape(lg.shape[:2])
        out = torch.empty(lg.shape[:2], dtype=torch.float32, device=lg.device)
        lse = torch.empty_like(out)
        for b, t in _chunks(lg.shape[0], lg.shape[1], rows):
            z = _scaled(lg[b, t], temperature)  # (b, t, V) float32
            lse[b, t] = torch.logsumexp(z, dim=-1)
            out[b, t] = z.gather(-1, idx[b, t, None]).squeeze(-1) - lse[b, t]
        ctx.save_for_backward(logits, index, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out.reshape(index.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, index, lse = ctx.saved_tensors
        lg = _as_3d(logits)
        idx = index.reshape(lg.shape[:2])
        g = grad_out.reshape(lg.shape[:2]).to(torch.float32)
        grad = torch.empty(lg.shape, dtype=logits.dtype, device=logits.device)  # contiguous
        t = ctx.temperature
        for b, ts in _chunks(lg.shape[0], lg.shape[1], ctx.rows):
            # d/dz (z[i] - lse(z)) = onehot(i) - softmax(z); dz/dlogits = 1 / temperature
            z = _scaled(lg[b, ts], t)
            p = (z - lse[b, ts, None]).exp_()  # softmax, (b, t, V)
            gc = g[b, ts, None]
            p.mul_(-gc).scatter_add_(-1, idx[b, ts, None], gc)
            if t != 1.0:
                p.div_(t)
            grad[b, ts] = p
        return grad.reshape(logits.shape), None, None, None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """log_softmax(logits / temperature)[..., index] without a full-vocabulary float32 copy.

    logits: (B, T, V) (any float dtype, may be a non-contiguous view) or (N, V);
    index: (B, T) or (N,) token ids. Returns float32 (B, T) / (N,), differentiable w.r.t. logits.
    chunk_size: rows per chunk (default: ~2^20 logits per chunk)."""
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index shape {tuple(index.shape)} must be logits' leading shape {tuple(logits.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    rows = _chunk_rows(logits.shape[-1], chunk_size)
    return _SelectiveLogSoftmax.apply(logits, index, float(temperature), rows)


@torch.no_grad()
def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int | None = None, *, temperature: float = 1.0
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row, float32 (B, T) / (N,), detached.

    H = -sum(p * log p) with log p = z - logsumexp(z), computed ``chunk_size`` rows at a time
    (the same arithmetic as the naive formula, without its cancellation-prone lse - sum(p z)."""
    lg = _as_3d(logits)
    rows = _chunk_rows(lg.shape[-1], chunk_size)
    out = torch.empty(lg.shape[:2], dtype=torch.float32, device=lg.device)
    for b, t in _chunks(lg.shape[0], lg.shape[1], rows):
        z = _scaled(lg[b, t], temperature)
        logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
        out[b, t] = -logp.exp().mul_(logp).sum(-1)
    return out.reshape(logits.shape[:-1])


def completion_logprobs(model, batch: Packed, *, temperature: float = 1.0, with_entropy: bool = True):
    """(logp (B, T) with grad if enabled, entropy (B, T) detached or None) of the completion tokens
    under `model`, with logits divided by the sampling temperature (the distribution sampled from)."""
    T = batch.completion_ids.shape[1]
    # logits at position j predict token j+1: keep the last T+1 positions, drop the final one.
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=T + 1,
    )
    logits = out.logits[:, :-1, :]  # (B, T, V), never copied: temperature is applied per chunk
    logp = selective_log_softmax(logits, batch.completion_ids, temperature=temperature)  # (B, T)
    ent = entropy_from_logits(logits.detach(), temperature=temperature) if with_entropy else None
    return logp, ent
