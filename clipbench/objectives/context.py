"""Shared pieces of every rule, computed once per call (lazily) and reused by rule and diagnostics.

Shapes: B sequences, T completion tokens.

* Masks are float32 0/1 tensors, not bool: on CPU, comparisons written into a float buffer and
  0/1 arithmetic (products, ``lerp``) are several times faster than bool tensors and ``where``.
  ``lerp(a, b, w)`` with w in {0, 1} is an exact select (a where w == 0, b where w == 1) whose
  gradient reaches ``a`` only where w == 0 and ``b`` only where w == 1.
* Padding (``mask == 0``) is neutralised up front: the log-ratio is multiplied by the mask, so it
  is exactly 0 there (r == 1) and padding gets no loss and no gradient. Padding values of logp /
  old_logp may be anything finite. 1 is inside every band, so every rule's keep mask is 1 there.
* The log-ratio is clamped to [-20, 20] inside the exp, with a straight-through gradient:
  r = exp(clamp(lr)) and dr/dlr = r (see :class:`_ClampedExp`), so r <= e^20 ~ 4.9e8 is finite and
  every rule keeps the gradient its formula prescribes, evaluated at the clamped ratio. Ratios
  within e^+-20 are untouched. GSPO's sequence log-ratio (mean of the raw log-ratios) is clamped
  the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from clipbench.objectives.registry import LOG_RATIO_CLAMP


# --------------------------------------------------------------------------------------------
# Float 0/1 masks
# --------------------------------------------------------------------------------------------
def bshape(shape: torch.Size, *others: torch.Size) -> torch.Size:
    """torch.broadcast_shapes, with a fast path (no Python-level shape machinery, ~10x cheaper)
    for the common case of ``others`` broadcasting into ``shape`` ((B, 1) or (B, T) into (B, T))."""
    for o in others:
        if o != shape and (len(o) != len(shape) or any(j != 1 and j != i for i, j in zip(shape, o))):
            return torch.broadcast_shapes(shape, *others)
    return shape


def _out(x: torch.Tensor, v) -> torch.Tensor:
    shape = bshape(x.shape, v.shape) if isinstance(v, torch.Tensor) else x.shape
    return torch.empty(shape, dtype=torch.float32, device=x.device)


def fgt(x: torch.Tensor, v) -> torch.Tensor:
    """float32 0/1 mask of x > v (v a number or a broadcastable tensor)."""
    return torch.gt(x, v, out=_out(x, v))


def flt(x: torch.Tensor, v) -> torch.Tensor:
    """float32 0/1 mask of x < v."""
    return torch.lt(x, v, out=_out(x, v))


def fle(x: torch.Tensor, v) -> torch.Tensor:
    """float32 0/1 mask of x <= v."""
    return torch.le(x, v, out=_out(x, v))


def feq(x: torch.Tensor, v) -> torch.Tensor:
    """float32 0/1 mask of x == v."""
    return torch.eq(x, v, out=_out(x, v))


def fge(x: torch.Tensor, v) -> torch.Tensor:
    """float32 0/1 mask of x >= v."""
    return torch.ge(x, v, out=_out(x, v))


# How the zeroed (keep == 0) tokens split between ratio > 1 and ratio < 1, so that the
# diagnostics can place them in quadrants without a per-token product:
ZERO_CELLS = (
    "aligned",  # inside the PPO clip's cells: A>0 -> ratio > 1, A<0 -> ratio < 1
    "band",     # exactly the tokens outside the reference band (out_of_band): x>hi or x<lo
    "dual",     # PPO clip cells plus (A<0, ratio > c): the ratio < 1 part is A<0 rows' x<lo
    "general",  # anything: split with two per-token products
)


class RuleOut(NamedTuple):
    """What a rule returns. The per-token loss is ``l = -A * surrogate`` (every method has this
    form), so a rule returns only ``surrogate``; ``policy_loss`` applies ``-A`` and the mask.

    surrogate:    (B, T), or (B, 1) for sequence-level rules; differentiable w.r.t. logp, finite.
    ratio:        (B, T) or (B, 1) detached; the ratio the rule acts on (cells, out_of_band).
    keep:         float 0/1 like ratio: 0 exactly where the rule sets the gradient to zero
                  (zero_grad = 1 - keep); None when it never does (or when ``zero_rows`` gives
                  its counts). It is 1 where ratio == 1 (1 is inside every band), hence at padding.
    zero_cells:   one of ZERO_CELLS (see there).
    rescued_rows, near_rows: (B,) per-row token counts of NSR-rescued tokens and of tokens in
                  the NSR band (None: 0). Both lie in the base clip's zeroed cells (q1 or q3).
    zero_rows:    (B,) per-row count of the tokens with keep == 0, when the rule has it and keeps
                  no keep mask (keep is then None; zero_cells must not be "general").
    beyond_rows:  (B,) per-row count of the tokens past the NSR band (d > delta on an active side,
                  d > 0 elsewhere). With near_rows None, the diagnostics derive in_band_near as
                  (the base clip's zeroed tokens) - beyond, the former read from their out_of_band
                  counts: only for rules whose reference band is their base clip band (nsr, decay).
    rescue:       True for a rule whose kept tokens among its base clip's zeroed ones are rescued
                  (nsr): with rescued_rows None, rescued = (base clip's zeroed tokens) - zero_grad.
    """

    surrogate: torch.Tensor
    ratio: torch.Tensor
    keep: torch.Tensor | None = None
    zero_cells: str = "general"
    rescued_rows: torch.Tensor | None = None
    near_rows: torch.Tensor | None = None
    zero_rows: torch.Tensor | None = None
    beyond_rows: torch.Tensor | None = None
    rescue: bool = False


class _Select(torch.autograd.Function):
    """y = x * gate where keep == 1, the constant ``value`` where keep == 0; dy/dx = gate.

    gate defaults to keep (y = x where kept). The forward is an exact ``lerp(value, x * gate,
    keep)`` (keep in {0, 1}); the backward is one product (autograd's lerp backward would first
    build 1 - weight). gate must be 0 wherever keep is 0."""

    @staticmethod
    def forward(ctx, x, value, keep, gate):
        ctx.save_for_backward(keep if gate is None else gate)
        ctx.x_shape = x.shape
        if gate is None:
            return torch.lerp(value, x.detach(), keep)
        kept = x.detach() * gate
        if kept.shape == bshape(kept.shape, value.shape, keep.shape):
            return torch.lerp(value, kept, keep, out=kept)  # in kept's buffer
        return torch.lerp(value, kept, keep)

    @staticmethod
    def backward(ctx, grad):
        (gate,) = ctx.saved_tensors
        g = grad * gate
        return (g if g.shape == ctx.x_shape else g.sum_to_size(ctx.x_shape)), None, None, None


def select(x: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
           gate: torch.Tensor | None = None) -> torch.Tensor:
    """x (times ``gate``) where keep == 1, the detached ``value`` where keep == 0 (zero gradient);
    the gradient is ``gate`` (default: keep)."""
    return _Select.apply(x, value.detach(), keep, gate)


class _Straight(torch.autograd.Function):
    """y = value (detached, broadcast to x's shape, no copy) with dy/dx = gate (broadcastable)."""

    @staticmethod
    def forward(ctx, x, value, gate):
        ctx.save_for_backward(gate)
        return value.expand(x.shape)

    @staticmethod
    def backward(ctx, grad):
        (gate,) = ctx.saved_tensors
        return grad * gate, None, None


def straight(x: torch.Tensor, value: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The detached ``value`` broadcast to x's shape, whose gradient w.r.t. x is ``gate``: the
    value and gradient of ``sg(value) + gate * (x - sg(x))`` with no (B, T) pass in the forward
    (for per-row values and gates, e.g. GSPO-token)."""
    return _Straight.apply(x, value.detach(), gate)


class _ClampedExp(torch.autograd.Function):
    """r = exp(clamp(x, -20, 20)) with d r / d x = r everywhere (straight-through clamp).

    One fused forward (clamp, in-place exp) and one backward op (grad * r)."""

    @staticmethod
    def forward(ctx, x):
        r = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp_()
        ctx.save_for_backward(r)
        return r

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return grad * r


def clamped_exp(x: torch.Tensor) -> torch.Tensor:
    return _ClampedExp.apply(x)


@dataclass
class RatioContext:
    logp_in: torch.Tensor  # (B, T) current policy log-probs (grad)
    old_logp_in: torch.Tensor  # (B, T) behaviour policy log-probs
    advantages: torch.Tensor  # (B,)
    mask_in: torch.Tensor  # (B, T) 1 on real completion tokens, 0 on padding (bool, int or float)
    generator: torch.Generator | None = None

    # -- inputs, normalised ---------------------------------------------------------------------
    @cached_property
    def maskf(self) -> torch.Tensor:  # (B, T) float32 0/1
        m = self.mask_in
        return m if m.dtype == torch.float32 else (m != 0).to(torch.float32)

    @cached_property
    def A(self) -> torch.Tensor:  # (B, 1) float32, detached
        return self.advantages.detach().to(torch.float32).reshape(-1, 1)

    @cached_property
    def pos(self) -> torch.Tensor:  # (B, 1) float 0/1, A > 0
        return fgt(self.A, 0.0)

    @cached_property
    def neg(self) -> torch.Tensor:  # (B, 1) float 0/1, A < 0
        return flt(self.A, 0.0)

    @cached_property
    def pos_b(self) -> torch.Tensor:  # (B, 1) bool, A > 0
        return self.A > 0

    @cached_property
    def neg_b(self) -> torch.Tensor:  # (B, 1) bool, A < 0
        return self.A < 0

    @cached_property
    def sign(self) -> torch.Tensor:  # (B, 1) float in {-1, 0, 1}
        return self.pos - self.neg

    @cached_property
    def weight(self) -> torch.Tensor:  # (B, T) detached: -A * mask, so l = surrogate * weight
        return self.maskf * -self.A

    @cached_property
    def n_tok(self) -> torch.Tensor:  # (B, 1) float32 valid tokens per sequence
        return self.maskf.sum(-1, keepdim=True)

    @cached_property
    def logp(self) -> torch.Tensor:  # (B, T) float32 with grad, 0 at padding
        return self.logp_in.to(torch.float32) * self.maskf

    # -- token log-ratio and ratio ----------------------------------------------------------------
    @cached_property
    def lr(self) -> torch.Tensor:  # (B, T) log r with grad (not clamped), 0 at padding
        old = self.old_logp_in.detach().to(torch.float32)
        return (self.logp_in.to(torch.float32) - old) * self.maskf

    @cached_property
    def lr_d(self) -> torch.Tensor:  # (B, T) detached
        return self.lr.detach()

    @cached_property
    def r(self) -> torch.Tensor:  # (B, T) with grad: exp(clamp(lr, +-20)), 1 at padding
        return clamped_exp(self.lr)

    @cached_property
    def r_d(self) -> torch.Tensor:  # (B, T) detached
        return self.r.detach()

    # -- sequence ratio (GSPO) --------------------------------------------------------------------
    @cached_property
    def s(self) -> torch.Tensor:
        """(B, 1) with grad: s_b = exp(sum_t mask * lr / sum_t mask); 1 for an all-padding row."""
        return clamped_exp(self.lr.sum(-1, keepdim=True) / self.n_tok.clamp(min=1.0))

    @cached_property
    def s_d(self) -> torch.Tensor:  # (B, 1) detached
        return self.s.detach()

    def ratio(self, level: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(x with grad, x detached): the token ratio r or the sequence ratio s."""
        return (self.s, self.s_d) if level == "sequence" else (self.r, self.r_d)

    def bound(self, lo, hi) -> torch.Tensor:
        """(B, 1): the bound the PPO clip uses for this sign of A (hi for A>0, lo for A<0, 0 for
        A == 0): the value of every clipped token."""
        return self.pos * hi + self.neg * lo

    def signed(self, xd: torch.Tensor, lo, hi) -> tuple[torch.Tensor, torch.Tensor]:
        """(xs, b): xs = x * sign(A) (exact), b = (hi for A>0, -lo for A<0, 0 for A == 0) as (B, 1).

        The PPO clip zeroes exactly xs > b (x > hi for A>0, x < lo for A<0), and the distance past
        the bound is d = xs - b, so "d <= delta" is tested as xs <= b + delta."""
        return xd * self.sign, self.pos * hi - self.neg * lo

    def unclipped(self, xd: torch.Tensor, lo, hi) -> torch.Tensor:
        """float 0/1 keep mask of the PPO clip: 0 on (A>0, x>hi) and (A<0, x<lo) (i.e. d > 0)."""
        xs, b = self.signed(xd, lo, hi)
        return torch.le(xs, b, out=xs) if xs.shape == bshape(xs.shape, b.shape) else fle(xs, b)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) valid-token count of a 0/1 mask that is 0 at padding, token-level (B, T) or
        sequence-level (B, 1) (then weighted by the row's token count)."""
        return t.sum(-1) if t.shape[-1] > 1 else t.reshape(-1) * self.n_tok.reshape(-1)

    def zero_rows(self, keep: torch.Tensor) -> torch.Tensor:
        """(B,) valid tokens with keep == 0 (keep: a 0/1 mask that is 1 at padding, (B, T) or
        (B, 1))."""
        if keep.shape[-1] == 1:
            return (1.0 - keep.reshape(-1)) * self.n_tok.reshape(-1)
        return keep.shape[-1] - keep.sum(-1)

    def scratch(self, shape: torch.Size) -> torch.Tensor:
        """A float32 buffer of ``shape`` reused for temporaries that are consumed right away
        (comparisons that are only counted, a rule's mask used once): no new allocation, and it
        stays in cache. Whatever is in it is overwritten by the next user: never return it."""
        bufs = self.__dict__.setdefault("_scratch", {})
        if shape not in bufs:
            bufs[shape] = torch.empty(shape, dtype=torch.float32, device=self.maskf.device)
        return bufs[shape]

    def count_rows(self, op, xd: torch.Tensor, v) -> torch.Tensor:
        """(B,) valid-token count of op(xd, v) (torch.gt / lt / ...), xd 0-padded-safe: the mask is
        computed into the scratch buffer and reduced at once."""
        shape = bshape(xd.shape, v.shape) if isinstance(v, torch.Tensor) else xd.shape
        return self.rows(op(xd, v, out=self.scratch(shape)))

    def rows_outside(self, xd: torch.Tensor, lo, hi) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) counts of x > hi and of x < lo (bounds: numbers or (B, 1)); cached, so a rule and
        the diagnostics asking for the same band share one pair of comparisons."""
        key = (id(xd), lo if isinstance(lo, float) else id(lo), hi if isinstance(hi, float) else id(hi))
        cache = self.__dict__.setdefault("_outside", {})
        if key not in cache:
            cache[key] = (self.count_rows(torch.gt, xd, hi), self.count_rows(torch.lt, xd, lo), (xd, lo, hi))
        n_hi, n_lo, _ = cache[key]
        return n_hi, n_lo

    # -- NSR draws --------------------------------------------------------------------------------
    # Every draw comes from ``self.generator`` only, as uniformly random 64-bit words sliced into
    # bits, bytes or 16-bit integers: 1/64, 1/8 or 1/4 of a word per token, far cheaper than a
    # ``torch.rand`` float (one word) per token. The generator advances by a number of words fixed
    # by the shape and the resolution, whatever the values (replayable streams).
    def _words(self, n_words: int) -> torch.Tensor:
        """(n_words,) int64, uniform over the full 64-bit range, on the generator's device."""
        gen = self.generator
        words = torch.empty(n_words, dtype=torch.int64, device=gen.device)
        return words.random_(-(2 ** 63), None, generator=gen)

    def coin_flips(self, shape: torch.Size, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 0/1 of ``shape`` (written into ``out`` when given), each exactly Bernoulli(1/2),
        independent: one bit of a random word per element (64 per word; the generator advances by
        ceil(numel / 64) words).

        Bit j of byte i goes to flat position j * n_bytes + i, so the unpacking is one contiguous
        uint8 AND per bit plane ((8, n_bytes) against the 8 one-bit masks), then one conversion."""
        n = shape.numel()
        bytes_ = self._words((n + 63) // 64).view(torch.uint8)
        device = self.maskf.device
        if bytes_.device != device:
            bytes_ = bytes_.to(device)
        n_bytes = (n + 7) // 8
        if n_bytes != bytes_.shape[0]:
            bytes_ = bytes_[:n_bytes]
        planes = torch.bitwise_and(bytes_, _BIT_MASKS if device.type == "cpu" else _BIT_MASKS.to(device))
        planes.clamp_(max=1)  # (8, n_bytes) 0/1 uint8
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=device)
        if 8 * n_bytes == n:
            out.view(8, n_bytes).copy_(planes)
        else:
            out.view(-1).copy_(planes.view(-1)[:n])
        return out

    def uniform8(self, shape: torch.Size) -> torch.Tensor:
        """uint8 of ``shape``, uniform in 0..255 (so ``U = k / 256 < p`` is ``k < 256 p``), 8 per
        word (the generator advances by ceil(numel / 8) words)."""
        n = shape.numel()
        return self._words((n + 7) // 8).view(torch.uint8)[:n].reshape(shape).to(self.maskf.device)

    def uniform16(self, shape: torch.Size) -> torch.Tensor:
        """Uniforms on the 2^16 grid, as int16 values k - 32768 for k uniform in 0..65535
        (so ``U < p`` is ``k16 < p * 65536 - 32768``), 4 per word (the generator advances by
        ceil(numel / 4) words)."""
        n = shape.numel()
        return self._words((n + 3) // 4).view(torch.int16)[:n].reshape(shape).to(self.maskf.device)


_BIT_MASKS = torch.tensor([[1], [2], [4], [8], [16], [32], [64], [128]], dtype=torch.uint8)  # (8, 1) one bit each
