"""Quadrant counts, aggregation arithmetic, KL term, histogram, bounds, registry and errors."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from clipbench.objectives import (
    AGGREGATIONS,
    CELLS,
    COUNTS,
    METHODS,
    effective_bounds,
    log_ratio_histogram,
    policy_loss,
    validate_params,
)
from clipbench.objectives import rules as rules_package
from clipbench.objectives.reference import REGENERATE, filled
from clipbench.objectives.rules import FAMILIES

REPO = Path(__file__).resolve().parent.parent


def from_ratios(r_rows, A, T=None):
    """logp/old/mask from ragged rows of ratios (old_logp = -1, logp = -1 + log r)."""
    T = T or max(len(r) for r in r_rows)
    logp = torch.full((len(r_rows), T), -1.0)
    mask = torch.zeros(len(r_rows), T)
    for i, row in enumerate(r_rows):
        logp[i, : len(row)] = -1.0 + torch.log(torch.tensor(row, dtype=torch.float64)).float()
        mask[i, : len(row)] = 1.0
    return logp, torch.full_like(logp, -1.0), torch.tensor(A, dtype=torch.float32), mask


# rows: A>0 with r in (1.1, 1.5, 0.9, 0.5, 1.0); A<0 with (1.1, 1.5, 0.9, 0.5, 0.7); A=0 with (1.5, 0.5)
CELL_BATCH = from_ratios([[1.1, 1.5, 0.9, 0.5, 1.0], [1.1, 1.5, 0.9, 0.5, 0.7], [1.5, 0.5]], [1.0, -1.0, 0.0])


def counts(out):
    return {c: [out.stats[f"{c}/{k}"].item() for k in COUNTS] for c in CELLS}


def test_quadrant_counts_grpo():
    out = policy_loss("grpo", *CELL_BATCH)
    # band [0.8, 1.2]; [tokens, out_of_band, zero_grad, rescued, in_band_near]
    assert counts(out) == {
        "q1": [2, 1, 1, 0, 0],  # 1.1, 1.5 (out, clipped)
        "q2": [2, 1, 0, 0, 0],  # 0.9, 0.5 (out, not clipped for A>0)
        "q3": [3, 2, 2, 0, 0],  # 0.9, 0.5, 0.7 (both out, both clipped)
        "q4": [2, 1, 0, 0, 0],  # 1.1, 1.5 (out, unbounded: not clipped)
        "zero_adv": [2, 2, 2, 0, 0],  # both out of band; A == 0: no gradient at all
        "on_policy": [1, 0, 0, 0, 0],  # r == 1 exactly with A != 0
    }
    assert out.stats["clip_events"].item() == 7
    assert out.stats["ratio/max"].item() == pytest.approx(1.5, rel=1e-6)
    assert out.stats["ratio/min"].item() == pytest.approx(0.5, rel=1e-6)
    rs = [1.1, 1.5, 0.9, 0.5, 1.0, 1.1, 1.5, 0.9, 0.5, 0.7, 1.5, 0.5]
    assert out.stats["ratio/mean"].item() == pytest.approx(sum(rs) / 12, rel=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in rs) / 12  # KL(old || new) estimator, r = new / old
    assert out.stats["approx_kl"].item() == pytest.approx(k3, rel=1e-5)


def test_quadrant_counts_abc_and_dual_clip():
    out = policy_loss("abc", *CELL_BATCH)
    z = {c: v[2] for c, v in counts(out).items()}
    assert z == {"q1": 1, "q2": 1, "q3": 2, "q4": 1, "zero_adv": 2, "on_policy": 0}  # every out-of-band token
    out = policy_loss("dual_clip", *CELL_BATCH, c=1.4)
    z = {c: v[2] for c, v in counts(out).items()}
    assert z == {"q1": 1, "q2": 0, "q3": 2, "q4": 1, "zero_adv": 2, "on_policy": 0}  # q4: 1.5 > c


def test_quadrant_counts_nsr_and_sequence_level():
    # nsr band (1.28, 1.38] / [0.7, 0.8): rows with 1.33 (A>0) and 0.75, 0.65 (A<0)
    b = from_ratios([[1.33, 1.5, 1.1], [0.75, 0.65, 0.9]], [1.0, -1.0])
    out = policy_loss("nsr", *b, p=1.0)
    c = counts(out)
    assert c["q1"] == [3, 2, 1, 1, 1] and c["q3"] == [3, 2, 1, 1, 1]
    out = policy_loss("decay", *b, p=0.5)
    c = counts(out)
    assert c["q1"] == [3, 2, 1, 0, 1] and c["q3"] == [3, 2, 1, 0, 1]
    # gspo: cells and bands on the sequence ratio s; row 0: s = (1.2 * 1.2)^(1/2) = 1.2 -> q1, clipped
    b = from_ratios([[1.2, 1.2], [0.9, 0.9, 0.9]], [1.0, -1.0])
    out = policy_loss("gspo", *b)
    c = counts(out)
    assert c["q1"] == [2, 2, 2, 0, 0] and c["q3"] == [3, 3, 3, 0, 0]
    assert out.stats["seq_ratio/max"].item() == pytest.approx(1.2, rel=1e-5)


def test_aggregations_arithmetic():
    # token losses: grpo, all in band, A = -1 -> l = r: row 0 = [1.1, 0.9], row 1 = [1.0] (+1 padding)
    b = from_ratios([[1.1, 0.9], [1.0]], [-1.0, -1.0])
    want = {
        "token-mean": (1.1 + 0.9 + 1.0) / 3,  # 1.0
        "seq-mean-token-mean": ((1.1 + 0.9) / 2 + 1.0 / 1) / 2,  # 1.0
        "seq-mean-token-sum": ((1.1 + 0.9) + 1.0) / 2,  # 1.5
        "seq-mean-token-sum-norm": ((1.1 + 0.9) / 2 + 1.0 / 2) / 2,  # max_len = T = 2: 0.75
        "token-sum": 1.1 + 0.9 + 1.0,  # 3.0, no normaliser (verl)
        "prompt-mean": ((1.1 + 0.9) / 2 + 1.0 / 1) / 2,  # groups [0, 1]: 1.0
    }
    groups = torch.tensor([0, 1])
    for agg, v in want.items():
        assert policy_loss("grpo", *b, agg=agg, groups=groups).loss.item() == pytest.approx(v, rel=1e-6), agg
    assert policy_loss("grpo", *b, agg="seq-mean-token-sum-norm", max_len=4).loss.item() == pytest.approx(
        ((1.1 + 0.9) / 4 + 1.0 / 4) / 2, rel=1e-6
    )
    # an all-padding row neither adds a term nor counts as a sequence
    # (prompt-mean: the empty row is in group 1; an empty group of its own would count as a prompt)
    b2 = from_ratios([[1.1, 0.9], [1.0], []], [-1.0, -1.0, 1.0])
    for agg in AGGREGATIONS:
        assert policy_loss("grpo", *b2, agg=agg, groups=torch.tensor([0, 1, 1])).loss.item() == pytest.approx(
            policy_loss("grpo", *b, agg=agg, groups=groups).loss.item(), rel=1e-6
        )


def test_prompt_mean_pools_each_group_and_counts_every_prompt():
    # l = r (A = -1, inside the band [0.8, 1.2]): group 0 = rows [1.1, 0.9] and [1.15] pooled:
    # (1.1 + 0.9 + 1.15) / 3 = 1.05; group 1 = [0.85]; prompt-mean = (1.05 + 0.85) / 2 = 0.95
    # (token-mean would be 4.0 / 4 = 1.0)
    b = from_ratios([[1.1, 0.9], [1.15], [0.85]], [-1.0, -1.0, -1.0])
    out = policy_loss("grpo", *b, agg="prompt-mean", groups=torch.tensor([0, 0, 1]))
    assert out.loss.item() == pytest.approx(0.95, rel=1e-6)
    # SkyRL's own test (ppo_utils prompt_mean): rows [1, 2], [3] | [5, 6], [7, 8] -> (2 + 6.5) / 2 = 4.25;
    # with l = r: an A = -1 clip-free loss equal to the ratio
    b = from_ratios([[1.0, 1.02], [1.03], [1.05, 1.06], [1.07, 1.08]], [-1.0] * 4)
    out = policy_loss("grpo", *b, agg="prompt-mean", groups=torch.tensor([0, 0, 1, 1]))
    assert out.loss.item() == pytest.approx(((1.0 + 1.02 + 1.03) / 3 + (1.05 + 1.06 + 1.07 + 1.08) / 4) / 2, rel=1e-6)
    # a prompt whose rows have no valid token still counts (SkyRL's P): (1.05 + 0.85 + 0) / 3
    b = from_ratios([[1.1, 0.9], [1.15], [0.85], []], [-1.0] * 4)
    out = policy_loss("grpo", *b, agg="prompt-mean", groups=torch.tensor([0, 0, 1, 2]))
    assert out.loss.item() == pytest.approx(1.9 / 3, rel=1e-6)
    with pytest.raises(ValueError, match="prompt group"):
        policy_loss("grpo", *b, agg="prompt-mean")


def test_kl_term():
    # beta * k3, k3 = exp(ref - logp) - (ref - logp) - 1; ref - logp = 0.5 on every token
    logp, old, A, mask = from_ratios([[1.0, 1.0]], [1.0])
    out0 = policy_loss("grpo", logp, old, A, mask)
    out = policy_loss("grpo", logp, old, A, mask, beta=0.1, ref_logp=logp + 0.5)
    k3 = math.exp(0.5) - 0.5 - 1.0
    assert out.stats["kl_ref"].item() == pytest.approx(k3, rel=1e-6)
    assert out.loss.item() == pytest.approx(out0.loss.item() + 0.1 * k3, rel=1e-6)
    assert "kl_ref" not in out0.stats
    lp = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(policy_loss("grpo", lp, old, A, mask, beta=0.1, ref_logp=logp + 0.5).loss, lp)
    # d/dlogp [-A r + beta * k3] / 2 = (-1 + 0.1 * (1 - e^0.5)) / 2 per token
    torch.testing.assert_close(g, torch.full_like(g, (-1 + 0.1 * (1 - math.exp(0.5))) / 2))


def test_stats_are_detached_0d_tensors():
    out = policy_loss("nsr", *CELL_BATCH, generator=torch.Generator().manual_seed(0), beta=0.1, ref_logp=CELL_BATCH[1])
    for k, v in out.stats.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad, k
    assert {f"{c}/{k}" for c in CELLS for k in COUNTS} <= set(out.stats)
    assert {"ratio/mean", "ratio/min", "ratio/max", "approx_kl", "clip_events", "kl_ref"} <= set(out.stats)


def test_log_ratio_histogram():
    logp = torch.tensor([[0.0, 0.3, -0.6, 0.9], [0.01, -0.01, 0.3, 0.0]])
    old = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    h = log_ratio_histogram(logp, old, torch.tensor([1.0, -1.0]), mask, bins=5, lo=-0.5, hi=0.5)
    # edges -0.5, -0.3, -0.1, 0.1, 0.3, 0.5; counts: [underflow, 5 bins, overflow]
    assert h["edges"] == pytest.approx([-0.5, -0.3, -0.1, 0.1, 0.3, 0.5])
    assert h["pos"] == [1, 0, 0, 1, 0, 1, 1]  # -0.6 under, 0.0 centre, 0.3 in [0.3, 0.5), 0.9 over
    assert h["neg"] == [0, 0, 0, 2, 0, 1, 0]  # +-0.01 centre, 0.3; the padded token is not counted
    h = log_ratio_histogram(logp, old, torch.tensor([1.0, 0.0]), mask)
    assert len(h["edges"]) == 42 and len(h["pos"]) == 43 and sum(h["neg"]) == 0 and sum(h["pos"]) == 4


def test_effective_bounds():
    b = effective_bounds("nsr", {"eps_high": 0.28, "delta": 0.1, "sides": "both"})
    assert b["nsr_band_upper"] == "(1.28, 1.38]" and b["nsr_band_lower"] == "[0.7, 0.8)"
    assert b["clip_high"] == pytest.approx(1.28) and b["ratio_level"] == "token"
    assert effective_bounds("nsr", {"sides": "upper", "base": "sequence"})["nsr_band_lower"] == "none"
    assert effective_bounds("nsr", {"base": "sequence"})["ratio_level"] == "sequence"
    assert effective_bounds("cispo", {})["weight_cap"] == "[0, 5]"
    assert "unified_mask" not in effective_bounds("cispo", {})  # a cispo run's logged params as before
    assert effective_bounds("cispo", {"unified_mask": True})["unified_mask"] == "zero where PPO's clip zeroes"
    assert effective_bounds("rollout_is", {})["weight_band"] == "(0.8, 1.2)"
    assert effective_bounds("cfpo", {"eps": 0.3})["ref_band_neg"] == "[0.7, 1.3]"
    b = effective_bounds("abc", {"eps1": 0.3, "eps4": 0.1})
    assert b["clip_pos"] == "[0.8, 1.3]" and b["clip_neg"] == "[0.9, 1.2]"
    assert b["ref_band_pos"] == "[0.8, 1.3]" and b["ref_band_neg"] == "[0.9, 1.2]"
    assert effective_bounds("sapo", {})["ref_band_pos"] == "[0.8, 1.2]"  # no eps: 0.2 / 0.2
    assert effective_bounds("gspo", {})["ratio_level"] == "sequence"
    for m in METHODS:
        assert all(isinstance(v, (str, float)) for v in effective_bounds(m, {}).values())


def _registered_in(path: Path) -> list[str]:
    """The names of a module's `@rule("name", ...)` decorations, read from its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    calls = [d for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for d in node.decorator_list]
    return [d.args[0].value for d in calls if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "rule"]


