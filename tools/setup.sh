#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine with the CUDA toolkit lacks to build gemvz (apt-get).
set -euo pipefail
pkgs=(cmake ninja-build g++ libabsl-dev libgtest-dev libgmock-dev nlohmann-json3-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: the CUDA toolkit (NVRTC, headers) is needed at /usr/local/cuda or on PATH" >&2
  exit 1
fi
