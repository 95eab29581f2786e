"""Math task loading: schema detection on every benchmark slice (tests/data), templates, benchmarks,
build_task."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from clipbench.errors import ConfigError, UserError
from clipbench.tasks import TASK_NAMES, build_task
from clipbench.tasks import benchmarks as bm
from clipbench.tasks.base import Problem, Task
from clipbench.tasks.benchmarks import BENCHMARKS, benchmark_grader, load_benchmark
from clipbench.tasks.math import MathTask, hold_out, load_problems, load_rows
from clipbench.tasks.templates import DAPO_TEMPLATE, TEMPLATES, render, resolve_template

FILES = {  # file stem -> (rows of its slice in tests/data, detected schema)
    "aime24": (8, "problem_answer"),
    "aime25": (8, "problem_answer"),
    "amc23": (8, "problem_answer"),
    "math500": (40, "problem_answer"),
    "gsm8k_test": (20, "question_answer"),
    "roll_math_benchmarks": (56, "roll"),
    "dapo_math_17k_sample": (8, "dapo"),
}


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---- schema detection on the benchmark slices (tests/data) ------------------------------------


@pytest.mark.parametrize("stem", FILES)
def test_each_benchmark_slice_loads_with_its_schema_and_row_count(data_dir, stem):
    rows, schema = FILES[stem]
    problems = load_problems(data_dir / f"{stem}.jsonl", template="plain")
    assert len(problems) == rows
    assert {p.meta["schema"] for p in problems} == {schema}
    assert len({p.id for p in problems}) == rows  # ids unique within a file
    assert all(p.answer and p.prompt == p.meta["problem"] for p in problems)
    assert all(p.id.startswith(f"{stem}/") for p in problems)


def test_the_slices_are_the_bytes_their_readme_names(data_dir):
    """tests/data/SHA256SUMS: each slice's sha256 (make_slices.py writes both from the public files)."""
    import hashlib

    sums = dict(reversed(line.split("  ")) for line in (data_dir / "SHA256SUMS").read_text().splitlines())
    assert sorted(sums) == sorted(f"{stem}.jsonl" for stem in FILES)
    for name, digest in sums.items():
        assert hashlib.sha256((data_dir / name).read_bytes()).hexdigest() == digest, name


def test_answers_are_normalised(data_dir):
    assert load_problems(data_dir / "amc23.jsonl")[0].answer == "27"  # 27.0 in the file
    assert load_problems(data_dir / "aime25.jsonl")[0].answer == "70"  # int in the file
    assert load_problems(data_dir / "gsm8k_test.jsonl")[0].answer == "18"  # '#### 18'
    assert load_problems(data_dir / "dapo_math_17k_sample.jsonl")[0].answer == "34"
    aime24 = load_problems(data_dir / "aime24.jsonl")
    assert aime24[0].id == "aime24/60" and aime24[0].answer == "204"
    roll = load_problems(data_dir / "roll_math_benchmarks.jsonl")
    assert roll[0].meta["source"] == "aime2024" and roll[0].answer == "204"


def test_dapo_template_rendering_is_verbatim(data_dir):
    # DAPO-Math-17k's own `source_prompt` is the template applied to `prompt`: ours must equal it.
    rows = [json.loads(line) for line in (data_dir / "dapo_math_17k_sample.jsonl").read_text().splitlines()]
    problems = load_problems(data_dir / "dapo_math_17k_sample.jsonl", template="dapo")
    assert len(problems) == 8
    for row, problem in zip(rows, problems):
        assert problem.prompt == row["source_prompt"][0]["content"]
        assert problem.id == f"dapo_math_17k_sample/{row['extra_info']['index']}"
    # and the README's text, line by line
    readme = (data_dir / "README.md").read_text()
    block = readme.split("The DAPO training prompt template (verbatim, `{problem}` replaced):")[1]
    lines = [ln[4:] for ln in block.strip("\n").splitlines()[:5]]  # 4-space indented block
    assert "\n".join(lines) == DAPO_TEMPLATE


