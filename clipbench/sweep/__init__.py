"""Declarative sweeps: a sweep file -> a frozen manifest of run configs -> resumable execution.

    from clipbench.sweep import load_spec, expand, freeze
    spec = load_spec("sweeps/nsr_vs_decay.yaml", ["train.steps=10"])
    exp = expand(spec)              # pure: {run_id: config}, {run_id: axis point}
    freeze("results", spec, exp)    # results/nsr_vs_decay/manifest.json (append-only)

See docs/sweeps.md. The CLI entry point is `clipbench sweep` (cli.py), which calls `clipbench.commands.sweep.sweep_command`.
"""

from clipbench.config.labels import label
from clipbench.sweep.expand import Expansion, expand
from clipbench.sweep.manifest import freeze, manifest_path, merge, read_manifest
from clipbench.sweep.spec import SweepSpec, load_spec

__all__ = [
    "Expansion",
    "SweepSpec",
    "expand",
    "freeze",
    "label",
    "load_spec",
    "manifest_path",
    "merge",
    "read_manifest",
]
