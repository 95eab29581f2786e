# Sourced by the recipes' reproduce.sh scripts, with HERE set to the script's own directory: sets
# REPO (the checkout, when there is one) and CLI, the clipbench command to run: $CLIPBENCH, else the
# checkout's .venv, else a clipbench on the PATH (an installed package).
REPO="$(cd "$HERE/../.." && pwd)"
[ -d "$REPO/.venv" ] || REPO="$(cd "$HERE/../../.." && pwd)"  # run by its path in the package, clipbench/recipes/

if [ -n "${CLIPBENCH:-}" ]; then
  CLI=("$CLIPBENCH")
elif [ -x "$REPO/.venv/bin/clipbench" ]; then
  CLI=("$REPO/.venv/bin/clipbench")
elif command -v clipbench >/dev/null 2>&1; then
  CLI=(clipbench)
else
  echo "clipbench not found: run 'make install' first (or set CLIPBENCH=/path/to/clipbench)" >&2
  exit 2
fi
