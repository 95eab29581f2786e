"""Sampled completions packed for a forward pass, batched the way they were generated.

Rows are laid out as  [pad ... pad | prompt | completion | pad ... pad]:
prompts left-padded to a common width Lp (as in generation), completions right-padded to T.
Position ids count real tokens only, so the forward pass sees the same positions as `generate`,
and a subset of rows can drop the columns none of them uses (`Packed.select`) without changing any
log-prob. The lengths are kept as Python ints so that choosing micro-batches never syncs a device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # (B, Lp + T)
    attention_mask: torch.Tensor  # (B, Lp + T)
    position_ids: torch.Tensor  # (B, Lp + T)
    completion_ids: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, T) float, 1.0 on real completion tokens
    prompt_lens: list[int] = field(default_factory=list)  # (B,) real prompt tokens per row
    completion_lens: list[int] = field(default_factory=list)  # (B,) real completion tokens per row

    def to(self, device) -> Packed:
        return Packed(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.position_ids,
                    self.completion_ids,
                    self.completion_mask,
                )
            ),
            self.prompt_lens,
            self.completion_lens,
        )

    def select(self, rows: list[int]) -> Packed:
        """The rows `rows`, trimmed to their longest prompt (left) and completion (right, >= 1 column)."""
        Lp = self.input_ids.shape[1] - self.completion_ids.shape[1]
        lp = max(self.prompt_lens[i] for i in rows)
        T = max(1, max(self.completion_lens[i] for i in rows))
        idx = torch.tensor(rows)
        cols = slice(Lp - lp, Lp + T)
        return Packed(
            self.input_ids[idx, cols],
            self.attention_mask[idx, cols],
            self.position_ids[idx, cols],
            self.completion_ids[idx, :T],
            self.completion_mask[idx, :T],
            [self.prompt_lens[i] for i in rows],
            [self.completion_lens[i] for i in rows],
        )

    def width(self, rows: list[int]) -> int:
        """Padded length (longest prompt + longest completion) of `rows` as one micro-batch."""
        return max(self.prompt_lens[i] for i in rows) + max(1, max(self.completion_lens[i] for i in rows))


def pack(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int) -> Packed:
    Lp = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completion_ids))
    ids = torch.tensor(
        [[pad_id] * (Lp - len(p)) + p + c + [pad_id] * (T - len(c)) for p, c in zip(prompt_ids, completion_ids)],
        dtype=torch.long,
    )  # (B, Lp + T)
    lp = torch.tensor([len(p) for p in prompt_ids])[:, None]  # (B, 1)
    lc = torch.tensor([len(c) for c in completion_ids])[:, None]  # (B, 1)
    j = torch.arange(Lp + T)
    att = ((j >= Lp - lp) & (j < Lp + lc)).long()  # real prompt and completion tokens
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    return Packed(
        ids,
        att,
        pos,
        ids[:, Lp:],
        (torch.arange(T) < lc).float(),
        [len(p) for p in prompt_ids],
        [len(c) for c in completion_ids],
    )


def placeholder(pad_id: int) -> Packed:
    """One row of one prompt and one completion token, no valid completion token: the empty
    micro-batch a rank runs to stay in step with the others (zero loss, zero gradient)."""
    ids = torch.tensor([[pad_id, pad_id]])
    return Packed(ids, torch.ones_like(ids), torch.tensor([[0, 1]]), ids[:, 1:], torch.zeros(1, 1), [1], [0])
