"""The report's figures: the expected series (inspected on the matplotlib objects) and valid PNGs."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from clipbench.report.analysis import analyze
from clipbench.report.load import load_results
from clipbench.report.plots import close_figures, make_figures, save_figures


@pytest.fixture(scope="module")
def figs(tmp_path_factory, report_fixture):
    root = report_fixture.build(tmp_path_factory.mktemp("results"))
    sweep = load_results(root, "fixture")
    figs = make_figures(sweep, analyze(sweep, "grpo", resamples=50))
    yield figs
    close_figures(figs)


def _lines(ax) -> dict[str, object]:
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def test_figure_order_passk_first(figs):
    assert list(figs) == ["passk", "entropy", "reward", "eval", "profile", "quadrants", "log_ratio_hist"]


def test_passk_against_k_base_model_and_each_rule_on_a_log2_axis(figs):
    """arith, final step (n = 4), per-problem Pass@k of c correct = (0, 1/2, 5/6, 1, 1)[c] for k = 2:
    grpo s0 c = [4, 2, 1, 0]: Avg 7/16, Pass@2 (1 + 5/6 + 1/2 + 0) / 4 = 0.5833, Pass@4 3/4; s1 [4, 1, 1, 0]:
    6/16, 0.5, 3/4 -> means 40.625, 54.167, 75.0 (%). The base model (step 0) c = [2, 1, 0, 0]: 18.75,
    (5/6 + 1/2) / 4 = 33.33, 50.0. Its interval: grpo's Pass@4 is 3/4 on both seeds, so none."""
    axes = figs["passk"].axes
    assert [ax.get_title() for ax in axes] == ["GSM8K", "arith", "benchmarks averaged"]
    ax = axes[1]
    assert ax.get_xscale() == "log" and list(ax.get_xticks()) == [1, 2, 4]
    lines = _lines(ax)
    assert list(lines) == ["base model (step 0)", "grpo", "abc", "nsr"]  # the base model, then the baseline
    x, y = lines["grpo"].get_data()
    assert list(x) == [1, 2, 4] and np.allclose(y, [40.625, (100 * 7 / 12 + 50) / 2, 75.0])
    assert np.allclose(lines["base model (step 0)"].get_data()[1], [18.75, 100 / 3.0, 50.0])
    assert lines["base model (step 0)"].get_linestyle() == "--"


def test_entropy_series(figs):
    ax = figs["entropy"].axes[0]
    lines = _lines(ax)
    assert list(lines) == ["grpo", "abc", "nsr"]  # the baseline first, one line per method
    # fixture entropy = 1 - 0.1 * opt_step (+0.2 for abc) + 0.01 * seed: mean over seeds 0, 1 adds 0.005
    x, y = lines["abc"].get_data()
    assert list(x) == [1, 2, 3, 4]
    assert np.allclose(y, [1.2 - 0.1 * s + 0.005 for s in (1, 2, 3, 4)])
    # the seed band is the 95% t interval of the mean over the two seeds, a filled polygon per method: abc's
    # seeds 1.2 - 0.1s and 1.21 - 0.1s, sd 0.00707, sem 0.005, t_.975,1 = 12.706: +-0.0635 around the mean
    assert len(ax.collections) == 3
    band = ax.collections[1].get_paths()[0].vertices[:, 1]
    half = 12.706205 * 0.01 / np.sqrt(2) / np.sqrt(2)
    assert band.min() == pytest.approx(1.205 - 0.4 - half) and band.max() == pytest.approx(1.205 - 0.1 + half)


def test_reward_is_per_rollout_step(figs):
    x, y = _lines(figs["reward"].axes[0])["grpo"].get_data()
    assert list(x) == [0, 1]  # rollout steps
    assert np.allclose(y, [0.325, 0.425])  # 0.3 + 0.1 * step + 0.05 * mean seed (0.5)


def test_eval_panels(figs):
    titles = [ax.get_title() for ax in figs["eval"].axes]
    assert titles == ["GSM8K: Avg@4", "GSM8K: Pass@4", "arith: Avg@4", "arith: Pass@4"]
    x, y = _lines(figs["eval"].axes[2])["abc"].get_data()
    assert list(x) == [0, 2] and np.allclose(y, [18.75, 56.25])  # base 3/16, final 9/16


