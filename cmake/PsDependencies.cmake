# Every third-party dependency comes from find_package; nothing is vendored.
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(mimalloc REQUIRED)
find_package(nlohmann_json 3 REQUIRED)

# liburing ships a pkg-config file, not a CMake config.
find_package(PkgConfig REQUIRED)
pkg_check_modules(LIBURING REQUIRED IMPORTED_TARGET liburing)

if(PS_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(PS_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()

# mimalloc's config names its targets mimalloc (shared) and mimalloc-static.
if(TARGET mimalloc)
  set(PS_MIMALLOC_TARGET mimalloc)
else()
  set(PS_MIMALLOC_TARGET mimalloc-static)
endif()
