#!/usr/bin/env bash
# Sets up everything (tools/setup.sh) and runs the tests: the GoogleTest suite (ctest), the
# import rules, the pytest suite, the C++ suite and the engine's core Python tests again on the
# strict emulated device (PATRICKSTAR_STRICT_DEVICE=1), the C++ suite under AddressSanitizer +
# UndefinedBehaviorSanitizer (build-asan/), and the copy engine / NVMe IO / tier / strict device
# tests under ThreadSanitizer. Exits non-zero on any failure, and also when a suite ran no test.
#
# The default run is CI's and fits its time on a 2-core machine; --full runs every test
# (Note [The default run and --full] in tests/python/run_selection.py): the pytest tests marked
# slow, all the engine's Python tests on the strict device, and the Python tests of the runtime
# against an ASan + UBSan patrickstar._C (built in build-asan/ beside the C++ tests).
#
#   tools/test.sh                 the default run (CI's)
#   tools/test.sh --full          every test (about twice as long)
#   tools/test.sh --no-sanitize   skip the sanitizer jobs (faster local runs)
#   tools/test.sh --sanitize      only the sanitizer jobs (ASan+UBSan C++ and Python, TSan)
#   tools/test.sh --tsan          only the ThreadSanitizer job
#   tools/test.sh --python-asan   only the Python tests against an ASan+UBSan patrickstar._C,
#                                 all of them
set -euo pipefail
cd "$(dirname "$0")/.."

run_main=1
run_sanitize=1
run_tsan=1
run_python_asan=0
full=0
python_asan_args=()  # tools/test_python_asan.sh's default: the runtime's Python tests
for arg in "$@"; do
  case "$arg" in
    --full) full=1; run_python_asan=1 ;;
    --no-sanitize) run_sanitize=0; run_tsan=0; run_python_asan=0 ;;
    --sanitize) run_main=0; run_python_asan=1 ;;
    --tsan) run_main=0; run_sanitize=0; run_python_asan=0 ;;
    --python-asan) run_main=0; run_sanitize=0; run_tsan=0; run_python_asan=1
                   python_asan_args=(tests/python -m "not slow") ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "tools/test.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done
