"""The @rule API: signature as schema, validation, errors, diagnostics derived from any rule's gradient,
weights and global counts, combinable sums."""

from __future__ import annotations

import warnings
from typing import Literal

import pytest
import torch

from clipbench.errors import UserError
from clipbench.objectives import (
    CELLS,
    COUNTS,
    MASSES,
    METHODS,
    RuleDefinitionError,
    RuleError,
    combine,
    effective_bounds,
    finalize,
    global_counts,
    nonneg,
    policy_loss,
    reduce_sums,
    rule,
    validate_params,
)


@pytest.fixture
def scratch_rules():
    """Rules registered by a test are removed afterwards."""
    before = set(METHODS)
    yield
    for name in set(METHODS) - before:
        del METHODS[name]


def one_token_rows(ratios, advantages, logp=-1.0):
    r = torch.tensor(ratios, dtype=torch.float64)
    lp = torch.full((len(ratios), 1), logp, requires_grad=True)
    old = (logp - torch.log(r)).float().reshape(-1, 1)
    return lp, old, torch.tensor(advantages, dtype=torch.float32), torch.ones(len(ratios), 1)


def counts(out):
    return {c: [int(out.stats[f"{c}/{k}"]) for k in COUNTS] for c in CELLS}


def test_lower_only_example_registers_and_derives_its_diagnostics(scratch_rules):
    @rule("lower_only", source="my idea")
    def lower_only(r, A, *, eps_low: float = 0.2):
        """-min(r*A, max(r, 1-eps_low)*A): PPO clip with only the lower bound."""
        return -torch.minimum(r * A, torch.clamp(r, min=1 - eps_low) * A)

    spec = METHODS["lower_only"]
    assert spec.inputs == ("r", "A") and spec.defaults == {"eps_low": 0.2}
    assert spec.formula == "-min(r*A, max(r, 1-eps_low)*A)"
    assert spec.description == "PPO clip with only the lower bound."
    assert spec.origin is not None and spec.origin.path.endswith("test_objectives_rule_api.py")
    assert len(spec.origin.sha256) == 64
    # band [0.8, 1.2] (eps_high absent: 0.2); r, A, l, dl/dlogp:
    #   1.5, +2: no upper clip: l = -3.0, grad -A*r = -3.0 (out of band, keeps its gradient)
    #   0.5, -2: -min(-1.0, 0.8*-2) = 1.6, clipped: grad 0
    #   0.5, +2: -min(1.0, 1.6) = -1.0, grad -1.0 (q2, out of band)
    #   1.1, -2: 2.2, grad 2.2
    lp, old, A, mask = one_token_rows([1.5, 0.5, 0.5, 1.1], [2.0, -2.0, 2.0, -2.0])
    out = policy_loss("lower_only", lp, old, A, mask, agg="seq-mean-token-sum")
    (g,) = torch.autograd.grad(out.token_loss.sum(), lp)
    torch.testing.assert_close(out.token_loss[:, 0], torch.tensor([-3.0, 1.6, -1.0, 2.2]))
    torch.testing.assert_close(g[:, 0], torch.tensor([-3.0, 0.0, -1.0, 2.2]))
    # [tokens, out_of_band, zero_grad, rescued, in_band_near]
    c = counts(out)
    assert c["q1"] == [1, 1, 0, 1, 0]  # past 1.2 with A>0 yet a gradient and l == -r*A: counted as rescued
    assert c["q3"] == [1, 1, 1, 0, 0] and c["q2"] == [1, 1, 0, 0, 0] and c["q4"] == [1, 0, 0, 0, 0]
    # grad_mass: |g| per cell (the per-token gradient of sum l, before aggregation)
    assert out.stats["q1/grad_mass"].item() == pytest.approx(3.0)
    assert out.stats["q1/rescued_grad_mass"].item() == pytest.approx(3.0)
    assert out.stats["q4/grad_mass"].item() == pytest.approx(2.2)
    assert out.stats["q3/grad_mass"].item() == 0.0


