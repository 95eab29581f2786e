"""Training-dynamics figures: the expected series (inspected on the matplotlib objects) and valid PNGs."""

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


def test_figure_order_entropy_first(figs):
    assert list(figs) == ["entropy", "reward", "eval", "profile", "quadrants", "log_ratio_hist"]


def test_entropy_series(figs):
    ax = figs["entropy"].axes[0]
    lines = _lines(ax)
    assert list(lines) == ["grpo", "abc", "nsr"]  # the baseline first, one line per method
    # fixture entropy = 1 - 0.1 * opt_step (+0.2 for abc) + 0.01 * seed: mean over seeds 0, 1 adds 0.005
    x, y = lines["abc"].get_data()
    assert list(x) == [1, 2, 3, 4]
    assert np.allclose(y, [1.2 - 0.1 * s + 0.005 for s in (1, 2, 3, 4)])
    # the seed band (min-max) is a filled polygon per method: 3 collections
    assert len(ax.collections) == 3
    band = ax.collections[1].get_paths()[0].vertices[:, 1]  # abc: between 1.2-0.1s and 1.21-0.1s
    assert band.min() == pytest.approx(1.2 - 0.4) and band.max() == pytest.approx(1.21 - 0.1)


def test_reward_is_per_rollout_step(figs):
    x, y = _lines(figs["reward"].axes[0])["grpo"].get_data()
    assert list(x) == [0, 1]  # rollout steps
    assert np.allclose(y, [0.325, 0.425])  # 0.3 + 0.1 * step + 0.05 * mean seed (0.5)


def test_eval_panels(figs):
    titles = [ax.get_title() for ax in figs["eval"].axes]
    assert titles == ["GSM8K: Avg@4", "GSM8K: Pass@4", "arith: Avg@4", "arith: Pass@4"]
    x, y = _lines(figs["eval"].axes[2])["abc"].get_data()
    assert list(x) == [0, 2] and np.allclose(y, [18.75, 56.25])  # base 3/16, final 9/16


def test_quadrant_shares_over_steps(figs):
    axes = figs["quadrants"].axes
    assert [ax.get_title() for ax in axes] == [f"Q{i} share of clip events" for i in (1, 2, 3, 4)]
    _, y = _lines(axes[3])["grpo"].get_data()
    assert np.allclose(y, [40.0, 40.0])
    total = sum(_lines(ax)["nsr"].get_data()[1] for ax in axes)
    assert np.allclose(total, 100.0)


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
