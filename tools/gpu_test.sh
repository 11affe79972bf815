#!/usr/bin/env bash
# Build and test on the GPU machine, which has torch (CUDA), nvcc, CMake and ninja but no Debian
# C++ libraries and no network. Carry .device-prefix (tools/make-device-prefix.sh builds it).
# Logs go to $OUT when it is set (the device tool brings that folder back).
#
#   tools/gpu_test.sh            build (PS_WITH_CUDA=ON) + ctest + pytest, then every GPU figure
#                                (step TFLOPS, copy GB/s vs cudaMemcpy, GPU Adam vs torch fused)
#                                in one table (tools/bench/gpu.py)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=$PWD/.device-prefix/usr
[ -d "$prefix" ] || { echo "missing .device-prefix: run tools/make-device-prefix.sh on the CPU machine first" >&2; exit 2; }
out=${OUT:-$PWD/build-gpu-logs}
mkdir -p "$out"
export LD_LIBRARY_PATH=$prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CMAKE_PREFIX_PATH=$prefix
export PKG_CONFIG_PATH=$prefix/lib/x86_64-linux-gnu/pkgconfig
# liburing.pc says prefix=/usr: the sysroot makes its -I/-L point into the carried prefix.
export PKG_CONFIG_SYSROOT_DIR=$PWD/.device-prefix
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || true
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
set -o pipefail
"$python" -m pip install --no-build-isolation --no-deps --no-index -e . \
  --config-settings=build-dir=build-gpu --config-settings=cmake.define.PS_WITH_CUDA=ON \
  2>&1 | tee "$out/build.log"
status=0
ctest --test-dir build-gpu -j8 --output-on-failure 2>&1 | tee "$out/ctest.log" || status=1
(cd / && "$python" -m pytest "$OLDPWD/tests/python" -q -ra) 2>&1 | tee "$out/pytest.log" || status=1
"$python" tools/bench/gpu.py --out "$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.log" || status=1
exit $status
