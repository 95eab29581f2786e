"""Render ``tables.Table`` objects: rich (terminal), markdown, LaTeX (booktabs), CSV, one HTML page.

The HTML page is a jinja2 template (``templates/report.html`` and ``report.css``, package data):
self-contained, tables as HTML, figures embedded as base64 PNG data URIs, inline CSS, no scripts and
no external resources (it opens from a file or an e-mail attachment); every text is autoescaped.
"""

from __future__ import annotations

import base64
import csv
import functools
import io
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table as RichTable

from clipbench.report.tables import Table
from clipbench.tracking.files import atomic_write_text

FORMATS = ("rich", "markdown", "latex", "csv", "html")
WRAP_AT = 24  # a rich column with a longer cell wraps
FIGURE_CAPTIONS = {
    "stability": "Gain over the base model (final Avg@n minus step 0, points) against the learning rate, one line "
    "per rule: mean over seeds, error bars the 95% Student t interval over seeds; right, the share of "
    "runs flagged as collapsed at each rate.",
    "entropy": "Token entropy of the policy per optimizer step.",
    "reward": "Mean training reward per rollout step.",
    "eval": "Avg@n and Pass@n on each benchmark at every evaluation step.",
    "quadrants": "Each rule's clip events by quadrant (ABC-GRPO's Figure 4f): the share of its out-of-band tokens in "
    "each quadrant, the mean over seeds of each run's shares over all its steps, with the events counted.",
    "passk": "Pass@k against k (log-2 axis): the base model at step 0 (dashed) and each rule at its final "
    "evaluation, the mean over seeds of the unbiased Pass@k, shaded its 95% Student t interval over seeds.",
    "log_ratio_hist": "Distribution of log r = logp - old_logp near the clip bounds, by the sign of the advantage.",
    "replay_zero_grad": "Replay: share of each quadrant's tokens that get no gradient, per rule, on the same recorded "
    "batches (Q1 A>0 r>1, Q2 A>0 r<1, Q3 A<0 r<1, Q4 A<0 r>1).",
    "replay_cosine": "Replay: cosine between the rules' per-token gradients (d loss / d logp), mean over the recorded "
    "optimizer steps.",
}


# ---- rich -------------------------------------------------------------------------------------


def to_rich(t: Table):
    styles = {
        "ref": "italic dim",
        "refgain": "italic dim",
        "gain": "bold",
        "base": "dim",
        "baseline": "cyan",
        "excluded": "dim",
        "flagged": "yellow",
    }
    rt = RichTable(title=t.title, caption="\n".join(t.notes) or None, caption_justify="left", show_lines=False)
    for i, c in enumerate(t.columns):  # numbers keep one line; a column of long texts wraps (claims, machines)
        prose = any(len(row[i]) > WRAP_AT for row in t.rows)
        rt.add_column(
            c,
            justify="left" if i < 2 or prose else "right",
            no_wrap=i > 0 and not prose,
            min_width=14 if prose else None,
        )
    prev = None
    for row, style in zip(t.rows, t.styles):
        if t.sections and row[0] and prev is not None:
            rt.add_section()
        rt.add_row(*row, style=styles.get(style))
        prev = row
    return rt


def report_console():
    """The terminal's width on a terminal; 200 columns when piped (rich would assume 80)."""

    return Console(width=None if sys.stdout.isatty() else 200)


def print_rich(tables: Sequence[Table], console=None) -> None:
    pass

    console = console or report_console()
    for t in tables:
        console.print(to_rich(t))
        console.print()


# ---- markdown ---------------------------------------------------------------------------------


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def to_markdown(t: Table) -> str:
    lines = [f"### {t.title}", ""]
    lines.append("| " + " | ".join(_md_escape(c) for c in t.columns) + " |")
    lines.append("|" + "|".join([":---"] * 2 + ["---:"] * (len(t.columns) - 2)) + "|")
    for row, style in zip(t.rows, t.styles):
        cells = [_md_escape(c) for c in row]
        if style in ("ref", "refgain") and cells[1]:
            cells[1] = f"*{cells[1]}*"
        if style == "gain" and cells[1]:
            cells[1] = f"**{cells[1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    if t.notes:
        lines.append("")
        lines += [f"{note}  " for note in t.notes]
    return "\n".join(lines) + "\n"


def markdown_document(
    title: str, header: Sequence[str], tables: Sequence[Table], figures: Mapping[str, str] | None = None
) -> str:
    parts = [f"# {title}", "", *[f"{h}  " for h in header], ""]
    for t in tables:
        parts.append(to_markdown(t))
    for name, rel in (figures or {}).items():
        parts.append(f"![{name}]({rel})\n\n{FIGURE_CAPTIONS.get(name, '')}\n")
    return "\n".join(parts)


# ---- LaTeX ------------------------------------------------------------------------------------

_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "Δ": r"$\Delta$",
    "≥": r"$\geq$",
}


def latex_escape(s: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in s)


