"""The report's table of mixture-of-experts routing (numbers: report/routing.py)."""

from __future__ import annotations

import math

from clipbench.report.routing import QUADRANTS, reading
from clipbench.report.tables import Table, model_title


def _cell(d: dict, seeds: int, fmt: str = ".1f") -> str:
    if d["mean"] is None or math.isnan(d["mean"]):
        return ""
    v = format(d["mean"], fmt)
    return f"{v} ± {format(d['std'], fmt)}" if seeds > 1 and d["std"] else v


def routing_table(by_block: dict, baseline: str | None) -> Table | None:
    cols = [
        "Method",
        "Seeds",
        "Moved first step (% tok)",
        "Moved (% tok)",
        "Agree per layer (%)",
        "Load maxvio mean / max",
        *(f"{q.upper()} moved / kept" for q in QUADRANTS),
        "Q1-Q4 moved / kept",
    ]
    t = Table(
        "routing",
        "Mixture-of-experts routing and the clip (off-policy steps; Qk: % out of band of the moved / kept tokens)",
        cols,
        sections=False,
    )
    multi = len(by_block) > 1
    for model, labels in by_block.items():
        for lb in ([baseline] if baseline in labels else []) + [lb for lb in labels if lb != baseline]:
            e, s = labels[lb], labels[lb]["seeds"]
            split = e["split"]
            t.add(
                [
                    f"{model_title(model)}: {lb}" if multi else lb,
                    str(s),
                    _cell(e["moved_first"], s),
                    _cell(e["moved"], s),
                    " / ".join(_cell(v, 1) for v in e["agree"].values()),
                    f"{_cell(e['load_maxvio'], s, '.2f')} / {_cell(e['load_maxvio_max'], 1, '.2f')}",
                    *(f"{_cell(split[f'{q}/moved'], s)} / {_cell(split[f'{q}/kept'], s)}" for q in (*QUADRANTS, "all")),
                ]
            )
    if not t.rows:
        return None
    sentence = reading(by_block)
    t.notes = ([sentence] if sentence else []) + [
        "Over the optimizer steps after the first of each rollout step (the first one's forward is the old "
        "forward: no expert can have moved). Moved: the valid completion tokens with at least one decoder "
        "layer whose top-k experts (as a set) differ from the old forward's (r3: the sampler's), whatever "
        "model.routing_replay then did with them. Moved first step: the same share at the first step of "
        "each rollout step (0 with routing replay none and r2; with r3 the sampler's experts against the "
        "trainer's). Agreement per layer: layer 0 first, the tokens whose experts in that layer are the old "
        "ones, mean over seeds.",
        "Load max violation: per optimizer step the busiest expert's share of the top-k assignments over the "
        "mean share, - 1, in the worst layer (0: balanced); mean over the run's steps and its maximum.",
        "Mean ± std over seeds. Qk moved / kept: the quadrant's tokens outside the run's reference band, as a "
        "share of its tokens whose experts moved / were kept (blank: no such token). The quadrant's tokens "
        "are report.json's routing split (moved + kept = all).",
    ]
    return t
