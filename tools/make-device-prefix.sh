#!/usr/bin/env bash
# Builds .device-prefix for the GPU machine: ../shared/device/make-prefix.sh (Abseil, mimalloc,
# GoogleTest, Google Benchmark, liburing) plus the header-only nlohmann-json, which that script
# does not carry and the GPU machine lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
../shared/device/make-prefix.sh .device-prefix
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download nlohmann-json3-dev >/dev/null 2>&1) \
  || { apt-get update >/dev/null && (cd "$work" && apt-get download nlohmann-json3-dev >/dev/null); }
dpkg -x "$work"/nlohmann-json3-dev_*.deb .device-prefix
rm -rf .device-prefix/usr/share/doc
du -sh .device-prefix
