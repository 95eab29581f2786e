"""Procedurally generated integer arithmetic: the built-in task of the tiny base models.

Two completion formats over the same prompts (``format``; what the trainer, the samplers and the
built-in base models use):

    prompt                "37+45-12+8="    operands and operators with no spaces, then '='
    answer  completion    "78" + EOS       the exact integer value; negative values as "-3"
    steps   completion    "37+45=82 82-12=70 70+8=78 #78" + EOS
                          every binary operation written out as ``left op right=result`` (products
                          first, then the sum left to right; see ``worked_steps``), steps separated by
                          a space, then ``#`` and the final answer. A '+' or '*' step may be written
                          either way round ("45+37=82"): equally correct, so a model fine-tuned on
                          both orders has real choices to make (forks), as a reasoning model does

Expressions follow the usual precedence ('*' binds tighter than '+' and '-', then left to right),
exactly as Python evaluates the same string. The worked steps are the one place that order lives
(``evaluate`` is their last result).

Splits are disjoint *by expression*, independent of the seed: an expression is held out iff the
first 8 bytes of ``sha256("clipbench-arith:" + expression)`` mod 1000 are below
``HELD_OUT_PER_MILLE``. Test problems are distinct held-out expressions; train problems are drawn
with replacement from the other expressions. So no seed's train split ever contains any seed's
test expression, which keeps the base model (trained on seed 0's train split) honest on every test
split.

A run's validation split (``val_problems``, the ``arith-val`` benchmark) is drawn from the held-out
expressions too, by a generator of its own, and never shares an expression with the test split:
hyperparameters are chosen on it, verdicts are read on the test split.

Reward (outcome only, like RLVR on math): the stated final answer equals the answer -> 1.0, else
0.0. The stated final answer is the completion's leading integer in the answer format and the
leading integer of the text after the first ``#`` in the steps format (see ``parse_leading_int``);
the steps themselves are not graded.

The knobs (``ArithKnobs``: operands, digits, ops, format, train_size, test_size) and their defaults
and checks live here only; the run config's ``task`` section and the base-model builder read them.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

from clipbench.errors import did_you_mean
from clipbench.tasks.base import Problem

VALID_OPS = "+-*"
FORMATS = ("answer", "steps")  # completion formats (see the module docstring)
STEP_SEP = " "  # between worked steps
ANSWER_MARK = "#"  # steps format: the final answer follows it
COMMUTATIVE = "+*"  # steps format: these steps may be written either way round
ALPHABET = "0123456789+-*= "  # every character of the answer format's prompts and completions
MAX_OPERANDS = 8
MAX_DIGITS = 6
HELD_OUT_PER_MILLE = 100  # 10% of all expressions are reserved for test
ENUMERATE_LIMIT = 200_000  # spaces this small are enumerated exactly
_HASH_SALT = b"clipbench-arith:"
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def parse_leading_int(completion: str) -> int | None:
    """The integer a completion states first, or None.

    Definition: skip leading whitespace; then an optional '-' followed by one or more ASCII digits,
    read up to the first non-digit character or the end of the string. Anything else at the start
    (empty text, '+', a letter, a lone '-') means no integer. Leading zeros are allowed ("082" is 82).
    """
    m = _LEADING_INT.match(completion)
    return int(m.group(1)) if m else None


Step = tuple[int, str, int, int]  # (left, op, right, result)


def worked_steps(operands: Sequence[int], ops: Sequence[str]) -> list[Step]:
    """The binary operations that evaluate ``operands[0] ops[0] operands[1] ...``, in order.

    First each product, left to right ('*' binds tighter), then the sum of the terms left to right:
    ``3+4*5-2`` -> [(4, '*', 5, 20), (3, '+', 20, 23), (23, '-', 2, 21)].
    """
    if len(ops) != len(operands) - 1:
        raise ValueError(f"need len(ops) == len(operands) - 1, got {len(ops)} and {len(operands)}")
    steps: list[Step] = []
    terms, signs = [operands[0]], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            steps.append((terms[-1], op, x, terms[-1] * x))
            terms[-1] *= x
        elif op in "+-":
            signs.append(op)
            terms.append(x)
        else:
            raise ValueError(f"unknown operator {op!r}; valid: {', '.join(VALID_OPS)}")
    total = terms[0]
    for op, term in zip(signs, terms[1:]):
        new = total + term if op == "+" else total - term
        steps.append((total, op, term, new))
        total = new
    return steps


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...``: the last result of ``worked_steps``."""
    steps = worked_steps(operands, ops)
    return steps[-1][3] if steps else operands[0]


