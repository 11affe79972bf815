// Helpers shared by the C++ tests.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ps::testing {

// A fresh directory under /tmp (ext4 here, so O_DIRECT works), removed on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "ps-test-XXXXXX").string();
    const char* made = mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr) << "mkdtemp failed";
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline void FillRandom(void* data, int64_t bytes, uint64_t seed) {
  std::mt19937_64 engine(seed);
  auto* out = static_cast<unsigned char*>(data);
  for (int64_t i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(engine());
}

inline bool SameBytes(const void* a, const void* b, int64_t bytes) {
  return std::memcmp(a, b, static_cast<size_t>(bytes)) == 0;
}

}  // namespace ps::testing

#define PS_ASSERT_OK_AND_ASSIGN(lhs, expr)               \
  auto PS_TEST_CONCAT_(statusor_, __LINE__) = (expr);    \
  ASSERT_TRUE(PS_TEST_CONCAT_(statusor_, __LINE__).ok()) \
      << PS_TEST_CONCAT_(statusor_, __LINE__).status();  \
  lhs = std::move(PS_TEST_CONCAT_(statusor_, __LINE__)).value()
#define PS_TEST_CONCAT_INNER_(a, b) a##b
#define PS_TEST_CONCAT_(a, b) PS_TEST_CONCAT_INNER_(a, b)
#define PS_ASSERT_OK(expr)                                \
  do {                                                    \
    const ::absl::Status ps_test_status_ = (expr);        \
    ASSERT_TRUE(ps_test_status_.ok()) << ps_test_status_; \
  } while (false)
#define PS_EXPECT_OK(expr)                                \
  do {                                                    \
    const ::absl::Status ps_test_status_ = (expr);        \
    EXPECT_TRUE(ps_test_status_.ok()) << ps_test_status_; \
  } while (false)
