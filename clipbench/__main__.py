"""`python -m clipbench ...` (what torchrun runs: `torchrun --nproc-per-node N -m clipbench train ...`)."""

from clipbench.cli import app

app(prog_name="clipbench")
