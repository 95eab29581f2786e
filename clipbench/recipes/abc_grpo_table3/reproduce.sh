#!/usr/bin/env bash
# Reproduce the ABC-GRPO paper's Table 3 (arXiv 2601.03895): train, evaluate, report.
#
#   bash recipes/abc_grpo_table3/reproduce.sh SCALE RESULTS [key=value ...]
#     SCALE    full: Qwen3-1.7B/4B-Base x {GRPO, ABC-GRPO} on DAPO-Math-17k (1 and 8 GPUs + vLLM; README.md)
#              tiny: the same pipeline on builtin:arith-tiny, CPU only, about 2 minutes
#     RESULTS  results directory (default: results)
#     key=value  overrides for every run, e.g. eval.data_dir=/data/benchmarks (offline benchmarks)
#
# Runs `clipbench sweep` (resumable: rerun the same command after an interruption), then
# `clipbench report --baseline grpo` in every format. The HTML page is printed last.
set -euo pipefail

SCALE="${1:-full}"
RESULTS="${2:-results}"
shift $(( $# >= 2 ? 2 : $# ))
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/../find_clipbench.sh"  # REPO and CLI

case "$SCALE" in
  full)
    SWEEP_FILE="$HERE/sweep.yaml"; SWEEP=abc_grpo_table3; JOBS=1
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
      echo "warning: no NVIDIA GPU found; SCALE=full trains Qwen3-1.7B on one 80 GB GPU and Qwen3-4B on" \
           "8 of them, with vLLM (about 300 GPU-hours in all, see $HERE/README.md). SCALE=tiny runs on a CPU." >&2
    fi
    ;;
  tiny)
    SWEEP_FILE="$HERE/sweep_tiny.yaml"; SWEEP=abc_grpo_table3_tiny; JOBS="${JOBS:-2}"
    ;;
  *)
    echo "usage: $0 full|tiny [RESULTS] [key=value ...] (got SCALE='$SCALE')" >&2
    exit 2
    ;;
esac

echo "== clipbench sweep $(basename "$SWEEP_FILE") -> $RESULTS/$SWEEP ($SCALE)"
"${CLI[@]}" sweep "$SWEEP_FILE" "$@" --results-dir "$RESULTS" --jobs "$JOBS"

echo "== clipbench report $SWEEP --baseline grpo"
for fmt in rich markdown latex csv html; do
  "${CLI[@]}" report "$SWEEP" --results-dir "$RESULTS" --baseline grpo --format "$fmt"
done