def test_render_and_template_choices():
    assert render("plain", "Find {x}.") == "Find {x}."  # braces survive: no str.format
    assert render("auto", "P") == DAPO_TEMPLATE.replace("{problem}", "P")
    assert resolve_template("auto") == "dapo" and set(TEMPLATES) == {"dapo", "plain"}
    with pytest.raises(UserError, match="did you mean 'dapo'"):
        render("dapoo", "x")


def test_dotted_flat_key_parquet_and_json_layouts(tmp_path, data_dir):
    # DAPO with the flat dotted column name (as some exports write it)
    flat = _write_jsonl(tmp_path / "flat.jsonl", [{"prompt": "1+1?", "reward_model.ground_truth": "2"}])
    (p,) = load_problems(flat, template="plain")
    assert (p.meta["schema"], p.answer, p.id) == ("dapo", "2", "flat/0")
    # parquet (nested struct column survives the round trip)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (data_dir / "dapo_math_17k_sample.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    from_parquet = load_problems(tmp_path / "dapo.parquet")
    assert [p.answer for p in from_parquet] == [
        p.answer for p in load_problems(data_dir / "dapo_math_17k_sample.jsonl")
    ]
    # a JSON list and a {"data": [...]} wrapper
    (tmp_path / "list.json").write_text(json.dumps([{"problem": "p", "answer": 3}]))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [{"question": "q", "answer": "x\n#### 4"}]}))
    assert load_problems(tmp_path / "list.json")[0].answer == "3"
    assert load_problems(tmp_path / "wrapped.json")[0].answer == "4"


def test_unknown_schema_names_file_and_columns(tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"foo": 1, "bar": 2}])
    with pytest.raises(UserError) as err:
        load_problems(bad)
    msg = str(err.value)
    assert "bad" in msg and "['bar', 'foo']" in msg and "problem + answer" in msg


