"""The evaluation runner: scripted fake sampler (logic only) and the real HF sampler on a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clipbench.eval.evaluate import batch_seed, evaluate, evaluate_and_store
from clipbench.rollout.base import Rollout
from clipbench.tasks.base import Problem
from clipbench.tracking.store import RunDir


class ScriptedSampler:
    """Completions come from a script: completion j of prompt p is script[p][j]; records every call.
    A fake only to unit-test the runner's bookkeeping (no model)."""

    name = "scripted"

    def __init__(self, script: dict[str, list[str]]):
        self.script = script
        self.calls: list[dict] = []

    def generate(self, prompts, n, *, seed, temperature=None, max_new_tokens=None, top_p=None):
        self.calls.append(
            {
                "prompts": list(prompts),
                "n": n,
                "seed": seed,
                "temperature": temperature,
                "max_new_tokens": max_new_tokens,
            }
        )
        texts = [self.script[p][j] for p in prompts for j in range(n)]  # prompt i owns rows i*n .. i*n+n-1
        ids = [[len(t)] * (1 + len(t) % 3) for t in texts]  # token counts 1..3, deterministic
        return Rollout(
            prompt_ids=[[0]] * len(texts), completion_ids=ids, texts=texts, truncated=[t.endswith("...") for t in texts]
        )

    def sync_weights(self, model):
        pass

    def close(self):
        pass


PROBLEMS = [Problem("p0", "1+1=", "2"), Problem("p1", "2+2=", "4"), Problem("p2", "3+4=", "7")]
SCRIPT = {
    "1+1=": ["2", "3", "2", "2"],  # 3 of 4 correct
    "2+2=": ["5", "5...", "4", "1"],  # 1 of 4 correct
    "3+4=": ["0", "1", "2", "3..."],  # 0 of 4 correct
}


def exact(completion: str, problem: Problem) -> bool:
    return completion == problem.answer