def test_registry_metadata():
    """The built-in rules are the `@rule` registrations in the rules package's modules (the one list:
    each module is one family of FAMILIES, the order docs/objectives.md shows them)."""
    modules = {p: _registered_in(p) for p in Path(rules_package.__file__).parent.glob("*.py")}
    assert {Path(m.__file__) for m in FAMILIES} == {p for p, names in modules.items() if names}
    declared = [name for names in modules.values() for name in names]
    assert sorted(n for n, spec in METHODS.items() if spec.origin is None) == sorted(declared)
    assert len(set(declared)) == len(declared) > 30
    for name, spec in METHODS.items():
        assert spec.description and "\n" not in spec.description and spec.formula and spec.source
        assert validate_params(name, {}) == spec.defaults
    assert METHODS["dapo"].defaults == {"eps_low": 0.2, "eps_high": 0.28}
    assert METHODS["nsr"].defaults["schedule"] == "const"
    assert validate_params("grpo", {"eps_high": 1}) == {"eps_low": 0.2, "eps_high": 1.0}


def test_the_tables_of_docs_objectives_are_written_from_the_registries():
    """Every built-in rule, aggregation and sampler correction: its row in docs/objectives.md is its
    docstring, signature and source (a new one is one registration and one regenerate command)."""
    text = (REPO / "docs" / "objectives.md").read_text(encoding="utf-8")
    assert filled(text) == text, f"docs/objectives.md is stale: {REGENERATE}"
    for name in [
        *(n for n, s in METHODS.items() if s.origin is None),
        *(n for n in AGGREGATIONS if AGGREGATIONS.origin(n) is None),
    ]:
        assert f"| `{name}` |" in text


