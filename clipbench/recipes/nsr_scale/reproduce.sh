#!/usr/bin/env bash
# The NSR-paper-scale study (NSR, arXiv 2605.22703: 7B-30B, dense and MoE, against DAPO and GSPO):
# train, evaluate, report, for both arms.
#
#   bash recipes/nsr_scale/reproduce.sh SCALE RESULTS [key=value ...]
#     SCALE    full: MoE arm, Qwen3-30B-A3B-Base x {GSPO, GSPO+NSR, GSPO+decay, GRPO+r2} on 8 x H200;
#                    dense arm, Qwen2.5-7B x {DAPO, DAPO+NSR, DAPO+decay} on 8 x 80 GB + vLLM (README.md)
#              tiny: the same pipeline on builtin:arith-steps-moe and builtin:arith-steps, CPU only
#     RESULTS  results directory (default: results)
#     key=value  overrides for every run, e.g. eval.data_dir=/data/benchmarks (offline benchmarks)
#   ARMS="moe dense" (default) or one of them: which arms to run.
#   FORMATS="rich markdown latex csv html" (default) or some of them: the report formats written.
#
# Each arm runs `clipbench sweep` (resumable: rerun the same command after an interruption), then
# `clipbench report` against its baseline (gspo, dapo) in every format. The HTML pages are printed last.
set -euo pipefail

SCALE="${1:-full}"
RESULTS="${2:-results}"
shift $(( $# >= 2 ? 2 : $# ))
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/../find_clipbench.sh"  # REPO and CLI

case "$SCALE" in
  full)
    SUFFIX=""; JOBS=1
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
      echo "warning: no NVIDIA GPU found; SCALE=full trains Qwen3-30B-A3B-Base on 8 x H200 and Qwen2.5-7B" \
           "on 8 x 80 GB with vLLM (thousands of GPU-hours, see $HERE/README.md). SCALE=tiny runs on a CPU." >&2
    fi
    ;;
  tiny)
    SUFFIX="_tiny"; JOBS="${JOBS:-2}"
    ;;
  *)
    echo "usage: $0 full|tiny [RESULTS] [key=value ...] (got SCALE='$SCALE')" >&2
    exit 2
    ;;
esac

for ARM in ${ARMS:-moe dense}; do
  case "$ARM" in
    moe) BASELINE=gspo ;;
    dense) BASELINE=dapo ;;
    *) echo "ARMS: 'moe', 'dense' or both (got '$ARM')" >&2; exit 2 ;;
  esac
  SWEEP_FILE="$HERE/sweep_${ARM}${SUFFIX}.yaml"; SWEEP="nsr_scale_${ARM}${SUFFIX}"
  echo "== clipbench sweep $(basename "$SWEEP_FILE") -> $RESULTS/$SWEEP ($SCALE)"
  "${CLI[@]}" sweep "$SWEEP_FILE" "$@" --results-dir "$RESULTS" --jobs "$JOBS"
  echo "== clipbench report $SWEEP --baseline $BASELINE"
  for fmt in ${FORMATS:-rich markdown latex csv html}; do
    "${CLI[@]}" report "$SWEEP" --results-dir "$RESULTS" --baseline "$BASELINE" --format "$fmt"
  done
done
