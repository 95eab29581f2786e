"""The report's replay section: tables and figures of a replay summary (clipbench.replay.summary).

    summary = sweep_replay(sweep)                  # None when no run of the sweep has records
    tables = replay_tables(summary)                 # vs the trained rule, zero-gradient shares, lookahead, tokens
    figs = replay_figures(summary)                  # {name: Figure}: zero-gradient heatmap, cosine matrix
    write_replay(summary, rows, fmt, out_dir, title)  # `clipbench replay`'s own report (markdown, html, ...)

One block per trained rule (the reference every other rule is compared with).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clipbench.replay.rules import parse_rules
from clipbench.replay.run import finished_runs, replay_runs
from clipbench.replay.summary import summarize
from clipbench.report import render
from clipbench.report.tables import Table
from clipbench.tracking.files import atomic_write_json, atomic_write_text, dumps

QUADS = ("q1", "q2", "q3", "q4")


def sweep_replay(sweep, rules: str | None = None) -> dict | None:
    """The replay summary of a sweep's finished runs with records (every registered rule), or None."""

    dirs, left_out = finished_runs(r.path for r in sweep.runs)
    if not dirs:
        return None
    result = replay_runs(dirs, parse_rules(rules))
    if left_out:  # the report's first line already names every unfinished run of the sweep
        result.notes.append(f"left out: {left_out}: their records cover part of their steps")
    return summarize(result)


def _f(x, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _ms(cell: dict | None, digits: int = 3, scale: float = 1.0) -> str:
    if not cell:
        return ""
    s = f"{scale * cell['mean']:.{digits}f}"
    return f"{s} ± {scale * cell['sd']:.{digits}f}" if cell["n"] > 1 else s


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}"


def replay_tables(summary: dict | None) -> list[Table]:
    tables: list[Table] = []
    for ref in (summary or {}).get("references", []):
        tables += [versus(ref), zero_grad(ref)]
        ahead = lookahead(ref)
        if ahead is not None:
            tables.append(ahead)
        if ref["tokens"]:
            tables.append(disagreement(ref))
    return tables


def _where(ref: dict) -> str:
    return f"{len(ref['runs'])} run(s) trained with {ref['reference']}, {ref['opt_steps']} recorded optimizer steps"


def versus(ref: dict) -> Table:
    t = Table(
        "replay_versus",
        f"Replay vs {ref['reference']}: each rule's gradient on the same batches (token level)",
        ["Rule", "", "cos(g, g_ref)", "|g| / |g_ref|", "departure %", *(f"in {q.upper()} %" for q in QUADS), "loss"],
        sections=False,
    )
    for lb in ref["rules"]:
        p = ref["per_rule"][lb]
        t.add(
            [
                lb,
                "trained" if lb == ref["reference"] else "",
                _ms(p["grad_cosine"]),
                _ms(p["grad_norm_ratio"]),
                _pct(p["pooled/departure"]),
                *(_pct(p[f"pooled/departure/{q}"]) for q in QUADS),
                _ms(p["loss"], 4),
            ],
            "baseline" if lb == ref["reference"] else "",
        )
    t.notes.append(
        f"{_where(ref)}. g = d loss / d logp per token (aggregation, weights and KL included); cosine, norm "
        "ratio and loss: mean ± sd over optimizer steps. departure = sum|g - g_ref| / sum|g_ref| over every "
        "step's tokens (pooled), and the part of it in each token-ratio quadrant."
    )
    if ref["identical"]:
        t.notes.append(
            "Identical gradients on every replayed step: " + "; ".join(" = ".join(g) for g in ref["identical"]) + "."
        )
    return t


def zero_grad(ref: dict) -> Table:
    t = Table(
        "replay_zero_grad",
        f"Replay vs {ref['reference']}: zero-gradient and rescued shares per quadrant (%)",
        [
            "Rule",
            "",
            *(f"{q.upper()} zero-grad" for q in QUADS),
            "Q1 rescued",
            "Q3 rescued",
            *(f"{q.upper()} out of band" for q in QUADS),
        ],
        sections=False,
    )
    for lb in ref["rules"]:
        p = ref["per_rule"][lb]
        t.add(
            [
                lb,
                "trained" if lb == ref["reference"] else "",
                *(_pct(p[f"zero_grad/{q}"]) for q in QUADS),
                _pct(p["rescued/q1"]),
                _pct(p["rescued/q3"]),
                *(_pct(p[f"out_of_band/{q}"]) for q in QUADS),
            ],
            "baseline" if lb == ref["reference"] else "",
        )
    tokens = ", ".join(f"{q.upper()} {int(ref['per_rule'][ref['reference']][f'tokens/{q}']):,}" for q in QUADS)
    t.notes.append(
        f"{_where(ref)}; tokens per quadrant: {tokens}. Shares of the quadrant's tokens, summed over steps; "
        "the out-of-band band is each rule's own reference band."
    )
    return t