def render_steps(steps: Sequence[Step], swap: Sequence[bool] = ()) -> str:
    """'37+45=82 82-12=70 #70': the steps format's completion text (without EOS). ``swap[i]`` writes
    step i's operands the other way round ('45+37=82'), allowed for the commutative '+' and '*'."""
    parts = []
    for i, (a, op, b, c) in enumerate(steps):
        if i < len(swap) and swap[i] and op in COMMUTATIVE:
            a, b = b, a
        parts.append(f"{a}{op}{b}={c}")
    return f"{STEP_SEP.join(parts)}{STEP_SEP}{ANSWER_MARK}{steps[-1][3]}"


SLIPS = (-10, -1, 1, 10)  # a slip: one digit of a sum step's result off by one (units or tens)


def slipped_steps(steps: Sequence[Step], rng: random.Random) -> list[Step]:
    """``steps`` with one slip, as a person working it out might make: the result of one step of the
    sum chain (a '+' or '-' step, chosen uniformly) is off by one of ``SLIPS``, and every later step
    carries the wrong value on, so the final answer is wrong. Products are never slipped. Steps with
    no '+' or '-' step are returned as they are."""
    out = list(steps)
    chain = [i for i, (_, op, _, _) in enumerate(out) if op in "+-"]
    if not chain:
        return out
    i = rng.choice(chain)
    a, op, b, c = out[i]
    total = c + rng.choice(SLIPS)
    out[i] = (a, op, b, total)
    for j in chain[chain.index(i) + 1 :]:  # the sum chain runs last, each step on the previous total
        _, op, b, _ = out[j]
        new = total + b if op == "+" else total - b
        out[j], total = (total, op, b, new), new
    return out


def render(operands: Sequence[int], ops: Sequence[str]) -> str:
    """'37+45-12' for operands (37, 45, 12) and ops ('+', '-')."""
    parts = [str(operands[0])]
    for op, x in zip(ops, operands[1:]):
        parts += [op, str(x)]
    return "".join(parts)


