"""A short organism run keeps its numbers bit for bit (what makes a speed change safe to merge at any
time: the same tokens, the same metrics, the same evaluations).

tests/fixtures/organism_short_88c50bf.json holds the numbers of grpo, dapo and nsr on a short version of
`recipes/organism.yaml` (tests/fixtures/make_organism_pinned.py: 4 rollout steps of 16 prompts x 8,
32 optimizer steps, evaluations of 19 problems per split at steps 0, 2 and 4), recorded at commit
88c50bf, before the sampler's and the evaluation's fast paths: every metric but `time/*` and every
evaluation payload but its `seconds`, compared exactly (floats included).

The numbers are the code's on this machine's float kernels: a machine whose kernels compute the
organism differently (another CPU capability, another torch) has another fingerprint, and there the
comparison is skipped; tests/test_fast_decode.py holds the fast paths equal to the readable ones on
any machine.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
PINNED = json.loads((FIXTURES / "organism_short_88c50bf.json").read_text())


def recorder():
    spec = importlib.util.spec_from_file_location("make_organism_pinned", FIXTURES / "make_organism_pinned.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_pinned_runs_are_the_recipe_shortened():
    mod = recorder()
    assert list(PINNED["overrides"]) == list(mod.OVERRIDES)
    assert sorted(PINNED["runs"]) == sorted(mod.RULES)
    for run in PINNED["runs"].values():
        # 4 rollout steps x 8 mini-batches x 1 epoch; evaluations at 0, eval.every = 2 and the last step
        assert len(run["metrics"]) == 32 and sorted(run["evals"]) == ["0", "2", "4"]
        assert run["evals"]["0"]["arith"]["n"] == 16 and run["evals"]["2"]["arith"]["n"] == 4
        assert len(run["evals"]["4"]["arith-val"]["correct"]) == 19


@pytest.mark.slow
def test_a_short_organism_run_keeps_its_numbers(tmp_path):
    mod = recorder()
    here = mod.fingerprint()
    if here != PINNED["fingerprint"]:
        pytest.skip(
            f"this machine's kernels compute the organism differently (fingerprint {here}, recorded on {PINNED['fingerprint']})"
        )
    from clipbench.config import run_id

    for cfg in mod.configs():
        rule = cfg.objective.name
        pinned = PINNED["runs"][rule]
        assert run_id(cfg) == pinned["run_id"]
        got = mod.train(cfg, tmp_path / rule)
        for i, (row, want) in enumerate(zip(got["metrics"], pinned["metrics"])):
            assert row == want, (
                rule,
                i,
                {k: (row.get(k), want.get(k)) for k in set(row) | set(want) if row.get(k) != want.get(k)},
            )
        assert len(got["metrics"]) == len(pinned["metrics"])
        assert got["evals"] == pinned["evals"], rule
