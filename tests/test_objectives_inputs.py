"""Issue 26 part 4: the rule inputs declared once (inputs.RuleInputs), the counts as one bundle
(inputs.Counts), a rule bound once (loss.bind) and called per micro-batch, bit for bit policy_loss.
Issue 38 part 4: a call is one bundle in (RuleInputs), one output out."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import clipbench
from clipbench.objectives import INPUTS, METHODS, policy_loss, registry
from clipbench.objectives import loss as loss_module
from clipbench.objectives.inputs import CALL_KEYWORDS, GIVEN, KEYWORDS, LOSS, Counts, RuleInputs
from clipbench.objectives.loss import BoundRule, bind


def test_the_rule_inputs_are_the_fields_of_one_dataclass_each_with_its_meaning():
    names = [f.name for f in dataclasses.fields(RuleInputs)]
    assert list(INPUTS) + list(LOSS) == names  # signature.py's INPUTS is derived, not a second list
    assert set(LOSS) == {"counts", "ref_logp", "weights", "correction_status", "token_splits"}  # no rule names these
    assert all(doc and f"{n}: {doc}" in RuleInputs.__doc__ for n, doc in {**INPUTS, **LOSS}.items())
    # what a caller passes when a rule reads it
    assert KEYWORDS == {"rewards": "reward", "entropy": "entropy", "sampler_logp": "rollout_logp"}
    assert {n: GIVEN[n]["shape"] for n in GIVEN} == {"reward": "(B,)", "entropy": "(B, T)", "rollout_logp": "(B, T)"}
    # every input a registered rule names is a field (the registry refuses any other name)
    assert {i for spec in METHODS.values() for i in spec.inputs} <= set(names)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RuleInputs().r = None


def _batch(seed: int, B: int = 6, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2
    logp = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_(True)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    given = {
        "rewards": torch.rand(B, generator=g),
        "entropy": torch.rand(B, T, generator=g),
        "sampler_logp": old + 0.1 * torch.randn(B, T, generator=g),
    }
    return logp, old, torch.randn(B, generator=g), mask, torch.rand(B, T, generator=g), given


@pytest.mark.parametrize(
    "method, params, agg",
    [("grpo", {"eps_high": 0.28}, "token-mean"), ("nsr", {"p": 0.5}, "seq-mean-token-mean"), ("topr", {}, "token-sum")],
)
def test_a_bound_rule_called_per_micro_batch_is_policy_loss_bit_for_bit(method, params, agg):
    bound = bind(method, params, agg=agg)
    counts = Counts(global_tokens=17.0, global_seqs=9)  # the mini-batch's, as a trainer passes them
    for seed in (0, 1):  # two micro-batches of one mini-batch
        logp, old, A, mask, u, given = _batch(seed)
        lp2 = logp.detach().clone().requires_grad_(True)
        a = bound(RuleInputs.of(logp=logp, old_logp=old, advantages=A, mask=mask, counts=counts, uniforms=u, **given))
        b = policy_loss(
            method, lp2, old, A, mask, agg=agg, uniforms=u, global_tokens=17.0, global_seqs=9, **given, **params
        )
        a.loss.backward()
        b.loss.backward()
        assert torch.equal(a.loss, b.loss) and torch.equal(a.token_loss, b.token_loss)
        assert torch.equal(logp.grad, lp2.grad)
        assert a.sums.keys() == b.sums.keys() and all(torch.equal(a.sums[k], b.sums[k]) for k in a.sums)


class Counter:
    """Counts the registry's lookups (get_method) and parameter validations (Registered.validated)."""

    def __init__(self, monkeypatch):
        self.lookups = self.validations = 0
        get_method, validated = registry.get_method, registry.Registered.validated

        def counted_get(name):
            self.lookups += 1
            return get_method(name)

        def counted_validated(spec, given):
            self.validations += 1
            return validated(spec, given)

        for module in (registry, loss_module):
            monkeypatch.setattr(module, "get_method", counted_get)
        monkeypatch.setattr(registry.Registered, "validated", counted_validated)


def test_bind_looks_the_rule_up_and_validates_it_once_then_calls_do_neither(monkeypatch):
    n = Counter(monkeypatch)
    bound = bind("m2po", {"action": "clip"}, agg="token-mean")
    assert (n.validations, bound.reads, bound.draws, bound.has_stat) == (1, (), False, True)
    setup = n.lookups  # bind's own lookup (and validate_params')
    for seed in range(4):
        logp, old, A, mask, _, _ = _batch(seed)
        x = RuleInputs.of(logp=logp, old_logp=old, advantages=A, mask=mask)
        stat = bound.mini_batch_stat(x)
        bound(dataclasses.replace(x, counts=Counts(global_tokens=40.0), stat=stat)).loss.backward()
    assert (n.lookups, n.validations) == (setup, 1)
    policy_loss("m2po", *_batch(0)[:4], action="clip")  # the one-call form binds per call
    assert n.validations == 2


