"""Memory-efficient per-token log-probs and entropy from logits.

A naive ``log_softmax(logits.float()).gather(...)`` materialises a float32 copy of the whole
(B, T, V) vocabulary tensor (plus a second one for its gradient, and a bf16 input gets upcast
first). Here the rows are processed in chunks of ``chunk_size`` rows (default: about 2^20 logits,
4 MiB of float32, per chunk):

* ``selective_log_softmax`` keeps only a (B, T) logsumexp from the forward; its backward writes
  the (B, T, V) logits gradient (which autograd needs anyway) chunk by chunk, recomputing the
  softmax of each chunk. Peak extra memory: the gradient (1x logits) + one chunk.
* ``entropy_from_logits`` (no grad) needs one chunk of temporaries at a time.

Computation is in float32 whatever the logits dtype (bf16 logits are upcast chunk by chunk), so
the result equals the naive float32 computation on the same (upcast) logits within ~1e-6.
``temperature`` divides the logits inside each chunk (no full-size scaled copy).
"""

from __future__ import annotations

from typing import Iterator

import torch

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


def _chunks(b_size: int, t_size: int, rows: int) -> Iterator[tuple[int, int, int]]:
    """(b, t0, t1): slices logits[b, t0:t1] of at most ``rows`` rows. Each slice is a block of
    whole vocabulary rows, so no copy is made even when logits is a non-contiguous (B, T, V)
    view such as ``out.logits[:, :-1]``."""
    for b in range(b_size):
        for t0 in range(0, t_size, rows):
            yield b, t0, min(t0 + rows, t_size)


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
        for b, t0, t1 in _chunks(lg.shape[0], lg.shape[1], rows):
            z = _scaled(lg[b, t0:t1], temperature)  # (c, V) float32
            lse[b, t0:t1] = torch.logsumexp(z, dim=-1)
            out[b, t0:t1] = z.gather(-1, idx[b, t0:t1, None]).squeeze(-1) - lse[b, t0:t1]
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
        for b, t0, t1 in _chunks(lg.shape[0], lg.shape[1], ctx.rows):
            # d/dz (z[i] - lse(z)) = onehot(i) - softmax(z); dz/dlogits = 1 / temperature
            z = _scaled(lg[b, t0:t1], t)
            p = (z - lse[b, t0:t1, None]).exp_()  # softmax, (c, V)
            gc = g[b, t0:t1, None]
            p.mul_(-gc).scatter_add_(-1, idx[b, t0:t1, None], gc)
            if t != 1.0:
                p.div_(t)
            grad[b, t0:t1] = p
        return grad.reshape(logits.shape), None, None, None


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, *, temperature: float = 1.0,
                          chunk_size: int | None = None) -> torch.Tensor:
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
def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None, *,
                        temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row, float32 (B, T) / (N,), detached.

    H = -sum(p * log p) with log p = z - logsumexp(z), computed ``chunk_size`` rows at a time
    (the same arithmetic as the naive formula, without its cancellation-prone lse - sum(p z)."""
    lg = _as_3d(logits)
    rows = _chunk_rows(lg.shape[-1], chunk_size)
    out = torch.empty(lg.shape[:2], dtype=torch.float32, device=lg.device)
    for b, t0, t1 in _chunks(lg.shape[0], lg.shape[1], rows):
        z = _scaled(lg[b, t0:t1], temperature)
        logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
        out[b, t0:t1] = -logp.exp().mul_(logp).sum(-1)
    return out.reshape(logits.shape[:-1])


def _n_completion(input_ids: torch.Tensor, completion) -> tuple[int, torch.Tensor | None]:
    """(T, mask (B, T) or None) from an int T or a completion mask of shape (B, L) or (B, T)."""
    L = input_ids.shape[1]
    if isinstance(completion, int) and not isinstance(completion, bool):
        if not 1 <= completion < L:
            raise ValueError(f"n_completion must be in [1, {L - 1}], got {completion}")
        return completion, None
    if not isinstance(completion, torch.Tensor) or completion.dim() != 2 or completion.shape[0] != input_ids.shape[0]:
        raise ValueError("completion must be an int (the last T columns) or a (B, L) / (B, T) completion mask")
    if completion.shape[1] == L:  # (B, L): the completion is the suffix starting at the first marked column
        cols = (completion != 0).any(0).nonzero()
        if cols.numel() == 0:
            raise ValueError("completion_mask marks no token")
        T = L - int(cols[0])
        if T >= L:
            raise ValueError("the completion cannot start at position 0 (no logits predict it)")
        return T, completion[:, L - T:]
    if completion.shape[1] >= L:
        raise ValueError(f"completion mask width {completion.shape[1]} must be L={L} or < L")
    return completion.shape[1], completion


def logprobs_and_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion, *,
                         temperature: float = 1.0, with_entropy: bool = True,
                         position_ids: torch.Tensor | None = None, chunk_size: int | None = None):
    """Per-token log-probs (with grad) and entropy (no grad) of the completion tokens under an HF
    causal LM, from logits divided by ``temperature``.

    input_ids, attention_mask: (B, L), rows laid out as [left-padded prompt | right-padded
    completion]. ``completion``: the number T of completion columns (the last T), or a completion
    mask (B, L) / (B, T). Logits at position j predict token j + 1, so only the last T + 1
    positions are computed (``logits_to_keep``). ``position_ids`` default to the running count of
    attended tokens (as in generation with left padding).

    Returns (logp (B, T) float32, entropy (B, T) float32 or None). With a completion mask, entries
    outside it are 0; with an int T they are the log-probs of whatever token sits there (padding).
    """
    T, cmask = _n_completion(input_ids, completion)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    try:
        logits = model(**kwargs, logits_to_keep=T + 1).logits
    except TypeError:  # a model without logits_to_keep: compute all positions
        logits = model(**kwargs).logits
    logits = logits[:, -(T + 1):-1]  # (B, T, V), a view
    targets = input_ids[:, -T:]
    logp = selective_log_softmax(logits, targets, temperature=temperature, chunk_size=chunk_size)
    ent = entropy_from_logits(logits.detach(), chunk_size, temperature=temperature) if with_entropy else None
    if cmask is not None:
        keep = cmask != 0
        logp = torch.where(keep, logp, 0.0)
        if ent is not None:
            ent = torch.where(keep, ent, 0.0)
    return logp, ent
