#!/usr/bin/env bash
# Sets up everything (tools/setup.sh) and runs every test: the GoogleTest suite (ctest), the
# pytest suite (the slow soak test included), the C++ suite and the engine's Python tests again
# on the strict emulated device (PATRICKSTAR_STRICT_DEVICE=1), the C++ suite under
# AddressSanitizer + UndefinedBehaviorSanitizer, the Python tests of the runtime (tiers, chunk
# bindings, Adam, checkpoints, reliability) against an ASan + UBSan patrickstar._C, and the copy
# engine / NVMe IO / tier / strict device tests under ThreadSanitizer.
# Exits non-zero on any failure, and also when a suite ran no test at all.
#
#   tools/test.sh                 everything
#   tools/test.sh --no-sanitize   skip the sanitizer builds (faster local runs)
#   tools/test.sh --sanitize      only the sanitizer jobs (ASan+UBSan, Python ASan, TSan)
#   tools/test.sh --tsan          only the ThreadSanitizer job
#   tools/test.sh --python-asan   only the Python tests against an ASan+UBSan patrickstar._C,
#                                 all of them (the default run takes the runtime's; the
#                                 sanitized module builds in ~3 min cold on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."

run_main=1
run_sanitize=1
run_tsan=1
run_python_asan=1
python_asan_args=()  # tools/test_python_asan.sh's default: the runtime's Python tests
for arg in "$@"; do
  case "$arg" in
    --no-sanitize) run_sanitize=0; run_tsan=0; run_python_asan=0 ;;
    --sanitize) run_main=0 ;;
    --tsan) run_main=0; run_sanitize=0; run_python_asan=0 ;;
    --python-asan) run_main=0; run_sanitize=0; run_tsan=0; run_python_asan=1
                   python_asan_args=(tests/python -m "not slow") ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "tools/test.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

jobs=$(nproc)
log() { printf '\n[test] %s\n' "$*"; }

tools/setup.sh

# ctest prints "No tests were found!!!" and exits 0 on an empty suite; treat that as failure.
run_ctest() {
  local dir=$1 out ctest_bin
  # Use the ctest of the cmake that configured the tree (scikit-build-core may use another).
  ctest_bin=$(sed -n 's/^CMAKE_CTEST_COMMAND:INTERNAL=//p' "$dir/CMakeCache.txt")
  [ -x "$ctest_bin" ] || ctest_bin=ctest
  out=$(mktemp)
  set +e
  "$ctest_bin" --test-dir "$dir" -j"$jobs" --output-on-failure --no-tests=error 2>&1 | tee "$out"
  local status=${PIPESTATUS[0]}
  set -e
  grep -qE '[1-9][0-9]* tests? failed|tests passed' "$out" || status=1
  rm -f "$out"
  return "$status"
}

