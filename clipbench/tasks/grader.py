"""Math answer grading, shared by training rewards and evaluation.

``extract_answer`` finds the stated final answer: the last ``Answer: X`` line (the DAPO template),
else the last ``\\boxed{X}``. ``grade`` compares it with the gold answer: plain decimal numbers are
compared exactly as numbers ("025" == "25", "27.0" == "27"); everything else goes through
math-verify's ``parse``/``verify`` (gold first), so ``\\frac{1}{2}`` == ``0.5`` and LaTeX tuples,
intervals and sets compare as mathematical objects.

``grade`` never raises: any parsing/verification error or timeout counts as incorrect. math-verify's
timeouts use ``signal.alarm``, which only works in the main thread; elsewhere they are switched off.
In both cases answers that could hang sympy or burn the whole timeout (power towers, huge
powers/factorials: ``_looks_explosive``; brackets that cannot close: ``_unbalanced``) are rejected
before parsing.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

TIMEOUT_S = 3  # math-verify parse / verify timeout (main thread only)
FALLBACK_TAIL_CHARS = 2000  # without Answer:/\boxed, math-verify scans this tail of the text
MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers

_ANSWER_MARK = re.compile(r"answer\s*:", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K_MARK = "####"
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_TRAILING_WORDS = re.compile(r"([+-]?[\d.,]*\d)\s+([A-Za-z]{2,}[A-Za-z .]*)")
_MATH_WORDS = {"pi", "sqrt", "infinity", "infty"}
_EXPLOSIVE = re.compile(
    r"\^\s*\{[^{}]*\^"  # 9^{9^9}: a power in a braced exponent
    r"|\^\s*\d+\s*\^"  # 9^9^9
    r"|\*\*\s*\(?\s*\d+\s*\*\*"  # 9**9**9, 9**(9**9)
    r"|(?:\^|\*\*)\s*[{(]?\s*\d{7,}"  # 10^{10000000}
    r"|\d{5,}\s*!"  # 100000!
)


# ---- extraction -----------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces matched) or ``\\boxed X``; None if none
    or unbalanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for j in range(start, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : j].strip()
            continue  # unbalanced: try an earlier one
        token = re.match(r"[^\s$]+", text[start:])
        if token:
            return token.group(0)
    return None


def _clean(answer: str) -> str:
    """Strip markdown bold, math delimiters and a final period around a stated answer."""
    s = answer.strip()
    for _ in range(3):
        before = s
        s = s.strip().strip("*").strip().removesuffix(".").rstrip()
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                inner = s[len(left) : len(s) - len(right)]
                if "$" not in inner:
                    s = inner.strip()
        if s == before:
            break
    return s


def extract_answer(completion: str) -> str | None:
    """The final answer a completion states, or None.

    The last ``Answer: X`` line (a ``\\boxed{}`` inside it is unwrapped; when nothing follows the
    colon, the next non-empty line is the answer), unless a ``\\boxed{X}`` comes after it (e.g. the
    model echoed the instruction "of the form Answer: $Answer" and then boxed its result); else the
    last ``\\boxed{X}``.
    """
    if not isinstance(completion, str):
        return None
    lines = completion.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        marks = list(_ANSWER_MARK.finditer(lines[i]))
        if not marks:
            continue
        content, last = lines[i][marks[-1].end() :].strip(), i
        if not content.strip("*$ "):
            last = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), i)
            content = lines[last].strip() if last > i else ""
        if last_boxed("\n".join(lines[last + 1 :])) is not None:
            break  # a later \boxed{} wins
        boxed = last_boxed(content)
        answer = _clean(boxed if boxed is not None else content)
        if answer:
            return answer
    boxed = last_boxed(completion)
    if boxed is not None:
        answer = _clean(boxed)
        return answer or None
    return None


def normalize_gold(answer) -> str:
    """Gold answer as a string: ints as is, integral floats without '.0' (27.0 -> "27"), GSM8K
    rationales reduced to the number after the last ``####`` (commas dropped)."""
    if isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, int):
        return str(answer)
    if isinstance(answer, float):
        return str(int(answer)) if answer.is_integer() else repr(answer)
    s = str(answer).strip()
    if _GSM8K_MARK in s:
        s = s.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")
    return s


