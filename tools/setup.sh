#!/usr/bin/env bash
# Sets up everything on a fresh Debian 12 machine, idempotently: missing Debian packages, the
# .venv with the pinned Python requirements, and the build of the C++ core, its tests and the
# patrickstar package (installed editable into .venv). A second run with nothing changed takes
# seconds: each step checks whether it has anything to do.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# The one list of Debian packages the project needs.
DEBIAN_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libmimalloc-dev libgtest-dev libgmock-dev libbenchmark-dev liburing-dev
  nlohmann-json3-dev libxxhash-dev fio
  chromium  # renders report.html headless in tests/python/test_profile.py
)

log() { printf '[setup] %s\n' "$*"; }

missing=()
for package in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$package")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$python" -m venv .venv
fi
venv_python=$root/.venv/bin/python

# Python requirements: reinstalled only when requirements.txt changed.
req_stamp=.venv/.ps-requirements.sha256
req_hash=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ ! -f "$req_stamp" ] || [ "$(cat "$req_stamp")" != "$req_hash" ]; then
  log "installing Python requirements (torch pinned, CPU build from the local wheel)"
  "$venv_python" -m pip install -q --upgrade pip
  "$venv_python" -m pip install -q -r requirements.txt
  echo "$req_hash" > "$req_stamp"
fi

# NCCL for the direct NCCL back end of CUDA builds (Note [Finding NCCL] in cmake/PsNccl.cmake):
# the same wheel torch's CUDA builds use. Only where nvcc is present (a CUDA build).
if command -v nvcc >/dev/null 2>&1 && ! "$venv_python" -c "import nvidia.nccl" 2>/dev/null; then
  log "installing nvidia-nccl-cu13 (NCCL headers and library for the CUDA build)"
  "$venv_python" -m pip install -q --no-deps nvidia-nccl-cu13 \
    || log "nvidia-nccl-cu13 not installed: the build goes on without the NCCL back end"
fi

# Build + editable install. scikit-build-core drives CMake in build/ (pyproject.toml), which also
# builds the GoogleTest and benchmark binaries that ctest runs. Skipped when no source is newer
# than the last install.
install_stamp=.venv/.ps-installed
sources=(CMakeLists.txt cmake runtime chunk kernels bindings python tests/cpp tools/bench
         pyproject.toml requirements.txt)
if [ ! -f "$install_stamp" ] || [ ! -d build ] \
   || [ -n "$(find "${sources[@]}" -newer "$install_stamp" -not -name '*.pyc' -print -quit)" ]; then
  log "building and installing patrickstar (incremental)"
  touch "$install_stamp.new"
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$venv_python" -m pip install -q --no-build-isolation --no-deps -e .
  mv "$install_stamp.new" "$install_stamp"
fi

# import works from anywhere, not just the source tree.
(cd / && "$venv_python" -c "import patrickstar") || { log "import patrickstar failed"; exit 1; }
log "ready: .venv/bin/python, build/ (ctest --test-dir build)"
