#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (CPU tests always; GPU tests run
# on a machine with a GPU and skip, saying why, without one).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 900
