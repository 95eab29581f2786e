import torch

from clipbench.objectives.advantages import compute_advantages, overlong_shaping, zero_variance_groups


def test_group_advantage_golden():
    # rewards [1, 0, 0, 1]: mean 0.5; Bessel std = sqrt(4 * 0.25 / 3) = 0.57735
    # A = +-0.5 / (0.57735 + 1e-6) = +-0.866024
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    a = compute_advantages(r, "group")
    assert torch.allclose(a, torch.tensor([[0.866024, -0.866024, -0.866024, 0.866024]]), atol=1e-5)


def test_group_mean_and_rloo_golden():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    # group_mean: R - 0.25
    assert torch.allclose(compute_advantages(r, "group_mean"), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))
    # rloo: R_i - mean(others): 1 - 0 = 1; 0 - 1/3 = -1/3
    assert torch.allclose(compute_advantages(r, "rloo"), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))


def test_all_equal_groups_get_zero_advantage_and_are_counted():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    for kind in ("group", "group_mean", "rloo"):
        a = compute_advantages(r, kind)
        assert torch.equal(a[:2], torch.zeros(2, 3)), kind
        assert a[2].abs().sum() > 0
    assert zero_variance_groups(r).tolist() == [True, True, False]


def test_overlong_shaping_golden():
    # max 32, buffer 8: no penalty up to 24 tokens; 28 tokens -> -(28-24)/8 = -0.5; truncated -> -1
    r = torch.tensor([1.0, 1.0, 1.0, 0.0])
    lengths = torch.tensor([20, 24, 28, 32])
    trunc = torch.tensor([False, False, False, True])
    out = overlong_shaping(r, lengths, trunc, max_new_tokens=32, buffer=8, penalty=1.0)
    assert torch.allclose(out, torch.tensor([1.0, 1.0, 0.5, -1.0]))