def is_held_out(expression: str) -> bool:
    """True iff the expression belongs to the test partition (seed-independent)."""
    digest = hashlib.sha256(_HASH_SALT + expression.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE


class ArithKnobError(ValueError):
    """A bad arith knob; ``knob`` names it (the config loader reports it as ``task.<knob>``)."""

    def __init__(self, knob: str, reason: str):
        self.knob = knob
        super().__init__(f"arith: {reason}")


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArithKnobError(name, f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ArithKnobError(name, f"{name} must be in {rng}, got {value}")
    return value


def _check_ops(ops) -> str:
    if not isinstance(ops, str) or not ops:
        raise ArithKnobError("ops", f"ops must be a non-empty string of operators from {VALID_OPS!r}, got {ops!r}")
    bad = [c for c in ops if c not in VALID_OPS]
    if bad:
        raise ArithKnobError(
            "ops",
            f"unknown operator {bad[0]!r} in ops={ops!r}{did_you_mean(bad[0], VALID_OPS)}; "
            f"valid: {', '.join(VALID_OPS)}",
        )
    if len(set(ops)) != len(ops):
        raise ArithKnobError("ops", f"ops={ops!r} repeats an operator; list each of {VALID_OPS!r} at most once")
    return ops


@dataclass(frozen=True, kw_only=True)
class ArithKnobs:
    """The arith knobs and their defaults: the one owner (``TaskConfig`` and the base-model builder
    read them). Operands are uniform on ``0 .. 10**digits - 1``; operators uniform on ``ops``."""

    operands: int = 2  # numbers per expression
    digits: int = 2  # digits per number (at most)
    ops: str = "+-"  # operators to draw from, each at most once
    format: str = "answer"  # completion format: answer | steps
    train_size: int = 20000  # train problems (drawn with replacement)
    test_size: int = 500  # held-out test problems (distinct)

    def __post_init__(self):  # cheap checks only (the config loader runs them on every run config)
        _check_int("operands", self.operands, 2, MAX_OPERANDS)
        _check_int("digits", self.digits, 1, MAX_DIGITS)
        _check_ops(self.ops)
        if self.format not in FORMATS:
            raise ArithKnobError(
                "format",
                f"unknown format {self.format!r}{did_you_mean(self.format, FORMATS)}; valid: {', '.join(FORMATS)}",
            )
        _check_int("train_size", self.train_size, 1)
        _check_int("test_size", self.test_size, 1)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(ArithKnobs))

    @property
    def alphabet(self) -> str:
        """Every character this format's prompts and completions can contain (a tokenizer's base)."""
        return ALPHABET + (ANSWER_MARK if self.format == "steps" else "")

    def knobs(self) -> dict:
        """The knob values as a plain dict (without the task's seed)."""
        return {name: getattr(self, name) for name in ArithKnobs.names()}


ARITH_DEFAULTS = ArithKnobs()


@dataclass(frozen=True, kw_only=True)
class ArithTask(ArithKnobs):
    """Integer arithmetic: the knobs of ``ArithKnobs`` plus the seed that draws the problems."""

    seed: int = 0

    name = "arith"

    def __post_init__(self):
        super().__post_init__()
        _check_int("seed", self.seed, 0)
        capacity = self.held_out_capacity
        if self.test_size > capacity:
            raise ArithKnobError(
                "test_size",
                f"test_size={self.test_size} exceeds the {capacity} held-out expressions "
                f"available for operands={self.operands} digits={self.digits} ops={self.ops!r}; "
                f"lower test_size or raise digits/operands",
            )

    # ---- the expression space -------------------------------------------------------------
    @property
    def space_size(self) -> int:
        """Number of distinct (operands, ops) tuples."""
        return (10**self.digits) ** self.operands * len(self.ops) ** (self.operands - 1)

    @property
    def held_out_capacity(self) -> int:
        """Distinct test expressions available: exact when enumerable, else a safe quarter of the
        expected held-out count (rejection sampling stays cheap below it)."""
        if self.space_size <= ENUMERATE_LIMIT:
            return len(self._held_out_pool)
        return self.space_size * HELD_OUT_PER_MILLE // 1000 // 4

    @cached_property
    def _held_out_pool(self) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
        """All held-out expressions (only built when the space is enumerable), sorted."""
        values = range(10**self.digits)
        pool = []
        for nums in itertools.product(values, repeat=self.operands):
            for ops in itertools.product(self.ops, repeat=self.operands - 1):
                if is_held_out(render(nums, ops)):
                    pool.append((nums, ops))
        return pool

    def _draw(self, rng: random.Random) -> tuple[tuple[int, ...], tuple[str, ...]]:
        hi = 10**self.digits - 1
        nums = tuple(rng.randint(0, hi) for _ in range(self.operands))
        ops = tuple(rng.choice(self.ops) for _ in range(self.operands - 1))
        return nums, ops

    def _rng(self, split: str) -> random.Random:
        # str seeds are hashed with sha512 by random.Random: stable across runs and PYTHONHASHSEED.
        return random.Random(f"clipbench-arith:{self.seed}:{self.operands}:{self.digits}:{self.ops}:{split}")

    def _problem(self, split: str, i: int, nums, ops) -> Problem:
        expr = render(nums, ops)
        value = evaluate(nums, ops)
        return Problem(
            id=f"arith-{split}-{i:05d}",
            prompt=f"{expr}=",
            answer=str(value),
            meta={"expression": expr, "operands": list(nums), "ops": list(ops)},
        )

    # ---- splits ---------------------------------------------------------------------------
    @cached_property
    def _train(self) -> tuple[Problem, ...]:
        rng = self._rng("train")
        out = []
        while len(out) < self.train_size:
            nums, ops = self._draw(rng)
            if not is_held_out(render(nums, ops)):
                out.append(self._problem("train", len(out), nums, ops))
        return tuple(out)

    def _held_out_draw(self, split: str, size: int, exclude: frozenset[str] = frozenset()) -> tuple[Problem, ...]:
        """``size`` distinct held-out expressions drawn by ``split``'s generator, none in ``exclude``."""
        rng = self._rng(split)
        if self.space_size <= ENUMERATE_LIMIT:
            pool = [e for e in self._held_out_pool if render(*e) not in exclude]
            if size > len(pool):
                raise ArithKnobError(
                    "test_size", f"{split}: {size} problems asked, {len(pool)} held-out expressions left"
                )
            chosen = rng.sample(pool, size)
        else:
            seen, chosen = set(exclude), []
            while len(chosen) < size:
                nums, ops = self._draw(rng)
                expr = render(nums, ops)
                if expr not in seen and is_held_out(expr):
                    seen.add(expr)
                    chosen.append((nums, ops))
        return tuple(self._problem(split, i, nums, ops) for i, (nums, ops) in enumerate(chosen))

    @cached_property
    def _test(self) -> tuple[Problem, ...]:
        return self._held_out_draw("test", self.test_size)

    @cached_property
    def _val(self) -> tuple[Problem, ...]:
        # the validation split: held-out expressions too (never trained on), drawn by a generator of
        # its own and disjoint from the test split, so tuning on it leaves the test split unseen
        test = frozenset(p.meta["expression"] for p in self._test)
        return self._held_out_draw("val", min(self.test_size, self.held_out_capacity - self.test_size), test)

    def train_problems(self, n: int | None = None) -> Sequence[Problem]:
        """The first ``n`` (default all ``train_size``) train problems; drawn with replacement."""
        return self._train if n is None else self._train[: _check_int("n", n, 0, self.train_size)]

    def test_problems(self, n: int | None = None) -> Sequence[Problem]:
        """The first ``n`` (default all ``test_size``) test problems; distinct expressions."""
        return self._test if n is None else self._test[: _check_int("n", n, 0, self.test_size)]

    def val_problems(self, n: int | None = None) -> Sequence[Problem]:
        """The first ``n`` validation problems (as many as the test split where the space allows):
        held-out expressions disjoint from the test split, for choosing hyperparameters."""
        return self._val if n is None else self._val[: _check_int("n", n, 0, len(self._val))]

    # ---- the format -----------------------------------------------------------------------
    def solution(self, problem: Problem, rng: random.Random | None = None, *, slip: random.Random | None = None) -> str:
        """A reference completion (without EOS): what the base model is fine-tuned on. Steps format:
        with ``rng``, each commutative step is written either way round with probability 1/2 (all
        are correct); without, the canonical order. With ``slip`` (a generator), the steps carry one
        slip (``slipped_steps``): a worked solution with a mistake in it, as real text has."""
        if self.format == "steps":
            steps = worked_steps(problem.meta["operands"], problem.meta["ops"])
            if slip is not None:
                steps = slipped_steps(steps, slip)
            return render_steps(steps, [rng.random() < 0.5 for _ in steps] if rng is not None else ())
        return problem.answer

    def final_answer(self, completion: str) -> int | None:
        """The integer a completion states as its final answer (see the module docstring), or None."""
        if self.format == "steps":
            _, mark, tail = completion.partition(ANSWER_MARK)
            return parse_leading_int(tail) if mark else None
        return parse_leading_int(completion)

    # ---- scoring --------------------------------------------------------------------------
    def is_correct(self, completion: str, problem: Problem) -> bool:
        stated = self.final_answer(completion)
        return stated is not None and stated == int(problem.answer)

    def reward(self, completion: str, problem: Problem) -> float:
        return 1.0 if self.is_correct(completion, problem) else 0.0