def to_latex(t: Table) -> str:
    spec = "ll" + "r" * (len(t.columns) - 2)
    out = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        f"\\caption{{{latex_escape(t.title)}}}",
        f"\\begin{{tabular}}{{{spec}}}",
        r"\toprule",
        " & ".join(latex_escape(c) for c in t.columns) + r" \\",
        r"\midrule",
    ]
    for i, (row, style) in enumerate(zip(t.rows, t.styles)):
        if t.sections and row[0] and i > 0:
            out.append(r"\midrule")
        cells = [latex_escape(c) for c in row]
        if style in ("ref", "refgain"):
            cells = [f"\\textit{{{c}}}" if c else c for c in cells]
        if style == "gain":
            cells = [f"\\textbf{{{c}}}" if c else c for c in cells]
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    if t.notes:
        out.append(r"\par\smallskip\footnotesize " + " ".join(latex_escape(n) for n in t.notes))
    out.append(r"\end{table}")
    return "\n".join(out) + "\n"


def latex_document(tables: Sequence[Table], warnings: Sequence[str] = ()) -> str:
    """A fragment to \\input (needs \\usepackage{booktabs}); `warnings` (what the numbers lack: an
    unfinished sweep) come first, as text the typeset page shows."""
    first = "".join(f"\\noindent\\textbf{{{latex_escape(w)}}}\\par\\medskip\n" for w in warnings)
    return (
        "% generated by `clipbench report`; needs \\usepackage{booktabs}\n\n"
        + (first + "\n" if first else "")
        + "\n".join(to_latex(t) for t in tables)
    )


# ---- CSV --------------------------------------------------------------------------------------


def to_csv(t: Table) -> str:
    """Rows as displayed, with the repeated Benchmark cell filled in and a row-kind column."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(t.columns + ["kind"])
    current = ""
    for row, style in zip(t.rows, t.styles):
        current = row[0] or current
        w.writerow([current] + row[1:] + [style or "method"])
    return buf.getvalue()


# ---- HTML -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _templates():
    """The report's jinja2 templates (package data: clipbench/report/templates), autoescaped."""
    import jinja2  # noqa: PLC0415 - jinja2 is heavy

    return jinja2.Environment(
        loader=jinja2.PackageLoader("clipbench.report", "templates"), autoescape=True, keep_trailing_newline=True
    )


def html_layout(tables: Sequence[Table]) -> list[list[Table]]:
    """Tables in display order, a table and its ``beside`` partner grouped (shown side by side)."""
    by_key = {t.key: t for t in tables}
    placed: set[int] = set()
    layout: list[list[Table]] = []
    for t in tables:
        if id(t) in placed:
            continue
        partner = by_key.get(t.beside) if t.beside else None
        group = [t, partner] if partner is not None and id(partner) not in placed else [t]
        placed |= {id(x) for x in group}
        layout.append(group)
    return layout


PROSE = 28  # characters: a column with a longer cell holds prose, which wraps (html)


def text_columns(t: Table) -> set[int]:
    """The columns of `t` that hold prose (some cell longer than PROSE characters): in HTML they wrap
    and align left, so a table of sentences fits the page width like the tables of numbers."""
    return {i for row in t.rows for i, c in enumerate(row) if len(c) > PROSE}


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


FIGURE_TITLES = {  # the page's table of contents
    "passk": "Pass@k against k",
    "stability": "Gain against the learning rate",
    "tuning": "Each rule's learning-rate curve",
    "entropy": "Token entropy",
    "reward": "Mean reward",
    "length": "Completion length",
    "eval": "Evaluation over training",
    "profile": "Performance profile",
    "quadrants": "Clip events by quadrant",
    "log_ratio_hist": "Log-ratio near the clip bounds",
    "replay_zero_grad": "Replay: tokens without gradient",
    "replay_cosine": "Replay: cosine between rules",
}


def html_document(
    title: str, header: Sequence[str], tables: Sequence[Table], figures: Mapping[str, bytes] | None = None
) -> str:
    """One self-contained page (templates/report.html): the Finding as its headline (and a sweep's
    INCOMPLETE line above it), a table of contents, the tables, the figures, then the other header
    lines (runs, models, seeds, machines, notes) as the page's footnotes."""
    figs = [
        {
            "name": name,
            "src": png_data_uri(png),
            "caption": FIGURE_CAPTIONS.get(name, name),
            "title": FIGURE_TITLES.get(name, name),
        }
        for name, png in (figures or {}).items()
    ]
    anchors = dict(zip((id(t) for t in tables), unique_names(tables)))
    return (
        _templates()
        .get_template("report.html")
        .render(
            title=title,
            alerts=[h for h in header if h.startswith("INCOMPLETE")],
            finding=next((h for h in header if h.startswith("Finding: ")), None),
            about=[h for h in header if not h.startswith(("INCOMPLETE", "Finding: "))],
            layout=html_layout(tables),
            anchor=lambda t: anchors[id(t)],
            figures=figs,
            text_columns=text_columns,
        )
    )


def unique_names(tables: Sequence[Table]) -> list[str]:
    """File stems per table: the key, with _2, _3 ... for repeated keys (one per model block)."""
    seen: dict[str, int] = {}
    out = []
    for t in tables:
        seen[t.key] = seen.get(t.key, 0) + 1
        out.append(t.key if seen[t.key] == 1 else f"{t.key}_{seen[t.key]}")
    return out


def write_text(path: Path, text: str) -> Path:
    atomic_write_text(path, text)
    return path
