"""ArithTask: determinism, disjoint splits, knobs, evaluation and the exact-integer reward."""

from __future__ import annotations

import itertools
import random

import pytest

from clipbench.tasks.arith import (
    ALPHABET,
    HELD_OUT_PER_MILLE,
    ArithKnobError,
    ArithKnobs,
    ArithTask,
    evaluate,
    is_held_out,
    parse_leading_int,
    render,
    render_steps,
    worked_steps,
)
from clipbench.tasks.base import Problem, Task


def _prompts(problems):
    return [p.prompt for p in problems]


def test_is_a_task_and_default_format():
    task = ArithTask()
    assert isinstance(task, Task)
    p = task.test_problems()[0]
    assert isinstance(p, Problem)
    assert p.prompt == p.meta["expression"] + "="
    assert p.answer == str(eval(p.meta["expression"]))  # noqa: S307 - digits and +- only
    assert len(task.train_problems()) == 20000 and len(task.test_problems()) == 500


def test_same_seed_same_problems_other_seed_other_problems():
    a, b, c = ArithTask(seed=3), ArithTask(seed=3), ArithTask(seed=4)
    assert a.train_problems() == b.train_problems()
    assert a.test_problems() == b.test_problems()
    assert _prompts(a.train_problems()[:200]) != _prompts(c.train_problems()[:200])
    assert _prompts(a.test_problems()) != _prompts(c.test_problems())


def test_prefix_n_is_consistent_with_full_split():
    task = ArithTask(train_size=300, test_size=40)
    assert task.train_problems(10) == task.train_problems()[:10]
    assert task.test_problems(7) == task.test_problems()[:7]
    with pytest.raises(ValueError, match="n must be in 0..40"):
        task.test_problems(41)


@pytest.mark.parametrize("knobs", [{}, {"operands": 3, "digits": 2, "ops": "+-*"}, {"digits": 4}])
def test_splits_disjoint_across_seeds(knobs):
    """No expression of any seed's test split appears in any seed's train split."""
    tasks = [ArithTask(seed=s, train_size=5000, test_size=200, **knobs) for s in (0, 1)]
    train = set().union(*(_prompts(t.train_problems()) for t in tasks))
    test = set().union(*(_prompts(t.test_problems()) for t in tasks))
    assert train.isdisjoint(test)
    for t in tasks:
        assert len(set(_prompts(t.test_problems()))) == t.test_size  # test problems are distinct
        assert all(is_held_out(p.meta["expression"]) for p in t.test_problems())
        assert not any(is_held_out(p.meta["expression"]) for p in t.train_problems())


def test_held_out_fraction_is_about_ten_percent():
    """Exact count over the 2-digit +- space (20000 expressions); binomial sd = sqrt(20000*.1*.9) = 42."""
    exprs = [render(n, o) for n in itertools.product(range(100), repeat=2) for o in itertools.product("+-")]
    held = sum(map(is_held_out, exprs))
    expected = len(exprs) * HELD_OUT_PER_MILLE / 1000  # 2000
    assert abs(held - expected) < 5 * 42
    assert ArithTask().held_out_capacity == held  # enumerable space: exact capacity


def test_difficulty_knobs_change_problems():
    base = ArithTask(train_size=2000, test_size=100)
    three = ArithTask(operands=3, train_size=2000, test_size=100)
    assert all(len(p.meta["operands"]) == 3 and len(p.meta["ops"]) == 2 for p in three.train_problems())
    one_digit = ArithTask(digits=1, ops="+", train_size=500, test_size=5)
    assert all(0 <= x <= 9 for p in one_digit.train_problems() for x in p.meta["operands"])
    assert {o for p in one_digit.train_problems() for o in p.meta["ops"]} == {"+"}
    five = ArithTask(digits=5, train_size=2000, test_size=100)
    assert max(x for p in five.train_problems() for x in p.meta["operands"]) >= 10**4  # P(miss) = 0.1^4000
    mul = ArithTask(ops="*", train_size=2000, test_size=100)
    assert {o for p in mul.train_problems() for o in p.meta["ops"]} == {"*"}
    assert _prompts(base.train_problems()) != _prompts(three.train_problems())
    # operators are uniform: 2000 draws of '+' vs '-' -> count('+') ~ Bin(2000, .5), sd 22.4
    plus = sum(p.meta["ops"] == ["+"] for p in base.train_problems())
    assert abs(plus - 1000) < 5 * 22.4