def test_a_rule_whose_clipped_tokens_keep_a_gradient_is_out_of_band_not_zero_grad(scratch_rules):
    @rule("half_past", source="test")
    def half_past(r, A, *, eps_low: float = 0.2, eps_high: float = 0.2):
        """-clip(r)*A - 0.5*(r - sg(r))*A: value of the clip, half the gradient past the bounds."""
        return -torch.clamp(r, 1 - eps_low, 1 + eps_high) * A - 0.5 * (r - r.detach()) * A

    lp, old, A, mask = one_token_rows([1.5, 0.5, 1.1], [2.0, -2.0, 2.0])
    out = policy_loss("half_past", lp, old, A, mask)
    c = counts(out)
    assert c["q1"] == [2, 1, 0, 0, 0] and c["q3"] == [1, 1, 0, 0, 0]  # l != -r*A: not rescued


def test_signature_types_literal_choices_and_checks(scratch_rules):
    @rule("typed", source="test", checks={"k": nonneg})
    def typed(r, A, mask, *, a: float = 1, k: int = 2, flag: bool = False, mode: Literal["x", "y"] = "x", name="n"):
        """l = -r*A"""
        return -r * A

    spec = METHODS["typed"]
    assert spec.inputs == ("r", "A", "mask")
    assert [(p.name, p.type, p.default, p.choices) for p in spec.params] == [
        ("a", float, 1.0, ()),
        ("k", int, 2, ()),
        ("flag", bool, False, ()),
        ("mode", str, "x", ("x", "y")),
        ("name", str, "n", ()),
    ]
    assert validate_params("typed", {"a": 2, "k": 3.0}) == {"a": 2.0, "k": 3, "flag": False, "mode": "x", "name": "n"}
    for params, match in [
        ({"a": "1"}, "'a' must be a finite number"),
        ({"a": float("inf")}, "finite number"),
        ({"k": 2.5}, "'k' must be an integer"),
        ({"k": -1}, "'k' must be >= 0"),
        ({"flag": 1}, "'flag' must be true or false"),
        ({"mode": "z"}, r"unknown value for 'mode' 'z'.*valid: x, y"),
        ({"nmae": "q"}, r"unknown parameter 'nmae' \(did you mean 'name'\?\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            validate_params("typed", params)


@pytest.mark.parametrize(
    "define, match",
    [
        (lambda: rule("bad1", source="t")(lambda r, A, eps: -r * A), r"'eps' is not an input .*keyword-only"),
        (lambda: rule("bad2", source="t")(eval("lambda r, A, *, eps: -r * A")), "needs a default"),
        (lambda: rule("bad3", source="t")(eval("lambda r, *args: r")), r"\*args"),
        (lambda: rule("grpo", source="t")(lambda r, A: -r * A), "built-in rule"),
        (lambda: rule("bad4", source="t")(eval("lambda r, A, *, eps=[1]: r")), "float, int, bool or str"),
        (lambda: rule("bad5", source="t", checks={"nope": nonneg})(lambda r, A: r), "unknown parameter"),
        (lambda: rule("bad name", source="t")(lambda r, A: r), "must start with a letter"),
        (lambda: rule("bad6", source="")(lambda r, A: r), "source= is required"),
    ],
)
def test_definition_errors_are_one_line_user_errors(scratch_rules, define, match):
    with pytest.raises(RuleDefinitionError, match=match) as e:
        define()
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)


def test_a_wrong_shape_is_a_one_line_error_naming_the_rule_and_file(scratch_rules):
    @rule("flat", source="t")
    def flat(r, A):
        """sum"""
        return (-r * A).sum(-1)  # (B,): wrong

    lp, old, A, mask = one_token_rows([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(
        RuleError,
        match=r"rule 'flat' \(plugin .*test_objectives_rule_api.py\) returned shape "
        r"\(2,\): a rule returns the per-token loss \(B, T\) = \(2, 1\)",
    ):
        policy_loss("flat", lp, old, A, mask)


def test_weights_scale_the_policy_term_but_not_the_diagnostics():
    lp, old, A, mask = one_token_rows([1.5, 0.5, 1.1, 0.9], [2.0, -2.0, 2.0, -2.0])
    w = torch.tensor([[0.5], [2.0], [1.0], [0.0]])
    a = policy_loss("grpo", lp, old, A, mask)
    b = policy_loss("grpo", lp, old, A, mask, weights=w)
    torch.testing.assert_close(b.token_loss, a.token_loss * w)
    (ga,) = torch.autograd.grad(a.loss, lp)
    (gb,) = torch.autograd.grad(b.loss, lp)
    torch.testing.assert_close(gb, ga * w)
    assert all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats)


def test_global_counts_are_the_normaliser():
    lp, old, A, mask = one_token_rows([1.0, 1.0, 1.0], [-1.0, -1.0, -1.0])  # l = r = 1 per token
    assert {k: v.item() for k, v in global_counts(mask).items()} == {"global_tokens": 3.0, "global_seqs": 3.0}
    for agg, kw, want in [
        ("token-mean", {"global_tokens": 6}, 3 / 6),
        ("token-mean", {"global_tokens": torch.tensor(12.0)}, 3 / 12),
        ("seq-mean-token-mean", {"global_seqs": 4}, 3 / 4),
        ("seq-mean-token-sum-norm", {"global_seqs": 5.0}, 3 / (16 * 5)),
        ("token-mean", {"global_tokens": 0}, 3 / 1),
    ]:  # an empty mini-batch divides by 1
        out = policy_loss("grpo", lp, old, A, mask, agg=agg, max_len=16, **kw)
        assert out.loss.item() == pytest.approx(want, rel=1e-6), (agg, kw)
    with pytest.raises(ValueError, match="global_tokens must be a number >= 0"):
        policy_loss("grpo", lp, old, A, mask, global_tokens=-1)


def test_sums_combine_and_reduce_by_kind():
    lp, old, A, mask = one_token_rows([1.5, 0.5, 1.1, 0.9], [2.0, -2.0, 2.0, 0.0])
    halves = [policy_loss("gspo", lp[i], old[i], A[i], mask[i]).sums for i in (slice(0, 2), slice(2, 4))]
    full = policy_loss("gspo", lp, old, A, mask).sums
    merged = combine(halves)
    assert merged["ratio/max"].item() == pytest.approx(1.5) and merged["seq_ratio/min"].item() == pytest.approx(0.5)
    for k in full:
        torch.testing.assert_close(merged[k], full[k])
    # reduce_sums: what a distributed caller does, here with two "ranks" reduced by hand
    calls = []

    def fake_all_reduce(vector, kind):  # rank 0's vector meets rank 1's
        calls.append(kind)
        other = torch.stack(
            [
                halves[1][k]
                for k in halves[0]
                if {"sum": "", "max": "/max", "min": "/min"}[kind] in k
                and (kind != "sum" or not k.endswith(("/max", "/min")))
            ]
        )
        vector.copy_(
            {"sum": vector + other, "max": torch.maximum(vector, other), "min": torch.minimum(vector, other)}[kind]
        )

    reduced = reduce_sums(halves[0], fake_all_reduce)
    assert calls == ["sum", "max", "min"]
    for k in full:
        torch.testing.assert_close(reduced[k], merged[k])
    assert finalize(reduced).keys() == finalize(full).keys()
    assert {f"{c}/{m}" for c in CELLS for m in MASSES} <= set(finalize(full))


def test_the_rule_gradient_never_backpropagates_into_the_model():
    w = torch.tensor(1.0, requires_grad=True)
    hits = []
    upstream = w * torch.full((2, 3), -1.0)
    upstream.register_hook(lambda g: hits.append(1))
    logp = upstream * 1.0
    out = policy_loss("grpo", logp, logp.detach() - 0.1, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    assert hits == [] and w.grad is None  # the diagnostics' autograd.grad stopped at logp
    out.loss.backward()
    assert hits == [1] and w.grad is not None


def test_no_grad_inputs_give_detached_outputs_with_full_diagnostics():
    lp, old, A, mask = one_token_rows([1.5, 0.5], [2.0, -2.0])
    out = policy_loss("grpo", lp.detach(), old, A, mask)
    assert not out.loss.requires_grad and out.stats["q3/zero_grad"].item() == 1
    with torch.no_grad():
        out = policy_loss("grpo", lp, old, A, mask)
    assert not out.loss.requires_grad and out.stats["q1/zero_grad"].item() == 1


def test_dual_clip_warns_when_the_cap_is_inside_the_band():
    with pytest.warns(UserWarning, match=r"dual_clip: c=1.2 <= 1 \+ eps_high = 1.28: .*not TRL's `delta`"):
        validate_params("dual_clip", {"c": 1.2, "eps_high": 0.28})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_params("dual_clip", {"c": 1.5, "eps_high": 0.28})
        effective_bounds("dual_clip", {"c": 1.2})  # logging the bounds does not warn again
