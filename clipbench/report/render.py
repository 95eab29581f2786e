"""Render ``tables.Table`` objects: rich (terminal), markdown, LaTeX (booktabs), CSV, one HTML page.

The HTML page is self-contained: tables as HTML, figures embedded as base64 PNG data URIs, inline
CSS, no scripts and no external resources (it opens from a file or an e-mail attachment).
"""

from __future__ import annotations

import base64
import csv
import html
import io
from pathlib import Path
from typing import Mapping, Sequence

from clipbench.report.tables import Table

FORMATS = ("rich", "markdown", "latex", "csv", "html")
FIGURE_CAPTIONS = {
    "entropy": "Token entropy of the policy per optimizer step.",
    "reward": "Mean training reward per rollout step.",
    "eval": "Avg@n and Pass@n on each benchmark at every evaluation step.",
    "quadrants": "Share of clip events per quadrant at every rollout step (the paper's Figure 4f over time).",
    "log_ratio_hist": "Distribution of log r = logp - old_logp near the clip bounds, by the sign of the advantage.",
}


# ---- rich -------------------------------------------------------------------------------------

def to_rich(t: Table):
    from rich.table import Table as RichTable

    styles = {"ref": "italic dim", "refgain": "italic dim", "gain": "bold", "base": "dim", "baseline": "cyan",
              "excluded": "dim", "flagged": "yellow"}
    rt = RichTable(title=t.title, caption="\n".join(t.notes) or None, caption_justify="left", show_lines=False)
    for i, c in enumerate(t.columns):
        rt.add_column(c, justify="left" if i < 2 else "right", no_wrap=i > 0)
    prev = None
    for row, style in zip(t.rows, t.styles):
        if t.sections and row[0] and prev is not None:
            rt.add_section()
        rt.add_row(*row, style=styles.get(style))
        prev = row
    return rt


def report_console():
    """The terminal's width on a terminal; 200 columns when piped (rich would assume 80)."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)


def print_rich(tables: Sequence[Table], console=None) -> None:
    from rich.console import Console

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


def markdown_document(title: str, header: Sequence[str], tables: Sequence[Table],
                      figures: Mapping[str, str] | None = None) -> str:
    parts = [f"# {title}", "", *[f"{h}  " for h in header], ""]
    for t in tables:
        parts.append(to_markdown(t))
    for name, rel in (figures or {}).items():
        parts.append(f"![{name}]({rel})\n\n{FIGURE_CAPTIONS.get(name, '')}\n")
    return "\n".join(parts)


# ---- LaTeX ------------------------------------------------------------------------------------

_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "±": r"$\pm$", "Δ": r"$\Delta$", "≥": r"$\geq$"}


def latex_escape(s: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in s)


def to_latex(t: Table) -> str:
    spec = "ll" + "r" * (len(t.columns) - 2)
    out = [r"\begin{table}[t]", r"\centering", r"\small", f"\\caption{{{latex_escape(t.title)}}}",
           f"\\begin{{tabular}}{{{spec}}}", r"\toprule",
           " & ".join(latex_escape(c) for c in t.columns) + r" \\", r"\midrule"]
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


def latex_document(tables: Sequence[Table]) -> str:
    """A fragment to \\input (needs \\usepackage{booktabs})."""
    return "% generated by `clipbench report`; needs \\usepackage{booktabs}\n\n" + "\n".join(to_latex(t) for t in tables)


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

CSS = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 24px 32px;
       color: #1d1d1f; background: #fff; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.meta { color: #555; font-size: 13px; line-height: 1.5; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
caption { text-align: left; font-weight: 600; padding: 4px 0 6px; font-size: 14px; }
th, td { padding: 3px 9px; border-bottom: 1px solid #e3e3e3; white-space: nowrap; }
th { background: #f3f4f6; border-bottom: 2px solid #9ca3af; text-align: right; white-space: normal;
     vertical-align: bottom; }
th:nth-child(-n+2), td:nth-child(-n+2) { text-align: left; }
td { text-align: right; font-variant-numeric: tabular-nums; }
tr.section td { border-top: 2px solid #9ca3af; }
tr.ref td, tr.refgain td { color: #6b7280; font-style: italic; background: #fafafa; }
tr.gain td { font-weight: 600; background: #f0fdf4; }
tr.baseline td { background: #eff6ff; }
tr.base td { color: #4b5563; }
tr.excluded td { color: #6b7280; }
tr.flagged td { background: #fffbeb; }
.notes { color: #555; font-size: 12px; max-width: 1100px; margin: 2px 0 14px; }
.row { display: flex; gap: 28px; align-items: flex-start; flex-wrap: wrap; }
.row .notes { max-width: 560px; }
figure { margin: 16px 0; } figcaption { color: #555; font-size: 12px; }
img { max-width: 100%; border: 1px solid #eee; }
"""


def to_html_table(t: Table) -> str:
    e = html.escape
    out = [f'<div class="table" id="{e(t.key)}"><table><caption>{e(t.title)}</caption><thead><tr>']
    out += [f"<th>{e(c)}</th>" for c in t.columns]
    out.append("</tr></thead><tbody>")
    for i, (row, style) in enumerate(zip(t.rows, t.styles)):
        classes = [style] if style else []
        if t.sections and row[0] and i > 0:
            classes.append("section")
        cls = f' class="{" ".join(classes)}"' if classes else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    if t.notes:
        out.append('<div class="notes">' + "<br>".join(e(n) for n in t.notes) + "</div>")
    out.append("</div>")
    return "".join(out)


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def html_document(title: str, header: Sequence[str], tables: Sequence[Table],
                  figures: Mapping[str, bytes] | None = None) -> str:
    """One self-contained page: header lines, tables (a table's ``beside`` partner next to it), figures."""
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{e(title)}</h1>", '<div class="meta">' + "<br>".join(e(h) for h in header) + "</div>"]
    by_key = {t.key: t for t in tables}
    placed: set[int] = set()
    parts.append("<h2>Tables</h2>")
    for t in tables:
        if id(t) in placed:
            continue
        partner = by_key.get(t.beside) if t.beside else None
        if partner is not None and id(partner) not in placed:
            parts.append('<div class="row">' + to_html_table(t) + to_html_table(partner) + "</div>")
            placed |= {id(t), id(partner)}
        else:
            parts.append(to_html_table(t))
            placed.add(id(t))
    if figures:
        parts.append("<h2>Training dynamics</h2>")
        for name, png in figures.items():
            parts.append(f'<figure id="fig-{e(name)}"><img alt="{e(name)}" src="{png_data_uri(png)}">'
                         f"<figcaption>{e(FIGURE_CAPTIONS.get(name, name))}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def unique_names(tables: Sequence[Table]) -> list[str]:
    """File stems per table: the key, with _2, _3 ... for repeated keys (one per model block)."""
    seen: dict[str, int] = {}
    out = []
    for t in tables:
        seen[t.key] = seen.get(t.key, 0) + 1
        out.append(t.key if seen[t.key] == 1 else f"{t.key}_{seen[t.key]}")
    return out


def write_text(path: Path, text: str) -> Path:
    from clipbench.tracking.store import atomic_write_text

    atomic_write_text(path, text)
    return path
