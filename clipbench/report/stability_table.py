"""The stability table (display strings) from ``result["stability"]`` (report/stability.py): one
pair of rows per rule, its gain over the base model at every learning rate with the seeds' 95%
interval, then the runs flagged at that rate and the kinds of collapse; the last column its
critical learning rate with its interval. Then the tuning table: each rule's best rate of the ladder
and lr*, the peak of the fitted curve, with its interval and its ratio to grpo's.
"""

from __future__ import annotations

import math

from clipbench.report.tables import Table, collapse_text, model_title


def rate_text(lr: float) -> str:
    return f"{lr:.3g}"


def gain_text(c: dict) -> str:
    if not math.isfinite(c["mean"]):
        return ""
    lo, hi = c["ci"]
    ci = f" [{lo:+.1f}, {hi:+.1f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{c['mean']:+.1f}{ci} ({len(c['seeds'])})"


def flags_text(c: dict) -> str:
    return collapse_text(c["flagged"], c["runs"], c["kinds"])


def critical_text(crit: dict) -> str:
    """'2e-04 [<1.2e-04, 3e-04)': the estimate, then [lower, upper) (module docstring of stability.py)."""
    rates = crit["rates"]
    if not rates:
        return ""
    lowest, highest = rate_text(rates[0]), rate_text(rates[-1])
    rate = (
        f"< {lowest}"
        if crit["rate"] is None
        else (f">= {highest}" if crit["rate"] == rates[-1] else rate_text(crit["rate"]))
    )
    lower = rate_text(crit["lower"]) if crit["lower"] is not None else f"< {lowest}"
    upper = rate_text(crit["upper"]) if crit["upper"] is not None else f"> {highest}"
    if crit["rate"] is None:  # the lowest rate already loses accuracy
        return f"{rate} (below the ladder)"
    return f"{rate} [{lower}, {upper})"


def fit_text(fit: dict | None) -> str:
    """'1.4e-04 [1.2e-04, 1.6e-04]' (the fitted critical rate, or lr*, and its bootstrap interval over
    seeds); '<= 6e-05' / '>= 3e-04' when the fit is censored at the ladder's end."""
    if not fit or not math.isfinite(fit["rate"]):
        return ""
    rate = {"below": "<= ", "above": ">= "}.get(fit["censored"], "") + rate_text(fit["rate"])
    lo, hi = fit["ci"]
    return rate + (f" [{rate_text(lo)}, {rate_text(hi)}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def ratio_text(fit: dict | None) -> str:
    if not fit or fit.get("ratio") is None or not math.isfinite(fit["ratio"]):
        return ""
    lo, hi = fit["ratio_ci"]
    return f"{fit['ratio']:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def gain_on(block: dict) -> str:
    return f"on {block['bench']}" if block.get("bench") else "benchmarks averaged"


def best_text(best: dict) -> str:
    """'2e-04 (+21.3)', and ', the lowest rate' / ', the highest rate' when the ladder did not bracket it."""
    if best["rate"] is None:
        return ""
    edge = f"; the {best['edge']} rate of the ladder" if best["edge"] else ""
    return f"{rate_text(best['rate'])} ({best['mean']:+.1f}{edge})"


def tuning_table(model: str, block: dict) -> Table:
    ref = block.get("reference")
    cols = [
        "Rule",
        "Best rate (mean gain, pts)",
        "lr*, peak of the fit [95% CI]",
        f"lr* x {ref}'s [95% CI]" if ref else "x reference",
        "Seeds",
    ]
    t = Table("tuning", f"Tuned learning rate, gain {gain_on(block)} ({model_title(model)})", cols)
    for rule, info in block["rules"].items():
        peak = info.get("peak")
        t.add([rule, best_text(info["best"]), fit_text(peak), ratio_text(peak), str(peak["seeds"]) if peak else ""])
    t.notes = [
        f"Best rate: the rate of the ladder with the highest mean gain over seeds ({gain_on(block)}); 'the lowest / "
        "highest rate of the ladder': the ladder does not bracket the best rate (one rate beyond it would).",
        "lr*: the peak of the least-squares quadratic of every (seed, rate) gain against log(lr) (the vertex when "
        "the fit is concave inside the ladder; else the end where it is higher, '<=' / '>='); 95% CI: percentile "
        "bootstrap over seeds, a seed's runs at every rate together (with 3 seeds a rough interval).",
    ]
    return t


def stability_table(stab: dict | None) -> list[Table]:
    """One table per block with a learning-rate axis, then its tuning table; [] without one."""
    tables = []
    for model, block in (stab or {}).items():
        rates = block["rates"]
        ref = block.get("reference")
        cols = (
            ["Rule", "Figure"]
            + [f"lr {rate_text(r)}" for r in rates]
            + [
                "Critical lr, fit [95% CI, seeds]",
                f"x {ref} [95% CI]" if ref else "x reference",
                "Critical lr [ladder]",
            ]
        )
        t = Table(
            "stability",
            f"Stability: gain over the base model by learning rate, {gain_on(block)} ({model_title(model)})",
            cols,
        )
        for rule, info in block["rules"].items():
            cells = [info["cells"].get(r) for r in rates]
            t.add(
                [rule, "gain (pts) [95% CI] (seeds)"]
                + [gain_text(c) if c else "" for c in cells]
                + [fit_text(info.get("fit")), ratio_text(info.get("fit")), critical_text(info["critical"])]
            )
            flagged = any(c and c["flagged"] for c in cells)
            t.add(
                ["", "collapsed: runs, kinds"] + [flags_text(c) if c else "" for c in cells] + ["", "", ""],
                "flagged" if flagged else "",
            )
        t.notes = [
            "Gain: each run's final Avg@n minus its own step-0 Avg@n (the base model), in points (benchmarks "
            "averaged); mean over seeds with Student's t 95% interval over the seeds' gains (none with one seed).",
            "Collapsed: runs at that rate whose health flags name a kind of collapse (see the Runs table's notes "
            "for each kind's threshold), counted per kind (a run may have several).",
            "Critical lr, fit: every (seed, rate) gain fitted against log(lr) (a quadratic from 3 rates, else a "
            "line) and solved for gain = 0 where the fit falls through 0 (never extrapolated: '<=' / '>=' at the "
            "ladder's ends); 95% CI: percentile bootstrap over seeds (a seed's runs at every rate together). "
            f"x {ref or 'reference'}: its ratio to {ref or 'the reference'}'s fitted rate, the shared seeds "
            "resampled together.",
            "Critical lr [ladder]: the largest rate at which the mean gain is >= 0 there and at every lower rate; "
            "[lower, upper): lower = the largest rate at or below it whose gain interval lies at or above 0, "
            "upper = the smallest rate above it whose gain interval lies below 0 ('< lowest' / '> highest': no "
            "rate of the ladder is shown safe / shown to lose). Built from uncorrected per-rate intervals: a "
            "bracket without a stated coverage (the fit's interval has one).",
        ]
        tables += [t, tuning_table(model, block)]
    return tables