@pytest.mark.parametrize(
    "method,params,match",
    [
        ("grpp", {}, r"unknown method 'grpp' \(did you mean 'grpo'\?\); valid: abc, aspo, bapo, ce_gppo, cfpo, cispo"),
        ("grpo", {"eps_hgh": 0.3}, r"unknown parameter 'eps_hgh' \(did you mean 'eps_high'\?\)"),
        ("grpo", {"eps_low": -0.1}, r"'eps_low' must be >= 0"),
        ("grpo", {"eps_low": "0.2"}, r"'eps_low' must be a finite number"),
        ("grpo", {"eps_low": float("nan")}, r"'eps_low' must be a finite number"),
        ("nsr", {"p": 1.5}, r"'p' must be in \[0, 1\]"),
        ("nsr", {"delta": 0.0}, r"'delta' must be > 0"),
        ("nsr", {"schedule": "linaer"}, r"unknown value for 'schedule' 'linaer' \(did you mean 'linear'\?\)"),
        ("nsr", {"sides": "top"}, r"unknown value for 'sides' 'top'.*valid: both, lower, upper"),
        ("nsr", {"base": "seq"}, r"unknown value for 'base'"),
        ("dual_clip", {"c": 1.0}, r"'c' must be > 1"),
        ("sapo", {"tau_neg": 0}, r"'tau_neg' must be > 0"),
        ("gppo", {"beta_low": -1}, r"'beta_low' must be >= 0"),
        ("abc", {"eps5": 0.1}, r"unknown parameter 'eps5'"),
    ],
)
def test_validation_errors(method, params, match):
    with pytest.raises(ValueError, match=match):
        validate_params(method, params)
    logp, old, A, mask = CELL_BATCH
    with pytest.raises(ValueError, match=match):
        policy_loss(method, logp, old, A, mask, **params)


