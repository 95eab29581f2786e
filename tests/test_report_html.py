"""The HTML report: self-contained, and rendered by headless Chromium with the tables on the page.

Chromium: `bash scripts/install_chromium.sh` (Debian's `chromium` package); the browser tests are
skipped with that hint when it is not installed.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from clipbench.commands.report import report_command

pytestmark = pytest.mark.slow  # renders and screenshots a real report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed: run `bash scripts/install_chromium.sh`"
)


@pytest.fixture(scope="module")
def page(tmp_path_factory, report_fixture) -> Path:
    root = report_fixture.build(tmp_path_factory.mktemp("results"))
    out = tmp_path_factory.mktemp("report")
    report_command("fixture", baseline="grpo", fmt="html", results_dir=root, out=out)
    return out / "report.html"


def test_page_is_self_contained(page):
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)=["'](https?:|//|file:)""", html)  # nothing fetched from outside
    assert "<script" not in html
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 7  # Pass@k against k, entropy, reward, eval, profile, quadrants, log-ratio histogram
    assert all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in images)
    for title in (
        "Table 3 layout: builtin:arith-tiny",
        "Significance vs grpo",
        "Clip events by quadrant",
        "Reference: ABC-GRPO paper, Table 3",
    ):
        assert title in html


def test_page_leads_with_the_finding_then_contents_tables_figures_and_the_runs_last(page):
    """The Finding is the headline; a table of contents links every table and figure (each anchor exists);
    the figures come before the header's other lines (runs, models, seeds), which close the page."""
    html = page.read_text()
    finding = html.index('<p class="finding">Finding: ')
    toc, tables, figures, about = (
        html.index(s) for s in ('<nav class="toc">', 'id="tables"', 'id="figures"', 'id="about"')
    )
    assert html.index("<h1>") < finding < toc < tables < figures < about
    assert html.index("Sweep &#39;fixture&#39;") > about and html.index("Models: ") > about
    links = re.findall(r'<a href="#([^"]+)">', html[toc : html.index("</nav>")])
    assert {"tables", "figures", "about", "table3", "fig-passk", "fig-quadrants"} <= set(links)
    for anchor in links:
        assert f'id="{anchor}"' in html, anchor


def _chromium(*args: str, tmp: Path, timeout: int = 90) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'profile'}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.browser
@needs_chromium
def test_screenshot_and_dom(page, tmp_path):
    shot = tmp_path / "shot.png"
    proc = _chromium(f"--screenshot={shot}", "--window-size=1200,2000", page.as_uri(), tmp=tmp_path)
    assert shot.is_file(), proc.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as im:
        assert im.size == (1200, 2000)
        px = np.asarray(im.convert("RGB"))
    colours = np.unique(px.reshape(-1, 3), axis=0)
    assert len(colours) > 50 and px.std() > 10  # text and tables, not a blank or single-colour page

    dom = _chromium("--dump-dom", page.as_uri(), tmp=tmp_path).stdout
    # the rendered DOM holds the tables: the Table 3 rows and the Gain cells as text
    assert "Table 3 layout: builtin:arith-tiny (Avg@4 / Pass@k, %)" in dom
    assert re.search(r"<td>abc</td><td>2</td><td>56\.2 ± 0\.0</td><td>72\.9 ± 2\.9</td><td>87\.5 ± 17\.7</td>", dom)
    assert "<td>Gain: abc vs grpo</td><td></td><td>+38.5%</td><td>+34.6%</td><td>+16.7%</td>" in dom
    assert "<td>Qwen3-4B-ABC-GRPO</td><td>25.9</td>" in dom
    assert dom.count("<table>") == 8  # + rliable aggregates, gradient mass, claims, the Runs table


@pytest.mark.browser
@needs_chromium
def test_every_table_fits_the_page_width(page, tmp_path):
    """Laid out by Chromium in a 1200 px window, no table reaches past the page (the claims table's
    sentences wrap): a copy of the page with a probe script reports the page's and each table's width."""
    import json

    probe = tmp_path / "probe.html"
    probe.write_text(
        page.read_text().replace(
            "</body>",
            (
                "<script>var r={};document.querySelectorAll('div.table').forEach(function(d){"
                "r[d.id]=Math.ceil(d.querySelector('table').getBoundingClientRect().right);});"
                "document.body.setAttribute('data-probe',JSON.stringify({page:document.documentElement.clientWidth,"
                "scroll:document.documentElement.scrollWidth,tables:r}));</script></body>"
            ),
        )
    )
    dom = _chromium("--window-size=1200,2000", "--dump-dom", probe.as_uri(), tmp=tmp_path).stdout
    got = json.loads(re.search(r'data-probe="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    assert "claims" in got["tables"] and got["scroll"] <= got["page"], got
    assert all(right <= got["page"] for right in got["tables"].values()), got


def test_every_text_is_escaped():
    from clipbench.report.render import html_document
    from clipbench.report.tables import Table

    t = Table("runs", "Runs <b>", ["Method", "Seed"])
    t.add(["<script>alert(1)</script>", "0"])
    html = html_document("a & <b>", ["<img src=x onerror=y>"], [t])
    assert "<script" not in html and "<img src=x" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "a &amp; &lt;b&gt;" in html
