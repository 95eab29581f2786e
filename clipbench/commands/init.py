"""`clipbench init [DIR]`: a starter kit to edit, in DIR (default: the current directory).

    sweep.yaml      two rules (grpo and your own) x three seeds on the shipped quickstart recipe
    lower_only.py   your own clipping rule (a plugin: docs/plugins.md)
    README.md       the next three commands

Refuses (exit 2, nothing written) when any of the three files already exists, unless --force.
"""

from __future__ import annotations

from pathlib import Path

from clipbench.errors import UserError

SWEEP = """\
# Your first study: GRPO's clip vs your own rule (lower_only.py) x 3 seeds on the shipped
# quickstart recipe (`clipbench recipes` lists the others; `clipbench recipes --show quickstart`
# prints it). About a minute per run on one CPU core; 6 runs.
name: my_study
description: grpo vs lower_only (my rule) on the quickstart recipe, 3 seeds
base: quickstart                   # a shipped recipe by name, or a path to your own recipe file
plugins: [lower_only.py]           # relative to this file
overrides:
  eval.every: 0                    # evaluate at the start and the end only
grid:
  objective.name: [grpo, lower_only]
  seed: [0, 1, 2]
"""

RULE = '''\
# Your own clipping rule: one decorated function (docs/plugins.md). Edit it, then
# `clipbench methods --plugin lower_only.py` shows how clipbench reads it.
import torch

from clipbench.objectives import rule


@rule("lower_only", source="my idea")
def lower_only(r, A, *, eps_low: float = 0.2):
    """-min(r*A, max(r, 1-eps_low)*A): PPO clip with only the lower bound."""
    return -torch.minimum(r * A, torch.clamp(r, min=1 - eps_low) * A)
'''

README = """\
# my_study

Made by `clipbench init`. The next three commands, from this directory:

    clipbench sweep sweep.yaml --dry-run         # the 6 runs, checked; nothing written
    clipbench sweep sweep.yaml --jobs 2          # run them into ./results (resumable: rerun to continue)
    clipbench report my_study --baseline grpo    # tables, claims and plots from ./results

Then: `clipbench doctor` (what this machine can run), `clipbench recipes` (the shipped recipes and
sweeps), `clipbench rehearse NAME` (a recipe's code path on this machine before booking GPUs).
"""

FILES = {"sweep.yaml": SWEEP, "lower_only.py": RULE, "README.md": README}


def init_command(directory: Path, *, force: bool = False) -> list[Path]:
    """Write the kit; returns the paths written."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory}: not a directory")
    clash = [directory / name for name in FILES if (directory / name).exists()]
    if clash and not force:
        raise UserError(f"{clash[0]}: already exists; nothing written (--force overwrites the kit's files)")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in FILES.items():
        (directory / name).write_text(text, encoding="utf-8")
        written.append(directory / name)
    print(f"wrote {', '.join(str(p) for p in written)}; next: {directory / 'README.md'}")
    return written