def test_answers_match_python_evaluation_brute_force():
    """The evaluator agrees with Python's own precedence on every 1-digit 3-operand expression."""
    for nums in itertools.product(range(10), repeat=3):
        for ops in itertools.product("+-*", repeat=2):
            assert evaluate(nums, ops) == eval(render(nums, ops)), render(nums, ops)  # noqa: S307
    task = ArithTask(operands=4, digits=2, ops="+-*", train_size=1000, test_size=100)
    for p in list(task.train_problems()) + list(task.test_problems()):
        assert int(p.answer) == eval(p.meta["expression"])  # noqa: S307


def test_golden_values():
    assert evaluate([37, 45, 12], ["+", "-"]) == 70  # 37+45=82, 82-12=70
    assert evaluate([2, 3, 4], ["+", "*"]) == 14  # 3*4 first
    assert evaluate([10, 2, 3], ["-", "-"]) == 5  # left to right
    assert evaluate([3, 5], ["-"]) == -2
    assert render([37, 45, 12], ["+", "-"]) == "37+45-12"


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("82", "82", 1.0),
        (" 82<eos>", "82", 1.0),  # leading space, then stops at the first non-digit
        ("82<eos>", "82", 1.0),
        ("82\n17", "82", 1.0),  # only the first integer counts
        ("082", "82", 1.0),  # integer value, leading zeros allowed
        ("8", "82", 0.0),
        ("821", "82", 0.0),  # the whole digit run is the integer
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("-3", "3", 0.0),
        ("- 3", "-3", 0.0),  # '-' must touch the digits
        ("+82", "82", 0.0),  # no leading '+'
        ("", "82", 0.0),
        ("   ", "82", 0.0),
        ("-", "0", 0.0),
        ("x82", "82", 0.0),  # must start (after whitespace) with the integer
        ("-0", "0", 1.0),
    ],
)
def test_reward_golden(completion, answer, reward):
    task = ArithTask(train_size=1, test_size=1)
    problem = Problem(id="p", prompt="?=", answer=answer)
    assert task.reward(completion, problem) == reward
    assert task.is_correct(completion, problem) is (reward == 1.0)


def test_parse_leading_int():
    assert parse_leading_int("\t-12=") == -12
    assert parse_leading_int("12-3") == 12
    assert parse_leading_int("abc") is None


@pytest.mark.parametrize(
    "knobs, knob, message",
    [
        ({"operands": 1}, "operands", "operands must be in 2..8"),
        ({"operands": 2.0}, "operands", "operands must be an integer"),
        ({"digits": 0}, "digits", "digits must be in 1..6"),
        ({"digits": True}, "digits", "digits must be an integer"),
        ({"ops": ""}, "ops", "ops must be a non-empty string"),
        ({"ops": "+/"}, "ops", "unknown operator '/'"),
        ({"ops": "++"}, "ops", "repeats an operator"),
        ({"seed": -1}, "seed", "seed must be in >= 0"),
        ({"train_size": 0}, "train_size", "train_size must be in >= 1"),
        ({"digits": 1, "ops": "+", "test_size": 500}, "test_size", "exceeds the .* held-out expressions"),
        ({"format": "step"}, "format", r"unknown format 'step' \(did you mean 'steps'\?\); valid: answer, steps"),
    ],
)
def test_bad_knobs(knobs, knob, message):
    with pytest.raises(ArithKnobError, match=message) as e:  # a ValueError naming the knob
        ArithTask(**knobs)
    assert isinstance(e.value, ValueError) and e.value.knob == knob


def test_large_space_uses_rejection_sampling():
    task = ArithTask(operands=3, digits=3, train_size=100, test_size=300)  # 10^9 * 4 expressions
    assert task.space_size == 10**9 * 4
    assert len(set(_prompts(task.test_problems()))) == 300


