"""scripts/organism_gate.py: the gate's five verdicts from per-seed values with known truth."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "organism_gate.py"


@pytest.fixture(scope="module")
def gate():
    spec = importlib.util.spec_from_file_location("_organism_gate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def row(method, seed, *, start, end, p_start, p_end, e_first, e_last, val=50.0):
    split = {"avg_start": start, "avg_end": end, "pass_start": p_start, "pass_end": p_end, "n": 64}
    return {
        "method": method,
        "seed": seed,
        "arith": split,
        "arith-val": {**split, "avg_end": val},
        "entropy": {
            "first_fifth": e_first,
            "last_fifth": e_last,
            "ratio": e_last / e_first,
            "series": [e_first, e_last],
        },
        "clip": {"out_of_band": 1.0, "share": {"q1": 25.0, "q2": 5.0, "q3": 50.0, "q4": 20.0}, "rescue_band": 0.2},
        "length": [24.0, 24.0],
    }


def store(dapo_entropy_gap=0.01, b_shift=0.0):
    """grpo seeds 0-19 and dapo seeds 0-9. grpo's gain per seed: 20 + (seed % 3) - 1, i.e. 19, 20, 21, ...
    (mean over seeds 0-9: (19*4 + 20*3 + 21*3) / 10 = 19.9); entropy 0.15 -> 0.06 (ratio 0.4) on every
    seed; Pass@64 97 -> 95 or 96 (-1.5 on seeds 0-9); dapo's last-fifth entropy above grpo's by `dapo_entropy_gap` plus a
    +-0.001 wobble; seeds 10-19 shifted by `b_shift` points of accuracy."""
    rows = []
    for s in range(20):
        shift = b_shift if s >= 10 else 0.0
        gain = 20 + (s % 3) - 1
        rows.append(
            row(
                "grpo",
                s,
                start=27.0,
                end=27.0 + gain + shift,
                p_start=97.0,
                p_end=95.0 + (s % 2),
                e_first=0.15,
                e_last=0.06 + 0.001 * (s % 2),
                val=48.0 + (s % 4) + shift,
            )
        )
        if s < 10:
            rows.append(
                row(
                    "dapo",
                    s,
                    start=27.0,
                    end=45.0,
                    p_start=97.0,
                    p_end=95.0,
                    e_first=0.15,
                    e_last=0.06 + 0.001 * (s % 2) + dapo_entropy_gap + 0.001 * ((s % 3) - 1),
                )
            )
    return rows


def test_every_gate_passes_on_a_store_built_to_pass(gate):
    g = gate.gates(store())
    assert g["G1"]["mean"] == pytest.approx(19.9) and g["G1"]["lo"] > 4 and g["G1"]["pass"]
    assert g["G2"]["hits"] == 10 and g["G2"]["pass"]
    assert g["G3"]["mean"] == pytest.approx(0.01 + 0.001 * (-1 * 4 + 0 * 3 + 1 * 3) / 10) and g["G3"]["pass"]
    assert g["G4"]["mean"] == pytest.approx(-1.5) and g["G4"]["pass"]
    assert g["G5"]["family_size"] == 5 and g["G5"]["pass"]


def test_gates_fail_where_the_truth_says(gate):
    g = gate.gates(store(dapo_entropy_gap=0.0, b_shift=5.0))
    assert not g["G3"]["pass"]  # no entropy kept by clip-higher beyond a +-0.001 wobble
    assert not g["G5"]["pass"]  # seeds 10-19 really are 5 points better: the A/A control must see it
    # seeds 0-9 gain 19.9 on average, seeds 10-19 gain (20*4 + 21*3 + 19*3) / 10 = 20.0, plus the 5-point shift
    assert g["G5"]["family"]["test Avg@n end"]["diff"] == pytest.approx(-5.1)


def test_the_page_renders(gate):
    text = gate.render(gate.gates(store()), store())
    assert "| G1 RL works |" in text and "**passes**" in text


def test_the_published_gate_is_rederived_from_its_per_seed_csv(gate, tmp_path):
    """docs/studies/organism/per_seed.csv is what the script writes from the committed gate.json, and
    the five gates computed from it alone are the published ones."""
    docs = SCRIPT.parent.parent / "docs" / "studies" / "organism"
    saved = json.loads((docs / "gate.json").read_text())
    gate.write_per_seed(tmp_path / "per_seed.csv", saved["runs"])
    assert (tmp_path / "per_seed.csv").read_text() == (docs / "per_seed.csv").read_text()
    again = gate.gates(gate.read_per_seed(docs / "per_seed.csv"))
    for key in ("G1", "G3", "G4"):
        assert {k: again[key][k] for k in ("mean", "lo", "hi", "p", "n", "pass")} == saved["gates"][key]
    assert again["G2"] == saved["gates"]["G2"]  # ratios 0.44-1.50, 8 of 10 at or under 0.5: fails
    assert again["G5"] == saved["gates"]["G5"]  # smallest Holm p 0.709: passes
    assert [again[k]["pass"] for k in ("G1", "G2", "G3", "G4", "G5")] == [True, False, False, True, True]