def test_quadrant_shares_are_a_stacked_bar_per_rule_with_its_events(figs):
    """grpo's rows hold (2, 1, 3, 4) events in Q1-Q4: 20/10/30/40%, 10 a row x 4 rows x 2 seeds = 80 events;
    nsr's seeds 20/20/20/40 and 25 x 4: 22.5/22.5/22.5/32.5."""
    (ax,) = figs["quadrants"].axes
    bars = {}
    for patch in ax.patches:  # one bar segment per rule and quadrant, stacked left to right
        bars.setdefault(round(patch.get_y() + patch.get_height() / 2), []).append(round(patch.get_width(), 6))
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["grpo", "abc", "nsr"]
    assert bars[0] == [20.0, 10.0, 30.0, 40.0] and bars[2] == [22.5, 22.5, 22.5, 32.5]
    assert all(sum(w) == pytest.approx(100.0) for w in bars.values())
    texts = [t.get_text() for t in ax.texts]
    assert "80 events, 2 seeds" in texts and "32 events, 2 seeds" in texts


def test_log_ratio_histogram(figs):
    ax = figs["log_ratio_hist"].axes[0]
    x, y = _lines(ax)["grpo"].get_data()
    assert len(x) == 40 and y.sum() == pytest.approx(1.0)  # a distribution over the 40 bins
    assert x[0] == pytest.approx(-0.4875) and x[-1] == pytest.approx(0.4875)  # bin centres
    assert ax.get_yscale() == "log"
    # dashed bounds: grpo log(0.8), log(1.2); nsr log(0.8), log(1.28)
    xs = sorted({round(ln.get_xdata()[0], 4) for ln in ax.get_lines() if ln.get_linestyle() == "--"})
    assert xs == [round(np.log(0.8), 4), round(np.log(1.2), 4), round(np.log(1.28), 4)]


def test_pngs_are_valid(figs, tmp_path):
    paths = save_figures(figs, tmp_path)
    for name, p in paths.items():
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 300 and height > 200, (name, width, height)
        from PIL import Image

        with Image.open(p) as im:
            px = np.asarray(im.convert("L"))
        assert px.std() > 5, name  # not a blank image


def test_histogram_bounds_are_each_runs_effective_band(report_fixture, tmp_path):
    """The dashed bounds come from each run's own rule (effective_bounds), per sign of A: abc's
    negative band (eps3, eps4) differs from its positive one; sapo has no eps (reference 0.2/0.2);
    dapo's defaults (0.2/0.28) are not written out; an unknown rule draws no bounds."""
    from clipbench.report.load import RunRecord
    from clipbench.report.plots import hist_figure

    hist = report_fixture.hist_rows("grpo", 0)
    objectives = {
        "abc": {"method": "abc", "eps1": 0.3, "eps2": 0.25, "eps3": 0.1, "eps4": 0.15},
        "sapo": {"method": "sapo"},
        "dapo": {"method": "dapo"},
        "mystery": {"method": "no_such_rule"},
    }
    groups = {
        name: [RunRecord(run_id=name, path=tmp_path, config={"objective": obj}, state="finished", hist=hist)]
        for name, obj in objectives.items()
    }
    fig = hist_figure(groups)
    try:

        def dashed(ax, color):
            return sorted(
                round(ln.get_xdata()[0], 4)
                for ln in ax.get_lines()
                if ln.get_linestyle() == "--" and ln.get_color() == color
            )

        colors = {name: _lines(fig.axes[0])[name].get_color() for name in objectives}
        pos, neg = fig.axes
        log = lambda x: round(float(np.log(x)), 4)  # noqa: E731
        assert dashed(pos, colors["abc"]) == [log(1 - 0.25), log(1 + 0.3)]  # A>0: [1 - eps2, 1 + eps1]
        assert dashed(neg, colors["abc"]) == [log(1 - 0.15), log(1 + 0.1)]  # A<0: [1 - eps4, 1 + eps3]
        for ax in (pos, neg):
            assert dashed(ax, colors["sapo"]) == [log(0.8), log(1.2)]
            assert dashed(ax, colors["dapo"]) == [log(0.8), log(1.28)]
            assert dashed(ax, colors["mystery"]) == []
    finally:
        close_figures({"h": fig})