# ---- the steps format ------------------------------------------------------------------------

STEPS = ArithTask(operands=4, format="steps", train_size=2000, test_size=200)


def test_worked_steps_golden():
    # products first, left to right, then the sum left to right
    assert worked_steps([3, 4, 5, 2], ["+", "*", "-"]) == [(4, "*", 5, 20), (3, "+", 20, 23), (23, "-", 2, 21)]
    assert worked_steps([6, 61, 50, 33], ["*", "-", "*"]) == [
        (6, "*", 61, 366),
        (50, "*", 33, 1650),
        (366, "-", 1650, -1284),
    ]
    assert worked_steps([2, 3, 4], ["*", "*"]) == [(2, "*", 3, 6), (6, "*", 4, 24)]
    # negative partial results are written with their sign
    assert render_steps(worked_steps([12, 45, 8], ["-", "+"])) == "12-45=-33 -33+8=-25 #-25"
    assert render_steps(worked_steps([37, 45, 12, 8], ["+", "-", "+"])) == "37+45=82 82-12=70 70+8=78 #78"


def test_worked_steps_agree_with_python_brute_force():
    """Every 3-operand expression over 0..9 and +-*: one step per operator, the last result is
    Python's value (so `evaluate`, defined as that last result, is Python's precedence)."""
    for nums in itertools.product(range(10), repeat=3):
        for ops in itertools.product("+-*", repeat=2):
            steps = worked_steps(nums, ops)
            assert len(steps) == 2
            assert all({"+": a + b, "-": a - b, "*": a * b}[op] == c for a, op, b, c in steps)
            assert steps[-1][3] == evaluate(nums, ops) == eval(render(nums, ops))  # noqa: S307


def test_steps_format_same_problems_reference_completion_and_length():
    answer = ArithTask(operands=4, train_size=2000, test_size=200)
    assert STEPS.test_problems() == answer.test_problems()  # the format changes completions only
    assert STEPS.train_problems() == answer.train_problems()
    lengths = []
    for p in STEPS.test_problems():
        sol = STEPS.solution(p)
        assert sol == render_steps(worked_steps(p.meta["operands"], p.meta["ops"]))
        assert sol.endswith(f" #{p.answer}") and sol.count("=") == 3 and sol.count(" ") == 3
        assert STEPS.reward(sol, p) == 1.0 and answer.solution(p) == p.answer
        assert set(sol) <= set(STEPS.alphabet)
        lengths.append(len(sol) + 1)  # + <eos>, one token per character
    # 4 two-digit operands: 3 steps of 7-10 characters and the answer: 20-60 tokens, ~34 on average
    assert 20 <= min(lengths) and max(lengths) <= 60 and 30 <= sum(lengths) / len(lengths) <= 38
    assert STEPS.alphabet == ALPHABET + "#" and ArithTask().alphabet == ALPHABET


def test_commutative_steps_may_be_written_either_way_round():
    steps = worked_steps([37, 45, 12, 8], ["+", "-", "+"])
    assert render_steps(steps, [True, True, True]) == "45+37=82 82-12=70 8+70=78 #78"  # '-' never swaps
    assert render_steps(worked_steps([6, 61, 5], ["*", "+"]), [True, False]) == "61*6=366 366+5=371 #371"
    # with an rng, the SFT targets use both orders (about half each), all graded correct
    rng = random.Random(0)
    firsts = {"canonical": 0, "swapped": 0}
    for p in STEPS.test_problems():
        sol = STEPS.solution(p, rng)
        assert STEPS.reward(sol, p) == 1.0 and len(sol) == len(STEPS.solution(p))
        if p.meta["ops"][0] == "+":
            lead = str(p.meta["operands"][0])
            firsts["canonical" if sol.startswith(lead + "+") else "swapped"] += 1
    assert min(firsts.values()) >= 0.35 * sum(firsts.values()), firsts
    assert ArithTask().solution(ArithTask().test_problems()[0], rng) == ArithTask().test_problems()[0].answer


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("37+45=82 82-12=70 70+8=78 #78", 1.0),
        ("#78", 1.0),  # outcome only: the steps are not graded
        ("37+45=80 80-12=68 #78", 1.0),
        ("37+45=82 82-12=70 70+8=78 #77", 0.0),
        ("37+45=82 82-12=70 70+8=78", 0.0),  # no '#': no final answer (e.g. truncated)
        ("78", 0.0),  # the answer format's completion does not count here
        ("37+45=82 #78 #79", 1.0),  # the first '#' is the final answer
        ("37+45=82 #79 #78", 0.0),
        ("37+45=82 # 78", 1.0),  # read like the answer format: leading space allowed
        ("37+45=82 #", 0.0),
        ("37+45=82 #078", 1.0),
        ("37+45=82 #78x", 1.0),
    ],
)
def test_steps_reward_golden(completion, reward):
    problem = Problem(id="p", prompt="37+45-12+8=", answer="78")
    assert STEPS.reward(completion, problem) == reward