selection=(-m "not slow")
if ((full)); then
  selection=()
  ((${#python_asan_args[@]})) || python_asan_args=(--full)
fi

jobs=$(nproc)
log() { printf '\n[test] %s\n' "$*"; }

tools/setup.sh

# Only the runtime's threaded parts run under ThreadSanitizer: copy engine, NVMe IO (io_uring
# reaper, pread/pwrite workers), tiers, fault injection and the shared-memory communicator (its
# ranks as threads). Note [TSan and Debian's Abseil] in tests/cpp/tsan_absl_shim.cc explains
# the shim these binaries link.
tsan_tests=(runtime_copy_engine_test runtime_nvme_tier_test runtime_tier_test
            runtime_fault_injection_test runtime_strict_device_test chunk_strict_device_test
            shm_communicator_test)
build_tsan() {
  if [ ! -f build-tsan/build.ninja ]; then
    cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPS_TSAN=ON \
      -DPS_BUILD_PYTHON=OFF -DPS_BUILD_BENCHMARKS=OFF -DPS_WITH_CUDA=OFF >/dev/null
  fi
  cmake --build build-tsan -j"$jobs" --target "${tsan_tests[@]}"
}
# The sanitized patrickstar._C only where its Python tests run.
asan_build_args=(--build-only)
((run_python_asan)) || asan_build_args+=(--no-module)
build_sanitizers() {
  if ((run_sanitize || run_python_asan)); then
    tools/test_python_asan.sh "${asan_build_args[@]}"
  fi
  if ((run_tsan)); then build_tsan; fi
}

# The sanitizer builds (about 10 minutes of a cold 2-core machine) start now at the lowest CPU
# priority, so they take what the tests below leave idle (processes starting, waits) and the
# tests keep the cores they need; their stages wait for them. Their output goes to a log,
# printed if they fail.
sanitizer_builds=
if ((run_main && (run_sanitize || run_tsan || run_python_asan))); then
  mkdir -p build
  # Its own process group (setsid), so that a run ending early stops the compilers too.
  setsid nice -n 19 bash -c "$(declare -p tsan_tests jobs run_sanitize run_tsan run_python_asan \
      asan_build_args);
    $(declare -f build_tsan build_sanitizers); build_sanitizers" \
    > build/sanitizer-builds.log 2>&1 &
  sanitizer_builds=$!
  trap '[ -z "$sanitizer_builds" ] || kill -- "-$sanitizer_builds" 2>/dev/null || true' EXIT
fi
# The sanitizer builds are ready after this: the background ones waited for, or (a run of
# sanitizer stages alone) built here, once for all the stages.
sanitizers_built=0
wait_for_sanitizer_builds() {
  ((sanitizers_built)) && return 0
  sanitizers_built=1
  if [ -z "$sanitizer_builds" ]; then
    build_sanitizers
    return 0
  fi
  log "waiting for the sanitizer builds (build/sanitizer-builds.log)"
  if ! wait "$sanitizer_builds"; then
    tail -n 60 build/sanitizer-builds.log >&2
    echo "[test] the sanitizer builds failed (build/sanitizer-builds.log)" >&2
    exit 1
  fi
  sanitizer_builds=
}

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
  .venv/bin/python -m pytest tests/python -q --durations=25 "${selection[@]}"
  status=$?
  set -e
  if [ "$status" -eq 5 ]; then echo "[test] pytest collected no tests" >&2; exit 1; fi
  [ "$status" -eq 0 ] || exit "$status"

  # Note [Strict device] (runtime/strict_device.h): the CUDA tiers, copy routes and stream
  # orderings on an emulated device where the host touching device memory crashes and device
  # work runs late. The C++ suite, and the engine's core Python tests (initialize, budgets,
  # prefetch, NVMe, full gradients, fp16 scaling, bf16 without master, bf16/int8 state) plus the
  # binding tests the engine stands on; --full adds data parallelism, checkpoints, the profile
  # and the recipes. Every other tests/python file passed there too (the sweep of 2026-11-26).
  log "C++ tests on the strict emulated device (PATRICKSTAR_STRICT_DEVICE=1)"
  PATRICKSTAR_STRICT_DEVICE=1 run_ctest build
  log "Python engine tests on the strict emulated device (PATRICKSTAR_STRICT_DEVICE=1)"
  strict_tests=(test_strict_device test_initialize test_nvme_training test_reliability
    test_parameter_slots test_chunk_bindings test_runtime test_parameter_writes test_estimator
    test_full_grad test_loss_scaling test_bf16_no_master test_state_dtype test_backward_budget
    test_vision_recipe test_resting_params)
  ((full)) && strict_tests+=(test_data_parallel test_dp_checkpoint test_checkpoint test_profile
    test_torch_save_resume test_hf_training)
  strict_paths=("${strict_tests[@]/#/tests/python/}")
  set +e
  PATRICKSTAR_STRICT_DEVICE=1 .venv/bin/python -m pytest -q -m "not slow" \
    "${strict_paths[@]/%/.py}"
  status=$?
  set -e
  if [ "$status" -eq 5 ]; then echo "[test] pytest collected no tests" >&2; exit 1; fi
  [ "$status" -eq 0 ] || exit "$status"
fi

if ((run_sanitize)); then
  wait_for_sanitizer_builds
  # build-asan/ (tools/test_python_asan.sh --build-only) is one sanitized build of the core for
  # the C++ tests and the Python module (the stage below). No CUDA there: build/ already
  # compiles it (so CI sees a break), and without a GPU its tests only skip.
  log "C++ tests under ASan + UBSan (build-asan/)"
  # protect_shadow_gap=0 lets the CUDA driver map its memory where ASan would reserve it.
  ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_ctest build-asan
fi
if ((run_tsan)); then
  wait_for_sanitizer_builds
  log "copy engine and NVMe IO tests under ThreadSanitizer (build-tsan/)"
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
  wait_for_sanitizer_builds
  log "Python tests against an ASan + UBSan patrickstar._C (build-asan/)"
  tools/test_python_asan.sh "${python_asan_args[@]}"
fi
log "all tests passed"
