"""Independent transcription of SkyRL's loss reductions, incl. `prompt_mean` (every prompt group
weighs the same), implemented by pre-scaling the advantages of each mini-batch.

Source: NovaSky-AI/SkyRL @ a9564572eb8e91076be43c1bd5e4615e3de17265 (2026-08-21)
  skyrl/backends/skyrl_train/utils/ppo_utils.py
      apply_loss_reduction_to_advantages_minibatch (l.1152-1221), reduce_loss (l.1145-1149)
  skyrl/train/trainer.py  RayPPOTrainer._normalize_advantages (~l.1467-1506): runs once per mini-batch
      (before any forward), with mini_batch["loss_mask"], prompt boundaries rebased to the mini-batch
  skyrl/train/dataset/preprocess.py compute_prompt_boundaries (l.286): consecutive equal uids = one prompt
  skyrl/backends/skyrl_train/workers/worker.py: loss = policy_loss * dp_size (DP all-reduce averages),
      policy_loss = sum(loss * loss_mask) over the micro-batch -> micro-batches/ranks SUM exactly.
  tests/backends/skyrl_train/utils/test_ppo_utils.py::test_prompt_mean (expected 4.25)
  config: AlgorithmConfig.loss_reduction default "token_mean".

Shapes (SkyRL's): advantages (N, T) token-level (GRPO advantage broadcast over the response),
loss_mask (N, T) 0/1 for the N sequences of ONE mini-batch, prompt_boundaries [(start, end), ...]
mini-batch-relative row slices, one per prompt group.
Written from the behaviour of the source, not copied.
"""

from __future__ import annotations

import torch


def skyrl_scale_advantages(
    advantages, loss_mask, loss_reduction="token_mean", micro_batch_size=None, max_seq_len=None, prompt_boundaries=None
):
    """Return advantages scaled so that sum(per_token_loss(scaled) * loss_mask) is the reduced loss.

    token_mean:              A / max(sum(loss_mask), 1)                      (whole mini-batch)
    sequence_mean:           A / (N * max(n_i, 1))                           (N = all rows, incl. empty)
    seq_mean_token_sum_norm: A / (N * max_seq_len)
    prompt_mean:             rows of prompt p: A / (P * max(sum of loss_mask over p's rows, 1)),
                             P = number of prompts in the mini-batch (incl. prompts with no tokens
                             and groups whose advantages are all 0); rows outside every prompt stay 0.
    token_mean_legacy:       per micro-batch of micro_batch_size rows: A / max(n_mb, 1) / n_micro_batches
    Valid because every SkyRL policy loss is linear in A for a fixed sign of A.
    """
    N = advantages.shape[0]
    out = torch.zeros_like(advantages)
    if loss_reduction == "token_mean":
        out = advantages / loss_mask.sum().clamp(min=1)
    elif loss_reduction == "token_mean_legacy":
        k = N // micro_batch_size
        for i in range(k):
            s, e = i * micro_batch_size, (i + 1) * micro_batch_size
            out[s:e] = advantages[s:e] / loss_mask[s:e].sum().clamp(min=1) / k
    elif loss_reduction == "sequence_mean":
        out = advantages / (N * loss_mask.sum(dim=-1, keepdim=True).clamp(min=1))
    elif loss_reduction == "seq_mean_token_sum_norm":
        out = advantages / (N * max_seq_len)
    elif loss_reduction == "prompt_mean":
        if prompt_boundaries is None:
            raise ValueError("prompt_mean needs prompt_boundaries")
        P = len(prompt_boundaries)
        for s, e in prompt_boundaries:
            out[s:e] = advantages[s:e] / (P * loss_mask[s:e].sum().clamp(min=1))
    else:
        raise ValueError(loss_reduction)
    return out


def skyrl_reduce_loss(per_token_loss, loss_mask):
    return (per_token_loss * loss_mask).sum()


def prompt_mean_direct(per_token_loss, loss_mask, prompt_boundaries):
    """The same quantity written directly: mean over prompts of the prompt's pooled token mean."""
    vals = [
        (per_token_loss[s:e] * loss_mask[s:e]).sum() / loss_mask[s:e].sum().clamp(min=1) for s, e in prompt_boundaries
    ]
    return torch.stack(vals).mean()


if __name__ == "__main__":
    adv = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    lm = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    pb = [(0, 2), (2, 4)]
    scaled = skyrl_scale_advantages(adv, lm, "prompt_mean", prompt_boundaries=pb)
    assert torch.allclose(skyrl_reduce_loss(scaled, lm), torch.tensor(4.25))  # SkyRL's own test value
    assert torch.allclose(prompt_mean_direct(adv, lm, pb), torch.tensor(4.25))
    # gradient equivalence for a PPO-clip loss: scaled advantages == direct prompt mean
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 2, generator=g)
    lp = (old + 0.3 * torch.randn(4, 2, generator=g)).requires_grad_(True)
    A = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, 2)

    def ppo(a):
        r = torch.exp(lp - old)
        return -torch.min(r * a, r.clamp(0.8, 1.2) * a)

    l1 = skyrl_reduce_loss(ppo(skyrl_scale_advantages(A, lm, "prompt_mean", prompt_boundaries=pb)), lm)
    (g1,) = torch.autograd.grad(l1, lp)
    l2 = prompt_mean_direct(ppo(A), lm, pb)
    (g2,) = torch.autograd.grad(l2, lp)
    assert torch.allclose(l1, l2) and torch.allclose(g1, g2)
    print("skyrl_prompt_mean ok", round(l1.item(), 6))
