"""eval.n_ends: the endpoints (first and last evaluation) sample more per problem than the curve."""

from __future__ import annotations

from pathlib import Path

from clipbench.config import load_run_config, run_id
from clipbench.eval.suite import eval_n, eval_suite
from clipbench.tasks import build_run_task

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


def test_n_ends_at_the_endpoints_only():
    cfg = load_run_config(RECIPE, ["eval.n=8", "eval.n_ends=64", "train.steps=40"])
    assert [eval_n(cfg, s) for s in (0, 20, 39, 40)] == [64, 8, 8, 64]
    plain = load_run_config(RECIPE, ["eval.n=8", "train.steps=40"])
    assert [eval_n(plain, s) for s in (0, 20, 40)] == [8, 8, 8]


def test_n_ends_unset_keeps_the_run_id():
    """A key added later stays out of the hash at its default: every earlier run id is unchanged."""
    assert run_id(load_run_config(RECIPE)) == run_id(load_run_config(RECIPE, ["eval.n_ends=null"]))
    assert run_id(load_run_config(RECIPE)) != run_id(load_run_config(RECIPE, ["eval.n_ends=64"]))


def test_arith_val_is_the_runs_own_validation_split():
    cfg = load_run_config(RECIPE, ["eval.benchmarks=[arith,arith-val]", "eval.limit=50"])
    suite = eval_suite(cfg, build_run_task(cfg))
    test, val = ([p.prompt for p in suite[b][0]] for b in ("arith", "arith-val"))
    assert len(test) == len(val) == 50 and not set(test) & set(val)