# ---- comparison -----------------------------------------------------------------------------


def _as_number(s: str) -> Decimal | None:
    """Decimal value of a plain number ("025", "27.0", "1,000", "-3"), else None."""
    s = s.strip().replace("{,}", ",")
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def _strip_trailing_words(s: str) -> str:
    """'18 dollars' -> '18' (a number followed only by plain words); anything else unchanged."""
    m = _TRAILING_WORDS.fullmatch(s.strip())
    if not m or _MATH_WORDS & {w.lower() for w in re.findall(r"[A-Za-z]+", m.group(2))}:
        return s
    return m.group(1)


def _looks_explosive(s: str) -> bool:
    """Answers whose sympy evaluation could run for ever (power towers, huge powers/factorials)."""
    return bool(_EXPLOSIVE.search(s))


def _unbalanced(s: str) -> bool:
    """Brackets that cannot close: (), [] counted together (intervals mix them), {} apart."""
    opens, closes = s.count("(") + s.count("["), s.count(")") + s.count("]")
    return opens != closes or s.count("{") != s.count("}")


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _mv_parse(expr: str, *, raw: bool = False):
    """math-verify parse of an answer: wrapped in ``$...$`` so bare LaTeX (tuples, sets, intervals)
    is read whole, unless it already carries delimiters or ``raw`` (default extraction over text)."""
    from math_verify import parse  # noqa: PLC0415 - math_verify is heavy

    text = expr if raw or "$" in expr or "\\boxed" in expr else f"${expr}$"
    return parse(text, parsing_timeout=_timeout())


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def _drop_currency(s: str) -> str:
    """'\\$32,\\!348' -> '32,348': dollar signs and LaTeX thin spaces say nothing about the value
    (and a bare '\\$' breaks the ``$...$`` wrapping of ``_mv_parse``)."""
    s = s.replace("\\$", "").replace("\\!", "").strip()
    return s[1:].strip() if s.startswith("$") and s.count("$") == 1 else s


def _grade_strings(pred: str, gold: str) -> bool:
    from math_verify import verify  # noqa: PLC0415 - math_verify is heavy

    if _squash(pred) == _squash(gold):
        return True
    pred, gold = _strip_trailing_words(_drop_currency(pred)), _drop_currency(gold)
    g_num, p_num = _as_number(gold), _as_number(pred)
    if g_num is not None and p_num is not None:
        return g_num == p_num
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    if _looks_explosive(pred) or _unbalanced(pred):
        return False
    gold_parsed = _mv_parse(gold)
    pred_parsed = _mv_parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_timeout()))


def grade(completion: str, gold, *, strict: bool = False) -> bool:
    """True iff the completion's final answer equals ``gold`` mathematically. Never raises.

    The answer is ``extract_answer(completion)``; when there is none, ``strict`` grades False and
    otherwise math-verify's own extraction reads the end of the completion (last number/LaTeX).
    """
    try:
        gold_s = normalize_gold(gold)
        if not gold_s or not isinstance(completion, str):
            return False
        pred = extract_answer(completion)
        if pred is not None:
            return _grade_strings(pred, gold_s)
        if strict:
            return False
        tail = completion[-FALLBACK_TAIL_CHARS:]
        if _looks_explosive(tail):
            return False
        from math_verify import verify  # noqa: PLC0415 - math_verify is heavy

        gold_parsed = _mv_parse(gold_s)
        pred_parsed = _mv_parse(tail, raw=True)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_timeout()))
    except Exception:  # noqa: BLE001 - a grader never takes training down
        return False


def gsm8k_gold(answer: str) -> str:
    """The integer after ``#### `` of a GSM8K rationale, commas dropped ("#### 1,000" -> "1000")."""
    if _GSM8K_MARK not in answer:
        raise ValueError(f"not a GSM8K answer (no '{_GSM8K_MARK}'): {answer[-80:]!r}")
    return normalize_gold(answer)