def test_policy_loss_input_errors():
    logp, old, A, mask = CELL_BATCH
    with pytest.raises(ValueError, match=r"unknown aggregation 'token_mean' \(did you mean 'token-mean'\?\)"):
        policy_loss("grpo", logp, old, A, mask, agg="token_mean")
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss("grpo", logp, old, A, mask, beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        policy_loss("grpo", logp, old, A, mask, beta=-1.0, ref_logp=old)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss("grpo", logp, old, A[:2], mask)
    with pytest.raises(ValueError, match="old_logp must have"):
        policy_loss("grpo", logp, old[:, :2], A, mask)
    with pytest.raises(ValueError, match="max_len"):
        policy_loss("grpo", logp, old, A, mask, agg="seq-mean-token-sum-norm", max_len=0)


def test_bool_and_bf16_inputs():
    logp, old, A, mask = CELL_BATCH
    a = policy_loss("grpo", logp, old, A, mask)
    b = policy_loss("grpo", logp, old, A, mask.bool())
    assert torch.equal(a.loss, b.loss)
    c = policy_loss("grpo", logp.bfloat16(), old.bfloat16(), A, mask)  # computed in float32
    assert c.loss.dtype == torch.float32 and torch.isfinite(c.loss)


def test_methods_lists_one_line_per_rule_at_80_columns():
    """`clipbench methods`: one line per rule and correction (name, level, summary), none wider than
    the console; the formula, parameters and source are NAME's card."""
    from rich.console import Console

    from clipbench.commands.methods import print_methods
    from clipbench.objectives.corrections import CORRECTIONS

    console = Console(record=True, width=80)
    print_methods(console)
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    first = {line.split()[0]: line.split() for line in lines if line.strip()}
    for name in [*METHODS, *CORRECTIONS, "none"]:
        assert sum(line.startswith(name + " ") for line in lines) == 1, name  # exactly one line
    assert first["grpo"][:2] == ["grpo", "token"] and first["gspo"][1] == "sequence"
    assert first["nsr"][1] == "token|sequence"  # its level is a function of its base parameter
    assert "PPO/GRPO clipped surrogate" in " ".join(first["grpo"])
    assert len(lines) < 2 * (len(METHODS) + len(CORRECTIONS))  # was 15+ lines a rule
    assert "2601.03895" not in console.export_text() and any("token-mean" in line for line in lines)


def test_methods_are_listed_by_name_and_filtered_by_words():
    """By name (not registration order); words keep the entries whose name, level, summary or source
    holds every one; --long prints each summary whole, over lines."""
    from rich.console import Console

    from clipbench.commands.methods import print_methods
    from clipbench.errors import UserError

    console = Console(record=True, width=80)
    print_methods(console)
    names = [line.split()[0] for line in console.export_text().splitlines()[2 : 2 + len(METHODS)]]
    assert names == sorted(METHODS)
    print_methods(console, words=["sequence", "ratio"])
    lines = console.export_text().splitlines()
    shown = {line.split()[0] for line in lines if line.split() and line.split()[0] in METHODS}
    assert shown == {"gspo", "vespo"}, (
        lines
    )  # 'sequence ratio, hard clip'; 'VESPO's gamma weight on the sequence ratio'
    print_methods(console, words=["cispo"])  # a name: its card
    assert "clipped importance-sampling weight" in console.export_text()
    print_methods(console, words=["verl"], wrap=True)
    text = console.export_text()
    assert "…" not in text and "kl_rs" in text and "rejection sampling" in text
    with pytest.raises(UserError, match=r"no rule or correction holds 'warp drive'"):
        print_methods(console, words=["warp", "drive"])


def test_methods_name_prints_the_full_card_and_an_unknown_name_is_one_line():
    from rich.console import Console

    from clipbench.commands.methods import print_methods
    from clipbench.errors import UserError

    console = Console(record=True, width=80)
    print_methods(console, "abc")
    text = " ".join(console.export_text().split())
    for words in ("abc: asymmetric bounded clip", "loss -clip(r, lo, hi)*A", "eps1=0.2", "2601.03895", "inputs r, A"):
        assert words in text, words
    print_methods(console, "tis")
    assert "cap=2.0" in " ".join(console.export_text().split())
    with pytest.raises(UserError, match=r"unknown rule or correction 'grpoo' \(did you mean 'grpo'\?\)"):
        print_methods(console, "grpoo")


def test_validate_params_accepts_the_objective_mapping():
    # a config's objective section {method: ..., params...} validates as is
    assert validate_params("dapo", {"method": "dapo", "eps_high": 0.3})["eps_high"] == 0.3
    with pytest.raises(ValueError, match="not 'grpo'"):
        validate_params("grpo", {"method": "dapo"})
