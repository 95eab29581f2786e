"""The ABC-GRPO paper's Table 3 and Figure 4f numbers, as reference rows beside ours.

The numbers live in ``recipes/abc_grpo_table3/paper_table3.json`` (transcribed exactly, percent).
A block of our report gets the paper's rows inline when its model is one of the paper's (matched
by the last path component, so a local copy ``/models/Qwen3-4B-Base`` matches too) and the
benchmark is one of AIME24/AIME25/AMC23. A sweep that compares ``grpo`` with ``abc`` on other
models (``SCALE=tiny``) gets the paper's table printed beside as a labelled reference.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PAPER_FILE = Path(__file__).resolve().parents[1] / "recipes" / "abc_grpo_table3" / "paper_table3.json"
PAPER_METHODS = ("base", "grpo", "abc")


@lru_cache(maxsize=4)
def load_paper(path: str | None = None) -> dict | None:
    """The transcribed table, or None when the recipes directory is not available (installed wheel)."""
    p = Path(path) if path else PAPER_FILE
    if not p.is_file():
        return None
    return json.loads(p.read_text())


def paper_model_key(model: str, paper: dict) -> str | None:
    """The paper's model key our model name refers to, else None."""
    tail = model.rstrip("/").rsplit("/", 1)[-1].lower()
    for key in paper["models"]:
        if key.rsplit("/", 1)[-1].lower() == tail:
            return key
    return None


def paper_value(paper: dict, model_key: str, bench: str, method: str, metric: str) -> float | None:
    """Percent value of one cell; ``metric`` is 'avg' or 'pass@k'; None when the paper has no such cell."""
    rows = paper["models"][model_key]["rows"].get(bench)
    if rows is None or method not in rows or metric not in paper["columns"]:
        return None
    return rows[method][paper["columns"].index(metric)]


def compares_grpo_abc(methods: set[str]) -> bool:
    return {"grpo", "abc"} <= methods
