#!/usr/bin/env bash
# Headless Chromium for the HTML report's browser test (tests/test_report_html.py, marker `browser`).
# Debian/Ubuntu: installs the distribution's `chromium` package. Idempotent; needs root (or sudo).
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  echo "chromium already installed: $(command -v chromium || command -v chromium-browser)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-get not found: install Chromium with your package manager; the browser test is skipped without it" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
command -v chromium