def lookahead(ref: dict) -> Table | None:
    rows = [lb for lb in ref["rules"] if ref["per_rule"][lb]["lookahead/kl"]]
    if not rows:
        return None
    t = Table(
        "replay_lookahead",
        f"Replay vs {ref['reference']}: one optimizer step ahead from the recorded state (parameter level)",
        [
            "Rule",
            "",
            "cos(θ-grad)",
            "|grad| ratio",
            "KL(new‖old) ×1e3",
            "Δ entropy ×1e3",
            "Δ log p correct",
            "Δ log p incorrect",
        ],
        sections=False,
    )
    for lb in rows:
        p = ref["per_rule"][lb]
        t.add(
            [
                lb,
                "trained" if lb == ref["reference"] else "",
                _ms(p["param/grad_cosine"]),
                _ms(p["param/grad_norm_ratio"]),
                _ms(p["lookahead/kl"], 3, 1e3),
                _ms(p["lookahead/entropy_change"], 3, 1e3),
                _ms(p["lookahead/dlogp_correct"], 4),
                _ms(p["lookahead/dlogp_incorrect"], 4),
            ],
            "baseline" if lb == ref["reference"] else "",
        )
    t.notes.append(
        f"{ref['param_steps']} optimizer step(s) with the policy state recorded. One AdamW step (the run's "
        "learning rate, moments and clipping) with each rule's gradient, measured on the same mini-batch: "
        "KL over the whole vocabulary, mean token entropy, mean change of each completion's log-probability. "
        "The step includes the optimizer's momentum, which every rule shares."
    )
    return t


def disagreement(ref: dict) -> Table:
    t = Table(
        "replay_tokens",
        f"Replay vs {ref['reference']}: the tokens where each rule departs most",
        ["Rule", "Run / opt step", "Context [token]", "Quadrant", "A", "r", "g", "g_ref"],
    )
    prev, order = None, {lb: i for i, lb in enumerate(ref["rules"])}
    for tok in sorted(ref["tokens"], key=lambda t: (order.get(t["rule"], len(order)), -abs(t["g"] - t["g_trained"]))):
        text = (
            f"{tok.get('context', '')}[{tok.get('token', tok['token_id'])}]"
            if tok["token_id"] is not None
            else "(no ids)"
        )
        t.add(
            [
                tok["rule"] if tok["rule"] != prev else "",
                f"{tok['run_id'][:8]} / {tok['opt_step']}",
                text,
                tok["cell"].upper(),
                _f(tok["advantage"], 2),
                _f(tok["ratio"]),
                f"{tok['g']:.2e}",
                f"{tok['g_trained']:.2e}",
            ]
        )
        prev = tok["rule"]
    return t


def replay_figures(summary: dict | None) -> dict:
    """Heatmaps of the first reference: zero-gradient shares (rules x quadrants), the cosine matrix."""
    import matplotlib  # noqa: PLC0415 - matplotlib is heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib is heavy

    refs = (summary or {}).get("references", [])
    if not refs:
        return {}
    ref = refs[0]
    labels = ref["rules"]
    z = np.array([[ref["per_rule"][lb][f"zero_grad/{q}"] or 0.0 for q in QUADS] for lb in labels]) * 100
    fig1, ax = plt.subplots(figsize=(5.5, 0.3 * len(labels) + 1.5), dpi=100)
    im = ax.imshow(z, aspect="auto", cmap="viridis", vmin=0, vmax=100)
    ax.set_xticks(range(4), [q.upper() for q in QUADS])
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(f"Zero-gradient share of each quadrant (%), vs {ref['reference']}", fontsize=9)
    fig1.colorbar(im, ax=ax)
    fig1.tight_layout()
    figs = {"replay_zero_grad": fig1}
    if ref["token_cosine"]:
        c = np.array(ref["token_cosine"])
        fig2, ax = plt.subplots(figsize=(0.32 * len(labels) + 2.5, 0.32 * len(labels) + 1.5), dpi=100)
        im = ax.imshow(c, cmap="RdBu", vmin=-1, vmax=1)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title("Cosine between the rules' token gradients", fontsize=9)
        fig2.colorbar(im, ax=ax)
        fig2.tight_layout()
        figs["replay_cosine"] = fig2
    return figs


def _pngs(summary: dict) -> dict[str, bytes]:
    from clipbench.report.plots import close_figures, png  # noqa: PLC0415 - report.plots pulls in matplotlib

    figs = replay_figures(summary)
    out = {name: png(fig) for name, fig in figs.items()}
    close_figures(figs)
    return out


def write_replay(
    summary: dict, rows: list[dict] | None, fmt: str, out_dir: Path, title: str, header: list[str]
) -> list[Path]:
    """`clipbench replay`'s files: replay.json (the summary), replay.jsonl (every row, unless rows is
    None), and the report in `fmt` (markdown: replay.md + plots/*.png; html: replay.html; csv: one
    file per table; latex: replay.tex)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "replay.json", summary)
    written = [out_dir / "replay.json"]
    if rows is not None:
        atomic_write_text(out_dir / "replay.jsonl", "".join(dumps(r) + "\n" for r in rows))
        written.append(out_dir / "replay.jsonl")
    tables = replay_tables(summary)
    if fmt == "markdown":
        rel = {}
        for name, png in _pngs(summary).items():
            p = out_dir / "plots" / f"{name}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(png)
            rel[name] = f"plots/{name}.png"
            written.append(p)
        written.append(render.write_text(out_dir / "replay.md", render.markdown_document(title, header, tables, rel)))
    elif fmt == "html":
        written.append(
            render.write_text(out_dir / "replay.html", render.html_document(title, header, tables, _pngs(summary)))
        )
    elif fmt == "csv":
        for name, t in zip(render.unique_names(tables), tables):
            written.append(render.write_text(out_dir / f"{name}.csv", render.to_csv(t)))
    elif fmt == "latex":
        written.append(render.write_text(out_dir / "replay.tex", render.latex_document(tables)))
    return written
