# Every third-party dependency comes from find_package; nothing is vendored.
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(mimalloc REQUIRED)
find_package(nlohmann_json 3 REQUIRED)

# liburing ships a pkg-config file, not a CMake config; where pkg-config is missing (the GPU
# machine), look for the header and library directly (CMAKE_PREFIX_PATH covers a carried prefix).
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(LIBURING QUIET IMPORTED_TARGET liburing)
endif()
if(TARGET PkgConfig::LIBURING)
  add_library(ps::uring ALIAS PkgConfig::LIBURING)
else()
  find_path(PS_LIBURING_INCLUDE_DIR liburing.h REQUIRED)
  find_library(PS_LIBURING_LIBRARY uring REQUIRED)
  add_library(ps::uring UNKNOWN IMPORTED)
  set_target_properties(ps::uring PROPERTIES IMPORTED_LOCATION "${PS_LIBURING_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${PS_LIBURING_INCLUDE_DIR}")
endif()

# xxHash, header-only (XXH_INLINE_ALL): the NVMe tier's checksums (Note [NVMe checksums]).
find_path(PS_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
add_library(ps::xxhash INTERFACE IMPORTED)
set_target_properties(ps::xxhash PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${PS_XXHASH_INCLUDE_DIR}")

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