def test_eval_curve_with_more_samples_at_the_endpoints(report_fixture, tmp_path):
    """eval.n_ends: the first and the last evaluation sample more (here 8 per problem) than the ones
    between (4). The curve's points share the smallest n (Avg@4 / Pass@4), where Pass@8 of a 4-sample
    step would raise; the tables read the endpoints at their own n."""
    import json
    import shutil

    root = report_fixture.build(tmp_path / "results")
    for start in (root / "fixture").glob("*/eval/step_000000"):
        between = start.parent / "step_000001"  # an evaluation between, at the endpoints' old n
        shutil.copytree(start, between)
        for payload in between.glob("*.json"):
            payload.write_text(json.dumps({**json.loads(payload.read_text()), "step": 1}))
        for payload in [*start.glob("*.json"), *(start.parent / "step_000002").glob("*.json")]:
            data = json.loads(payload.read_text())  # each problem's 4 samples twice over
            payload.write_text(json.dumps({**data, "correct": [r + r for r in data["correct"]], "n": 2 * data["n"]}))
    sweep = load_results(root, "fixture")
    figs = make_figures(sweep, analyze(sweep, "grpo", resamples=50))
    try:
        assert [ax.get_title() for ax in figs["eval"].axes][2:] == ["arith: Avg@4", "arith: Pass@4"]
        x, y = _lines(figs["eval"].axes[2])["abc"].get_data()
        assert list(x) == [0, 1, 2] and np.allclose(y, [18.75, 18.75, 56.25])  # base 3/16 twice, final 9/16
    finally:
        close_figures(figs)


def test_the_performance_profile_is_each_labels_share_of_runs_above(figs):
    # rliable's performance profile as a step function: per label, the share of its run x task scores
    # (final Avg@4 on GSM8K and arith, 2 seeds: 4 scores) strictly above each score; it starts at 1
    ax = figs["profile"].axes[0]
    lines = _lines(ax)
    assert list(lines) == ["grpo", "abc", "nsr"]
    _, y = lines["grpo"].get_data()
    assert y[0] == 1.0 and y[-1] == 0.0 and list(y) == sorted(y, reverse=True)
    assert set(np.round(y, 6)) <= {1.0, 0.75, 0.5, 0.25, 0.0}  # quarters: 4 scores


def test_the_png_holds_a_legend_of_long_labels_whole():
    """Before plots.png, a figure legend of long labels (organism_confirm's ten
    'dual_clip(lr=0.0001)'-like labels, four columns) ran past both sides of a 7-inch figure and was
    cut; the PNG now grows to the legend's extent."""
    import struct

    import matplotlib.pyplot as plt

    from clipbench.report.plots import png

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for i in range(10):
        ax.plot([0, 1], [i, i + 1], label=f"a_rather_long_rule_name_{i}(lr=0.0001)")
    legend = fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=4)
    fig.canvas.draw()
    wide = legend.get_window_extent().width  # pixels at the figure's dpi
    assert wide > 700  # wider than the figure itself: the case that was cut
    data = png(fig)
    width = struct.unpack(">I", data[16:20])[0]  # the PNG's IHDR width
    plt.close(fig)
    assert width >= wide


def test_many_rules_get_distinct_styles_and_a_legend_beside_the_axes():
    """27 rules (the stability study's): every series its own colour and line style, the legend to the
    right of the axes (under them it covered the plot); the note naming identical curves sits under the
    title, clear of the legend and the axes."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from clipbench.report.plots_style import draw_band, finish, series_styles

    names = [f"rule_{i}(lr=0.0001)" for i in range(27)]
    styles = series_styles(names)
    assert len({(s["color"], s["linestyle"]) for s in styles.values()}) == 27
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    drawn = {}
    for i, name in enumerate(names):
        frame = pd.DataFrame({s: [1.0 - 0.02 * (i % 26) + 0.01 * s, 0.5 + 0.01 * s] for s in range(3)})
        drawn[name] = draw_band(ax, frame, name, styles[name])  # rule_0 and rule_26: the same curve
    finish(fig, ax, "Token entropy", [drawn])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend, axes = fig.legends[0].get_window_extent(renderer), ax.get_window_extent(renderer)
    (note,) = [t for t in fig.texts if t.get_text().startswith("Identical curves")]
    assert "rule_0(lr=0.0001) = rule_26(lr=0.0001)" in note.get_text()
    box = note.get_window_extent(renderer)
    assert legend.x0 >= axes.x1 and not box.overlaps(legend) and box.y0 >= axes.y1
    plt.close(fig)
