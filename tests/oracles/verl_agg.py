"""Independent transcription of verl's agg_loss (all modes, incl. the new `token-sum`).

Source: verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22)
  verl/trainer/ppo/core_algos.py agg_loss (l.1140-1207); token-sum added by commit 4730d46b1
  ("[algo, cfg] feat: add token-sum loss aggregation (#7197)", 2026-08-03), with
  tests/trainer/ppo/test_loss_aggregation_on_cpu.py.
  Global counts: verl/workers/engine/fsdp/transformer_impl.py forward_backward_batch: batch_num_tokens =
  all-reduced sum of the mini-batch's loss_mask (= response_mask, after rollout rejection sampling);
  verl/trainer/ppo/ray_trainer.py: global_batch_size = ppo_mini_batch_size * rollout.n (all
  sequences of the mini-batch, including fully masked ones); dp_size = data-parallel world size.
  verl/workers/utils/losses.py ppo_loss: passes these via config.global_batch_info; FSDP backwards
  each micro-batch's loss directly and averages gradients over ranks.

Shapes (verl's): loss_mat, loss_mask (bs, T) of ONE micro-batch on ONE rank.
Written from the behaviour of the source, not copied.
"""

from __future__ import annotations

import torch


def _msum(x, m, axis=None):
    v = torch.where(m.bool(), x, torch.zeros_like(x)) * m
    return v.sum() if axis is None else v.sum(dim=axis)


def verl_agg_loss(
    loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
):
    """token-mean:  sum_valid / batch_num_tokens * dp_size     (own count if None and dp_size == 1)
    token-sum:   sum_valid * dp_size                          (NO normaliser at all; micro-batches and
                                                              ranks add up to the mini-batch's token sum)
    seq-mean-token-sum(-norm): sum_seqs(token sum) / global_batch_size * dp_size [/ loss_scale_factor or T]
    seq-mean-token-mean: sum_seqs(token sum / (n_i + 1e-8)) / global_batch_size * dp_size
    (sequences with no valid token are excluded from the numerator; own count of non-empty
    sequences if global_batch_size is None and dp_size == 1)."""
    m = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            assert dp_size == 1
            batch_num_tokens = m.sum()
        return _msum(loss_mat, m) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return _msum(loss_mat, m) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq = (loss_mat * m).sum(dim=-1)
        sm = (m.sum(dim=-1) > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            assert dp_size == 1
            global_batch_size = sm.sum()
        loss = _msum(seq, sm) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else m.shape[-1])
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        n = m.sum(dim=-1)
        seq = (loss_mat * m).sum(dim=-1) / (n + 1e-8)
        sm = (n > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            assert dp_size == 1
            global_batch_size = sm.sum()
        return _msum(seq, sm) / global_batch_size * dp_size
    raise ValueError(loss_agg_mode)


if __name__ == "__main__":
    lm = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 6.0]])
    mk = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert verl_agg_loss(lm, mk, "token-sum", dp_size=4).item() == (1 + 2 + 4 + 6) * 4  # verl's own test
    L = torch.arange(1, 25, dtype=torch.float32).reshape(8, 3)
    M = torch.tensor([[1.0, 1.0, 0.0]] * 8)
    whole = verl_agg_loss(L, M, "token-sum")
    parts = sum(verl_agg_loss(L[i : i + 2], M[i : i + 2], "token-sum") for i in range(0, 8, 2))
    ranks = torch.stack([verl_agg_loss(L[i : i + 4], M[i : i + 4], "token-sum", dp_size=2) for i in (0, 4)]).mean()
    assert torch.allclose(whole, parts) and torch.allclose(whole, ranks)
    tm = sum(verl_agg_loss(L[i : i + 2], M[i : i + 2], "token-mean", batch_num_tokens=M.sum()) for i in range(0, 8, 2))
    assert torch.allclose(tm, verl_agg_loss(L, M, "token-mean"))
    print("verl_agg ok", whole.item())
