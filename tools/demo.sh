#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: `gemvz demo` on the built-in default
# (pack the benchmark suite's weights, compile the kernels, run and check the GEMV on the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
exec build/gemvz demo "$@"
