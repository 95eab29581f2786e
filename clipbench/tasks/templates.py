"""Prompt templates for math problems.

``dapo`` is the DAPO training prompt, verbatim (the ``source_prompt`` of DAPO-Math-17k); ``plain``
is the bare problem text; ``auto`` resolves to ``dapo`` for math (its answers are graded from the
``Answer:`` line the template asks for, or a ``\\boxed{}``).
"""

from __future__ import annotations

from clipbench.errors import UserError, unknown_choice

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
PLAIN_TEMPLATE = "{problem}"

TEMPLATES: dict[str, str] = {"dapo": DAPO_TEMPLATE, "plain": PLAIN_TEMPLATE}
AUTO_TEMPLATE = "dapo"
TEMPLATE_CHOICES = (*TEMPLATES, "auto")


def resolve_template(name: str) -> str:
    """Template name -> the concrete name ('auto' -> 'dapo'); UserError for unknown names."""
    if name == "auto":
        return AUTO_TEMPLATE
    if name not in TEMPLATES:
        raise UserError(unknown_choice("template", name, TEMPLATE_CHOICES))
    return name


def render(template: str, problem: str) -> str:
    """Fill ``{problem}`` of the named template. Plain substitution, not ``str.format``: problem
    texts are full of LaTeX braces."""
    return TEMPLATES[resolve_template(template)].replace("{problem}", problem)