def test_a_rule_reading_an_input_it_is_not_given_is_refused_by_the_bound_rule():
    bound = bind("topr")
    assert bound.reads == ("reward",)
    logp, old, A, mask, _, _ = _batch(0)
    with pytest.raises(
        ValueError, match=r"topr reads the input 'reward': pass rewards=\(B,\) \(each sequence's reward\)"
    ):
        bound(RuleInputs.of(logp=logp, old_logp=old, advantages=A, mask=mask))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['reward'\]: the call's inputs are"):
        RuleInputs.of(logp=logp, old_logp=old, advantages=A, mask=mask, reward=torch.ones(6))  # the caller's: rewards=
    with pytest.raises(TypeError, match="not both"):
        RuleInputs.of(logp=logp, counts=Counts(), global_tokens=3.0)


def test_a_call_is_one_bundle_in_and_one_output_out():
    """BoundRule.__call__ takes one RuleInputs (it took 5 positional and 7 keyword tensors plus
    **given), policy_loss 8 named parameters (it took 15); the trainer's rows are a bundle too; a
    rule's own function keeps its positional inputs (docs/plugins.md)."""
    from clipbench.train.step import StepInputs

    assert list(inspect.signature(BoundRule.__call__).parameters) == ["self", "inputs"]
    assert list(inspect.signature(policy_loss).parameters) == [
        "method", "logp", "old_logp", "advantages", "mask", "agg", "beta", "max_len", "params_and_inputs"
    ]  # fmt: skip
    assert set(CALL_KEYWORDS) >= set(KEYWORDS) | {"uniforms", "batch_stat", "weights", "global_tokens", "groups"}
    assert list(inspect.signature(METHODS["grpo"].fn).parameters)[:2] == ["r", "A"]
    logp, old, A, mask, u, given = _batch(0)
    rows = StepInputs(advantages=A, old_logp=old, uniforms=u, rewards=given["rewards"]).rows(torch.arange(6), 5)
    assert isinstance(rows, RuleInputs) and torch.equal(rows.A, A) and torch.equal(rows.reward, given["rewards"])
    assert rows.logp is None and rows.u is not None  # the forward's logp is the caller's to add


# The whole change that adds a rule input: one field (docs/objectives.md, "Adding a rule input").
NEW_FIELD = """
    values: torch.Tensor | None = given(
        "(B, T) a critic's per-token value estimates, detached; 0 at padding",
        TOKEN,
        "values",
        "the critic's value of each token",
    )
"""

USE_IT = """
from dataclasses import fields

import torch
from clipbench.objectives import INPUTS, policy_loss, rule
from clipbench.objectives.loss import bind
from clipbench.replay.tokens import OptStepView


@rule("value_baseline", source="tests/test_objectives_inputs.py")
def value_baseline(r, A, values):
    '''-r * (A - values): the advantage less a per-token value.'''
    return -r * (A - values)


logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
A, values = torch.tensor([1.0, -1.0]), torch.tensor([[0.5, 0.25, 0.0], [0.5, 0.5, 7.0]])
print(INPUTS["values"])
print(bind("value_baseline").reads)
print(float(policy_loss("value_baseline", logp, logp, A, mask, agg="token-sum", values=values).loss))
try:
    policy_loss("value_baseline", logp, logp, A, mask)
except ValueError as e:
    print(e)


class Record:  # a replay record that holds the new input under its keyword
    index = {"objective": {"method": "value_baseline", "params": {}, "agg": "token-sum", "beta": 0.0, "max_len": 3}}
    tensors = {"logp": logp[None], "old_logp": logp, "advantages": A, "mask": mask, "values": values}

    def get(self, name):
        return self.tensors.get(name)


step = OptStepView(Record(), {"epoch": 0, "global_tokens": None, "global_seqs": None})
x = step.inputs({"rows": [0, 1], "width": 3}, None)
print(sorted(f.name for f in fields(x) if isinstance(getattr(x, f.name), torch.Tensor)))
out = bind("value_baseline", agg="token-sum")(x)
print(float(out.loss))
"""


@pytest.mark.slow  # a subprocess: importing torch takes 5-15 s on the shared machine
def test_adding_a_rule_input_is_adding_one_field(tmp_path):
    """A copy of the package with NEW_FIELD added to RuleInputs and nothing else: a rule names the
    input, policy_loss and the bound rule take it by its keyword, a missing one is refused in one
    line, and the replay passes it from a record that holds it."""
    src = Path(clipbench.__file__).parent
    dst = tmp_path / "clipbench"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    inputs = dst / "objectives" / "inputs.py"
    text = inputs.read_text()
    anchor = '        "the current policy\'s token entropy, from the same forward as logp",\n    )\n'
    assert text.count(anchor) == 1
    inputs.write_text(text.replace(anchor, anchor + NEW_FIELD.lstrip("\n")))
    script = tmp_path / "use_it.py"
    script.write_text(textwrap.dedent(USE_IT))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # r == 1: token losses -(A - v): row 0 (A=1) -0.5 -0.75 -1; row 1 (A=-1) 1.5 1.5 (padding 0): sum 0.75
    assert done.stdout.splitlines() == [
        "(B, T) a critic's per-token value estimates, detached; 0 at padding",
        "('values',)",
        "0.75",
        "value_baseline reads the input 'values': pass values=(B, T) (the critic's value of each token)",
        "['A', 'logp', 'mask', 'old_logp', 'values']",
        "0.75",
    ]
    assert "values" not in inspect.signature(policy_loss).parameters  # no keyword was added by hand
