"""The report's table of the sampler mismatch and its correction (numbers: report/correction.py)."""

from __future__ import annotations

import math

from clipbench.report.correction import QUADRANTS
from clipbench.report.tables import Table, model_title


def correction_table(by_block: dict, baseline: str | None) -> Table | None:
    cols = [
        "Method",
        "Seeds",
        "|log rho| mean",
        "rho min / mean / max",
        "Weight mean",
        "Truncated (% tok)",
        "Masked (% tok)",
        "Masked (% seq)",
    ] + [f"Masked {q.upper()} (% tok)" for q in QUADRANTS]
    t = Table(
        "correction",
        "Sampler/trainer mismatch and its correction (per rollout step, mean ± std over seeds)",
        cols,
        sections=False,
    )
    multi = len(by_block) > 1
    for model, labels in by_block.items():
        for lb in ([baseline] if baseline in labels else []) + [lb for lb in labels if lb != baseline]:
            c, s = labels[lb], labels[lb]["seeds"]

            def cell(d, fmt, scale=1.0):
                if d["mean"] is None or math.isnan(d["mean"]):
                    return ""
                v = format(scale * d["mean"], fmt)
                return f"{v} ± {format(scale * d['std'], fmt)}" if s > 1 and d["std"] else v

            rho = f"{cell(c['rho_min'], '.3g')} / {cell(c['mismatch/rho_mean'], '.4f')} / {cell(c['rho_max'], '.3g')}"
            t.add(
                [
                    f"{model_title(model)}: {lb}" if multi else lb,
                    str(s),
                    cell(c["mismatch/abs_mean"], ".2e"),
                    rho,
                    cell(c["correction/weight_mean"], ".4f"),
                    cell(c["correction/truncated_frac"], ".2f", 100),
                    cell(c["correction/masked_frac"], ".2f", 100),
                    cell(c["correction/seq_masked_frac"], ".1f", 100),
                ]
                + [cell(c[f"{q}/masked"], ".2f") for q in QUADRANTS]
            )
    if not t.rows:
        return None
    t.notes = [
        "rho = pi_old / pi_sampler per token (the trainer's recomputed old log-prob over the sampler's), "
        "before any truncation or mask: its mean over the rollout steps, its extrema over the run. "
        "Weight, truncated and masked shares: the run's sampler.correction (blank without one). Masked Qk: "
        "the quadrant's tokens the correction weighted 0, over all of the run's optimizer steps."
    ]
    return t