def test_correctness_matrix_and_summary_golden():
    sampler = ScriptedSampler(SCRIPT)
    out = evaluate(
        sampler, {"toy": PROBLEMS}, n=4, seed=7, grade=exact, temperature=0.6, max_new_tokens=9, batch_prompts=2
    )
    p = out["toy"]
    assert p["problem_ids"] == ["p0", "p1", "p2"]
    assert p["correct"] == [[1, 0, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]]
    s = p["summary"]
    # avg@4 = (3 + 1 + 0) / 12 = 1/3; pass@2 per problem = 1 - C(4-c, 2)/6: c=3 -> 1, c=1 -> 1/2, c=0 -> 0
    assert s["avg@4"] == pytest.approx(1 / 3) and "avg@n" not in s  # Avg@n names its n
    assert s["pass@1"] == pytest.approx(1 / 3)
    assert s["pass@2"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert s["pass@4"] == pytest.approx(2 / 3)
    assert s["num_problems"] == 3 and s["n"] == 4 and "per_problem" not in s
    assert p["truncated_fraction"] == pytest.approx(2 / 12)
    assert p["n"] == 4 and p["seed"] == 7 and p["temperature"] == 0.6 and p["max_new_tokens"] == 9
    # two batches (2 + 1 prompts), each with its own seed; overrides forwarded to the sampler
    assert [c["prompts"] for c in sampler.calls] == [["1+1=", "2+2="], ["3+4="]]
    assert [c["seed"] for c in sampler.calls] == [batch_seed(7, "toy", 0), batch_seed(7, "toy", 1)]
    assert all(c["temperature"] == 0.6 and c["max_new_tokens"] == 9 and c["n"] == 4 for c in sampler.calls)
    json.dumps(p)  # JSON-able as stored


def test_sharded_evaluation_equals_one_process():
    """Two processes (threads here, gathering through a barrier; the real 2-process run is in
    test_distributed.py) share 3 batches: rank 0 samples batches 0 and 2, rank 1 batch 1 and then
    repeats the last batch, discarded, to stay in lockstep; both return one process's payload."""
    import threading

    from clipbench.eval.evaluate import Shard

    problems = PROBLEMS * 2  # 6 prompts, batches of 2: three batches
    one = evaluate(ScriptedSampler(SCRIPT), {"toy": problems}, n=4, seed=7, grade=exact, batch_prompts=2)["toy"]
    box, barrier = [None, None], threading.Barrier(2)

    def gather(rank):
        def fn(obj):
            box[rank] = obj
            barrier.wait()
            return list(box)

        return fn

    samplers, outs = [ScriptedSampler(SCRIPT), ScriptedSampler(SCRIPT)], [None, None]

    def run(rank):
        outs[rank] = evaluate(
            samplers[rank],
            {"toy": problems},
            n=4,
            seed=7,
            grade=exact,
            batch_prompts=2,
            shard=Shard(rank, 2, gather(rank)),
        )["toy"]

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in outs:
        assert {k: v for k, v in out.items() if k != "seconds"} == {k: v for k, v in one.items() if k != "seconds"}
    seeds = [batch_seed(7, "toy", b) for b in range(3)]
    assert [c["seed"] for c in samplers[0].calls] == [seeds[0], seeds[2]]
    assert [c["seed"] for c in samplers[1].calls] == [seeds[1], seeds[2]]  # the repeat, discarded


def test_batch_seeds_are_deterministic_and_distinct():
    seeds = {batch_seed(s, b, i) for s in (0, 1) for b in ("aime24", "amc23") for i in range(3)}
    assert len(seeds) == 12
    assert batch_seed(3, "aime24", 1) == batch_seed(3, "aime24", 1)
    assert all(0 <= s < 2**31 for s in seeds)
    assert batch_seed(2**62, "x", 0) >= 0  # the trainer's 63-bit derived seeds work


def test_benchmark_samples_do_not_depend_on_other_benchmarks():
    a = ScriptedSampler(SCRIPT)
    b = ScriptedSampler(SCRIPT)
    evaluate(a, {"toy": PROBLEMS}, n=2, seed=1, grade=exact)
    evaluate(b, {"other": PROBLEMS[:1], "toy": PROBLEMS}, n=2, seed=1, grade=exact)
    assert a.calls[0]["seed"] == b.calls[1]["seed"]


def test_grade_per_benchmark_and_default_grader():
    sampler = ScriptedSampler({"1+1=": ["2", "Answer: 2"], "2+2=": ["4", "The answer is 5"]})
    out = evaluate(
        sampler, {"a": PROBLEMS[:1], "b": PROBLEMS[1:2]}, n=2, seed=0, grade={"a": exact, "b": lambda c, p: "4" in c}
    )
    assert out["a"]["correct"] == [[1, 0]] and out["b"]["correct"] == [[1, 0]]
    # None: the benchmark's own grader (arith: the leading integer must equal the answer)
    arith = [Problem("arith-test-00000", "12+30=", "42")]
    out = evaluate(ScriptedSampler({"12+30=": ["42", "42 ", "43", "x42"]}), {"arith": arith}, n=4, seed=0)
    assert out["arith"]["correct"] == [[1, 1, 0, 0]]


def test_evaluate_and_store_writes_the_run_dir(tmp_path):
    rd = RunDir(tmp_path / "run")
    evaluate_and_store(rd, 10, ScriptedSampler(SCRIPT), {"toy": PROBLEMS}, n=4, seed=3, grade=exact)
    evals = rd.read_evals()
    assert list(evals) == [10] and list(evals[10]) == ["toy"]
    assert evals[10]["toy"]["correct"][0] == [1, 0, 1, 1] and evals[10]["toy"]["step"] == 10
    assert rd.eval_path(10, "toy").is_file()


def test_bad_inputs():
    with pytest.raises(ValueError, match="n must be >= 1"):
        evaluate(ScriptedSampler(SCRIPT), {"toy": PROBLEMS}, n=0, seed=0, grade=exact)
    with pytest.raises(ValueError, match="no problems"):
        evaluate(ScriptedSampler(SCRIPT), {"toy": []}, n=1, seed=0, grade=exact)

    class Short(ScriptedSampler):
        def generate(self, prompts, n, **kw):
            r = super().generate(prompts, n, **kw)
            return Rollout(r.prompt_ids[:-1], r.completion_ids[:-1], r.texts[:-1], r.truncated[:-1])

    with pytest.raises(RuntimeError, match="returned 3 completions for 1 prompts x n=4"):
        evaluate(Short(SCRIPT), {"toy": PROBLEMS[:1]}, n=4, seed=0, grade=exact)


# ---- the real HF sampler on a tiny random Qwen3 (no download, a few seconds) ---------------------


@pytest.fixture(scope="module")
def tiny_hf():
    torch = pytest.importorskip("torch")
    from clipbench.basemodel import Recipe, build_model, build_tokenizer

    tok = build_tokenizer(["12+30=42"])
    recipe = Recipe(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    model = build_model(recipe, tok, torch.Generator().manual_seed(0))
    return model, tok


def test_real_hf_sampler(tiny_hf):
    from clipbench.rollout.hf import HFSampler
    from clipbench.tasks.arith import ArithTask

    model, tok = tiny_hf
    sampler = HFSampler(model, tok, max_new_tokens=6, temperature=1.0)
    problems = list(ArithTask(seed=0).test_problems(5))

    # a grade that depends on the text only, to check which completion landed in which cell:
    def even_length(c, p):
        return len(c) % 2 == 0

    out = evaluate(sampler, {"arith": problems}, n=3, seed=11, grade=even_length, batch_prompts=2)["arith"]
    assert np.asarray(out["correct"]).shape == (5, 3)
    # regenerate batch 1 (problems 2, 3) directly with its seed: the same texts, in the same cells
    again = sampler.generate([p.prompt for p in problems[2:4]], 3, seed=batch_seed(11, "arith", 1))
    expect = [[int(even_length(again.texts[i * 3 + j], None)) for j in range(3)] for i in range(2)]
    assert out["correct"][2:4] == expect
    # deterministic: the same seed gives the same matrix; real arith grading gives 0/1 cells
    assert (
        evaluate(sampler, {"arith": problems}, n=3, seed=11, grade=even_length, batch_prompts=2)["arith"]["correct"]
        == out["correct"]
    )
    graded = evaluate(sampler, {"arith": problems}, n=3, seed=11)["arith"]
    assert set(np.asarray(graded["correct"]).ravel()) <= {0, 1}
    assert 0 < graded["mean_completion_tokens"] <= 6


# ---- `clipbench eval` ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tiny_hf, tmp_path_factory):
    model, tok = tiny_hf
    path = tmp_path_factory.mktemp("model") / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_eval_command_on_a_model_dir(saved_model, tmp_path, capsys):
    from clipbench.commands.eval import eval_command

    out = tmp_path / "out"
    summary = eval_command(
        model=str(saved_model),
        benchmarks="arith",
        n=2,
        data_dir=None,
        limit=3,
        max_new_tokens=4,
        temperature=1.0,
        seed=5,
        backend="hf",
        out=out,
    )
    payload = json.loads((out / "arith.json").read_text())
    assert len(payload["problem_ids"]) == 3 and np.asarray(payload["correct"]).shape == (3, 2)
    assert json.loads((out / "summary.json").read_text())["benchmarks"]["arith"] == payload["summary"]
    assert summary["n"] == 2 and summary["backend"] == "hf"
    assert "Avg@2" in capsys.readouterr().out


def test_eval_command_on_a_run_dir(saved_model, tmp_path):
    """A run directory: its last checkpoint, and `arith` drawn with the run's own task settings."""
    import yaml

    from clipbench.commands.eval import eval_command, load_suite, resolve_target
    from clipbench.models import load_model_and_tokenizer
    from clipbench.tasks.arith import ArithTask
    from clipbench.train.checkpoint import save_checkpoint
    from clipbench.train.distributed import Dist

    run = tmp_path / "results" / "mysweep" / "abcdef012345"
    model, tok = load_model_and_tokenizer(str(saved_model))
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(
        run / "checkpoints" / "last",
        model=model,
        optimizer=opt,
        tokenizer=tok,
        state={"step": 1},
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        dist=Dist(),
    )
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {"seed": 3, "model": {"dtype": "float32"}, "task": {"name": "arith", "ops": "+", "template": "auto"}}
        )
    )
    target = resolve_target(str(run), "bfloat16")
    assert target.slug == "mysweep--abcdef012345" and target.dtype == "float32"
    assert target.arith == ArithTask(seed=3, ops="+")  # clipbench.tasks.build_run_task, as the trainer
    eval_command(
        model=str(run),
        benchmarks="arith",
        n=1,
        data_dir=None,
        limit=4,
        max_new_tokens=3,
        temperature=1.0,
        seed=0,
        backend="hf",
        out=tmp_path / "o",
    )
    ids = json.loads((tmp_path / "o" / "arith.json").read_text())["problem_ids"]
    assert ids == [p.id for p in ArithTask(seed=3, ops="+").test_problems(4)]
    problems, _ = load_suite(["arith"], data_dir=None, limit=4, template="dapo", arith=target.arith)
    assert [p.prompt for p in problems["arith"]] == [p.prompt for p in ArithTask(seed=3, ops="+").test_problems(4)]
    assert all("-" not in p.prompt for p in problems["arith"])  # the run's ops, not the default "+-"


def test_eval_command_bad_input(tmp_path):
    from clipbench.commands.eval import eval_command
    from clipbench.errors import UserError

    kw = dict(
        model="x", n=2, data_dir=None, limit=None, max_new_tokens=4, temperature=1.0, seed=0, backend="hf", out=None
    )
    with pytest.raises(UserError, match=r"unknown benchmark 'aime2' \(did you mean 'aime25'\?\); valid: aime24"):
        eval_command(benchmarks="aime2", **kw)
    with pytest.raises(UserError, match=r"--n must be >= 1"):
        eval_command(benchmarks="arith", **{**kw, "n": 0})
    empty_run = tmp_path / "run"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(UserError, match="run directory has no checkpoint"):
        eval_command(benchmarks="arith", **{**kw, "model": str(empty_run)})
