#!/usr/bin/env bash
# Build .venv-verl, the environment of the verl integration tests (`make test-verl`).
#
# verl 0.9.1 pins transformers<5.11 and tensordict<=0.10, next to our transformers 5.19; its
# core_algos (the policy-loss registry) and its config schema import and work with ours. So instead
# of a second torch install, .venv-verl is layered over .venv: a `.pth` file puts .venv's packages
# (torch, transformers, ray, hydra, clipbench itself) behind its own, and only verl and the few
# packages its core needs are installed here, without their dependencies (no CUDA, no vLLM):
#   verl==0.9.1 tensordict==0.10.0 pyvers<0.2 codetiming orjson, and this checkout (-e, --no-deps)
# .venv keeps a consistent `pip check`. Idempotent: a second run only re-checks the imports.
# Environment: VENV (default .venv-verl), BASE (default .venv, built by `make install`).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv-verl}"
BASE="${BASE:-.venv}"
PKGS=("verl==0.9.1" "tensordict==0.10.0" "pyvers<0.2" "codetiming" "orjson")
start=$(date +%s)
stamp="$VENV/.clipbench-verl-ready"

[[ -x "$BASE/bin/python" ]] || { echo "setup_verl_env: $BASE not found; run make install first" >&2; exit 2; }
if [[ ! -x "$VENV/bin/python" ]]; then
  "$BASE/bin/python" -m venv --without-pip "$VENV"
fi
site() { "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
base_site="$(cd "$(site "$BASE")" && pwd)"
# `import` lines of a .pth run at startup: addsitedir also processes .venv's own .pth files (editable installs)
echo "import site; site.addsitedir('$base_site')" >"$(site "$VENV")/_clipbench_base.pth"

want="${PKGS[*]} pyproject=$(sha256sum pyproject.toml | cut -c1-16)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  PIP=("$BASE/bin/python" -m pip --disable-pip-version-check --python "$VENV/bin/python" install --quiet --no-deps)
  "${PIP[@]}" "${PKGS[@]}"
  # this checkout too (no dependencies: they come from .venv), so its `verl.plugins` entry point is
  # the one verl discovers here
  "${PIP[@]}" -e .
  echo "$want" >"$stamp"
fi

"$VENV/bin/python" - <<'PY'
import torch, transformers, verl
from verl.trainer.ppo import core_algos
assert "vanilla" in core_algos.POLICY_LOSS_REGISTRY
print(f"verl {verl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "setup_verl_env: ready in $(( $(date +%s) - start ))s ($VENV)"
