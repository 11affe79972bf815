#!/usr/bin/env bash
# Builds .device-prefix for the GPU machine: ../shared/device/make-prefix.sh (Abseil, mimalloc,
# GoogleTest, Google Benchmark, liburing) plus the header-only nlohmann-json and xxHash (used
# header-only: the NVMe tier's checksums), which that script does not carry and the GPU machine
# lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
../shared/device/make-prefix.sh .device-prefix
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
headers=(nlohmann-json3-dev libxxhash-dev)
(cd "$work" && apt-get download "${headers[@]}" >/dev/null 2>&1) \
  || { apt-get update >/dev/null && (cd "$work" && apt-get download "${headers[@]}" >/dev/null); }
for deb in "$work"/*.deb; do dpkg -x "$deb" .device-prefix; done
rm -rf .device-prefix/usr/share/doc
du -sh .device-prefix