if ((run_main)); then
  log "C++ tests (ctest, build/)"
  run_ctest build

  log "Python import rules (lint-imports, pyproject.toml [tool.importlinter])"
  # Layers from initialize() down to the chunk bindings, and no import circle: a broken
  # contract fails the run. Run from python/ so the source tree is what gets analysed.
  (cd python && ../.venv/bin/lint-imports --no-cache --no-logo ../pyproject.toml)

  log "Python tests (pytest)"
  # Exit code 5 means pytest collected nothing: that must fail, not pass silently.
  set +e
  .venv/bin/python -m pytest tests/python -q --durations=25
  status=$?
  set -e
  if [ "$status" -eq 5 ]; then echo "[test] pytest collected no tests" >&2; exit 1; fi
  [ "$status" -eq 0 ] || exit "$status"

  # Note [Strict device] (runtime/strict_device.h): the CUDA tiers, copy routes and stream
  # orderings on an emulated device where the host touching device memory crashes and device
  # work runs late. The C++ suite, and the engine's Python tests (initialize, budgets, prefetch,
  # NVMe, data parallel, checkpoints, profile, memory estimate, full gradients, fp16 scaling,
  # bf16 without master, bf16/int8 state) plus the binding tests the engine stands on. Every
  # other tests/python file passed there too (the sweep of 2026-11-26), about 30 minutes more.
  log "C++ tests on the strict emulated device (PATRICKSTAR_STRICT_DEVICE=1)"
  PATRICKSTAR_STRICT_DEVICE=1 run_ctest build
  log "Python engine tests on the strict emulated device (PATRICKSTAR_STRICT_DEVICE=1)"
  set +e
  PATRICKSTAR_STRICT_DEVICE=1 .venv/bin/python -m pytest -q -m "not slow" \
    tests/python/test_strict_device.py tests/python/test_initialize.py \
    tests/python/test_nvme_training.py tests/python/test_data_parallel.py \
    tests/python/test_dp_checkpoint.py tests/python/test_checkpoint.py \
    tests/python/test_profile.py tests/python/test_reliability.py \
    tests/python/test_parameter_slots.py tests/python/test_chunk_bindings.py \
    tests/python/test_runtime.py tests/python/test_parameter_writes.py \
    tests/python/test_estimator.py tests/python/test_full_grad.py \
    tests/python/test_loss_scaling.py tests/python/test_bf16_no_master.py \
    tests/python/test_state_dtype.py tests/python/test_backward_budget.py \
    tests/python/test_torch_save_resume.py tests/python/test_hf_training.py \
    tests/python/test_vision_recipe.py tests/python/test_resting_params.py
  status=$?
  set -e
  if [ "$status" -eq 5 ]; then echo "[test] pytest collected no tests" >&2; exit 1; fi
  [ "$status" -eq 0 ] || exit "$status"
fi

if ((run_sanitize)); then
  log "C++ tests under ASan + UBSan (build-asan/)"
  if [ ! -f build-asan/build.ninja ]; then
    # No CUDA here: build/ already compiles it (so CI sees a break), and without a GPU its tests
    # only skip; nvcc was a large share of this build on a cold 2-core machine.
    cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPS_SANITIZE=ON \
      -DPS_BUILD_PYTHON=OFF -DPS_BUILD_BENCHMARKS=OFF -DPS_WITH_CUDA=OFF >/dev/null
  fi
  cmake --build build-asan -j"$jobs"
  # protect_shadow_gap=0 lets the CUDA driver map its memory where ASan would reserve it.
  ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_ctest build-asan
fi
if ((run_tsan)); then
  # Only the runtime's threaded parts: copy engine, NVMe IO (io_uring reaper, pread/pwrite
  # workers), tiers, fault injection and the shared-memory communicator (its ranks as
  # threads). Note [TSan and Debian's Abseil] in tests/cpp/tsan_absl_shim.cc explains the shim
  # these binaries link.
  log "copy engine and NVMe IO tests under ThreadSanitizer (build-tsan/)"
  tsan_tests=(runtime_copy_engine_test runtime_nvme_tier_test runtime_tier_test
              runtime_fault_injection_test runtime_strict_device_test chunk_strict_device_test
              shm_communicator_test)
  if [ ! -f build-tsan/build.ninja ]; then
    cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPS_TSAN=ON \
      -DPS_BUILD_PYTHON=OFF -DPS_BUILD_BENCHMARKS=OFF -DPS_WITH_CUDA=OFF >/dev/null
  fi
  cmake --build build-tsan -j"$jobs" --target "${tsan_tests[@]}"
  for test in "${tsan_tests[@]}"; do
    filter=()
    # The strict device's streams are threads: its deliberate missing wait is a real race (TSan
    # reports it, as it would any missing wait there), and death tests fork.
    [ "$test" = runtime_strict_device_test ] && filter=(--gtest_filter=-*WithoutAWait*:*HostTouch*)
    # halt_on_error: the first race fails the job with its report.
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "build-tsan/tests/cpp/$test" \
      --gtest_brief=1 "${filter[@]}"
  done
fi
if ((run_python_asan)); then
  log "Python tests against an ASan + UBSan patrickstar._C (build-asan-py/)"
  tools/test_python_asan.sh "${python_asan_args[@]}"
fi
log "all tests passed"
