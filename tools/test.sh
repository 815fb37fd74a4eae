#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (CPU tests always; GPU tests run
# on a machine with a GPU and skip, saying why, without one). First the readers that take corrupt
# and fuzzed files (packed matrices, safetensors, packed checkpoints) run once more under
# AddressSanitizer and UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
export PATH="/usr/local/cuda/bin:$PATH"
jobs="$(nproc)"

echo "== sanitizer build of the file readers' tests" >&2
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGEMVZ_BUILD_TOOLS=OFF \
  "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
  >/dev/null
cmake --build build-asan -j"$jobs" --target serialize_test safetensors_test checkpoint_test \
  json_check_test file_util_test disk_cache_test
ctest --test-dir build-asan --output-on-failure -j"$jobs" --timeout 900 -E "_NOT_BUILT$"

echo "== the whole suite" >&2
tools/build.sh
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 900