def test_knobs_have_one_owner():
    """ArithTask = ArithKnobs + seed; the run config's task section reads the knobs' defaults."""
    from clipbench.config.schema import TaskConfig

    assert ArithKnobs.names() == ("operands", "digits", "ops", "format", "train_size", "test_size")
    assert ArithTask(seed=3).knobs() == ArithKnobs().knobs()
    cfg = TaskConfig()
    assert {k: getattr(cfg, k) for k in ArithKnobs.names()} == ArithKnobs().knobs()


@pytest.mark.parametrize("knobs", [{}, {"operands": 3, "digits": 2, "ops": "+-"}, {"digits": 4}])
def test_validation_split_is_held_out_and_disjoint_from_test(knobs):
    """The validation split (what hyperparameters are tuned on) never shares an expression with the
    test split (what verdicts are read on) nor with any train split; it is as large as the test split
    where the space allows, distinct, and the same for the same seed. The test split is unchanged by
    its existence (it is drawn first, by its own generator): every stored evaluation stays valid."""
    task, again = ArithTask(seed=5, test_size=120, **knobs), ArithTask(seed=5, test_size=120, **knobs)
    val, test = _prompts(task.val_problems()), _prompts(task.test_problems())
    assert len(set(val)) == len(val) == min(120, task.held_out_capacity - 120)
    assert set(val).isdisjoint(test)
    assert set(val).isdisjoint(_prompts(task.train_problems()[:5000]))
    assert all(is_held_out(p.meta["expression"]) for p in task.val_problems())
    assert task.val_problems() == again.val_problems()
    assert task.val_problems(7) == task.val_problems()[:7]
    assert task.val_problems()[0].id == "arith-val-00000"


def test_test_split_unchanged_golden():
    """The first test problems of the default task, pinned before the validation split existed."""
    assert _prompts(ArithTask(seed=0).test_problems()[:3]) == GOLDEN_TEST_PROMPTS


GOLDEN_TEST_PROMPTS = ["41-76=", "46-42=", "83+67="]


def test_slipped_steps_golden():
    """One sum step's result off by a SLIPS offset, carried on: 43-80+59 = -37, then 22.
    random.Random(1): choice of step index 0 (of the chain [0, 1]), offset -10: 43-80=-47, -47+59=12."""
    from clipbench.tasks.arith import SLIPS, slipped_steps

    steps = worked_steps([43, 80, 59], ["-", "+"])
    assert steps == [(43, "-", 80, -37), (-37, "+", 59, 22)]
    assert slipped_steps(steps, random.Random(1)) == [(43, "-", 80, -47), (-47, "+", 59, 12)]
    for seed in range(50):  # every slip: exactly one step's own arithmetic is wrong, later steps carry it
        out = slipped_steps(steps, random.Random(seed))
        wrong = [i for i, (a, op, b, c) in enumerate(out) if c != (a + b if op == "+" else a - b)]
        assert len(wrong) == 1 and out[wrong[0]][3] - steps[wrong[0]][3] in SLIPS
        assert out[-1][3] != steps[-1][3]
    products = worked_steps([3, 4], ["*"])
    assert slipped_steps(products, random.Random(0)) == products  # products are never slipped
