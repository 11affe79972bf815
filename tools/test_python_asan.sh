#!/usr/bin/env bash
# The Python tests of the runtime against an ASan + UBSan build of patrickstar._C
# (docs/design.md, "ASan over the Python tests"). CPython and torch are not instrumented, so
# libasan is preloaded and leak checking is off (both keep allocations until exit by design);
# every heap access of our C++ code, and every chunk slab (from libc in sanitizer builds), is
# checked. build-asan/ also holds the C++ tests under the same sanitizers (tools/test.sh runs
# them with ctest): one sanitized build of the core serves both.
#
#   tools/test_python_asan.sh [pytest args]   default: the runtime/chunk/kernel tests
#   tools/test_python_asan.sh --full          those and the engine's checkpoint, reliability,
#                                             NVMe and data-parallel tests (tools/test.sh --full)
#   tools/test_python_asan.sh --build-only    configure and build build-asan/ (tests and _C)
#   tools/test_python_asan.sh --build-only --no-module   the C++ tests alone
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=$root/.venv/bin/python
[ -x "$python" ] || tools/setup.sh

# -O1 -g1: line tables are all a report needs, and the LibTorch headers the bindings include
# compile in about a third of the time of -O2 -g. ASan's own advice is -O1 for its checks.
build_only=0
engine_tests=()
module=ON  # the core's flags do not depend on it, so adding the module later builds only _C
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) build_only=1; shift ;;
    --no-module) module=OFF; shift ;;
    --full) engine_tests=(tests/python/test_checkpoint.py tests/python/test_reliability.py
                          tests/python/test_nvme_training.py tests/python/test_data_parallel.py)
            shift ;;
    *) break ;;
  esac
done
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O1 -g1" \
  -DPS_SANITIZE=ON -DPS_SANITIZE_PYTHON=$module -DPS_BUILD_PYTHON=$module -DPS_BUILD_TESTS=ON \
  -DPS_BUILD_BENCHMARKS=OFF -DPS_WITH_CUDA=OFF -DPython_EXECUTABLE="$python" >/dev/null || exit 1
cmake --build build-asan -j"$(nproc)" || exit 1
((build_only)) && exit 0

# A package directory whose _C is the sanitized module and whose Python files are the sources.
pkg=build-asan/pythonpath/patrickstar
rm -rf "$pkg" && mkdir -p "$pkg"
for entry in python/patrickstar/*; do ln -s "$root/$entry" "$pkg/"; done
ln -sf "$root"/build-asan/bindings/_C*.so "$pkg/"
# The editable install's import hook sits in front of sys.path; sitecustomize (run by every
# Python process on this PYTHONPATH, test subprocesses included) drops it so this package, with
# the sanitized _C, is the one imported.
cat > build-asan/pythonpath/sitecustomize.py <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not type(f).__module__.startswith("_editable_skbc_")]
PY

# libstdc++ is preloaded too: python itself does not link it, and ASan's __cxa_throw
# interceptor must find the real one when it initializes ("CHECK failed: real___cxa_throw").
libasan="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export PYTHONPATH=$root/build-asan/pythonpath
# Reports also go to build-asan/asan.<pid> (pytest's capture would swallow a dying process's
# stderr).
rm -f build-asan/asan.*
export ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:halt_on_error=1:log_path=$root/build-asan/asan
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$root/build-asan/ubsan
if [ $# -eq 0 ]; then
  set -- tests/python/test_runtime.py tests/python/test_chunk_bindings.py \
    tests/python/test_parameter_slots.py tests/python/test_adam.py \
    tests/python/test_adam_lowp.py tests/python/test_state_dtype.py "${engine_tests[@]}" \
    -m "not slow"
fi
LD_PRELOAD=$libasan "$python" -c "
import sys
import patrickstar, pytest
assert patrickstar._C.__file__.startswith('$root/build-asan'), patrickstar._C.__file__
print('sanitized module:', patrickstar._C.__file__, flush=True)
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider'] + sys.argv[1:]))" "$@"
status=$?
if compgen -G "build-asan/*san.*" >/dev/null; then
  echo "[asan] sanitizer reports:" >&2
  cat build-asan/*san.* >&2
  status=1
fi
exit $status