def test_bad_sources_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_problems(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unsupported file type"):
        load_rows(tmp_path / "x.csv")
    (tmp_path / "broken.jsonl").write_text('{"problem": "p", "answer": 1}\n{oops\n')
    with pytest.raises(UserError, match="line 2"):
        load_rows(tmp_path / "broken.jsonl")
    empty_answer = _write_jsonl(tmp_path / "e.jsonl", [{"problem": "p", "answer": ""}])
    with pytest.raises(UserError, match="row 0: empty answer"):
        load_problems(empty_answer)


def test_limit(data_dir):
    assert [p.id for p in load_problems(data_dir / "math500.jsonl", limit=3)] == [
        p.id for p in load_problems(data_dir / "math500.jsonl")[:3]
    ]


# ---- Hugging Face datasets paths (real `datasets` code, no hub) -----------------------------


def test_directory_sources_go_through_datasets(tmp_path, data_dir):
    import datasets

    rows = [json.loads(line) for line in (data_dir / "aime25.jsonl").read_text().splitlines()]
    # a save_to_disk dataset (DatasetDict with a 'test' split)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    saved = load_problems(tmp_path / "saved", split="test")
    assert len(saved) == 8 and saved[0].answer == "70"
    with pytest.raises(UserError, match="no split 'train'; available: test"):
        load_problems(tmp_path / "saved", split="train")
    # a directory of data files: datasets infers the split from the file name
    (tmp_path / "files").mkdir()
    _write_jsonl(tmp_path / "files" / "test.jsonl", rows)
    files = load_problems(tmp_path / "files", split="test")
    assert [p.answer for p in files] == [p.answer for p in saved]


def test_load_benchmark_by_dataset_name_routes_to_load_dataset(tmp_path, data_dir, monkeypatch):
    import datasets

    # A local "hub" dataset: a directory with a test split, named by a registry entry.
    rows = [json.loads(line) for line in (data_dir / "amc23.jsonl").read_text().splitlines()]
    (tmp_path / "amc").mkdir()
    _write_jsonl(tmp_path / "amc" / "test.jsonl", rows)
    monkeypatch.setitem(BENCHMARKS, "amc23", bm.Benchmark("amc23", str(tmp_path / "amc"), "test", None, "amc23.jsonl"))
    calls = []
    real = datasets.load_dataset

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    problems = load_benchmark("amc23", limit=5)
    assert calls == [((str(tmp_path / "amc"), None), {"split": "test"})]
    assert [p.answer for p in problems] == ["27", "36", "45", "3159", "36"]  # 27.0, 36.0, ... in the file
    assert [p.id for p in problems][:2] == ["amc23/0", "amc23/1"]
    assert problems[0].prompt.startswith("Solve the following math problem step by step.")


def test_load_benchmark_hub_offline_is_a_user_error(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # conftest sets it; be explicit
    with pytest.raises(UserError) as err:
        load_benchmark("aime24")
    msg = str(err.value)
    assert "HuggingFaceH4/aime_2024" in msg and "--data-dir" in msg and "aime24.jsonl" in msg


def test_hub_reachable_connects_once_to_the_hub_or_its_proxy(monkeypatch):
    import socket

    from clipbench.tasks import hub

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "https_proxy", "HTTPS_PROXY"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        hub.hub_reachable.cache_clear()
        assert hub.hub_reachable()
        hub.hub_reachable.cache_clear()
        monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")  # the proxy is what a request reaches first
        assert hub._probe_target() == ("127.0.0.1", port) and hub.hub_reachable()
    hub.hub_reachable.cache_clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # said offline: nothing is tried
    assert not hub.hub_reachable()
    hub.hub_reachable.cache_clear()


def test_eval_of_a_hub_benchmark_fails_at_once_when_the_hub_cannot_be_reached(tmp_path):
    """`clipbench eval` of a hub benchmark on a machine that cannot reach the hub (here: an endpoint on a
    closed local port, no offline variables set): one line saying so and naming --data-dir, exit 2, and
    no retry of huggingface_hub's five (about 25 s) before it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE") and "PROXY" not in k.upper()}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "ds"))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipbench",
            "eval",
            "--model",
            "builtin:arith-tiny",
            "--benchmarks",
            "aime24",
            "--n",
            "1",
            "--limit",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "error: benchmark 'aime24': could not load dataset 'HuggingFaceH4/aime_2024' (split 'train'): the Hugging "
        "Face hub (http://127.0.0.1:9) cannot be reached and the local cache does not hold it; without the hub, "
        "pass --data-dir DIR holding aime24.jsonl"
    )
    assert "Retrying" not in res.stderr


# ---- benchmarks registry --------------------------------------------------------------------


@pytest.mark.parametrize("name,rows", [("aime24", 8), ("aime25", 8), ("amc23", 8), ("math500", 40), ("gsm8k", 20)])
def test_load_benchmark_from_data_dir(data_dir, name, rows):
    problems = load_benchmark(name, data_dir=data_dir)
    assert len(problems) == rows
    assert all(p.id.startswith(f"{name}/") for p in problems)
    assert all(p.prompt.endswith('Remember to put your answer on its own line after "Answer:".') for p in problems)
    assert len(load_benchmark(name, data_dir=data_dir, limit=7, template="plain")) == 7
    is_correct = benchmark_grader(name)
    assert is_correct(f"Answer: {problems[0].answer}", problems[0])


def test_benchmark_registry_names_and_errors(data_dir, tmp_path):
    assert set(BENCHMARKS) == {"aime24", "aime25", "amc23", "math500", "gsm8k", "arith", "arith-val"}
    assert (BENCHMARKS["gsm8k"].hf_name, BENCHMARKS["gsm8k"].hf_config) == ("openai/gsm8k", "main")
    with pytest.raises(UserError, match="did you mean 'aime24'"):
        load_benchmark("aime2024", data_dir=data_dir)
    with pytest.raises(UserError, match="no file math500.jsonl"):
        load_benchmark("math500", data_dir=tmp_path)


def test_arith_benchmark_is_built_lazily_from_the_arith_task():
    from clipbench.tasks.arith import ArithTask

    assert load_benchmark("arith", limit=5) == list(ArithTask().test_problems()[:5])
    problems = load_benchmark("arith", limit=5, arith=ArithTask(seed=3))
    assert problems == list(ArithTask(seed=3).test_problems()[:5])
    is_correct = benchmark_grader("arith")
    assert is_correct(problems[0].answer, problems[0]) and not is_correct("x", problems[0])


# ---- the math task and build_task -----------------------------------------------------------


def test_build_math_task_from_mapping(data_dir):
    task = build_task(
        {
            "name": "math",
            "path": str(data_dir / "dapo_math_17k_sample.jsonl"),
            "split": "train",
            "template": "auto",
            "limit": 6,
        }
    )
    assert isinstance(task, MathTask) and isinstance(task, Task) and task.name == "math"
    assert len(task.train_problems()) == 6 and len(task.test_problems()) == 0
    p = task.train_problems()[0]
    assert task.reward("...\nAnswer: 34", p) == 1.0 and task.reward("Answer: 35", p) == 0.0
    assert task.reward("\\boxed{34}", p) == 1.0


def test_math_holdout_is_seeded_and_disjoint(data_dir):
    path = str(data_dir / "math500.jsonl")
    a = build_task({"name": "math", "path": path, "holdout": 10}, seed=1)
    b = build_task({"name": "math", "path": path, "holdout": 10}, seed=1)
    c = build_task({"name": "math", "path": path, "holdout": 10}, seed=2)
    ids = lambda ps: [p.id for p in ps]  # noqa: E731
    assert len(a.train_problems()) == 30 and len(a.test_problems()) == 10
    assert not set(ids(a.train_problems())) & set(ids(a.test_problems()))
    assert ids(a.test_problems()) == ids(b.test_problems()) != ids(c.test_problems())
    with pytest.raises(UserError, match="holdout"):
        hold_out(a.train_problems(), 30, 0)


def test_math_task_with_a_benchmark_as_test_split(data_dir):
    test = load_benchmark("aime24", data_dir=data_dir)
    task = MathTask.from_source(data_dir / "dapo_math_17k_sample.jsonl", test=test)
    assert len(task.train_problems()) == 8 and task.test_problems() == tuple(test)


def test_build_task_errors():
    with pytest.raises(UserError, match="did you mean 'math'"):
        build_task({"name": "mth"})
    assert TASK_NAMES == ("arith", "math")
    with pytest.raises(ConfigError, match="task.path"):
        build_task({"name": "math"})


def test_build_arith_passes_every_knob_and_the_seed():
    cfg = types.SimpleNamespace(
        name="arith",
        path=None,
        split="train",
        template="auto",
        limit=None,
        operands=3,
        digits=1,
        ops="+*",
        format="steps",
        train_size=100,
        test_size=10,
    )
    task = build_task(cfg, seed=7)
    assert (
        task.knobs() == {"operands": 3, "digits": 1, "ops": "+*", "format": "steps", "train_size": 100, "test_size": 10}
        and task.seed == 7
    )
    assert build_task({"name": "arith"}).seed == 0  # no seed given: 0


def test_build_run_task_uses_the_run_seed():
    """One function builds a run's task, from the RunConfig or the dict of its config.yaml alike."""
    from clipbench.config import load_run_config, to_dict
    from clipbench.tasks import build_run_task

    cfg = load_run_config(None, ["seed=3", "task.format=steps", "task.operands=4"])
    a, b = build_run_task(cfg), build_run_task(to_dict(cfg))
    assert a == b and a.seed == 3 and a.format == "steps" and a.operands == 4
    assert (
        build_run_task({"seed": 3, "task": {"name": "arith"}}).test_problems()
        == build_task({"name": "arith"}, seed=3).test_problems()
    )
    assert build_run_task({"task": {"name": "arith"}}).seed == 0


def test_build_arith_with_the_real_task():
    task = build_task(
        {"name": "arith", "operands": 2, "digits": 1, "ops": "+", "train_size": 50, "test_size": 5, "seed": 0}
    )
    assert task.name == "arith" and len(task.train_problems()) == 50 and len(task.test_problems()) == 5
    p = task.test_problems()[0]
    assert isinstance(p, Problem) and task.reward(p.answer, p) == 1.0
    with pytest.raises(ConfigError, match="ops"):
        build_task({"name": "arith", "ops": "+/"})
