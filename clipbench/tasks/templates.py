"""Prompt templates for math problems.

``dapo`` is the DAPO training prompt, verbatim (the ``source_prompt`` of DAPO-Math-17k); ``plain``
is the bare problem text; ``auto`` resolves to ``dapo`` for math (its answers are graded from the
``Answer:`` line the template asks for, or a ``\\boxed{}``).
"""

from __future__ import annotations

from clipbench.registry import Registry

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
PLAIN_TEMPLATE = "{problem}"

AUTO_TEMPLATE = "dapo"
TEMPLATES: Registry[str] = Registry("template", also=("auto",))  # name -> the template text
TEMPLATES.register("dapo", DAPO_TEMPLATE)
TEMPLATES.register("plain", PLAIN_TEMPLATE)
TEMPLATE_CHOICES = TEMPLATES.choices()  # the templates and 'auto'


def resolve_template(name: str) -> str:
    """Template name -> the concrete name ('auto' -> 'dapo'); UserError for unknown names."""
    if name == "auto":
        return AUTO_TEMPLATE
    TEMPLATES.lookup(name)
    return name


def render(template: str, problem: str) -> str:
    """Fill ``{problem}`` of the named template. Plain substitution, not ``str.format``: problem
    texts are full of LaTeX braces."""
    return TEMPLATES[resolve_template(template)].replace("{problem}", problem)
